"""The engine's runtime: the context a guard decides in, the report of a plan, the
installed state, and the post-import hook that wraps a target when its module loads.

It knows no guard. ``activation/install.py`` plans every guard with it (side-effect
free: it reads the installed SGLang's source files and does not import SGLang;
``kvguard doctor`` prints the plan), refuses loudly if any guard is refused (unless
``--kvguard-on-unknown=warn``), and installs through :func:`hook`.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from packaging.version import InvalidVersion, Version

from . import manifest as manifest_mod
from .config import Config
from .fingerprint import fingerprint_file
from .guard import REFUSED, TargetRefused
from .manifest import Located, Manifest
from .patching import Patcher

log = logging.getLogger("sglang_kvguard")


class KVGuardRefused(SystemExit):
    """Raised when kvguard will not let SGLang start unguarded.

    A ``SystemExit`` on purpose: SGLang's plugin loader catches ``Exception`` from
    plugins and carries on; a refusal must stop the process instead.
    """

    def __str__(self) -> str:
        return str(self.code)


# --------------------------------------------------------------------------- sources
def sglang_release() -> Optional[str]:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def _sglang_root() -> Optional[Path]:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def module_file(module: str) -> Optional[Path]:
    """Source file of an ``sglang.*`` module, found without importing it."""
    root = _sglang_root()
    if root is None:
        return None
    parts = module.split(".")[1:]
    base = root.joinpath(*parts) if parts else root
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


# --------------------------------------------------------------------------- context
@dataclass
class Context:
    release: Optional[str]
    manifest: Optional[Manifest]
    config: Config
    exact: bool  # the manifest is this exact release's
    warnings: List[str] = field(default_factory=list)
    _verified: Dict[str, Located] = field(default_factory=dict)

    @property
    def version(self) -> Optional[Version]:
        try:
            return Version(self.release) if self.release else None
        except InvalidVersion:
            return None

    def has(self, key: str) -> bool:
        """True if this release ships the target ``key`` (per the manifest)."""
        return self.manifest is not None and self.manifest.get(key) is not None

    def require(self, key: str) -> Located:
        """The target's location, after checking the installed code is the reviewed code."""
        if key in self._verified:
            return self._verified[key]
        assert self.manifest is not None
        if not self.manifest.knows(key):
            raise TargetRefused(
                f"target {key} is not listed in the manifest for SGLang {self.manifest.release} "
                f"({self.manifest.path}); regenerate the manifests (scripts/gen_manifests.py)",
                key,
            )
        loc = self.manifest.get(key)
        if loc is None:
            raise TargetRefused(
                f"target {key} does not exist in SGLang {self.manifest.release}", key
            )
        path = module_file(loc.module)
        actual = fingerprint_file(str(path), loc.qualname) if path else None
        if actual != loc.fingerprint:
            what = "is missing" if actual is None else f"has fingerprint {actual}"
            msg = (
                f"target {loc.module}:{loc.qualname} ({key}) {what} in the installed SGLang "
                f"{self.release} ({path}); the reviewed code for {self.manifest.release} has "
                f"fingerprint {loc.fingerprint}"
            )
            if self.exact and self.config.on_unknown == "refuse":
                raise TargetRefused(msg, key)
            if actual is None:
                raise TargetRefused(msg, key)
            self.warnings.append(msg)
        self._verified[key] = loc
        return loc


@dataclass
class GuardReport:
    name: str
    protects: str
    state: str
    reason: str
    patches: Tuple[str, ...] = ()


@dataclass
class Report:
    kvguard: str
    release: Optional[str]
    manifest: Optional[str]
    on_unknown: str
    guards: List[GuardReport]
    warnings: List[str]
    activation: Dict[str, str]

    @property
    def refused(self) -> List[GuardReport]:
        return [g for g in self.guards if g.state == REFUSED]

    def as_dict(self) -> dict:
        return {
            "kvguard": self.kvguard,
            "sglang": self.release,
            "manifest": self.manifest,
            "on_unknown": self.on_unknown,
            "ok": not self.refused,
            "guards": [
                {"name": g.name, "state": g.state, "reason": g.reason, "protects": g.protects,
                 "patches": list(g.patches)}
                for g in self.guards
            ],
            "activation": self.activation,
            "warnings": self.warnings,
        }

    def banner(self, where: str = "") -> str:
        states = " ".join(f"{g.name}={g.state}" for g in self.guards)
        head = f"kvguard {self.kvguard} sglang={self.release or 'absent'} pid={os.getpid()}"
        if where:
            head += f" {where}"
        return f"{head} guards: {states}"

    def refusal_message(self) -> str:
        lines = [f"kvguard refuses to start SGLang {self.release}:"]
        for g in self.refused:
            lines.append(f"  - {g.name}: {g.reason}")
        lines.append(
            "  Way out: install a supported SGLang release ("
            + ", ".join(manifest_mod.known_releases())
            + "), or upgrade sglang-kvguard; for experiments only, pass "
            "--kvguard-on-unknown=warn (env KVGUARD_ON_UNKNOWN=warn), or switch the guard off "
            "with --kvguard-disable=NAME (env KVGUARD_DISABLE)."
        )
        return "\n".join(lines)


def make_context(config: Config, release: Optional[str]) -> Context:
    if release is None:
        return Context(None, None, config, exact=False)
    m = manifest_mod.load(release)
    if m is not None:
        return Context(release, m, config, exact=True)
    nearest = manifest_mod.nearest_known(release) if config.on_unknown == "warn" else None
    m = manifest_mod.load(nearest) if nearest else None
    ctx = Context(release, m, config, exact=False)
    if m is not None:
        ctx.warnings.append(
            f"SGLang {release} is not a known release; using the manifest of {nearest} "
            "(--kvguard-on-unknown=warn)"
        )
    return ctx


# --------------------------------------------------------------------------- install
LOCK = threading.RLock()
STATE: Dict[str, object] = {"report": None, "patcher": None, "generation": 0, "ctx": None}


def ensure_log_handler(level: str) -> None:
    if not any(getattr(h, "_kvguard", False) for h in log.handlers):
        h = logging.StreamHandler(sys.stderr)
        h._kvguard = True  # type: ignore[attr-defined]
        h.setFormatter(logging.Formatter("[%(asctime)s kvguard] %(levelname)s %(message)s"))
        log.addHandler(h)
        log.propagate = False
    log.setLevel(level)


def installed_report() -> Optional[Report]:
    return STATE["report"]  # type: ignore[return-value]


def hook(patcher: Patcher, generation, ctx: Context, key: str, guard: str, factory) -> None:
    import wrapt

    loc = ctx.require(key)

    def apply(_module) -> None:
        if STATE["generation"] != generation or STATE["patcher"] is not patcher:
            return  # uninstalled (or reinstalled) since this hook was registered
        patcher.wrap(key, guard, loc.module, loc.qualname, factory)

    wrapt.register_post_import_hook(apply, loc.module)


def current_patcher() -> Optional[Patcher]:
    return STATE.get("patcher")  # type: ignore[return-value]
