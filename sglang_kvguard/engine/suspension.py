"""Guards switched off in this process after they were installed.

A start-up check may find, once a scheduler has built its pools, that some installed
guards cannot cover what this node transfers (hybrid_pool_check) and the operator
accepted that with a ``warn`` policy. Such a guard must then not run at all on this
node: aimed at the wrong pool, its wrappers could write into it (a canary stamped at
a HiSparse host page id lands in a live device row). Guards that declare
``suspendable = True`` get a pass-through check in front of each wrapper; once
suspended, every call goes straight to the upstream function the wrapper wraps.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable, Set

SUSPENDED: Set[str] = set()


def suspend(names: Iterable[str]) -> Set[str]:
    """Suspend ``names`` in this process; returns those newly suspended."""
    new = set(names) - SUSPENDED
    SUSPENDED.update(new)
    return new


def is_suspended(name: str) -> bool:
    return name in SUSPENDED


def reset() -> None:
    SUSPENDED.clear()


def suspendable(guard: str, factory: Callable[[Callable], Callable]) -> Callable[[Callable], Callable]:
    """``factory`` whose wrapper passes straight through to the upstream call while
    ``guard`` is suspended."""

    def make(original: Callable) -> Callable:
        wrapper = factory(original)

        @functools.wraps(wrapper)
        def unless_suspended(*args, **kwargs):
            if guard in SUSPENDED:
                return original(*args, **kwargs)
            return wrapper(*args, **kwargs)

        return unless_suspended

    return make
