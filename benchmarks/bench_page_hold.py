"""Cost of prefill_source_hold on SGLang's real paged allocator (CPU); prints JSON.

Run with a test-bed interpreter (real SGLang installed)::

    ~/.cache/kvguard-testbed/sglang-0.5.19/bin/python benchmarks/bench_page_hold.py

Measures one request's ``free`` (``--pages`` pages) on a real
``PagedTokenToKVPoolAllocator``, side by side in one run:

* ``unguarded``: kvguard not installed;
* ``guarded_idle``: installed, no transfer in flight (no page pinned);
* ``guarded_busy``: installed, ``--pinned`` other pages pinned by transfers in flight
  (every free then checks its pages against the pins);
* ``pin_unpin``: the transfer worker's cost per chunk (pin at put, unpin at get).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("KVGUARD_AUTO_INSTALL", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "component"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _meta import git_commit  # noqa: E402


def _per_call(fn, reps):
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=64, help="pages per request")
    ap.add_argument("--pinned", type=int, default=4096, help="pages pinned by other transfers")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    import _sglang_components as sgl
    import sglang_kvguard
    from sglang_kvguard.guards import prefill_source_hold as g
    from sglang_kvguard.lifetime.page_hold import HOLDS

    ps = args.page_size
    size = (args.pages + args.pinned + 64) * ps
    with sgl.sglang_config():
        pool = sgl.make_kv_pool(size, ps)
        alloc = sgl.make_paged_allocator(size, ps, pool)

        def cycle():
            alloc.free(alloc.alloc(args.pages * ps))

        out = {"benchmark": "bench_page_hold", "sglang": str(sgl.SGLANG_VERSION), "commit": git_commit(),
               "cpus": os.cpu_count(), "pages_per_free": args.pages, "page_size": ps,
               "rounds": args.rounds}
        others = alloc.alloc(args.pinned * ps)
        pinned = sorted({int(t) // ps for t in others.tolist()})
        chunk = list(range(1, args.pages + 1))
        samples = {"unguarded_us": [], "guarded_idle_us": [], "guarded_busy_us": [], "pin_unpin_us": []}
        # Interleaved rounds (plain, then guarded idle and busy, on one allocator) so that
        # drift of the machine lands on both sides; medians reported.
        for _ in range(args.rounds):
            samples["unguarded_us"].append(_per_call(cycle, args.reps) * 1e6)
            sglang_kvguard.install()
            try:
                hold = g.bind_allocator(alloc)
                samples["guarded_idle_us"].append(_per_call(cycle, args.reps) * 1e6)
                hold.pin(pinned)
                samples["guarded_busy_us"].append(_per_call(cycle, args.reps) * 1e6)
                samples["pin_unpin_us"].append(
                    _per_call(lambda: (hold.pin(chunk), hold.unpin(chunk)), args.reps) * 1e6)
                hold.unpin(pinned)
            finally:
                sglang_kvguard.uninstall()
                HOLDS.clear()
        alloc.free(others)
        for k, v in samples.items():
            out[k] = statistics.median(v)
        out["pinned_pages"] = len(pinned)
    out["overhead_idle"] = out["guarded_idle_us"] / out["unguarded_us"] - 1
    out["overhead_busy"] = out["guarded_busy_us"] / out["unguarded_us"] - 1
    out["overhead_busy_per_round"] = [round(b / u - 1, 3) for b, u in
                                      zip(samples["guarded_busy_us"], samples["unguarded_us"])]
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.items()}))


if __name__ == "__main__":
    main()
