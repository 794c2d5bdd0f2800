"""Page pins at the KV allocator: a page that a transfer may still touch is never freed.

Shared machinery of the page-lifetime guards (design: docs/design/page-lifetime.md,
"design B"). Instead of finding every place a release frees KV (request release,
radix eviction, chunked-prefill dedup, abort paths: they differ by release), the
allocator's own free sink is wrapped once:

* a transfer **pins** the pages it will read or write (``pin``) and **unpins** them
  when it has drained (``unpin``), from whatever thread observes that;
* when the scheduler frees a page that is pinned, the free is **diverted**: the page
  is held, still out of the free list, and counted;
* when its last pin goes, a held page becomes **releasable**, and the scheduler thread
  gives it to the allocator's original free at its next allocator call
  (``flush``): the allocator is only ever touched from the scheduler thread;
* a page held longer than the quarantine bound is **quarantined**: logged once and
  counted, still never freed blind; it is released only if its drain is confirmed
  later.

Held and quarantined pages are reported to upstream's leak checker as session-held
tokens (``held_tokens``), so its idle invariant ``available + evictable + protected +
session_held == total`` keeps holding while a transfer drains.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Dict, Iterable, List, Optional

log = logging.getLogger("sglang_kvguard")


class PageHold:
    """Pins, held pages and quarantine for one allocator (one per scheduler process)."""

    def __init__(self, role: str, quarantine_after: float = 300.0) -> None:
        self.role = role
        self.quarantine_after = float(quarantine_after)
        self._lock = threading.Lock()
        self._pins: Dict[int, int] = {}
        self._held: Dict[int, float] = {}  # page -> monotonic time its free was diverted
        self._releasable: List[int] = []
        self._quarantined: set = set()
        # page -> count of failed sends (``stick``) that may still read it: pinned until
        # their peer is confirmed gone, possibly never. Such a page that the scheduler has
        # not freed yet (it sits in the radix cache, evictable to upstream) is not
        # capacity: ``stuck_unheld_pages``.
        self._stuck: Dict[int, int] = {}
        self._allocator_ref = None
        self.page_size = 1
        self.page_shift: Optional[int] = 0
        # True where the caller reports quarantine per room (decode_destination_hold):
        # the per-page report then goes to INFO instead of a second ERROR line.
        self.rooms_report = False
        self.stats = {"diverted": 0, "released": 0, "quarantined": 0, "released_from_quarantine": 0}
        # A bool per page id, True while pinned (numpy, host memory): the scheduler's
        # busy-path membership test of a CPU free is one vectorised lookup
        # (``mask_hit``). None until bound, or when the allocator's size is unknown.
        self._mask = None

    # -- binding
    def bind(self, allocator) -> None:
        self._allocator_ref = weakref.ref(allocator)
        self.page_size = int(getattr(allocator, "page_size", 1) or 1)
        ps = self.page_size
        # token -> page by shift where the page size is a power of two (cheaper than //)
        self.page_shift = ps.bit_length() - 1 if ps & (ps - 1) == 0 else None
        self._mask = None
        try:
            import numpy as np

            pages = int(getattr(allocator, "size", 0) or 0) // ps + 2  # paged allocators use ids 1..size/ps
            if pages > 2:
                mask = np.zeros(pages, dtype=bool)
                with self._lock:
                    for page in self._pins:
                        if not 0 <= page < pages:
                            return  # an id outside the pool: keep the exact path only
                        mask[page] = True
                    self._mask = mask
        except Exception as exc:  # noqa: BLE001 - the exact path works without it
            log.debug("kvguard page hold (%s): no pinned-page mask: %s", self.role, exc)

    def owns(self, allocator) -> bool:
        ref = self._allocator_ref
        return ref is not None and ref() is allocator

    # -- transfer side (any thread)
    def pin(self, pages: Iterable[int]) -> None:
        with self._lock:
            mask = self._mask
            for p in pages:
                p = int(p)
                n = self._pins.get(p, 0)
                self._pins[p] = n + 1
                if n == 0 and mask is not None:
                    if 0 <= p < len(mask):
                        mask[p] = True
                    else:  # an id outside the pool: the mask can no longer say "not pinned"
                        self._mask = mask = None

    def unpin(self, pages: Iterable[int]) -> None:
        with self._lock:
            for p in pages:
                p = int(p)
                n = self._pins.get(p, 0) - 1
                if n > 0:
                    self._pins[p] = n
                    continue
                if p in self._held:
                    # releasable before it leaves the held set, and before its pin goes: a
                    # lock-free reader (flush_barrier, the poll fast path) may count it twice
                    # for an instant, never not at all
                    self._releasable.append(p)
                    self._held.pop(p)
                    if p in self._quarantined:
                        self._quarantined.discard(p)
                        self.stats["released_from_quarantine"] += 1
                self._pins.pop(p, None)
                mask = self._mask
                if mask is not None and 0 <= p < len(mask):
                    mask[p] = False
                if n < 0:
                    log.error("kvguard page hold (%s): page %d unpinned more often than pinned", self.role, p)

    def stick(self, pages: Iterable[int]) -> None:
        """``pages`` (pinned) belong to a failed send that may still be running: they stay
        pinned until its peer is gone, which may be never."""
        with self._lock:
            for p in pages:
                self._stuck[int(p)] = self._stuck.get(int(p), 0) + 1

    def unstick(self, pages: Iterable[int]) -> None:
        with self._lock:
            for p in pages:
                n = self._stuck.get(int(p), 0) - 1
                if n > 0:
                    self._stuck[int(p)] = n
                else:
                    self._stuck.pop(int(p), None)

    def stuck_unheld_pages(self) -> int:
        """Pages of failed sends that the scheduler has not freed yet: still in a request
        or in the radix cache, where upstream counts them as evictable (admission
        budgets with them; evicted, they would only be held)."""
        if not self._stuck:
            return 0
        with self._lock:
            held = self._held
            return sum(1 for p in self._stuck if p not in held)

    def mask_hit(self, ids, shift: Optional[int] = 0) -> Optional[bool]:
        """Whether a CPU tensor of page ids (``shift`` 0) or token ids (``shift``: the
        page shift; None: divide by the page size) holds a pinned page, from the mask;
        None when the mask cannot say (no mask, a device tensor, an id outside it):
        the caller then takes the exact path. A stale True costs the exact path; a
        page is never reported unpinned while pinned (the mask is set before a pin is
        visible to the scheduler and cleared only when its last pin goes)."""
        mask = self._mask
        if mask is None:
            return None
        try:
            if ids.device.type != "cpu":
                return None
            a = ids.numpy()
            if shift is None:
                a = a // self.page_size
            elif shift:
                a = a >> shift
            return bool(mask.take(a).any())  # raises for an id past the end: exact path
        except Exception:  # noqa: BLE001
            return None

    def touches_pinned(self, pages) -> bool:
        """Whether a tensor of page ids (repeats allowed) holds a pinned page."""
        if not self._pins:
            return False
        ids = pages.tolist()
        with self._lock:
            return not self._pins.keys().isdisjoint(ids)

    def pinned(self, page: int) -> bool:
        with self._lock:
            return int(page) in self._pins

    def active(self) -> bool:
        return bool(self._pins) or bool(self._releasable)

    # -- scheduler thread
    def divert(self, pages) -> Optional[object]:
        """Split a tensor of page ids: returns those free to release now, holds the rest.

        Returns ``pages`` itself when none is pinned (no copy)."""
        if not self._pins:  # a page-id tensor: tolist + isdisjoint beats the mask (64 ids: 3 vs 6 us)
            return pages
        ids = pages.tolist()
        with self._lock:
            if self._pins.keys().isdisjoint(ids):  # C-level: the common busy case
                return pages
            keep = [p for p in ids if p in self._pins]
            now = time.monotonic()
            for p in keep:
                self._held.setdefault(p, now)
            self.stats["diverted"] += len(keep)
        if len(keep) == len(ids):
            return pages[:0]
        import torch

        kept = set(keep)
        mask = torch.tensor([p not in kept for p in ids], dtype=torch.bool, device=pages.device)
        return pages[mask]

    def take_releasable(self) -> List[int]:
        if not self._releasable:
            return []
        with self._lock:
            out, self._releasable = self._releasable, []
            self.stats["released"] += len(out)
        return out

    def sweep(self, now: Optional[float] = None) -> List[int]:
        """Quarantine pages held past the bound; returns the newly quarantined ones."""
        if not self._held:
            return []
        now = time.monotonic() if now is None else now
        with self._lock:
            new = [p for p, t in self._held.items() if p not in self._quarantined and now - t >= self.quarantine_after]
            self._quarantined.update(new)
            self.stats["quarantined"] += len(new)
        if new:
            log.log(
                logging.INFO if self.rooms_report else logging.ERROR,
                "kvguard page hold (%s): %d page(s) freed %.0f s ago are still in use by a transfer that "
                "has not drained; quarantined (kept out of the free list, never freed blind): %s",
                self.role, len(new), self.quarantine_after, sorted(new)[:32],
            )
        return new

    # -- accounting
    def held_pages(self) -> int:
        with self._lock:
            return len(self._held) + len(self._releasable)

    def quarantined_pages(self) -> int:
        with self._lock:
            return len(self._quarantined)

    def held_tokens(self) -> int:
        return self.held_pages() * self.page_size

    def stuck_unheld_tokens(self) -> int:
        return self.stuck_unheld_pages() * self.page_size

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "pinned": len(self._pins),
                "stuck": len(self._stuck),
                "held": len(self._held) + len(self._releasable),
                "quarantined": len(self._quarantined),
                **self.stats,
            }


# One hold per role in this process (a scheduler process has one KV allocator).
HOLDS: Dict[str, PageHold] = {}


def hold_for_allocator(allocator) -> Optional[PageHold]:
    for h in HOLDS.values():
        if h.owns(allocator):
            return h
    return None


def bind_hold(role: str, allocator, quarantine_after: float = 300.0) -> PageHold:
    """Make ``allocator`` the one whose pages this process's ``role`` hold keeps."""
    hold = HOLDS.get(role) or PageHold(role, quarantine_after)
    hold.quarantine_after = float(quarantine_after)
    hold.bind(allocator)
    HOLDS[role] = hold
    return hold


