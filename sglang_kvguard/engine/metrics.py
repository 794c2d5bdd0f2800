"""Prometheus metrics of kvguard (guard states now; guard events as guards land)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import Report

_metrics = {}


def _gauge():
    if "state" not in _metrics:
        from prometheus_client import Gauge

        kwargs = {}
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            kwargs["multiprocess_mode"] = "max"
        _metrics["state"] = Gauge(
            "kvguard_guard_state",
            "1 for the state each kvguard guard is in (active, upstream, off, refused)",
            ["guard", "state"],
            **kwargs,
        )
    return _metrics["state"]


def record_guard_states(report: "Report") -> None:
    from .guard import STATES

    try:
        g = _gauge()
    except Exception:  # noqa: BLE001 - metrics must never stop the guards
        return
    for gr in report.guards:
        for s in STATES:
            g.labels(guard=gr.name, state=s).set(1 if gr.state == s else 0)


def set_guard_state(guard: str, state: str) -> None:
    """Move one guard's state gauge (e.g. to ``off`` when it is suspended in this process)."""
    from .guard import STATES

    try:
        g = _gauge()
        for s in STATES:
            g.labels(guard=guard, state=s).set(1 if s == state else 0)
    except Exception:  # noqa: BLE001 - metrics must never stop the guards
        pass


def _counter():
    if "events" not in _metrics:
        from prometheus_client import Counter

        _metrics["events"] = Counter(
            "kvguard_events",
            "kvguard guard events (drained rejections, mismatches, quarantined pages, ...)",
            ["event", "where"],
        )
    return _metrics["events"]


def count(event: str, n: int = 1, **labels) -> None:
    """Count one guard event; never raises."""
    try:
        where = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        _counter().labels(event=event, where=where).inc(n)
    except Exception:  # noqa: BLE001
        pass


def set_pool_check(role: str, pool: int, context: int, outcome: str) -> None:
    """Gauges of the start-up pool check (tokens, and 1 for the outcome)."""
    try:
        from prometheus_client import Gauge

        if "pool" not in _metrics:
            kwargs = {"multiprocess_mode": "max"} if os.environ.get("PROMETHEUS_MULTIPROC_DIR") else {}
            _metrics["pool"] = Gauge("kvguard_pool_tokens", "KV pool size in tokens seen by the pool check", ["role"], **kwargs)
            _metrics["ctx"] = Gauge("kvguard_context_tokens", "context length seen by the pool check", ["role"], **kwargs)
            _metrics["outcome"] = Gauge("kvguard_pool_check", "1 for the pool check outcome", ["role", "outcome"], **kwargs)
        _metrics["pool"].labels(role=role).set(pool)
        _metrics["ctx"].labels(role=role).set(context)
        for o in ("ok", "note", "refuse", "clamp", "warn"):
            _metrics["outcome"].labels(role=role, outcome=o).set(1 if o == outcome else 0)
    except Exception:  # noqa: BLE001
        pass
