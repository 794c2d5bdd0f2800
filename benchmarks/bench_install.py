"""What ``import sglang_kvguard`` plus installing every guard costs each SGLang process.

Every SGLang process that kvguard guards (the launcher, each scheduler, the detokenizer)
imports kvguard, plans (reads and fingerprints each upstream target in the installed
SGLang's source files) and wraps its targets as SGLang's modules are imported. This
benchmark starts fresh interpreters of the running environment, alternating:

* ``plain``: ``import`` of the modules a PD scheduler process loads
  (``sglang.srt.managers.scheduler`` and the Mooncake connector);
* ``guarded``: ``import sglang_kvguard`` (which installs every guard) and then the same
  imports (each target is wrapped by its post-import hook as its module loads), with
  the fingerprint cache warm (every process after the first on a machine);
* ``cold``: the same with an empty fingerprint cache (the first process after SGLang
  or kvguard was installed);

and reports, per run and as medians: both import times, the difference (kvguard's cost
beyond SGLang's own import; goal <= 0.5 s), kvguard's own import + install, and the
processes' peak RSS. Run with a test-bed interpreter (real SGLang installed)::

    ~/.cache/kvguard-testbed/sglang-0.5.23/bin/python benchmarks/bench_install.py [--pairs 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _meta import git_commit  # noqa: E402

MODULES = ("sglang.srt.managers.scheduler", "sglang.srt.disaggregation.mooncake.conn")

CHILD = r"""
import json, os, resource, sys, time
t0 = time.perf_counter()
kv = None
if os.environ.get("BENCH_GUARDED") == "1":
    import sglang_kvguard
    kv = time.perf_counter() - t0
    report = sglang_kvguard.install()
    assert not report.refused, report.refusal_message()
for m in sys.argv[1:]:
    __import__(m)
total = time.perf_counter() - t0
wrapped = None
if kv is not None:
    from sglang_kvguard.engine.runtime import current_patcher
    wrapped = len(current_patcher().applied) if hasattr(current_patcher(), "applied") else None
print(json.dumps({"total_s": total, "kvguard_s": kv, "wrapped": wrapped,
                  "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def _run(guarded: bool, cold: bool = False) -> dict:
    env = dict(os.environ)
    if cold:  # an empty fingerprint cache: the first process after installing SGLang or kvguard
        env["KVGUARD_FINGERPRINT_CACHE"] = tempfile.mkdtemp(prefix="kvguard-bench-fp-")
    env["BENCH_GUARDED"] = "1" if guarded else "0"
    env["KVGUARD_AUTO_INSTALL"] = "1" if guarded else "0"
    env.setdefault("KVGUARD_LOG_LEVEL", "WARNING")
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, *MODULES], env=env, capture_output=True, text=True,
                         cwd="/", check=False)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"child failed ({'guarded' if guarded else 'plain'}):\n{out.stderr[-3000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["wall_s"] = wall
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=5, help="alternating plain/guarded pairs (one warm-up pair first)")
    ap.add_argument("--out", help="also write the JSON here")
    a = ap.parse_args()

    import importlib.metadata

    _run(False), _run(True)  # warm the page cache and the bytecode caches
    plain, guarded, cold = [], [], []
    for i in range(a.pairs):
        order = (False, True) if i % 2 == 0 else (True, False)
        for g in order:
            (guarded if g else plain).append(_run(g))
        cold.append(_run(True, cold=True))
    med = lambda rows, k: round(statistics.median(r[k] for r in rows), 3)  # noqa: E731
    extra = [round(g["total_s"] - p["total_s"], 3) for p, g in zip(plain, guarded)]
    out = {
        "benchmark": "bench_install",
        "sglang": importlib.metadata.version("sglang"),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "commit": git_commit(),
        "modules": list(MODULES),
        "pairs": a.pairs,
        "plain_import_s": med(plain, "total_s"),
        "guarded_import_s": med(guarded, "total_s"),
        "kvguard_import_and_install_s": med(guarded, "kvguard_s"),
        "cold_cache_guarded_import_s": med(cold, "total_s"),
        "cold_cache_kvguard_import_and_install_s": med(cold, "kvguard_s"),
        "extra_s_per_pair": extra,
        "extra_s_median": round(statistics.median(extra), 3),
        "goal_extra_s": 0.5,
        "plain_maxrss_mb": med(plain, "maxrss_mb"),
        "guarded_maxrss_mb": med(guarded, "maxrss_mb"),
    }
    out["within_goal"] = out["extra_s_median"] <= out["goal_extra_s"]
    text = json.dumps(out, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
