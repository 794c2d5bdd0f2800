"""Prefill source pages stay allocated until every Mooncake transfer reading them has drained.

No release (0.5.10-0.5.23) holds prefill source pages for the transfer worker: when a
request fails or is aborted (``sender.abort()``, decode's ABORT, another rank's
Failed, a chunked-prefill abort), the scheduler releases its KV at the next inflight
poll while ``MooncakeKVManager.transfer_worker`` may still be inside
``batch_transfer_sync`` reading those pages, or may still have the room's chunks
queued (0.5.10-0.5.12 do not even skip them). The pages go back to the free list,
the next request writes them, and the late transfer ships that request's KV
(design: docs/design/page-lifetime.md, hazards P1-P5).

kvguard, in every prefill scheduler process:

* each transfer queue of the KV manager is wrapped: a chunk **pins** its source
  pages when it is enqueued, and the worker **unpins** them when it asks for its next
  chunk (it has finished this one), or, if it left transfer futures running (the
  early return after a failed layer, 0.5.10-0.5.18), when the last of them finishes;
* the prefill allocator's free sink is wrapped (``free`` up to 0.5.16,
  ``_release_page_ids`` from 0.5.17, ``free`` of the token allocator): a pinned
  page's free is diverted and the page held until it is unpinned, then released
  from the scheduler thread (``PrefillBootstrapQueue.pop_bootstrapped``, every loop
  iteration);
* held pages are reported to upstream's leak checker as session-held tokens; a page
  held past ``--kvguard-quarantine-after`` seconds is quarantined: logged, counted,
  never freed blind.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Dict, List, Optional

from ..engine.process import SCHEDULER_INIT
from ..engine.config import Flag, non_negative_seconds, register_flag
from ..engine.guard import ACTIVE, Decision, Guard
from ..engine.targets import target
from ..lifetime import peer_liveness, transfer_components, transfer_drain
from ..lifetime.page_hold import HOLDS, ROWS, PageHold, bind_at_scheduler_init, bind_hold, hold_for_allocator
from . import _faults
from .mooncake_batch_bound import TRANSFER_DATA  # one declaration of the batch sink

log = logging.getLogger("sglang_kvguard")


def _positive(value: str) -> float:
    v = float(value)
    if v <= 0:
        raise ValueError("must be > 0")
    return v


register_flag(
    Flag(
        "quarantine_after",
        "300",
        "Seconds a KV page may wait, freed but still in use by a transfer that has not "
        "drained, before kvguard reports it quarantined (it is never freed blind).",
        validate=_positive,
    )
)

register_flag(
    Flag(
        "peer_probe_interval",
        "5",
        "Seconds between checks of whether the peer of a failed Mooncake send (prefill) or of an "
        "unanswered drain request (decode) is gone: its port refuses connections twice in a row. "
        "The pages such a transfer may still touch are held until then; 0 holds them until restart.",
        validate=non_negative_seconds,
    )
)

TRANSFER_WORKER = target(
    "mooncake.MooncakeKVManager.transfer_worker",
    "sglang.srt.disaggregation.mooncake.conn:MooncakeKVManager.transfer_worker",
    why="prefill: the thread that reads source pages (its queue and executor are wrapped)",
)
ADD_TRANSFER = target(
    "mooncake.MooncakeKVManager.add_transfer_request",
    "sglang.srt.disaggregation.mooncake.conn:MooncakeKVManager.add_transfer_request",
    why="prefill: enqueues a chunk of source pages",
)
PAGED_FREE = target(
    "allocator.PagedTokenToKVPoolAllocator.free",
    "sglang.srt.mem_cache.allocator:PagedTokenToKVPoolAllocator.free",
    "sglang.srt.mem_cache.allocator.paged:PagedTokenToKVPoolAllocator.free",
    why="paged allocator free sink up to 0.5.16 (token indices)",
)
PAGED_RELEASE = target(
    "allocator.PagedTokenToKVPoolAllocator._release_page_ids",
    "sglang.srt.mem_cache.allocator.paged:PagedTokenToKVPoolAllocator._release_page_ids",
    why="paged allocator free sink from 0.5.17 (page ids; free, free_segment, free_page_ids, groups)",
)
TOKEN_FREE = target(
    "allocator.TokenToKVPoolAllocator.free",
    "sglang.srt.mem_cache.allocator:TokenToKVPoolAllocator.free",
    "sglang.srt.mem_cache.allocator.token:TokenToKVPoolAllocator.free",
    why="token allocator (page size 1) free sink",
)
PAGED_ALLOC = target(
    "allocator.PagedTokenToKVPoolAllocator.alloc",
    "sglang.srt.mem_cache.allocator:PagedTokenToKVPoolAllocator.alloc",
    "sglang.srt.mem_cache.allocator.paged:PagedTokenToKVPoolAllocator.alloc",
    why="paged allocator: a failed allocation waits for held pages to drain",
)
PAGED_ALLOC_EXTEND = target(
    "allocator.PagedTokenToKVPoolAllocator.alloc_extend",
    "sglang.srt.mem_cache.allocator:PagedTokenToKVPoolAllocator.alloc_extend",
    "sglang.srt.mem_cache.allocator.paged:PagedTokenToKVPoolAllocator.alloc_extend",
    why="paged allocator (prefill extend): a failed allocation waits for held pages to drain",
)
TOKEN_ALLOC = target(
    "allocator.TokenToKVPoolAllocator.alloc",
    "sglang.srt.mem_cache.allocator:TokenToKVPoolAllocator.alloc",
    "sglang.srt.mem_cache.allocator.token:TokenToKVPoolAllocator.alloc",
    why="token allocator: a failed allocation waits for held pages to drain",
)
BASE_AVAILABLE = target(
    "allocator.BaseTokenToKVPoolAllocator.available_size",
    "sglang.srt.mem_cache.allocator:BaseTokenToKVPoolAllocator.available_size",
    "sglang.srt.mem_cache.allocator.base:BaseTokenToKVPoolAllocator.available_size",
    why="paged allocator's admission budget up to 0.5.19 (inherited): pages of failed sends are not capacity",
)
PAGED_AVAILABLE = target(
    "allocator.PagedTokenToKVPoolAllocator.available_size",
    "sglang.srt.mem_cache.allocator.paged:PagedTokenToKVPoolAllocator.available_size",
    why="paged allocator's admission budget from 0.5.20: pages of failed sends are not capacity",
)
TOKEN_AVAILABLE = target(
    "allocator.TokenToKVPoolAllocator.available_size",
    "sglang.srt.mem_cache.allocator:TokenToKVPoolAllocator.available_size",
    "sglang.srt.mem_cache.allocator.token:TokenToKVPoolAllocator.available_size",
    why="token allocator's admission budget: pages of failed sends are not capacity",
)
ABORT_ACK = target(
    "common.CommonKVManager._send_abort_ack",
    "sglang.srt.disaggregation.common.conn:CommonKVManager._send_abort_ack",
    why="prefill, 0.5.19+: upstream's ack that an aborted room drained (withheld for a failed send)",
)
ALLOC_WAIT = 5.0  # seconds a failed allocation waits for held pages' transfers to drain
PEER_WAIT_MAX = 30.0  # at most this long for a failed send's peer to be confirmed gone


def alloc_wait() -> float:
    """How long a failed allocation waits for held pages: ``ALLOC_WAIT``, or, while a
    failed send's pages wait for peer_liveness to confirm its peer gone, long enough for
    that (its ``confirm`` probes ``interval`` apart, plus one interval). Chaos soak on
    0.5.10 (session 17): decode killed during a 16-page send on a 16-page prefill pool;
    the next allocation gave up after 5 s and upstream's "Prefill out of memory" killed
    the prefill scheduler, while the dead peer would have been confirmed at 10 s."""
    if ALLOC_WAIT <= 0:
        return ALLOC_WAIT  # never wait (tests that play the transfer worker on one thread)
    w = peer_liveness.watch()
    if w.interval > 0 and w.watched():
        confirm_by = w.interval * (w.confirm + 1) + 1.0
        if confirm_by <= PEER_WAIT_MAX:  # a slow probe (a long interval) is not waited for
            return max(ALLOC_WAIT, confirm_by)
    return ALLOC_WAIT

METADATA_FREE = target(
    "disagg.utils.ReqToMetadataIdxAllocator.free",
    "sglang.srt.disaggregation.utils:ReqToMetadataIdxAllocator.free",
    why="metadata rows: a row a transfer may still read (prefill's aux row) or write (decode's) is held",
)
POP_BOOTSTRAPPED = target(
    "disagg.prefill.PrefillBootstrapQueue.pop_bootstrapped",
    "sglang.srt.disaggregation.prefill:PrefillBootstrapQueue.pop_bootstrapped",
    why="prefill scheduler thread, every loop iteration: release drained held pages",
)
HELD_MIXIN = target(
    "scheduler.SchedulerRuntimeCheckerMixin._session_held_tokens",
    "sglang.srt.managers.scheduler_runtime_checker_mixin:SchedulerRuntimeCheckerMixin._session_held_tokens",
    why="leak checker's session-held term, 0.5.10-0.5.12",
)
HELD_OBSERVER = target(
    "scheduler.SchedulerPoolStatsObserver.session_held_tokens",
    "sglang.srt.managers.scheduler_components.pool_stats_observer:SchedulerPoolStatsObserver.session_held_tokens",
    why="leak checker's session-held term, 0.5.13+",
)

ROLE = "prefill"
_SWEEP_EVERY = 1.0


# ----------------------------------------------------------------------------- transfer side


def page_list(idx) -> List[int]:
    """Page ids of a numpy array, tensor or sequence, as Python ints."""
    try:
        return [int(p) for p in idx.tolist()]
    except AttributeError:
        return [int(p) for p in idx]


def _chunk_pages(chunk, state_positions=()) -> List[int]:
    """The KV pages a chunk reads: its own, and those its state components read at KV
    page ids (the DSA/NSA indexer's keys, sent with the last chunk for the request's
    pages: on 0.5.10-0.5.22 from page 0, beyond this chunk's own)."""
    idx = getattr(chunk, "prefill_kv_indices", None)
    pages = [] if idx is None else page_list(idx)
    if state_positions:
        extra = transfer_components.state_pages(getattr(chunk, "state_indices", None), state_positions)
        pages = list(dict.fromkeys(pages + extra))
    return pages


def _chunk_row(chunk) -> Optional[int]:
    """The metadata row the worker sends with a room's last chunk (its aux data), if any."""
    if not getattr(chunk, "is_last_chunk", False):
        return None
    row = getattr(chunk, "prefill_aux_index", None)
    return None if row is None or int(row) < 0 else int(row)


class _Chunk:
    """The chunk a transfer worker (and the executor threads it hands work to) is sending."""

    __slots__ = ("pages", "row", "futures", "room", "unsettled", "failed_peers")

    def __init__(self, pages: List[int], room, row: Optional[int] = None) -> None:
        self.pages = pages
        self.row = row  # the metadata row it sends (last chunk only)
        self.futures: list = []
        self.room = room
        self.unsettled = ""  # why a send of it may still be running, once one failed
        self.failed_peers: set = set()  # Mooncake sessions its failed batches went to

    def failed(self, peer, why: str) -> None:
        self.unsettled = self.unsettled or why
        if peer:
            self.failed_peers.add(str(peer))


_sending = threading.local()  # .chunk: the _Chunk this thread is sending, if any


def current_chunk():
    return getattr(_sending, "chunk", None)


class _PinningQueue:
    """Wraps one of the manager's transfer queues: pin at put, unpin when the worker is done."""

    def __init__(self, queue, hold: PageHold, manager=None) -> None:
        self._kvguard_inner = queue
        self._hold = hold
        # positions of the state components sent at KV page ids (transfer_components)
        self._state_positions = transfer_components.page_state_positions(getattr(manager, "kv_args", None))
        self._local = threading.local()
        # Pins are taken only once a wrapped worker consumes this queue: a pin that
        # no ``get`` of ours would ever release must never be taken.
        self.consumer_wrapped = False

    def put(self, item, *args, **kwargs):
        if item is not None and self.consumer_wrapped:
            pages = _chunk_pages(item, self._state_positions)
            row = _chunk_row(item)
            room = getattr(item, "room", None)
            self._hold.pin(pages)
            ROWS.pin(row)
            transfer_drain.enqueued(room)
            try:
                return self._kvguard_inner.put(item, *args, **kwargs)
            except BaseException:
                self._hold.unpin(pages)
                ROWS.unpin(row)
                transfer_drain.finished(room)
                raise
        return self._kvguard_inner.put(item, *args, **kwargs)

    def get(self, *args, **kwargs):
        self.finish_current()
        item = self._kvguard_inner.get(*args, **kwargs)
        cur = (_Chunk(_chunk_pages(item, self._state_positions), getattr(item, "room", None), _chunk_row(item))
               if item is not None else None)
        self._local.current = _sending.chunk = cur
        return item

    def track_future(self, fut) -> None:
        cur = getattr(self._local, "current", None)
        if cur is not None:
            cur.futures.append(fut)

    def finish_current(self) -> None:
        """The worker asks for its next chunk: the current one no longer reads its pages,
        except through futures still running; those unpin when the last one finishes.
        A chunk one of whose Mooncake batches failed is never unpinned (``_settled``)."""
        cur = getattr(self._local, "current", None)
        self._local.current = _sending.chunk = None
        if cur is None:
            return
        running = [f for f in cur.futures if not f.done()]
        if not running:
            self._settled(cur)
            return
        left = {"n": len(running)}
        lock = threading.Lock()

        def done(_f) -> None:
            with lock:
                left["n"] -= 1
                last = left["n"] == 0
            if last:
                self._settled(cur)

        for f in running:
            f.add_done_callback(done)

    def _settled(self, cur: _Chunk) -> None:
        if not cur.unsettled:
            self._hold.unpin(cur.pages)
            ROWS.unpin(cur.row)
            transfer_drain.finished(cur.room)
            return
        # Mooncake's batch_transfer_sync gives up on a batch after its wall-clock
        # timeout and drops the handle while the batch may still be running (upstream
        # says so itself from 0.5.22, _poison_unsettled_send): the pages stay pinned
        # (held, then quarantined: never freed blind) and decode is not told the room
        # drained, so its destination pages stay out of circulation too. They are
        # released only once every peer the failed batches went to is gone
        # (peer_liveness: nothing can then still read them for it).
        from ..engine import metrics

        metrics.count("unsettled_sends")
        peers = sorted(cur.failed_peers)
        log.error(
            "kvguard prefill_source_hold: a Mooncake send of room %s to %s failed (%s) and may still be running "
            "(a failed batch is not cancelled): its %d source page(s) stay held, quarantined, never freed blind, "
            "and decode is not told that the room drained; %s", cur.room, ", ".join(peers) or "?", cur.unsettled,
            len(cur.pages), "they are released if that peer goes away" if peers and peer_liveness.watch().interval > 0
            else "they stay held until this process restarts",
        )
        self._hold.stick(cur.pages)
        transfer_drain.finished(cur.room, unsettled=cur.unsettled)
        peer_liveness.watch().watch(peers, lambda: self._peer_gone(cur, peers), what=f"room {cur.room}")

    def _peer_gone(self, cur: _Chunk, peers: List[str]) -> None:
        """Every peer the chunk's failed batches went to is gone: nothing reads its pages any more."""
        from ..engine import metrics

        self._hold.unstick(cur.pages)
        self._hold.unpin(cur.pages)
        ROWS.unpin(cur.row)
        transfer_drain.settle(cur.room)
        metrics.count("unsettled_sends_settled")
        log.warning("kvguard prefill_source_hold: the failed send of room %s can no longer run (%s gone): its %d "
                    "source page(s) are released", cur.room, ", ".join(peers), len(cur.pages))

    def __getattr__(self, name):
        return getattr(self._kvguard_inner, name)


class _TrackingExecutor:
    """Wraps a worker's executor so that futures are tied to the chunk being sent."""

    def __init__(self, executor, queue: _PinningQueue) -> None:
        self._kvguard_inner = executor
        self._queue = queue

    def submit(self, fn, /, *args, **kwargs):
        chunk = current_chunk()
        if chunk is not None:  # the executor thread sends for the worker's current chunk
            fut = self._kvguard_inner.submit(_sending_for, chunk, fn, *args, **kwargs)
        else:
            fut = self._kvguard_inner.submit(fn, *args, **kwargs)
        self._queue.track_future(fut)
        return fut

    def __getattr__(self, name):
        return getattr(self._kvguard_inner, name)


def _sending_for(chunk: _Chunk, fn, *args, **kwargs):
    prev = getattr(_sending, "chunk", None)
    _sending.chunk = chunk
    try:
        return fn(*args, **kwargs)
    finally:
        _sending.chunk = prev


def _transfer_data(original: Callable) -> Callable:
    """Every Mooncake batch of a chunk goes through here: a failed one may still be running."""

    def _transfer_data(self, mooncake_session_id, transfer_blocks, *args, **kwargs):
        chunk = current_chunk()
        if chunk is not None:
            late = _faults.late_write(chunk.room, lambda: original(self, mooncake_session_id, transfer_blocks,
                                                                   *args, **kwargs))
            if late is not None:
                chunk.failed(mooncake_session_id, f"ret={late}")
                return late
        try:
            ret = original(self, mooncake_session_id, transfer_blocks, *args, **kwargs)
        except BaseException as exc:
            if chunk is not None:
                chunk.failed(mooncake_session_id, f"raised {type(exc).__name__}")
            raise
        if chunk is not None and ret not in (0, None):
            chunk.failed(mooncake_session_id, f"ret={ret}")
        return ret

    return _transfer_data


def _ack_room(args, kwargs):
    if "room" in kwargs:
        return kwargs["room"]
    # (decode_ip, decode_port, room) up to 0.5.21; (room, target) from 0.5.22
    return args[2] if len(args) >= 3 and isinstance(args[0], str) else (args[0] if args else None)


def _send_abort_ack(original: Callable) -> Callable:
    """Upstream's drain ack (decode's deferred release, 0.5.19+) is never sent for a room
    whose failed batch may still write: 0.5.19-0.5.21 would send it (0.5.22+ poison it
    themselves, but only on their deferred path)."""

    def _send_abort_ack(self, *args, **kwargs):
        room = _ack_room(args, kwargs)
        if room is not None and transfer_drain.is_unsettled(room):
            log.error("kvguard prefill_source_hold: not acking decode's abort of room %s: a failed Mooncake send of "
                      "it may still write decode's pages (decode keeps them until its release timeout, which "
                      "kvguard's decode_deferred_release turns into quarantine)", room)
            return None
        return original(self, *args, **kwargs)

    return _send_abort_ack


_proxy_lock = threading.Lock()


def _pinning_queues(manager) -> None:
    """Replace the manager's transfer queues with pinning wrappers (idempotent)."""
    with _proxy_lock:
        # The manager (and its workers) is built inside Scheduler.__init__, before
        # the allocator is bound to the hold: create it here, bind it later.
        hold = HOLDS.get(ROLE)
        if hold is None:
            hold = HOLDS[ROLE] = PageHold(ROLE)
        queues = getattr(manager, "transfer_queues", None)
        if not queues:
            return
        for i, q in enumerate(queues):
            if not isinstance(q, _PinningQueue):
                queues[i] = _PinningQueue(q, hold, manager)


def _proxy_for(manager, queue):
    _pinning_queues(manager)
    for q in getattr(manager, "transfer_queues", None) or ():
        if isinstance(q, _PinningQueue) and (q is queue or q._kvguard_inner is queue):
            return q
    return queue


def _stop_server() -> None:
    """What SGLang itself does when its scheduler fails: SIGQUIT to the server's main
    process (the scheduler's parent), which stops the whole server."""
    import os
    import signal

    os.kill(os.getppid(), signal.SIGQUIT)


STOP_SERVER = _stop_server  # tests replace it


def _worker_died(manager, exc: BaseException) -> None:
    """Upstream's transfer worker ends on any exception ("Transfer thread failed ...
    Prefill instance ... is dead"), but only its thread dies: the server keeps answering
    /health and admitting requests whose KV is never sent (each hangs until its timeout),
    and the pages of every chunk still queued stay pinned. Chaos soak on 0.5.10 (session
    17, a cause since fixed): a dead worker, then "Prefill out of memory" 50 s later.
    Fail closed: stop the server the way SGLang stops it when its scheduler fails, so the
    router and the supervisor see a dead node instead of a hanging one."""
    from ..engine import metrics

    metrics.count("transfer_worker_died")
    log.critical(
        "kvguard prefill_source_hold: SGLang's Mooncake transfer worker thread died (%s: %s); this prefill can no "
        "longer send KV (bootstrap port %s), every request it admits would hang until its timeout and the "
        "pages of its queued chunks stay pinned. Stopping the server (SIGQUIT to its main process, as SGLang "
        "does when its scheduler fails).", type(exc).__name__, exc, getattr(manager, "bootstrap_port", "?"),
    )
    try:
        STOP_SERVER()
    except Exception as err:  # noqa: BLE001
        log.critical("kvguard prefill_source_hold: could not stop the server: %s", err)


def _transfer_worker(original: Callable) -> Callable:
    def transfer_worker(self, queue, executor, *args, **kwargs):
        q = _proxy_for(self, queue)
        if isinstance(q, _PinningQueue):
            q.consumer_wrapped = True
            executor = _TrackingExecutor(executor, q)
        else:
            log.error("kvguard prefill_source_hold: transfer worker started on an unknown queue; its pages are not held")
        try:
            return original(self, q, executor, *args, **kwargs)
        except Exception as exc:
            _worker_died(self, exc)
            raise

    return transfer_worker


def _add_transfer_request(original: Callable) -> Callable:
    def add_transfer_request(self, *args, **kwargs):
        queues = getattr(self, "transfer_queues", None)
        if queues and not isinstance(queues[0], _PinningQueue):
            _pinning_queues(self)
        room = args[0] if args else kwargs.get("bootstrap_room")
        # A room whose decode asked kvguard for its drain gets no further chunk: the ack
        # promised decode that nothing more is written into its pages.
        with transfer_drain.locked():
            if not transfer_drain.gate_chunk(self, room):
                return None
            return original(self, *args, **kwargs)

    return add_transfer_request


# ----------------------------------------------------------------------------- allocator side


def _in_free_group(alloc) -> bool:
    if hasattr(alloc, "is_not_in_free_group"):
        return not alloc.is_not_in_free_group
    return getattr(alloc, "free_group", None) is not None


def _flush(alloc, hold: PageHold, release_pages: Callable) -> None:
    pages = hold.take_releasable()
    if pages:
        import torch

        release_pages(torch.tensor(pages, dtype=torch.int64, device=getattr(alloc, "device", "cpu")))


def _paged_free(original: Callable) -> Callable:
    """<= 0.5.16: ``free(token_indices)`` releases ``unique(idx // page_size)``."""

    def free(self, free_index, *args, **kwargs):
        hold = hold_for_allocator(self)
        if hold is None or not hold.active() or _in_free_group(self):
            return original(self, free_index, *args, **kwargs)
        ps = hold.page_size
        _flush(self, hold, lambda pages: original(self, pages * ps))
        if free_index.numel() == 0:
            return original(self, free_index, *args, **kwargs)
        import torch

        hit = hold.mask_hit(free_index, hold.page_shift)  # CPU: one lookup in the pinned-page mask
        if hit is False:
            return original(self, free_index, *args, **kwargs)
        # Every page the free touches, repeats allowed (a run of one page's tokens is one
        # entry): far cheaper than upstream's sort-based unique, and exact for membership.
        touched = free_index >> hold.page_shift if hold.page_shift is not None else free_index // ps
        if hit is None and not hold.touches_pinned(torch.unique_consecutive(touched)):
            return original(self, free_index, *args, **kwargs)
        pages = torch.unique(touched)  # what upstream frees; checks pages, not tokens
        keep_pages = hold.divert(pages)
        if keep_pages is pages:
            return original(self, free_index, *args, **kwargs)
        if keep_pages.numel() == 0:
            return None
        return original(self, keep_pages * ps, *args, **kwargs)

    return free


def _paged_release(original: Callable) -> Callable:
    """0.5.17+: ``_release_page_ids(*page_ids)``, the one sink of every paged free."""

    def _release_page_ids(self, *page_ids):
        hold = hold_for_allocator(self)
        if hold is None or not hold.active():
            return original(self, *page_ids)
        _flush(self, hold, lambda pages: original(self, pages))
        import torch

        parts = [p for p in page_ids if p.numel()]
        if not parts:
            return original(self, *page_ids)
        ids = parts[0] if len(parts) == 1 else torch.cat(parts)
        keep = hold.divert(ids)
        if keep is ids:
            return original(self, *page_ids)
        if keep.numel() == 0:
            return None
        return original(self, keep)

    return _release_page_ids


def _token_free(original: Callable) -> Callable:
    """Page size 1: token ids are page ids."""

    def free(self, free_index, *args, **kwargs):
        hold = hold_for_allocator(self)
        if hold is None or not hold.active() or _in_free_group(self):
            return original(self, free_index, *args, **kwargs)
        _flush(self, hold, lambda pages: original(self, pages))
        if free_index.numel() == 0:
            return original(self, free_index, *args, **kwargs)
        keep = hold.divert(free_index)
        if keep is free_index:
            return original(self, free_index, *args, **kwargs)
        if keep.numel() == 0:
            return None
        return original(self, keep, *args, **kwargs)

    return free


def release_drained(alloc) -> int:
    """Scheduler thread: give drained held pages back to ``alloc``; returns how many.

    An empty free through the (wrapped) sink flushes the releasable pages first."""
    hold = hold_for_allocator(alloc)
    if hold is None or not hold._releasable:
        return 0
    import torch

    n = len(hold._releasable)
    empty = torch.empty((0,), dtype=torch.int64, device=getattr(alloc, "device", "cpu"))
    if hasattr(type(alloc), "_release_page_ids"):
        alloc._release_page_ids(empty)  # 0.5.17+ paged sink
    else:
        alloc.free(empty)
    return n


_SIGNATURES: Dict[Callable, object] = {}


def _pages_between(prefix_lens, seq_lens, ps: int) -> int:
    return sum((int(s) + ps - 1) // ps - (int(p) + ps - 1) // ps for p, s in zip(prefix_lens, seq_lens))


def _free_list_covers(alloc, original: Callable, args, kwargs) -> bool:
    """Whether a paged ``alloc_extend`` finds the pages it needs on the free list.

    Up to 0.5.22, upstream's ``alloc_extend`` launches its kernel over the free list
    first and checks the list's length only afterwards: short by k pages, the kernel
    reads k entries past the end of the tensor (on CPU, through Triton's interpreter, a
    segmentation fault that killed the prefill scheduler in the chaos soak on 0.5.10;
    on a GPU an out-of-bounds read). Upstream never gets there short, because its
    admission budget counts exactly the free and evictable pages; kvguard's hold takes
    pages it budgets for off the free list, so kvguard checks first (0.5.23 checks
    itself). Other allocation calls check before they read."""
    if not hasattr(alloc, "free_pages") or hold_for_allocator(alloc) is None:
        return True  # no kvguard hold on this allocator: upstream's budget is exact
    need = None
    try:
        sig = _SIGNATURES.get(original)
        if sig is None:
            import inspect

            sig = _SIGNATURES[original] = inspect.signature(original)
        bound = sig.bind(alloc, *args, **kwargs).arguments
    except (TypeError, ValueError):
        return True
    if bound.get("num_new_pages") is not None:
        need = int(bound["num_new_pages"])
    elif bound.get("seq_lens_cpu") is not None and bound.get("prefix_lens_cpu") is not None:
        try:
            need = _pages_between(bound["prefix_lens_cpu"].tolist(), bound["seq_lens_cpu"].tolist(),
                                  int(alloc.page_size))
        except Exception:  # noqa: BLE001 - unknown argument shapes: upstream decides
            return True
    if need is None:
        return True
    try:
        # upstream merges its released pages into the free list before the kernel when
        # the list runs low, so what it can read is everything available
        return need * int(alloc.page_size) <= real_available(alloc)
    except Exception as exc:  # noqa: BLE001 - never fail an allocation over the check itself
        log.debug("kvguard prefill_source_hold: free-list check skipped: %s", exc)
        return True


def _alloc_waits_for_held_pages(original: Callable, extend: bool = False) -> Callable:
    """A failed allocation retries once held pages have drained (bounded wait).

    The scheduler budgets admission with the allocator's free pages plus the radix
    cache's evictable ones. A page evicted (or freed) while a transfer still reads it
    is held by kvguard instead of returning to the free list, so the allocation that
    follows the eviction can come up short, and upstream turns that into a fatal
    "Prefill out of memory". Found on 0.5.23 with aborts during transfers
    (tests/server/test_abort_phases.py). The transfer of one chunk drains within
    milliseconds normally, so on failure this waits (up to ``ALLOC_WAIT``) for held
    pages to drain, gives them back and retries. Costs nothing on success."""

    def covers(self, args, kwargs) -> bool:
        return not extend or _free_list_covers(self, original, args, kwargs)

    def alloc(self, *args, **kwargs):
        if covers(self, args, kwargs):
            out = original(self, *args, **kwargs)
            if out is not None:
                return out
        else:
            out = None
        hold = hold_for_allocator(self)
        if hold is None or hold.role != ROLE or not hold.held_pages():
            return out  # decode never blocks its scheduler on a stuck prefill: admission just waits
        wait = alloc_wait()
        deadline = time.monotonic() + wait
        waited = False
        while True:
            if release_drained(self) and covers(self, args, kwargs):
                out = original(self, *args, **kwargs)
                if out is not None:
                    from ..engine import metrics

                    metrics.count("alloc_waited_for_held_pages")
                    if waited:
                        log.info("kvguard prefill_source_hold: an allocation waited for held pages to drain")
                    return out
            if not hold.held_pages() or time.monotonic() > deadline:
                if hold.held_pages():
                    log.error(
                        "kvguard prefill_source_hold: an allocation failed while %d page(s) are held for "
                        "transfers that have not drained within %.0f s", hold.held_pages(), wait,
                    )
                return out
            waited = True
            time.sleep(0.002)

    return alloc


# ----------------------------------------------------------------------------- admission budget

_raw = threading.local()  # .on: available_size() answers the free list itself


def real_available(alloc) -> int:
    """The allocator's free tokens as upstream counts them (free list and pages being
    released), without kvguard's deduction for failed sends."""
    _raw.on = True
    try:
        return int(alloc.available_size())
    finally:
        _raw.on = False


def _available_size(original: Callable) -> Callable:
    """Upstream budgets admission and eviction with ``available_size() +
    evictable_size()`` (PrefillAdder up to 0.5.22, PrefillBudget on 0.5.23, and
    ``evict_from_tree_cache`` evicts the shortfall). The pages of a failed send stay
    pinned until its peer is confirmed gone, which for a live peer is never; meanwhile
    the finished request has put them in the radix cache, where upstream counts them as
    evictable. It admitted a request on them, evicted them (the eviction only moved them
    to kvguard's hold), and the allocation that followed failed: "Prefill out of
    memory" killed the scheduler (issue 18). The prefill allocator's free tokens are
    reported minus those pages (``PageHold.stuck_unheld_pages``), so the budget counts
    only what eviction can really free and the shortfall evicted covers them; the leak
    checker's session-held term adds them back (``_held_tokens``). Nothing changes
    while no send has failed (one dict test per call)."""

    def available_size(self, *args, **kwargs):
        n = original(self, *args, **kwargs)
        hold = HOLDS.get(ROLE)
        if hold is None or not hold._stuck or getattr(_raw, "on", False) or not hold.owns(self):
            return n
        return n - hold.stuck_unheld_tokens()

    return available_size


def unusable_tokens() -> int:
    """Tokens of failed sends' pages the prefill allocator's free size leaves out."""
    hold = HOLDS.get(ROLE)
    return hold.stuck_unheld_tokens() if hold is not None else 0


_last_sweep = {"t": 0.0}


def _nothing_to_release() -> bool:
    """Lock-free: no hold has a freed page held or releasable, and no metadata row waits
    (a page moving from held to releasable is never seen in neither: PageHold.unpin); a
    stale 'something' costs one slow pass, a stale 'nothing' one loop iteration."""
    for h in HOLDS.values():
        if h._held or h._releasable:
            return False
    return not ROWS._releasable


def _pop_bootstrapped(original: Callable) -> Callable:
    def pop_bootstrapped(self, *args, **kwargs):
        if _nothing_to_release():  # the idle poll: every loop iteration
            return original(self, *args, **kwargs)
        try:
            sched = getattr(self, "scheduler", None)
            alloc = getattr(sched, "token_to_kv_pool_allocator", None) or getattr(self, "token_to_kv_pool_allocator", None)
            if alloc is not None:
                hold = hold_for_allocator(alloc)
                if hold is not None:
                    release_drained(alloc)
                    ROWS.flush()
                    now = time.monotonic()
                    if now - _last_sweep["t"] >= _SWEEP_EVERY:
                        _last_sweep["t"] = now
                        if hold.sweep(now):
                            from ..engine import metrics

                            metrics.count("pages_quarantined", role=ROLE)
        except Exception as exc:  # noqa: BLE001 - never break the scheduler loop
            log.warning("kvguard prefill_source_hold: releasing drained pages failed: %s", exc)
        return original(self, *args, **kwargs)

    return pop_bootstrapped


# ----------------------------------------------------------------------------- leak checker


def total_held_tokens() -> int:
    """Tokens kvguard keeps out of upstream's free and evictable counts: held pages, and
    the pages of failed sends deducted from the free size (``_available_size``)."""
    return sum(h.held_tokens() for h in HOLDS.values()) + unusable_tokens()


def _held_tokens(original: Callable) -> Callable:
    def session_held_tokens(self, *args, **kwargs):
        return original(self, *args, **kwargs) + total_held_tokens()

    return session_held_tokens


# ----------------------------------------------------------------------------- start-up


def bind_allocator(alloc, quarantine_after: float = 300.0) -> PageHold:
    """Make ``alloc`` this process's prefill allocator whose transfer pages are held."""
    return bind_hold(ROLE, alloc, quarantine_after)


def _scheduler_init(quarantine_after: float) -> Callable[[Callable], Callable]:
    return bind_at_scheduler_init(
        ROLE, quarantine_after, "prefill_source_hold: source pages of Mooncake transfers stay allocated until the "
        "transfer worker has drained them")


class PrefillSourceHoldGuard(Guard):
    name = "prefill_source_hold"
    suspendable = True  # hybrid_pool_check may switch it off on a node it cannot cover (warn)
    protects = "prefill source pages are never freed while a Mooncake transfer may still read them"
    targets = (
        SCHEDULER_INIT, TRANSFER_WORKER, ADD_TRANSFER, PAGED_FREE, PAGED_RELEASE, TOKEN_FREE,
        POP_BOOTSTRAPPED, HELD_MIXIN, HELD_OBSERVER, PAGED_ALLOC, PAGED_ALLOC_EXTEND, TOKEN_ALLOC,
        TRANSFER_DATA, ABORT_ACK, METADATA_FREE, BASE_AVAILABLE, PAGED_AVAILABLE, TOKEN_AVAILABLE,
    )

    def decide(self, ctx) -> Decision:
        patches = [SCHEDULER_INIT.key, TRANSFER_WORKER.key, ADD_TRANSFER.key, TOKEN_FREE.key, POP_BOOTSTRAPPED.key,
                   PAGED_ALLOC.key, PAGED_ALLOC_EXTEND.key, TOKEN_ALLOC.key, TRANSFER_DATA.key, METADATA_FREE.key]
        patches.append(PAGED_RELEASE.key if ctx.has(PAGED_RELEASE.key) else PAGED_FREE.key)
        patches.append(HELD_OBSERVER.key if ctx.has(HELD_OBSERVER.key) else HELD_MIXIN.key)
        # the paged allocator inherits the base's available_size up to 0.5.19
        patches.append(PAGED_AVAILABLE.key if ctx.has(PAGED_AVAILABLE.key) else BASE_AVAILABLE.key)
        patches.append(TOKEN_AVAILABLE.key)
        if ctx.has(ABORT_ACK.key):
            patches.append(ABORT_ACK.key)
        for key in patches:
            ctx.require(key)
        sink = "_release_page_ids" if PAGED_RELEASE.key in patches else "free"
        return Decision(ACTIVE, f"paged free sink: {sink}", patches=tuple(patches))

    def wrappers(self, ctx) -> Dict[str, Callable[[Callable], Callable]]:
        q = float(ctx.config.get("quarantine_after"))
        peer_liveness.configure(float(ctx.config.get("peer_probe_interval")))
        return {
            SCHEDULER_INIT.key: _scheduler_init(q),
            TRANSFER_WORKER.key: _transfer_worker,
            TRANSFER_DATA.key: _transfer_data,
            ABORT_ACK.key: _send_abort_ack,
            ADD_TRANSFER.key: _add_transfer_request,
            PAGED_FREE.key: _paged_free,
            PAGED_RELEASE.key: _paged_release,
            TOKEN_FREE.key: _token_free,
            POP_BOOTSTRAPPED.key: _pop_bootstrapped,
            HELD_MIXIN.key: _held_tokens,
            HELD_OBSERVER.key: _held_tokens,
            PAGED_ALLOC.key: _alloc_waits_for_held_pages,
            PAGED_ALLOC_EXTEND.key: lambda original: _alloc_waits_for_held_pages(original, extend=True),
            TOKEN_ALLOC.key: _alloc_waits_for_held_pages,
            METADATA_FREE.key: ROWS.wrap_free,
            BASE_AVAILABLE.key: _available_size,
            PAGED_AVAILABLE.key: _available_size,
            TOKEN_AVAILABLE.key: _available_size,
        }
