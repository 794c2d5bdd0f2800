"""What every benchmark result records about where it was measured."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def git_commit() -> str:
    """Short commit of this checkout, ``+dirty`` when tracked files differ from it."""
    try:
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=REPO, check=True).stdout.strip()
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO,
                              check=True).stdout.strip() + ("+dirty" if dirty else "")
    except Exception:  # noqa: BLE001
        return "unknown"