def bind_at_scheduler_init(role: str, quarantine_after: float, what: str):
    """Wrapper factory for ``Scheduler.__init__``: a scheduler of PD role ``role`` binds
    its allocator to the role's hold and logs ``kvguard <what> (allocator ...)``."""

    def factory(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            from ..engine.process import pd_role

            if pd_role(self) != role:
                return
            alloc = getattr(self, "token_to_kv_pool_allocator", None)
            if alloc is None:
                return
            hold = bind_hold(role, alloc, quarantine_after)
            log.info("kvguard %s (allocator %s, page size %d, quarantine after %.0f s)",
                     what, type(alloc).__name__, hold.page_size, quarantine_after)

        return __init__

    return factory


class RowHold:
    """Metadata-buffer rows (``ReqToMetadataIdxAllocator``) that a transfer may still read
    (prefill's aux row) or write (decode's): a free of a pinned row is held until its
    last pin goes, then released by ``flush`` on the scheduler thread.

    One per process: prefill pins its rows, decode its own. prefill_source_hold wraps the
    free (``wrap_free``); decode_destination_hold, which needs that guard, pins through it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pins: Dict[int, int] = {}
        self._held: Dict[int, object] = {}  # row -> the allocator whose free was held
        self._releasable: List[tuple] = []
        self.free = None  # the allocator's original free (set when it is wrapped)

    def pin(self, row: Optional[int]) -> None:
        if row is None or int(row) < 0:
            return
        with self._lock:
            self._pins[int(row)] = self._pins.get(int(row), 0) + 1

    def unpin(self, row: Optional[int]) -> None:
        if row is None or int(row) < 0:
            return
        with self._lock:
            n = self._pins.get(int(row), 0) - 1
            if n > 0:
                self._pins[int(row)] = n
                return
            owner = self._held.get(int(row))
            if owner is not None:  # releasable first: lock-free readers never see it in neither
                self._releasable.append((owner, int(row)))
                self._held.pop(int(row), None)
            self._pins.pop(int(row), None)

    def divert(self, owner, row) -> bool:
        """The scheduler frees ``row``: True if it is pinned (held instead)."""
        if not self._pins:
            return False
        try:
            key = int(row)
        except (TypeError, ValueError):
            return False
        with self._lock:
            if key in self._pins:
                self._held[key] = owner
                return True
        return False

    def flush(self) -> int:
        """Give released rows to the allocator's original free (scheduler thread)."""
        if not self._releasable:
            return 0
        with self._lock:
            out, self._releasable = self._releasable, []
        for owner, row in out:
            self.free(owner, row)
        return len(out)

    def held(self) -> int:
        with self._lock:
            return len(self._held)

    def reset(self) -> None:
        """Forget every pin and held row (a fresh scheduler process; tests)."""
        with self._lock:
            self._pins.clear()
            self._held.clear()
            self._releasable = []

    def wrap_free(self, original):
        """Wrapper factory for ``ReqToMetadataIdxAllocator.free``."""
        self.free = original
        hold = self

        def free(self, free_index, *args, **kwargs):
            if hold.divert(self, free_index):
                return None
            return original(self, free_index, *args, **kwargs)

        return free


ROWS = RowHold()
