#!/usr/bin/env bash
# CI job: probe a staging deployment (sglang-router in PD mode, an SGLang server, or an
# OpenAI-compatible endpoint) for the incident class and keep JSON + JUnit reports.
#
#   KVGUARD_PROBE_URL=http://staging-router:30000 bash examples/ci-probe.sh
#
# Optional: KVGUARD_PROBE_LIMIT (tokens; default discovered from the workers),
# KVGUARD_PROBE_MODEL, KVGUARD_PROBE_TIMEOUT (s per request, default 60),
# KVGUARD_PROBE_API_KEY, KVGUARD_PROBE_NODES (space-separated node URLs whose limits
# the probe cannot find through the router's /workers), REPORT_DIR (default
# ./probe-reports). Exit status: 0 pass, 1 a check failed, 2 unreachable / usage.
# Any CI that reads JUnit (GitLab `artifacts:reports:junit`, Jenkins `junit`, Buildkite
# test analytics) can pick up $REPORT_DIR/kvguard-probe.xml; see ci-probe.yml for
# GitHub Actions.
set -euo pipefail
URL=${KVGUARD_PROBE_URL:?set KVGUARD_PROBE_URL to the staging router, e.g. http://router:30000}
REPORT_DIR=${REPORT_DIR:-probe-reports}
mkdir -p "$REPORT_DIR"

command -v kvguard >/dev/null || python -m pip install --quiet sglang-kvguard   # no SGLang needed

args=(probe "$URL" --timeout "${KVGUARD_PROBE_TIMEOUT:-60}"
      --json "$REPORT_DIR/kvguard-probe.json" --junit "$REPORT_DIR/kvguard-probe.xml")
[[ -n "${KVGUARD_PROBE_LIMIT:-}" ]] && args+=(--limit "$KVGUARD_PROBE_LIMIT")
[[ -n "${KVGUARD_PROBE_MODEL:-}" ]] && args+=(--model "$KVGUARD_PROBE_MODEL")
[[ -n "${KVGUARD_PROBE_API_KEY:-}" ]] && args+=(--api-key "$KVGUARD_PROBE_API_KEY")
for node in ${KVGUARD_PROBE_NODES:-}; do args+=(--node "$node"); done

set +e
kvguard "${args[@]}" | tee "$REPORT_DIR/kvguard-probe.txt"
rc=${PIPESTATUS[0]}
set -e
case $rc in
  0) echo "kvguard probe: PASS" ;;
  1) echo "kvguard probe: FAIL -- the deployment answers like the incident; do not promote it" >&2 ;;
  *) echo "kvguard probe: could not probe $URL (exit $rc)" >&2 ;;
esac
exit "$rc"
