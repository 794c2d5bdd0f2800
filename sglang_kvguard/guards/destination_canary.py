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

Head-sliced transfers (an MHA model with prefill and decode at different attention TP
sizes: several prefill ranks write head slices of each decode page, or each decode row
is cut from a wider prefill row) cannot be judged page by page: a page one sender never
wrote still lost its canary in the other senders' slices. Such a receiver is not
stamped, and the request fails closed at commit with a message naming both TP sizes
(``_peer_tp``; counter ``head_sliced_transfers_refused``, one ERROR per prefill address).
"""

from __future__ import annotations

import logging
import random
import threading
from typing import Callable, Dict, List, Optional

from ..lifetime import transfer_components
from ..engine.guard import ACTIVE, Decision, Guard
from ..engine.targets import target
from ._peer_tp import head_sliced, refuse
from .transfer_coverage import COMMIT, RESERVE, RESERVE_FAKE, _is_fake, fail_closed, landed_room

log = logging.getLogger("sglang_kvguard")

POP_PREALLOCATED = target(
    "disagg.decode.DecodePreallocQueue.pop_preallocated",
    "sglang.srt.disaggregation.decode:DecodePreallocQueue.pop_preallocated",
    why="decode: allocates pages for transfers and sends their indices to prefill",
)

kv_buffers = transfer_components.kv_buffers  # re-exported: the one definition lives there

_current = threading.local()
_warned = {"pool": False}


def _pool_of(queue):
    alloc = getattr(queue, "token_to_kv_pool_allocator", None)
    if alloc is None or not hasattr(alloc, "get_kvcache"):
        return None
    return alloc.get_kvcache()


def _draft_pool_of(queue):
    return getattr(queue, "draft_token_to_kv_pool", None)


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
        if head_sliced(self) is not None:
            pass  # whole-page canaries cannot judge head slices: failed closed at commit
        elif queue is not None and kv_indices is not None and len(kv_indices):
            pool = _pool_of(queue)
            groups = transfer_components.page_groups(pool, _draft_pool_of(queue))
            if groups is None:
                if not _warned["pool"]:
                    _warned["pool"] = True
                    log.warning("destination_canary: %s has no per-layer page buffers; not stamped",
                                type(pool).__name__)
            else:
                pages = [int(p) for p in kv_indices]
                transfer_components.stamp_canary(groups, pages, int(room))
                self._kvguard_canary = (pages, int(room), pool, groups)
        return original(self, kv_indices, *args, **kwargs)

    return send_metadata


def unwritten_pages(receiver) -> Optional[Dict[str, List[int]]]:
    """component -> reserved pages of ``receiver`` that still hold their canary in every
    word of that component (KV, draft KV, indexer keys); None if nothing was stamped."""
    stamped = getattr(receiver, "_kvguard_canary", None)
    if stamped is None:
        return None
    pages, room, _pool, groups = stamped
    return transfer_components.unwritten(groups, pages, room)


def _commit(original: Callable) -> Callable:
    def _commit_transfer_to_req(self, decode_req, *args, **kwargs):
        receiver = getattr(decode_req, "kv_receiver", None)
        if receiver is not None and not _is_fake(decode_req.req):
            reason = head_sliced(receiver)
            if reason is not None:
                return refuse(decode_req, receiver, reason, "destination_canary")
        room = landed_room(self, decode_req) if receiver is not None else None
        if room is None:
            return original(self, decode_req, *args, **kwargs)
        by_component = unwritten_pages(receiver)
        if not by_component:
            return original(self, decode_req, *args, **kwargs)
        from ..engine import metrics

        bad = sorted({p for pages in by_component.values() for p in pages})
        metrics.count("canary_hits", n=len(bad))
        total = len(receiver._kvguard_canary[0])
        shown = ", ".join(str(p) for p in bad[:16]) + (" ..." if len(bad) > 16 else "")
        parts = "" if set(by_component) == {"kv"} else " [" + "; ".join(
            f"{c}: {len(ps)}" for c, ps in sorted(by_component.items())) + "]"
        message = (f"kvguard: {len(bad)} of {total} KV pages reserved for this request were never written "
                   f"by its transfer (pages {shown}){parts}")
        return fail_closed(decode_req, room, message)

    return _commit_transfer_to_req


class DestinationCanaryGuard(Guard):
    name = "destination_canary"
    suspendable = True  # hybrid_pool_check may switch it off on a node it cannot cover (warn)
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
