#!/usr/bin/env bash
# The main job on its embedded default: a local CPU PD deployment of real SGLang
# (default release 0.5.19, the newest that answers the incident's request with 200),
# run without and with kvguard, sent the incident's request.
#   bash scripts/demo.sh [--timeout S] [--log-dir DIR]
#   KVGUARD_DEMO_RELEASE=0.5.23 bash scripts/demo.sh
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if ! ldconfig -p | grep -q libibverbs.so.1 && [[ $(id -u) == 0 ]]; then
  apt-get update -qq && apt-get install -y -qq libibverbs1 >/dev/null
fi
VENV=$(bash "$REPO/scripts/testbed.sh" "${KVGUARD_DEMO_RELEASE:-0.5.19}" | tail -n1)
exec "$VENV/bin/kvguard" demo "$@"
