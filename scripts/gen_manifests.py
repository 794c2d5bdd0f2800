#!/usr/bin/env python3
"""Regenerate ``patches/sglang-<release>.json`` from the released SGLang wheels.

    python scripts/gen_manifests.py                 # every supported release
    python scripts/gen_manifests.py 0.5.24          # add one release
    python scripts/gen_manifests.py --wheels DIR    # use wheels already downloaded

For each target that a guard (or the activation layer) declares, the manifest records
where the target lives in that release and the fingerprint of its code as shipped,
or ``null`` if the release has no such code. Review the diff before committing: a
changed fingerprint means upstream changed code a guard wraps.
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ["KVGUARD_AUTO_INSTALL"] = "0"

from sglang_kvguard.engine import manifest as manifest_mod  # noqa: E402
from sglang_kvguard.engine.fingerprint import FINGERPRINT_SCHEME, fingerprint_source  # noqa: E402
from sglang_kvguard.activation.install import all_targets  # noqa: E402
from sglang_kvguard.releases import SUPPORTED_RELEASES  # noqa: E402


def find_wheel(release: str, wheels: Path) -> Path:
    pattern = str(wheels / f"sglang-{release}-*.whl")
    found = sorted(glob.glob(pattern))
    if not found:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"sglang=={release}", "-d", str(wheels)],
            check=True,
        )
        found = sorted(glob.glob(pattern))
    if not found:
        raise SystemExit(f"no wheel for sglang {release} in {wheels}")
    return Path(found[0])


def module_paths(module: str):
    rel = module.replace(".", "/")
    return [f"{rel}.py", f"{rel}/__init__.py"]


def manifest_for(release: str, wheel: Path) -> str:
    targets = all_targets()
    located = {}
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        for key, t in targets.items():
            located[key] = None
            for location in t.locations:
                module, qualname = t.split(location)
                path = next((p for p in module_paths(module) if p in names), None)
                if path is None:
                    continue
                fp = fingerprint_source(zf.read(path).decode("utf-8"), qualname)
                if fp is not None:
                    located[key] = manifest_mod.Located(module, qualname, fp)
                    break
    return manifest_mod.dump(release, FINGERPRINT_SCHEME, located)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("releases", nargs="*", help="releases (default: every supported release)")
    ap.add_argument("--wheels", default=None, help="directory holding sglang wheels (downloaded if missing)")
    ap.add_argument("--out", default=str(REPO / "patches"))
    args = ap.parse_args()
    wheels = Path(args.wheels) if args.wheels else Path(tempfile.mkdtemp(prefix="kvguard-wheels-"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for release in args.releases or SUPPORTED_RELEASES:
        text = manifest_for(release, find_wheel(release, wheels))
        path = out / f"sglang-{release}.json"
        old = path.read_text() if path.exists() else None
        path.write_text(text)
        print(f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}: "
              f"{'unchanged' if old == text else 'written'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
