#!/usr/bin/env bash
# Exhaustive check of models/pd_transfer.pml (PD KV transfer ownership) with SPIN.
#
# Every configuration below is compiled (spin -a, gcc) and searched by pan, one after the
# other.  Each run has an expected outcome:
#   clean     - complete search (no depth truncation, exhaustive hashing: no bitstate,
#               no hash compaction), errors: 0
#   violation - pan finds a counterexample of the one property compiled in; its trail is
#               replayed (spin -t -p), trimmed to the labelled hook steps and written to
#               $KVGUARD_MODEL_OUT/<run>.trail.txt
#   reachable - a non-vacuity probe: the guarded model does reach the named situation
# The script exits 0 only if every run ended as expected.  docs/design/formal-model.md
# explains the model, the bounds and the results.
#
# Usage: bash scripts/check-model.sh        (KVGUARD_MODEL_OUT=DIR to keep the trails)
#        KVGUARD_MODEL_EXTENDED=1 also runs the three-transfer check (-DANY_FIT: about
#        16M states, 3.5 GB and 2.5 minutes per family on 2 cores; not in CI)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODEL="$ROOT/models/pd_transfer.pml"
OUT="${KVGUARD_MODEL_OUT:-$(mktemp -d "${TMPDIR:-/tmp}/kvguard-model.XXXXXX")}"
mkdir -p "$OUT"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/kvguard-pan.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

for tool in spin gcc; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "check-model: '$tool' not found (Debian: apt-get install -y spin gcc)" >&2
    exit 2
  fi
done

# The machine is shared with timing-sensitive jobs: lowest priority, one pan at a time.
NICE=(nice -n 19)

ALL_GUARDS="ADMISSION_DRAIN REJECTION_NOTICE COVERAGE SOURCE_HOLD DEST_HOLD QUARANTINE GENERATION CHECKSUM CANARY POOL_CHECK FLUSH_BARRIER PEER_LIVENESS"
# a dead peer: frozen batches never land, and may vanish; a 3-page pool, clients wait
DEAD_PEER="-DNPAGE=3 -DPEER_NEVER_RESUMES -DNO_CLIENT_ABORT -DPEER_CAN_DIE"
SAFETY_PROPS="PROP_ISOLATION PROP_FID200 PROP_FID4XX PROP_REUSE_SRC PROP_REUSE_DST PROP_LATEWRITE PROP_CONSERVATION PROP_UAF PROP_TERMINAL"

declare -A PROP_NAME=(
  [PROP_ISOLATION]="isolation"
  [PROP_FID200]="error fidelity (never 200)"
  [PROP_FID4XX]="error fidelity (its own 400)"
  [PROP_REUSE_SRC]="no reuse under a transfer (prefill source page)"
  [PROP_REUSE_DST]="no reuse under a transfer (decode destination page)"
  [PROP_LATEWRITE]="no late write into a reused page"
  [PROP_CONSERVATION]="conservation"
  [PROP_UAF]="no read of a page freed under its reader (use after free)"
  [PROP_TERMINAL]="progress (every run ends with all requests ended, pages free or quarantined)"
  [PROGRESS]="progress (LTL <> all done, weak fairness)"
)

