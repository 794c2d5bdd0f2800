"""Installing kvguard in a process: plan every guard for the running SGLang, refuse or
install, and say so (banner, metrics). The orchestration above the engine: the engine
(``engine/runtime.py``) holds the mechanism and the installed state and knows no guard;
this module hands it the guard registry, the activation hooks and the accounting
wrappers."""

from __future__ import annotations

import logging
from typing import Dict, List, Optional, Tuple

from ..engine import manifest as manifest_mod
from ..engine import suspension
from ..engine.config import Config
from ..engine.fingerprint import release_parse_cache
from ..engine.guard import ACTIVE, OFF, REFUSED, Decision, Guard, TargetRefused
from ..engine.patching import Patcher
from ..engine import metrics
from ..engine.process import defer_banner, where
from ..engine.runtime import (LOCK, STATE, Context, GuardReport, KVGuardRefused, Report, ensure_log_handler, hook,
                              installed_report, make_context, sglang_release)
from ..engine.targets import Target
from ..engine.version import __version__
from ..observe import guard_cost
from . import hooks

log = logging.getLogger("sglang_kvguard")

__all__ = ["plan", "install", "uninstall", "reinstall_if_config_changed", "installed_report", "all_targets",
           "KVGuardRefused"]


def all_guards() -> List[Guard]:
    from ..guards import GUARDS  # the registry; importing it declares every guard's targets and flags

    return [cls() for cls in GUARDS]


def all_targets() -> Dict[str, Target]:
    """Every target any guard, the activation hooks or the accounting may wrap (for the
    manifests, ``scripts/gen_manifests.py``)."""
    from .. import guards  # noqa: F401 - the guards declare their targets at import
    from ..engine.targets import registered

    return registered()


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
        for key in hooks.TARGETS:
            try:
                ctx.require(key)
                activation[key] = ACTIVE
            except TargetRefused as exc:
                activation[key] = f"{OFF}: {exc}"
    release_parse_cache()  # the fingerprints found stay memoised; the syntax trees go
    report = Report(__version__, release, ctx.manifest.path if ctx.manifest else None,
                    config.on_unknown, reports, ctx.warnings, activation)
    return report, ctx, guards


def install(config: Optional[Config] = None, *, banner: bool = True) -> Report:
    """Install every active guard; idempotent. Raises :class:`KVGuardRefused`."""
    with LOCK:
        if STATE["report"] is not None:
            return STATE["report"]  # type: ignore[return-value]
        config = config or Config.from_env()
        ensure_log_handler(config.get("log_level"))
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
        STATE.update(report=report, patcher=patcher, ctx=ctx, config=config)
        STATE["generation"] = int(STATE["generation"]) + 1  # type: ignore[arg-type]
        generation = STATE["generation"]
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
                    hook(patcher, generation, ctx, key, gr.name, factory)
            guard.on_installed(ctx)
        if accounting:
            _hook_busy_time(patcher, generation, ctx)
        for key, factory in hooks.TARGETS.items():
            if report.activation.get(key) == ACTIVE:
                hook(patcher, generation, ctx, key, "activation", factory)
        metrics.record_guard_states(report)
        if banner and not defer_banner():
            log.info(report.banner(where()))
        return report


def _hook_busy_time(patcher: Patcher, generation, ctx: Context) -> None:
    """Accounting on: count the scheduler's busy time beside the guards' (guard_cost)."""
    counted, missing = [], []
    for key, factory in guard_cost.BUSY_TARGETS.items():
        try:
            hook(patcher, generation, ctx, key, guard_cost.BUSY, factory)
            counted.append(key.rsplit(".", 1)[-1])
        except TargetRefused as exc:
            missing.append(str(exc))
    bias = guard_cost.calibrate()
    log.info("kvguard accounting on: guard wrappers timed (the timing itself adds %.0f ns per call, "
             "exported for subtraction); scheduler busy time from %s", bias, ", ".join(counted))
    for why in missing:
        log.warning("kvguard accounting: busy time not counted there (the guard share reads high): %s", why)


def uninstall() -> int:
    """Revert every wrapper; idempotent. Returns how many were reverted."""
    with LOCK:
        patcher = STATE.get("patcher")
        n = patcher.revert_all() if patcher is not None else 0  # type: ignore[union-attr]
        suspension.reset()
        STATE.update(report=None, patcher=None, ctx=None)
        STATE["generation"] = int(STATE["generation"]) + 1  # type: ignore[arg-type]
        return n


def reinstall_if_config_changed() -> Optional[Report]:
    """Re-plan with the KVGUARD_* environment if it differs from the installed config."""
    with LOCK:
        installed = STATE.get("config")
        new = Config.from_env()
        if installed is not None and installed.values == new.values:  # type: ignore[union-attr]
            return installed_report()
        uninstall()
        return install(new)


# the hooks call this back when SGLang's own command line changes a --kvguard-* flag
if reinstall_if_config_changed not in hooks.ON_CONFIG_CHANGE:
    hooks.ON_CONFIG_CHANGE.append(reinstall_if_config_changed)
