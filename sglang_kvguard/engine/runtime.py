"""Deciding each guard's state for the running SGLang and installing the active ones.

``plan()`` is side-effect free (it reads the installed SGLang's source files, it
does not import SGLang): ``kvguard doctor`` prints it. ``install()`` runs the same
plan, refuses loudly if any guard is refused (unless ``--kvguard-on-unknown=warn``),
then registers post-import hooks that wrap each target as soon as its module is
imported (at once if it already is). ``uninstall()`` reverts every wrapper.
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

from .. import __version__
from ..config import Config
from . import manifest as manifest_mod
from . import suspension
from .fingerprint import fingerprint_file, release_parse_cache
from .guard import ACTIVE, OFF, REFUSED, Decision, Guard, TargetRefused
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


def all_guards() -> List[Guard]:
    from ..guards import GUARDS

    return [cls() for cls in GUARDS]


def _activation_targets() -> Dict[str, object]:
    from .. import activation

    return activation.TARGETS


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


def plan(config: Optional[Config] = None, release: Optional[str] = None) -> Tuple[Report, Context, List[Guard]]:
    config = config or Config.from_env()
    release = release if release is not None else sglang_release()
    ctx = make_context(config, release)
    guards = all_guards()
    reports: List[GuardReport] = []
    disabled = set(config.disabled)
    unknown = disabled - {g.name for g in guards}
    if unknown:
        ctx.warnings.append(f"--kvguard-disable names unknown guards: {', '.join(sorted(unknown))}")
    for g in guards:
        if release is None:
            reports.append(GuardReport(g.name, g.protects, OFF, "SGLang is not installed"))
            continue
        if g.name in disabled:
            reports.append(GuardReport(g.name, g.protects, OFF, "switched off by --kvguard-disable"))
            continue
        if ctx.manifest is None:
            known = ", ".join(manifest_mod.known_releases())
            reports.append(
                GuardReport(
                    g.name, g.protects, REFUSED,
                    f"SGLang {release} is not a release kvguard has reviewed (known: {known})",
                )
            )
            continue
        try:
            d: Decision = g.decide(ctx)
        except TargetRefused as exc:
            d = Decision(REFUSED, str(exc))
        reports.append(GuardReport(g.name, g.protects, d.state, d.reason, d.patches))
    activation: Dict[str, str] = {}
    if ctx.manifest is not None:
        for key in _activation_targets():
            try:
                ctx.require(key)
                activation[key] = ACTIVE
            except TargetRefused as exc:
                activation[key] = f"{OFF}: {exc}"
    release_parse_cache()  # the fingerprints found stay memoised; the syntax trees go
    report = Report(__version__, release, ctx.manifest.path if ctx.manifest else None,
                    config.on_unknown, reports, ctx.warnings, activation)
    return report, ctx, guards


# --------------------------------------------------------------------------- install
_lock = threading.RLock()
_state: Dict[str, object] = {"report": None, "patcher": None, "generation": 0, "ctx": None}


def _ensure_log_handler(level: str) -> None:
    if not any(getattr(h, "_kvguard", False) for h in log.handlers):
        h = logging.StreamHandler(sys.stderr)
        h._kvguard = True  # type: ignore[attr-defined]
        h.setFormatter(logging.Formatter("[%(asctime)s kvguard] %(levelname)s %(message)s"))
        log.addHandler(h)
        log.propagate = False
    log.setLevel(level)


def installed_report() -> Optional[Report]:
    return _state["report"]  # type: ignore[return-value]


def install(config: Optional[Config] = None, *, banner: bool = True) -> Report:
    """Install every active guard; idempotent. Raises :class:`KVGuardRefused`."""
    with _lock:
        if _state["report"] is not None:
            return _state["report"]  # type: ignore[return-value]
        config = config or Config.from_env()
        _ensure_log_handler(config.get("log_level"))
        report, ctx, guards = plan(config)
        for w in report.warnings:
            log.warning(w)
        if report.refused and config.on_unknown == "refuse":
            log.error(report.banner())
            raise KVGuardRefused(report.refusal_message())
        if report.refused:
            log.warning(report.refusal_message())
        patcher = Patcher()
        suspension.reset()
        _state.update(report=report, patcher=patcher, ctx=ctx, config=config)
        _state["generation"] = int(_state["generation"]) + 1  # type: ignore[arg-type]
        generation = _state["generation"]
        from .. import guard_cost

        accounting = guard_cost.enabled(config)
        by_name = {g.name: g for g in guards}
        for gr in report.guards:
            if gr.state != ACTIVE:
                continue
            guard = by_name[gr.name]
            factories = guard.wrappers(ctx)
            for key in gr.patches:
                if key in factories:
                    factory = guard_cost.accounted(gr.name, factories[key], key) if accounting else factories[key]
                    if getattr(guard, "suspendable", False):
                        factory = suspension.suspendable(gr.name, factory)
                    _hook(patcher, generation, ctx, key, gr.name, factory)
            guard.on_installed(ctx)
        if accounting:
            _hook_busy_time(patcher, generation, ctx)
        from .. import activation, metrics

        for key, factory in activation.TARGETS.items():
            if report.activation.get(key) == ACTIVE:
                _hook(patcher, generation, ctx, key, "activation", factory)
        metrics.record_guard_states(report)
        if banner and not activation.defer_banner():
            log.info(report.banner(activation.where()))
        return report


def _hook_busy_time(patcher: Patcher, generation, ctx: Context) -> None:
    """Accounting on: count the scheduler's busy time beside the guards' (guard_cost)."""
    from .. import guard_cost

    counted, missing = [], []
    for key, factory in guard_cost.BUSY_TARGETS.items():
        try:
            _hook(patcher, generation, ctx, key, guard_cost.BUSY, factory)
            counted.append(key.rsplit(".", 1)[-1])
        except TargetRefused as exc:
            missing.append(str(exc))
    bias = guard_cost.calibrate()
    log.info("kvguard accounting on: guard wrappers timed (the timing itself adds %.0f ns per call, "
             "exported for subtraction); scheduler busy time from %s", bias, ", ".join(counted))
    for why in missing:
        log.warning("kvguard accounting: busy time not counted there (the guard share reads high): %s", why)


def _hook(patcher: Patcher, generation, ctx: Context, key: str, guard: str, factory) -> None:
    import wrapt

    loc = ctx.require(key)

    def apply(_module) -> None:
        if _state["generation"] != generation or _state["patcher"] is not patcher:
            return  # uninstalled (or reinstalled) since this hook was registered
        patcher.wrap(key, guard, loc.module, loc.qualname, factory)

    wrapt.register_post_import_hook(apply, loc.module)


def uninstall() -> int:
    """Revert every wrapper; idempotent. Returns how many were reverted."""
    with _lock:
        patcher = _state.get("patcher")
        n = patcher.revert_all() if patcher is not None else 0  # type: ignore[union-attr]
        suspension.reset()
        _state.update(report=None, patcher=None, ctx=None)
        _state["generation"] = int(_state["generation"]) + 1  # type: ignore[arg-type]
        return n


def reinstall_if_config_changed() -> Optional[Report]:
    """Re-plan with the KVGUARD_* environment if it differs from the installed config."""
    with _lock:
        installed = _state.get("config")
        new = Config.from_env()
        if installed is not None and installed.values == new.values:  # type: ignore[union-attr]
            return installed_report()
        uninstall()
        return install(new)


def current_patcher() -> Optional[Patcher]:
    return _state.get("patcher")  # type: ignore[return-value]