# guards "all", "none", or "all -X -Y", "none +X +Y" -> -D list
guard_defines() {
  local spec="$1" base word out="" g
  base="${spec%% *}"
  declare -A on=()
  if [[ "$base" == all ]]; then for g in $ALL_GUARDS; do on[$g]=1; done; fi
  for word in ${spec#"$base"}; do
    case "$word" in
      -*) unset "on[${word#-}]" ;;
      +*) on[${word#+}]=1 ;;
    esac
  done
  for g in $ALL_GUARDS; do [[ -n "${on[$g]:-}" ]] && out="$out -D$g"; done
  echo "$out"
}

total_runs=0
failures=0
FAILED_RUNS=()
TABLE=()          # necessity table rows
SUMMARY=()        # one line per run
T0=$(date +%s.%N)

# trim a spin -t -p replay to the printf lines of the model, numbering each action
trim_trail() {
  grep -vE '^[[:space:]]*[0-9]+:[[:space:]]+proc|^Starting |^spin: trail ends|^spin: warning|starting claim|^#processes|^[[:space:]]+[a-z_0-9]+\[[0-9]+\] = |^[[:space:]]+[a-z_0-9]+ = |^[[:space:]]*[0-9]+ processes created|^[[:space:]]*$' \
    | sed -E 's/^[[:space:]]+//; s/[[:space:]]{2,}/ /g; s/\( /(/g; s/ \)/)/g' \
    | awk '/^(r[0-9]+:|prefill @Scheduler_flush_cache|decode @Scheduler_flush_cache)/ { n++; printf "%3d. %s\n", n, $0; next }
           /^spin: / { printf "     %s\n", $0; next }
           { printf "       %s\n", $0 }'
}

# run ID FAMILY GUARDS PROPS MODE EXPECT CLASS [EXTRA_DEFINES]
#   MODE: bfs (shortest counterexample) | dfs | ltl (pan -a -f) | big (dfs, -O2, -DCOLLAPSE)
#   EXPECT: clean | violation | reachable
#   CLASS: text for the summary (what the run is for)
run() {
  local id="$1" fam="$2" guards="$3" props="$4" mode="$5" expect="$6" class="$7" extra="${8:-}"
  local rel defs gdefs p pdefs="" dir t0 t1 secs ccflags panflags ok=1 verdict actions="-" depth states trans
  total_runs=$((total_runs + 1))
  case "$fam" in 0.5.19) rel=REL_0519 ;; 0.5.23) rel=REL_0523 ;; *) echo "bad family $fam" >&2; exit 2 ;; esac
  gdefs="$(guard_defines "$guards")"
  for p in $props; do pdefs="$pdefs -D$p"; done
  defs="-D$rel$gdefs$pdefs $extra"
  dir="$WORK/$id"; mkdir -p "$dir"; cp "$MODEL" "$dir/pd_transfer.pml"
  echo
  echo "=== [$total_runs] $id: SGLang $fam, guards: $guards, property: $props${extra:+, $extra}; expect $expect"
  case "$mode" in
    bfs) ccflags="-O0 -DSAFETY -DBFS"; panflags="-m10000 -w20" ;;
    dfs) ccflags="-O0 -DSAFETY";       panflags="-m10000 -w23" ;;
    ltl) ccflags="-O0 -DNFAIR=5";      panflags="-a -f -m10000 -w22" ;;
    big) ccflags="-O2 -DSAFETY -DCOLLAPSE"; panflags="-m100000 -w26" ;;
  esac
  echo "    spin -a $defs; gcc $ccflags; pan $panflags"
  t0=$(date +%s.%N)
  (cd "$dir" && "${NICE[@]}" spin -a $defs pd_transfer.pml >spin.log 2>&1) || { echo "    spin failed:"; sed 's/^/    /' "$dir/spin.log"; ok=0; }
  if ((ok)); then
    (cd "$dir" && "${NICE[@]}" gcc $ccflags -o pan pan.c >gcc.log 2>&1) || { echo "    gcc failed:"; sed 's/^/    /' "$dir/gcc.log"; ok=0; }
  fi
  if ((ok)); then
    (cd "$dir" && "${NICE[@]}" ./pan $panflags >pan.out 2>&1) || true
  fi
  t1=$(date +%s.%N)
  secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
  if ((ok)); then
    # pan's own summary
    grep -E 'Full statespace search|Breadth-First|^State-vector|states, stored|transitions \(= |Search not completed|max search depth too small|out of memory|assertion violated|acceptance cycle|^pan:[0-9]+: invalid end state|claim violated' "$dir/pan.out" \
      | grep -v '^pan: wrote' | sed -E 's/^[[:space:]]*(pan: )?/    pan: /' | cut -c1-220
    depth=$(sed -nE 's/.*depth reached ([0-9]+).*/\1/p' "$dir/pan.out" | tail -1)
    states=$(sed -nE 's/^[[:space:]]*([0-9.e+]+) states, stored.*/\1/p' "$dir/pan.out" | tail -1)
    trans=$(sed -nE 's/^[[:space:]]*([0-9.e+]+) transitions.*/\1/p' "$dir/pan.out" | tail -1)
    local errs
    errs=$(sed -nE 's/.*errors: ([0-9]+).*/\1/p' "$dir/pan.out" | tail -1)
    local truncated=0
    grep -qE 'max search depth too small|out of memory|Search not completed|invalid end state \(|pan: error' "$dir/pan.out" && truncated=1
    if [[ -z "$errs" ]]; then
      verdict="pan did not finish"; ok=0
    elif [[ "$expect" == clean ]]; then
      if [[ "$errs" == 0 && $truncated == 0 ]]; then
        verdict="complete search, errors: 0"
        echo "    complete search (exhaustive, no depth limit reached, no bitstate/hash compaction), errors: 0"
      else
        verdict="UNEXPECTED: errors: $errs$( ((truncated)) && echo ', search incomplete')"; ok=0
      fi
    else
      if [[ "$errs" != 0 ]] && grep -qE 'assertion violated|acceptance cycle|claim violated' "$dir/pan.out"; then
        # replay and trim the counterexample
        (cd "$dir" && "${NICE[@]}" spin -t -p $defs pd_transfer.pml 2>&1 | trim_trail > "$OUT/$id.trail.txt") || true
        actions=$(grep -cE '^ *[0-9]+\. ' "$OUT/$id.trail.txt" || true)
        if [[ "$expect" == violation ]]; then
          verdict="violation: $(for p in $props; do echo -n "${PROP_NAME[$p]:-$p}"; done)"
        else
          verdict="reachable"
        fi
        echo "    counterexample: $actions actions (pan depth $depth); trail: $OUT/$id.trail.txt"
      else
        verdict="UNEXPECTED: no counterexample (errors: ${errs:-?})"; ok=0
      fi
    fi
  else
    verdict="build failed"
  fi
  if ((ok)); then
    echo "    OK ($secs s)"
  else
    echo "    FAILED: $verdict ($secs s)"
    failures=$((failures + 1)); FAILED_RUNS+=("$id")
  fi
  echo "RESULT $id $fam $class: $verdict"
  SUMMARY+=("$(printf '%-26s %-7s %-10s %-62s %9s %6s %6s' "$id" "$fam" "$class" "$verdict" "${states:-?}" "$actions" "$secs")")
  LAST_ACTIONS="$actions"; LAST_STATES="${states:-?}"; LAST_SECS="$secs"; LAST_OK=$ok
}

