"""Destination canaries: a reserved decode page that the transfer never wrote fails closed.

When decode reserves pages for an incoming transfer, kvguard stamps every word of
every reserved page, in every layer's K and V (or MLA) buffer, with a 32-bit canary
derived from the request's bootstrap room and the page
(``sglang_kvguard.kernels.stamp_canary``: a Triton kernel on GPU, the bit-identical
torch reference on CPU). Mooncake moves whole pages, so after a successful transfer
no word of a reserved page still holds its canary. Before decode commits the
transfer (``DecodeTransferQueue._commit_transfer_to_req``), kvguard counts, per page,
the words still holding the canary (``canary_counts``); a page that still holds it
everywhere was never written, and the request fails closed (500 naming the pages,
log line with the room, counter ``canary_hits``). This catches the incident's exact
shape (8 pages reserved, 1 written) even with every other check off, and any
transfer that reports success without having written everything.

Stamping happens in the decode receiver's ``send_metadata``, i.e. after the pages are
allocated and before prefill learns where to write. The KV pool is the one of the
``DecodePreallocQueue`` whose ``pop_preallocated`` is running. Pools without
per-layer page buffers (hybrid SWA / Mamba pools) are not stamped; a decode node on
one refuses to start while this guard is active (``hybrid_pool_check``).
"""

from __future__ import annotations

import logging
import random
import threading
from typing import Callable, Dict, List, Optional

from ..engine.guard import ACTIVE, Decision, Guard
from ..engine.targets import target
from .transfer_coverage import COMMIT, RESERVE, RESERVE_FAKE, fail_closed, landed_room

log = logging.getLogger("sglang_kvguard")

POP_PREALLOCATED = target(
    "disagg.decode.DecodePreallocQueue.pop_preallocated",
    "sglang.srt.disaggregation.decode:DecodePreallocQueue.pop_preallocated",
    why="decode: allocates pages for transfers and sends their indices to prefill",
)

_current = threading.local()
_warned = {"pool": False}


def kv_buffers(pool) -> Optional[List]:
    """Every per-layer page buffer of an MHA or MLA token pool, or None."""
    bufs = []
    for attr in ("k_buffer", "v_buffer", "kv_buffer"):
        value = getattr(pool, attr, None)
        if isinstance(value, (list, tuple)):
            bufs.extend(value)
    if not bufs or not all(hasattr(b, "data_ptr") for b in bufs):
        return None
    return bufs


def _pool_of(queue):
    alloc = getattr(queue, "token_to_kv_pool_allocator", None)
    if alloc is None or not hasattr(alloc, "get_kvcache"):
        return None
    return alloc.get_kvcache()


def _pop_preallocated(original: Callable) -> Callable:
    def pop_preallocated(self, *args, **kwargs):
        prev = getattr(_current, "queue", None)
        _current.queue = self
        try:
            return original(self, *args, **kwargs)
        finally:
            _current.queue = prev

    return pop_preallocated


def _send_metadata(original: Callable) -> Callable:
    def send_metadata(self, kv_indices, *args, **kwargs):
        queue = getattr(_current, "queue", None)
        room = getattr(self, "bootstrap_room", None)
        if room is None:  # the fake backend's receiver does not keep its room
            room = random.getrandbits(63)
        if queue is not None and kv_indices is not None and len(kv_indices):
            pool = _pool_of(queue)
            bufs = kv_buffers(pool) if pool is not None else None
            if bufs is None:
                if not _warned["pool"]:
                    _warned["pool"] = True
                    log.warning("destination_canary: %s has no per-layer page buffers; not stamped",
                                type(pool).__name__)
            else:
                from .. import kernels

                pages = [int(p) for p in kv_indices]
                kernels.stamp_canary(bufs, pages, int(pool.page_size), int(room))
                self._kvguard_canary = (pages, int(room), pool)
        return original(self, kv_indices, *args, **kwargs)

    return send_metadata


def unwritten_pages(receiver) -> Optional[List[int]]:
    """Reserved pages of ``receiver`` that still hold their canary everywhere."""
    stamped = getattr(receiver, "_kvguard_canary", None)
    if stamped is None:
        return None
    pages, room, pool = stamped
    from .. import kernels

    bufs = kv_buffers(pool)
    counts = kernels.canary_counts(bufs, pages, int(pool.page_size), room)
    full = kernels.canary_full_count(bufs, int(pool.page_size))
    return [p for p, c in zip(pages, counts.tolist()) if c == full]


def _commit(original: Callable) -> Callable:
    def _commit_transfer_to_req(self, decode_req, *args, **kwargs):
        receiver = getattr(decode_req, "kv_receiver", None)
        room = landed_room(self, decode_req) if receiver is not None else None
        if room is None:
            return original(self, decode_req, *args, **kwargs)
        bad = unwritten_pages(receiver)
        if not bad:
            return original(self, decode_req, *args, **kwargs)
        from .. import metrics

        metrics.count("canary_hits", n=len(bad))
        total = len(receiver._kvguard_canary[0])
        shown = ", ".join(str(p) for p in bad[:16]) + (" ..." if len(bad) > 16 else "")
        message = (f"kvguard: {len(bad)} of {total} KV pages reserved for this request were never written "
                   f"by its transfer (pages {shown})")
        return fail_closed(decode_req, room, message)

    return _commit_transfer_to_req


class DestinationCanaryGuard(Guard):
    name = "destination_canary"
    protects = "decode never commits a transfer that left a reserved page unwritten"
    targets = (POP_PREALLOCATED, RESERVE, RESERVE_FAKE, COMMIT)

    def decide(self, ctx) -> Decision:
        for t in self.targets:
            ctx.require(t.key)
        return Decision(ACTIVE, "reserved pages stamped at send_metadata, verified before commit",
                        patches=tuple(t.key for t in self.targets))

    def wrappers(self, ctx) -> Dict[str, Callable[[Callable], Callable]]:
        return {POP_PREALLOCATED.key: _pop_preallocated, RESERVE.key: _send_metadata,
                RESERVE_FAKE.key: _send_metadata, COMMIT.key: _commit}
