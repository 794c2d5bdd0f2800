"""docs/performance.md's results table is what the committed benchmark JSON says, and
the charts render from it (benchmarks/plot.py)."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_results_table_matches_the_committed_json():
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "plot.py"), "--check"], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr


def test_charts_render_from_the_committed_json(tmp_path):
    pytest.importorskip("matplotlib")  # a test extra: present in the CI unit tier
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import plot
    finally:
        sys.path.pop(0)
    written = plot.charts(plot.load("bench_guard_share"), plot.load("bench_install"), tmp_path)
    assert {p.name for p in written} == {"perf-guard-share.png", "perf-guard-breakdown.png", "perf-install.png"}
    assert all(p.stat().st_size > 10_000 and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in written)
