#!/usr/bin/env bash
# Run kvguard's test suite against real SGLang releases.
#
#   bash scripts/run-tests.sh            # CI matrix (see below)
#   bash scripts/run-tests.sh --full     # every supported release, every tier
#
# Tiers:
#   unit       tests/unit      kvguard alone, in a venv without SGLang
#   engine     tests/engine    patch engine / doctor / activation against a real release
#   component  tests/component real allocators, pools and PD queues on device=cpu
#   server     tests/server    real prefill + decode + sglang-router on loopback
#   kernels    tests/kernels   Triton kernels vs the torch reference, bit for bit
#                              (TRITON_INTERPRET=1 on CPU; real kernels on a GPU),
#                              in the test bed of KVGUARD_KERNEL_RELEASE (default 0.5.23)
#
# Releases per tier (space separated) can be set with
#   KVGUARD_ENGINE_RELEASES, KVGUARD_COMPONENT_RELEASES, KVGUARD_SERVER_RELEASES.
# Without them, the engine and component tiers also run one more supported release,
# picked by the commit hash (KVGUARD_ROTATE=0: none; KVGUARD_ROTATE=0.5.15: that one).
# Extra pytest arguments: KVGUARD_PYTEST_ARGS. Logs of failed server tests:
#   KVGUARD_TEST_LOGDIR (default ./test-logs).
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
ROOT=${KVGUARD_TESTBED_ROOT:-$HOME/.cache/kvguard-testbed}
export KVGUARD_TEST_LOGDIR=${KVGUARD_TEST_LOGDIR:-$REPO/test-logs}
RESULTS=$(mktemp -d)
mkdir -p "$KVGUARD_TEST_LOGDIR"

ALL=$(python3 -c "import sys; sys.path.insert(0, '$REPO'); from sglang_kvguard.releases import SUPPORTED_RELEASES as R; print(' '.join(R))")
if [[ ${1:-} == "--full" ]]; then
  ENGINE=${KVGUARD_ENGINE_RELEASES:-$ALL}
  COMPONENT=${KVGUARD_COMPONENT_RELEASES:-$ALL}
  SERVER=${KVGUARD_SERVER_RELEASES:-$ALL}
else
  # One more supported release for the engine and component tiers, rotating by commit
  # (the commit hash picks it), so that every release is exercised over time.
  # KVGUARD_ROTATE=0 switches it off; KVGUARD_ROTATE=0.5.15 names the extra release.
  EXTRA=""
  if [[ ${KVGUARD_ROTATE:-1} != 0 ]]; then
    if [[ ${KVGUARD_ROTATE:-1} != 1 ]]; then
      EXTRA=$KVGUARD_ROTATE
    else
      COMMIT=$(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo 0)
      EXTRA=$(python3 -c "
import sys
others = [r for r in sys.argv[2:] if r not in ('0.5.10', '0.5.19', '0.5.23')]
print(others[int(sys.argv[1][:8] or '0', 16) % len(others)] if others else '')" "$COMMIT" $ALL)
    fi
    echo "=== rotating release for the engine and component tiers: ${EXTRA:-none}" >&2
  fi
  ENGINE=${KVGUARD_ENGINE_RELEASES:-"0.5.10 0.5.19 0.5.23 $EXTRA"}
  COMPONENT=${KVGUARD_COMPONENT_RELEASES:-"0.5.10 0.5.19 0.5.23 $EXTRA"}
  SERVER=${KVGUARD_SERVER_RELEASES:-"0.5.10 0.5.19 0.5.23"}
  # The slowest server modules (smoke record, live probe) run on one server release per
  # run, also picked by the commit hash (tests/server/server_tier.py rotating_module).
  if [[ -z ${KVGUARD_SERVER_ROTATION:-} ]]; then
    COMMIT=${COMMIT:-$(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo 0)}
    export KVGUARD_SERVER_ROTATION=$(python3 -c "
import sys
rels = sys.argv[2:]
print(rels[int(sys.argv[1][8:16] or '0', 16) % len(rels)] if rels else 'all')" "$COMMIT" $SERVER)
  fi
  echo "=== rotating server modules (smoke record, live probe) run on: $KVGUARD_SERVER_ROTATION" >&2
fi

status=0
run_pytest() {  # name python paths...
  local name=$1 py=$2; shift 2
  echo "=== [$name] $py -m pytest $*" >&2
  "$py" -m pytest -q -rs -p no:cacheprovider --junitxml="$RESULTS/$name.xml" ${KVGUARD_PYTEST_ARGS:-} "$@"
  local rc=$?
  if [[ $rc -ne 0 && $rc -ne 5 ]]; then
    echo "=== [$name] FAILED (pytest exit $rc)" >&2
    status=1
  fi
}

# Unit tier: a venv with kvguard and no SGLang.
UNIT_VENV=$ROOT/kvguard-unit
if [[ ! -x $UNIT_VENV/bin/python ]]; then
  python3 -m venv "$UNIT_VENV"
fi
"$UNIT_VENV/bin/pip" install -q -e "$REPO[test]" >&2 || status=1
run_pytest unit "$UNIT_VENV/bin/python" tests/unit

declare -A VENVS
testbed() {
  local v=$1
  if [[ -z ${VENVS[$v]:-} ]]; then
    local out
    if ! out=$(bash "$REPO/scripts/testbed.sh" "$v" | tail -n1) || [[ ! -x $out/bin/python ]]; then
      echo "=== test bed for sglang $v could not be built" >&2
      status=1
      return 1
    fi
    VENVS[$v]=$out
  fi
  echo "${VENVS[$v]}"
}

for v in $ENGINE; do
  if venv=$(testbed "$v"); then run_pytest "engine-$v" "$venv/bin/python" tests/engine; fi
done
for v in $COMPONENT; do
  if venv=$(testbed "$v"); then run_pytest "component-$v" "$venv/bin/python" tests/component; fi
done
for v in $SERVER; do
  if venv=$(testbed "$v"); then run_pytest "server-$v" "$venv/bin/python" tests/server; fi
done
KERNEL_RELEASE=${KVGUARD_KERNEL_RELEASE:-0.5.23}
if venv=$(testbed "$KERNEL_RELEASE"); then run_pytest "kernels" "$venv/bin/python" tests/kernels; fi

python3 - "$RESULTS" <<'PY'
import glob, sys, xml.etree.ElementTree as ET
tot = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
for path in sorted(glob.glob(sys.argv[1] + "/*.xml")):
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    n = {k: sum(int(s.get(k, 0)) for s in suites) for k in tot}
    for k in tot:
        tot[k] += n[k]
    name = path.rsplit("/", 1)[-1][:-4]
    print(f"  {name:<22} {n['tests'] - n['failures'] - n['errors'] - n['skipped']:>4} passed "
          f"{n['failures'] + n['errors']:>3} failed {n['skipped']:>3} skipped")
passed = tot["tests"] - tot["failures"] - tot["errors"] - tot["skipped"]
print(f"total: {passed} passed, {tot['failures'] + tot['errors']} failed, {tot['skipped']} skipped")
PY
exit $status
