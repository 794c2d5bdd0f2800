#!/usr/bin/env bash
# Chaos soak alone, through a real guarded PD trio of one SGLang release:
#
#   bash scripts/soak.sh 0.5.19                     # 150 requests, seed 0
#   KVGUARD_SOAK_REQUESTS=400 KVGUARD_SOAK_SEED=7 bash scripts/soak.sh 0.5.23
#
# Builds (or reuses) the release's test bed (scripts/testbed.sh), runs
# tests/server/test_chaos_soak.py, prints the soak's summary line and keeps the
# servers' logs and the JSON report under $KVGUARD_TEST_LOGDIR (default ./test-logs).
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VERSION=${1:?usage: scripts/soak.sh RELEASE}
export KVGUARD_TEST_LOGDIR=${KVGUARD_TEST_LOGDIR:-$REPO/test-logs}
mkdir -p "$KVGUARD_TEST_LOGDIR"
VENV=$(bash "$REPO/scripts/testbed.sh" "$VERSION" | tail -n1)
cd "$REPO"
exec "$VENV/bin/python" -m pytest -q -s -rs -p no:cacheprovider tests/server/test_chaos_soak.py