# necessity: guard G off alone -> each property P it exists for is violated; or "clean":
# the guard is defence in depth here (all safety properties still hold, complete search);
# EXTRA: defines of the environment the guard matters in (e.g. a dead peer)
necessity() {
  local fam="$1" g="$2" props="$3" expect="$4" why="${5:-}" extra="${6:-}"
  local id="n${fam: -2}-no-$(echo "$g" | tr 'A-Z_' 'a-z-')" p res
  if [[ "$expect" == upstream ]]; then
    TABLE+=("$(printf '%-8s %-18s %-52s %-24s %9s %6s' "$fam" "$g" "- ($why)" "upstream: switch unused" "-" "-")")
    echo
    echo "=== $fam without $g: not run: $why; the switch is not read for this family"
    return
  fi
  if [[ "$expect" == clean ]]; then
    run "$id" "$fam" "all -$g" "$props" dfs clean necessity
    res="all hold: defence in depth"; ((LAST_OK)) || res="UNEXPECTED"
    TABLE+=("$(printf '%-8s %-18s %-52s %-24s %9s %6s' "$fam" "$g" "every safety property" "$res" "$LAST_STATES" "$LAST_SECS")")
    return
  fi
  for p in $props; do
    run "$id-$(echo "${p#PROP_}" | tr 'A-Z_' 'a-z-')" "$fam" "all -$g" "$p" bfs violation necessity "$extra"
    res="violated, cex ${LAST_ACTIONS} actions"; ((LAST_OK)) || res="UNEXPECTED"
    TABLE+=("$(printf '%-8s %-18s %-52s %-24s %9s %6s' "$fam" "$g" "${PROP_NAME[$p]}" "$res" "$LAST_STATES" "$LAST_SECS")")
  done
}

echo "kvguard formal model: $MODEL"
echo "spin: $(spin -V 2>&1 | head -1)"
echo "trails: $OUT"

for fam in 0.5.19 0.5.23; do
  f="${fam//./}"; f="${f: -2}"
  echo
  echo "################ SGLang $fam as shipped (unguarded)"
  if [[ $fam == 0.5.19 ]]; then
    run u19-incident      0.5.19 none PROP_ISOLATION bfs violation unguarded
    run u19-incident-200  0.5.19 none PROP_FID200    bfs violation unguarded
    run u19-late-write    0.5.19 none PROP_LATEWRITE bfs violation unguarded
  else
    run u23-source-reuse  0.5.23 none PROP_REUSE_SRC bfs violation unguarded
    run u23-500           0.5.23 none PROP_FID4XX    bfs violation unguarded
    run u23-isolation     0.5.23 none PROP_ISOLATION bfs violation unguarded
  fi

  echo
  echo "################ SGLang $fam with every guard"
  run "g$f-safety"       "$fam" all "$SAFETY_PROPS" dfs clean guarded
  run "g$f-progress"     "$fam" all PROGRESS ltl clean guarded
  run "g$f-clients-wait"  "$fam" all "$SAFETY_PROPS" dfs clean guarded "-DNO_CLIENT_ABORT"
  run "g$f-frozen-peer"  "$fam" all "$SAFETY_PROPS" dfs clean guarded "-DPEER_NEVER_RESUMES"
  run "g$f-dead-peer"    "$fam" all "$SAFETY_PROPS" dfs clean guarded "-DPEER_CAN_DIE"
  run "g$f-dead-frozen-peer" "$fam" all "$SAFETY_PROPS" dfs clean guarded "-DPEER_CAN_DIE -DPEER_NEVER_RESUMES"
  run "g$f-dead-peer-ends" "$fam" all PROP_TERMINAL dfs clean guarded "$DEAD_PEER"
  run "g$f-router-retry" "$fam" all "$SAFETY_PROPS" dfs clean guarded "-DROUTER_RETRY"
  run "g$f-progress-retry" "$fam" all PROGRESS ltl clean guarded "-DROUTER_RETRY"

  echo
  echo "################ SGLang $fam: each guard switched off alone"
  if [[ $fam == 0.5.19 ]]; then
    necessity 0.5.19 ADMISSION_DRAIN  PROP_FID4XX violation
  else
    necessity 0.5.23 ADMISSION_DRAIN  "" upstream "0.5.23 rejects at upstream's door"
  fi
  necessity "$fam" REJECTION_NOTICE PROP_FID4XX violation
  necessity "$fam" COVERAGE         "$SAFETY_PROPS" clean
  necessity "$fam" CANARY           "$SAFETY_PROPS" clean
  necessity "$fam" CHECKSUM         "$SAFETY_PROPS" clean
  if [[ $fam == 0.5.19 ]]; then
    necessity 0.5.19 SOURCE_HOLD    "PROP_REUSE_SRC PROP_ISOLATION" violation
    necessity 0.5.19 DEST_HOLD      "PROP_REUSE_DST PROP_ISOLATION" violation
  else
    necessity 0.5.23 SOURCE_HOLD    PROP_REUSE_SRC violation
    # upstream's ABORT_ACK is withheld for a failed send, so decode keeps its pages
    run n23-no-source-hold-isolation 0.5.23 "all -SOURCE_HOLD" PROP_ISOLATION dfs clean necessity
    TABLE+=("$(printf '%-8s %-18s %-52s %-24s %9s %6s' 0.5.23 SOURCE_HOLD isolation \
      "$( ((LAST_OK)) && echo 'holds (upstream ack)' || echo UNEXPECTED)" "$LAST_STATES" "$LAST_SECS")")
    necessity 0.5.23 DEST_HOLD      "" upstream "0.5.23's deferred release holds decode pages"
  fi
  necessity "$fam" QUARANTINE       PROP_ISOLATION violation
  necessity "$fam" GENERATION       "$SAFETY_PROPS" clean
  necessity "$fam" POOL_CHECK       "$SAFETY_PROPS" clean
  necessity "$fam" FLUSH_BARRIER    PROP_CONSERVATION violation
  necessity "$fam" PEER_LIVENESS    PROP_TERMINAL violation "" "$DEAD_PEER"

  echo
  echo "################ SGLang $fam: non-vacuity (the guarded model does reach these)"
  run "r$f-notice-400"     "$fam" all REACH_NOTICE_400     bfs reachable probe
  run "r$f-late-into-held" "$fam" all REACH_LATE_INTO_HELD bfs reachable probe
  run "r$f-retry-200"      "$fam" all REACH_RETRY_200      bfs reachable probe "-DROUTER_RETRY"
  run "r$f-dead-release"   "$fam" all REACH_DEAD_RELEASE   bfs reachable probe "-DPEER_CAN_DIE"
  if [[ $fam == 0.5.19 ]]; then
    run r19-two-200        0.5.19 all REACH_TWO_200        bfs reachable probe
    run r19-source-held    0.5.19 all REACH_SOURCE_HELD    bfs reachable probe
    run r19-flush          0.5.19 all REACH_FLUSH          bfs reachable probe
    run r19-quarantine     0.5.19 all REACH_QUARANTINE     bfs reachable probe "-DPEER_NEVER_RESUMES"
  fi
done

echo
echo "################ defence in depth: what the redundant guards catch on their own"
DID="all -ADMISSION_DRAIN -COVERAGE -CANARY -CHECKSUM"
run w19-no-verification   0.5.19 "$DID"           PROP_ISOLATION bfs violation witness "-DNREQ=2"
run w19-coverage-alone    0.5.19 "$DID +COVERAGE" "PROP_ISOLATION PROP_FID200" dfs clean witness "-DNREQ=2"
run w19-canary-alone      0.5.19 "$DID +CANARY"   "PROP_ISOLATION PROP_FID200" dfs clean witness "-DNREQ=2"
run w19-checksum-alone    0.5.19 "$DID +CHECKSUM" "PROP_ISOLATION PROP_FID200" dfs clean witness "-DNREQ=2"
run w19-no-gen-no-barrier 0.5.19 "all -FLUSH_BARRIER -GENERATION" PROP_UAF bfs violation witness
run w19-gen-no-barrier    0.5.19 "all -FLUSH_BARRIER" PROP_UAF dfs clean witness

echo
echo "################ negative control for progress: quarantine can starve a small pool"
run x19-starvation 0.5.19 all PROP_TERMINAL bfs violation limit "-DNPAGE=3 -DPEER_NEVER_RESUMES -DNO_CLIENT_ABORT"

if [[ "${KVGUARD_MODEL_EXTENDED:-0}" == 1 ]]; then
  echo
  echo "################ extended: request 1 may fit too, so three requests transfer at once"
  run e19-any-fit 0.5.19 all "$SAFETY_PROPS" big clean guarded "-DANY_FIT"
  run e23-any-fit 0.5.23 all "$SAFETY_PROPS" big clean guarded "-DANY_FIT"
fi

T1=$(date +%s.%N)
TOTAL=$(awk -v a="$T0" -v b="$T1" 'BEGIN { printf "%.0f", b - a }')

{
  echo
  echo "================ necessity: each guard switched off alone (all others on)"
  printf '%-8s %-18s %-52s %-24s %9s %6s\n' family guard property result states secs
  printf '%s\n' "${TABLE[@]}"
  echo
  echo "================ all runs"
  printf '%-26s %-7s %-10s %-62s %9s %6s %6s\n' run family kind verdict states cex secs
  printf '%s\n' "${SUMMARY[@]}"
  echo
  echo "runs: $total_runs, unexpected: $failures, wall time: ${TOTAL} s (spin+gcc+pan, niced, one pan at a time)"
} | tee "$OUT/summary.txt"

if ((failures)); then
  echo "check-model: FAILED: ${FAILED_RUNS[*]}"
  exit 1
fi
echo "check-model: every run ended as expected"
