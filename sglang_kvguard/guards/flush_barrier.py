"""A cache flush never returns pages that a transfer may still touch to the free list.

``/flush_cache`` (and every other idle-only reset: weight updates, HiCache attach)
runs only when ``Scheduler.is_fully_idle()`` says so, and then resets the allocator
(``token_to_kv_pool_allocator.clear()``): every page goes back to the free list.
Upstream's idle test looks at requests and queues only. A page that kvguard holds for
a transfer that has not drained (prefill_source_hold, decode_destination_hold: the
request is gone, its pages are not) is not in any queue, so a flush that arrives in
that window put the page back in the free list while a Mooncake write could still
land in it. Then, when the drain came, the hold gave the page to the allocator a
second time, and upstream's idle leak check found ``available + session_held >
total`` and killed the scheduler (seen on 0.5.19: "pool memory leak detected! ...
available=8192 ... session_held=1504" a few milliseconds after a flush that followed
an over-capacity rejection). 0.5.21-0.5.22 have the same hole for their own deferred
decode release (0.5.23 added it to the idle test).

kvguard makes a scheduler that pins or holds pages or metadata rows for a transfer
(or, on decode, has upstream's deferred releases pending) *not idle* for every caller
except the health check. A flush then waits (``/flush_cache?timeout=S``) or answers
400 as upstream does for a busy server, and says why in the log; once the transfer
drains and the pages are back, the flush goes through.
"""

from __future__ import annotations

import logging
from typing import Callable, Dict

from ..engine.guard import ACTIVE, Decision, Guard
from ..engine.targets import target
from ..lifetime.page_hold import HOLDS, ROWS

log = logging.getLogger("sglang_kvguard")

IS_FULLY_IDLE = target(
    "scheduler.Scheduler.is_fully_idle",
    "sglang.srt.managers.scheduler:Scheduler.is_fully_idle",
    why="the idle test that gates /flush_cache and every other allocator reset",
)
FLUSH_CACHE = target(
    "scheduler.Scheduler.flush_cache",
    "sglang.srt.managers.scheduler:Scheduler.flush_cache",
    why="resets the allocator when idle: says why kvguard keeps it waiting",
)


def busy_reason(scheduler) -> str:
    """Why this scheduler is not idle for kvguard ('' when it is)."""
    parts = []
    for role, hold in list(HOLDS.items()):
        # unlocked reads: a stale answer only delays a flush by one loop iteration
        pinned, held = len(hold._pins), len(hold._held) + len(hold._releasable)
        if pinned or held:
            parts.append(f"{role} page hold: {pinned} page(s) pinned by transfers, {held} freed page(s) held")
    rows_pinned, rows_held = len(ROWS._pins), len(ROWS._held) + len(ROWS._releasable)
    if rows_pinned or rows_held:
        parts.append(f"metadata rows: {rows_pinned} pinned, {rows_held} held")
    tq = getattr(scheduler, "disagg_decode_transfer_queue", None)
    pending = getattr(tq, "has_pending_deferred_releases", None)
    if pending is not None:
        try:
            if pending():
                parts.append("upstream's deferred decode KV releases are pending")
        except Exception as exc:  # noqa: BLE001 - an unreadable queue is not idle
            parts.append(f"upstream's deferred releases could not be read ({exc})")
    return "; ".join(parts)


def _is_fully_idle(original: Callable) -> Callable:
    def is_fully_idle(self, *args, **kwargs):
        idle = original(self, *args, **kwargs)
        if not idle:
            return idle
        for_health_check = kwargs.get("for_health_check", args[0] if args else False)
        if for_health_check:
            return idle  # the health check asks whether a batch will answer it, not whether pages are free
        return not busy_reason(self)

    return is_fully_idle


def _flush_cache(original: Callable) -> Callable:
    def flush_cache(self, *args, **kwargs):
        reason = busy_reason(self)
        if reason:
            from ..engine import metrics

            metrics.count("flush_deferred")
            log.warning("kvguard flush_barrier: cache not flushed: pages a transfer may still read or write are "
                        "out of the free list (%s); a flush now would hand them out again. It goes through once "
                        "they drain (/flush_cache?timeout=SECONDS waits)", reason)
        return original(self, *args, **kwargs)

    return flush_cache


class FlushBarrierGuard(Guard):
    name = "flush_barrier"
    protects = "a cache flush waits until no page or metadata row is pinned or held for a transfer"
    targets = (IS_FULLY_IDLE, FLUSH_CACHE)

    def decide(self, ctx) -> Decision:
        ctx.require(IS_FULLY_IDLE.key)
        ctx.require(FLUSH_CACHE.key)
        return Decision(ACTIVE, "held pages make the scheduler busy for every idle-only reset",
                        patches=(IS_FULLY_IDLE.key, FLUSH_CACHE.key))

    def wrappers(self, ctx) -> Dict[str, Callable[[Callable], Callable]]:
        return {IS_FULLY_IDLE.key: _is_fully_idle, FLUSH_CACHE.key: _flush_cache}
