"""Upstream functions that kvguard wraps or relies on, by stable key.

A :class:`Target` names one piece of upstream code by a stable key and lists the
places it has lived across releases ("module:Qual.name"). The per-release manifest
in ``patches/`` records, for each key, which location exists in that release and the
fingerprint of the code as shipped; ``null`` means the release has no such code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple


@dataclass(frozen=True)
class Target:
    key: str
    locations: Tuple[str, ...]
    why: str = ""

    def split(self, location: str) -> Tuple[str, str]:
        module, _, qualname = location.partition(":")
        return module, qualname


_REGISTRY: Dict[str, Target] = {}


def target(key: str, *locations: str, why: str = "") -> Target:
    """Declare (or fetch) the target ``key``; guards share targets by key."""
    existing = _REGISTRY.get(key)
    t = Target(key, tuple(locations), why)
    if existing is not None:
        if existing.locations != t.locations:
            raise ValueError(f"target {key!r} declared twice with different locations")
        return existing
    _REGISTRY[key] = t
    return t


def registered() -> Dict[str, Target]:
    """Every target declared so far (``activation.install.all_targets`` imports every
    declaring module first)."""
    return dict(sorted(_REGISTRY.items()))
