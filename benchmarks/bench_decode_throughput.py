"""End-to-end decode throughput, guarded against unguarded, on real PD servers (CPU); prints JSON.

Run with a test-bed interpreter (real SGLang and sglang-router installed)::

    ~/.cache/kvguard-testbed/sglang-0.5.19/bin/python benchmarks/bench_decode_throughput.py

Starts the server tier's trio (prefill + decode + sglang-router, Mooncake over TCP,
the tiny Llama, tests/server's CPU set-up) twice per pair: once with plain
``python -m sglang.launch_server`` (kvguard not installed) and once with
``python -m sglang_kvguard.launch_server`` (every guard on: page_generation's batch
check, destination canaries, transfer checksums, page holds, ...). Each trio serves
``--rounds`` rounds of ``--streams`` concurrent requests of ``--new-tokens`` output
tokens; a round's throughput is output tokens / wall time. Pairs alternate
(unguarded, guarded, unguarded, guarded, ...) so that a slow phase of the machine
hits both. Reported: best and median round of each side, the guarded/unguarded
ratio of the bests, and (the cross-check of bench_guard_share.py) the ratio of the
median rounds of each pair with its mean and 95 % t-interval over the pairs, flagged
``interval_wider_than_goal`` when the half-width exceeds the 1 % goal. Servers get
``--sleep-on-idle`` where the release has it (0.5.10-0.5.19), so an idle scheduler
does not busy-poll a core the other trio's processes need. On two CPU cores the noise
between rounds is several percent, larger than the 1 % goal: read the result as "no
visible cost" or "a cost of about X %", not to the decimal.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "server"))
os.environ.setdefault("KVGUARD_AUTO_INSTALL", "0")

sys.path.insert(0, str(REPO / "benchmarks"))
from _meta import git_commit  # noqa: E402
from server_tier import CONTEXT_LENGTH, CPU_SHIM_DIR, CPU_SHIM_PLUGIN, DECODE_POOL, STUBS_DIR, VOCAB  # noqa: E402

from sglang_kvguard.demo.deployment import PDDeployment, has_sleep_on_idle  # noqa: E402
from sglang_kvguard.demo.tinymodel import make_tiny_model, prompt_of_tokens  # noqa: E402


def _round(d: PDDeployment, streams: int, new_tokens: int, prompt_tokens: int) -> float:
    out = [0] * streams
    errors = []

    def one(i: int) -> None:
        r = d.generate(prompt_of_tokens(prompt_tokens, vocab=VOCAB, offset=i), max_new_tokens=new_tokens,
                       sampling_params={"ignore_eos": True}, timeout=600)
        if r.status != 200:
            errors.append(r)
            return
        out[i] = int(r.json["meta_info"]["completion_tokens"])

    ts = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise SystemExit(f"requests failed: {errors[:2]}")
    return sum(out) / wall


# two-sided 95 % Student t quantiles by degrees of freedom (1..10); larger: 2.2
T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228]


def _ci95(xs):
    mean = statistics.fmean(xs)
    if len(xs) < 2:
        return mean, float("nan")
    t = T95[len(xs) - 2] if len(xs) - 2 < len(T95) else 2.2
    return mean, t * statistics.stdev(xs) / len(xs) ** 0.5


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="kvguard-bench-"))
    model = make_tiny_model(work / "llama", context_length=CONTEXT_LENGTH, vocab=VOCAB)
    common = dict(
        python=sys.executable, prefill_max_total_tokens=DECODE_POOL, decode_max_total_tokens=DECODE_POOL,
        context_length=CONTEXT_LENGTH, sglang_plugins=[CPU_SHIM_PLUGIN],
        extra_pythonpath=[CPU_SHIM_DIR, STUBS_DIR], env={"KVGUARD_AUTO_INSTALL": "0"},
    )
    sleep = ["--sleep-on-idle"] if has_sleep_on_idle() else []
    common.update(prefill_extra_args=sleep, decode_extra_args=sleep)
    sides = {"unguarded": "sglang.launch_server", "guarded": "sglang_kvguard.launch_server"}
    rounds = {k: [] for k in sides}
    pair_ratios = []
    version = None
    for pair in range(args.pairs):
        medians = {}
        for side, launcher in sides.items():
            d = PDDeployment(model, log_dir=work / f"{side}-{pair}", launcher=launcher, **common)
            try:
                d.start()
                version = d.release.version if d.release else version
                _round(d, args.streams, 16, args.prompt_tokens)  # warm-up
                mine = [_round(d, args.streams, args.new_tokens, args.prompt_tokens) for _ in range(args.rounds)]
                rounds[side].extend(mine)
                medians[side] = statistics.median(mine)
            finally:
                d.stop()
        pair_ratios.append(medians["guarded"] / medians["unguarded"])
    best = {k: max(v) for k, v in rounds.items()}
    mean, half = _ci95(pair_ratios)
    print(json.dumps({
        "benchmark": "bench_decode_throughput", "sglang": version, "commit": git_commit(),
        "streams": args.streams, "new_tokens": args.new_tokens, "prompt_tokens": args.prompt_tokens,
        "tokens_per_s": {k: [round(x, 1) for x in v] for k, v in rounds.items()},
        "best": {k: round(x, 1) for k, x in best.items()},
        "median": {k: round(statistics.median(v), 1) for k, v in rounds.items()},
        "guarded_over_unguarded_best": round(best["guarded"] / best["unguarded"], 4),
        "pairs": args.pairs, "sleep_on_idle": bool(sleep),
        "pair_ratios": [round(r, 4) for r in pair_ratios],
        "ratio_mean": round(mean, 4), "ratio_ci95_halfwidth": round(half, 4) if half == half else None,
        "goal": 0.01, "interval_wider_than_goal": not (half <= 0.01),
        "logs": str(work),
    }, indent=2))


if __name__ == "__main__":
    main()
