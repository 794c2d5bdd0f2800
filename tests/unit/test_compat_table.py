"""docs/compatibility.md is generated from patches/ and must be up to date."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_compatibility_table_is_current():
    cp = subprocess.run([sys.executable, str(REPO / "scripts" / "compat_table.py"), "--check"],
                        capture_output=True, text=True)
    assert cp.returncode == 0, cp.stderr


def test_table_lists_every_release_and_guard():
    from sglang_kvguard.guards import GUARDS
    from sglang_kvguard.releases import SUPPORTED_RELEASES

    text = (REPO / "docs" / "compatibility.md").read_text()
    for r in SUPPORTED_RELEASES:
        assert f"| {r} |" in text
    for g in GUARDS:
        assert f"`{g.name}`" in text
    assert "| 0.5.21 | upstream |" in text  # admission doors are upstream's from 0.5.21
