"""Charts and the results table of docs/performance.md, from the committed JSON results.

    python benchmarks/plot.py                  # writes docs/images/perf-*.png and the table in docs/performance.md
    python benchmarks/plot.py --check          # exit 1 if docs/performance.md's table is not what the JSON says
    python benchmarks/plot.py --out DIR        # charts elsewhere (tests)

Reads ``benchmarks/results/bench_guard_share-*.json`` (the guards' share of scheduler
busy time per release and role, accounting mode) and ``bench_install-*.json`` (import
and install time per release). Needs matplotlib (``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
DOC = REPO / "docs" / "performance.md"
BEGIN, END = "<!-- results:begin (benchmarks/plot.py) -->", "<!-- results:end -->"


def load(prefix: str):
    out = []
    for p in sorted(RESULTS.glob(f"{prefix}-*.json")):
        d = json.loads(p.read_text())
        d["_file"] = p.name
        out.append(d)
    return sorted(out, key=lambda d: Version(str(d.get("sglang") or "0")))


def table(shares, installs) -> str:
    lines = ["### Guards' share of scheduler busy time (accounting mode, CPU)", "",
             "| release | role | guard share (95 % CI) | inside busy calls | top guards | trios x runs | commit |",
             "|---|---|---|---|---|---|---|"]
    for d in shares:
        for role, r in d["roles"].items():
            top = ", ".join(f"{g} {v['share'] * 100:.1f} %" for g, v in list(r["per_guard"].items())[:3])
            lines.append(f"| {d['sglang']} | {role} | {r['guard_share'] * 100:.1f} % ± {r['ci95_halfwidth'] * 100:.1f} "
                         f"| {r['guard_share_busy_phase'] * 100:.1f} % | {top} | {d['trios']} x {d['runs_per_trio']} "
                         f"| {d['commit']} |")
    lines += ["", "### Import and install time per process (CPU)", "",
              "| release | SGLang's own imports | with kvguard | kvguard's cost (median) | first process (cold cache) "
              "| RSS plain / guarded | commit |",
              "|---|---|---|---|---|---|---|"]
    for d in installs:
        cold = d.get("cold_cache_guarded_import_s")
        cold_txt = f"+{cold - d['plain_import_s']:.2f} s" if cold is not None else "-"
        lines.append(f"| {d['sglang']} | {d['plain_import_s']:.2f} s | {d['guarded_import_s']:.2f} s "
                     f"| +{d['extra_s_median']:.2f} s | {cold_txt} "
                     f"| {d['plain_maxrss_mb']:.0f} / {d['guarded_maxrss_mb']:.0f} MB | {d['commit']} |")
    return "\n".join(lines) + "\n"


def charts(shares, installs, out: Path) -> list:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []

    def save(fig, ax, name: str, ylabel: str, title: str, legend_size: int = 8, ncol: int = 1) -> None:
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=legend_size, ncol=ncol)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(out / name)

    if shares:
        cells = [(d["sglang"], role, r) for d in shares for role, r in d["roles"].items()]
        labels = [f"{release}\n{role}" for release, role, _ in cells]
        x = list(range(len(cells)))

        fig, ax = plt.subplots(figsize=(7, 3.6))
        ax.bar(x, [r["guard_share"] * 100 for _, _, r in cells], yerr=[r["ci95_halfwidth"] * 100 for _, _, r in cells],
               capsize=4, color="#c0504d", label="all guard time")
        ax.bar(x, [r["guard_share_busy_phase"] * 100 for _, _, r in cells], width=0.4, color="#4f81bd",
               label="inside busy calls")
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="goal 1 %")
        ax.set_xticks(x, labels)
        save(fig, ax, "perf-guard-share.png", "% of scheduler busy time", "kvguard guard share (CPU, tiny Llama, 95 % CI)")

        fig, ax = plt.subplots(figsize=(7, 3.6))
        guards = []
        for _, _, r in cells:
            guards += [g for g, v in r["per_guard"].items() if v["share"] > 0.001 and g not in guards]
        bottom = [0.0] * len(cells)
        for g in guards:
            col = [r["per_guard"].get(g, {"share": 0})["share"] * 100 for _, _, r in cells]
            ax.bar(x, col, bottom=bottom, label=g)
            bottom = [b + c for b, c in zip(bottom, col)]
        ax.set_xticks(x, labels)
        save(fig, ax, "perf-guard-breakdown.png", "% of scheduler busy time", "guard share by guard (CPU)",
             legend_size=6, ncol=2)
    if installs:
        fig, ax = plt.subplots(figsize=(6, 3.2))
        x = list(range(len(installs)))
        ax.bar(x, [d["extra_s_median"] for d in installs], color="#4f81bd", label="warm cache")
        ax.scatter(x, [d.get("cold_cache_guarded_import_s", d["guarded_import_s"]) - d["plain_import_s"]
                       for d in installs], color="#c0504d", zorder=3, label="first process")
        ax.axhline(0.5, color="black", linestyle="--", linewidth=1, label="goal 0.5 s")
        ax.set_xticks(x, [d["sglang"] for d in installs])
        save(fig, ax, "perf-install.png", "seconds beyond SGLang's import", "import + install cost per process (CPU)")
    return written


def splice(doc: str, body: str) -> str:
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{DOC} has no {BEGIN} ... {END} block")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return head + BEGIN + "\n" + body + END + tail


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only check that the table in the docs is current")
    ap.add_argument("--out", default=str(REPO / "docs" / "images"))
    a = ap.parse_args()
    shares, installs = load("bench_guard_share"), load("bench_install")
    body = table(shares, installs)
    doc = DOC.read_text()
    new = splice(doc, body)
    if a.check:
        if new != doc:
            print(f"{DOC.relative_to(REPO)} is stale: run python benchmarks/plot.py", file=sys.stderr)
            return 1
        return 0
    for p in charts(shares, installs, Path(a.out)):
        print(p)
    if new != doc:
        DOC.write_text(new)
        print(f"{DOC.relative_to(REPO)}: table updated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
