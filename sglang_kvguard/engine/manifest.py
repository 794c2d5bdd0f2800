"""Per-release manifests (``patches/sglang-<release>.json``)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from packaging.version import InvalidVersion, Version


@dataclass(frozen=True)
class Located:
    module: str
    qualname: str
    fingerprint: str


@dataclass
class Manifest:
    release: str
    scheme: str
    targets: Dict[str, Optional[Located]]
    path: str

    def get(self, key: str) -> Optional[Located]:
        return self.targets.get(key)

    def knows(self, key: str) -> bool:
        return key in self.targets


def manifest_dir() -> Path:
    """Where manifests live: ``KVGUARD_MANIFEST_DIR``, the wheel copy, or the repo."""
    env = os.environ.get("KVGUARD_MANIFEST_DIR")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parent.parent
    packaged = here / "_manifests"
    if packaged.is_dir():
        return packaged
    return here.parent / "patches"


def _release_of(path: Path) -> str:
    return path.stem[len("sglang-") :]


def known_releases(directory: Optional[Path] = None) -> List[str]:
    directory = directory or manifest_dir()
    releases = [_release_of(p) for p in directory.glob("sglang-*.json")]
    return sorted(releases, key=Version)


def load(release: str, directory: Optional[Path] = None) -> Optional[Manifest]:
    directory = directory or manifest_dir()
    path = directory / f"sglang-{release}.json"
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    targets: Dict[str, Optional[Located]] = {}
    for key, entry in data["targets"].items():
        targets[key] = None if entry is None else Located(**entry)
    return Manifest(release=data["sglang"], scheme=data["scheme"], targets=targets, path=str(path))


def nearest_known(release: str, directory: Optional[Path] = None) -> Optional[str]:
    """The newest known release not newer than ``release`` (for --kvguard-on-unknown=warn)."""
    try:
        v = Version(release)
    except InvalidVersion:
        return None
    older = [r for r in known_releases(directory) if Version(r) <= v]
    if older:
        return older[-1]
    known = known_releases(directory)
    return known[0] if known else None


def dump(release: str, scheme: str, targets: Dict[str, Optional[Located]]) -> str:
    data = {
        "sglang": release,
        "scheme": scheme,
        "generated_by": "scripts/gen_manifests.py",
        "targets": {
            k: (None if v is None else {"module": v.module, "qualname": v.qualname, "fingerprint": v.fingerprint})
            for k, v in sorted(targets.items())
        },
    }
    return json.dumps(data, indent=1, sort_keys=False) + "\n"
