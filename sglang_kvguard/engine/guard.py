"""Base class of a guard: one small module per protection.

Modelled on OpenTelemetry's ``BaseInstrumentor`` and ddtrace's ``contrib/*/patch.py``:
a guard declares what it protects and which upstream targets it needs; the engine
decides its state for the running release, then calls :meth:`Guard.apply` only for
guards that are ``active``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, ClassVar, Dict, Tuple

from .targets import Target

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import Context

ACTIVE = "active"
UPSTREAM = "upstream"
OFF = "off"
REFUSED = "refused"
STATES = (ACTIVE, UPSTREAM, OFF, REFUSED)


@dataclass
class Decision:
    state: str
    reason: str = ""
    # Targets to wrap when active (keys); upstream-aware guards may wrap a subset.
    patches: Tuple[str, ...] = ()
    details: Dict[str, object] = field(default_factory=dict)


class TargetRefused(Exception):
    """A target this guard needs is missing or is not the reviewed code."""

    def __init__(self, message: str, target: str = "") -> None:
        super().__init__(message)
        self.target = target


class Guard:
    #: short name used in flags, logs and metrics
    name: ClassVar[str] = ""
    #: one line: what it protects
    protects: ClassVar[str] = ""
    #: every upstream target this guard may wrap or check
    targets: ClassVar[Tuple[Target, ...]] = ()
    #: may be switched off in a process after install (engine/suspension.py): each of its
    #: wrappers then passes straight through (the page guards, which a start-up check
    #: can find aimed at a pool they do not cover)
    suspendable: ClassVar[bool] = False

    def decide(self, ctx: "Context") -> Decision:
        """Default: all declared targets present and recognised -> active."""
        keys = tuple(t.key for t in self.targets)
        for key in keys:
            ctx.require(key)
        return Decision(ACTIVE, "", patches=keys)

    def wrappers(self, ctx: "Context") -> Dict[str, Callable[[Callable], Callable]]:
        """Target key -> factory(original) returning the wrapper."""
        return {}

    def on_installed(self, ctx: "Context") -> None:
        """Hook after the guard's patches are registered (e.g. set upstream knobs)."""
