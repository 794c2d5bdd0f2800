"""Per-transfer KV checksum, bound to the request and page, verified before decode reads.

Prefill computes a 64-bit digest of exactly the KV pages it sends for a request (every
layer's K and V, or MLA KV, every page of the transferred range), bound to the
request's bootstrap room and each page's logical position in the transfer
(``sglang_kvguard.kernels.digest_pages``: a Triton kernel on GPU, the bit-identical
torch reference on CPU), and publishes it in spare columns of the request's metadata
row (``cached_tokens`` 10-13: digest low/high, marker, page count), which travels
with the transfer. Before decode commits the transfer it computes the same digest
over the pages it reserved (in the order it sent them to prefill) and fails the
request closed on any difference (500, log line with room and pages, counter
``checksum_mismatches``). A flipped bit, two pages swapped, a page replayed from
another request or a page left unwritten all change the digest.

The digest is computed when prefill sends the last chunk
(``SchedulerDisaggregationPrefillMixin.send_kv_chunk`` with ``last_chunk=True``,
every release), over the range it transfers: from the prefix decode promised at
bootstrap (``req.disagg_decode_prefix_len`` where it exists, else where the first
chunk started) to the end of the prompt. It runs beside upstream's optional
``--enable-kv-checksum`` (0.5.23), not instead of it.

A row without the marker means prefill did not publish (no kvguard there);
``--kvguard-coverage-unverified`` decides, as for the coverage check.

Head-sliced transfers (an MHA model with prefill and decode at different attention TP
sizes) cannot match: each prefill rank digests its own heads of its whole rows, decode
digests its whole rows, and the metadata row carrying the digest is last-writer-wins
among the prefill ranks. Decode does not record such a reservation and fails the
request closed at commit with a message naming both TP sizes (``_peer_tp``; counter
``head_sliced_transfers_refused``, one ERROR per prefill address). When the
destination canary is active it runs first and gives the one message.
"""

from __future__ import annotations

import logging
from typing import Callable, Dict, List, Optional

from ..lifetime import transfer_components
from ..engine.guard import ACTIVE, Decision, Guard
from ..engine.targets import target
from ._peer_tp import head_sliced, refuse
from ._row import read_cols, row_view
from .destination_canary import POP_PREALLOCATED, _current, _draft_pool_of, _pool_of, _pop_preallocated
from .transfer_coverage import COMMIT, RESERVE, RESERVE_FAKE, _is_fake, fail_closed, landed_room, unverified

log = logging.getLogger("sglang_kvguard")

COL_LO, COL_HI, COL_MARKER, COL_PAGES = 10, 11, 12, 13
MARKER = 0x4B564332  # "KVC2"

SEND_CHUNK = target(
    "disagg.prefill.SchedulerDisaggregationPrefillMixin.send_kv_chunk",
    "sglang.srt.disaggregation.prefill:SchedulerDisaggregationPrefillMixin.send_kv_chunk",
    why="prefill: sends each chunk's KV; the last call also fills the metadata row",
)



def _i32(x: int) -> int:
    x &= 0xFFFFFFFF
    return x - (1 << 32) if x >= (1 << 31) else x


def split(total: int):
    return _i32(total), _i32(total >> 32)


def join(lo: int, hi: int) -> int:
    v = ((int(hi) & 0xFFFFFFFF) << 32) | (int(lo) & 0xFFFFFFFF)
    return v - (1 << 64) if v >= (1 << 63) else v


def digest(pool, pages: List[int], room: int, draft_pool=None) -> int:
    """Digest of ``pages`` over every buffer the transfer writes at those page ids
    (``transfer_components.page_groups``: KV, draft KV, indexer keys)."""
    return transfer_components.digest(transfer_components.page_groups(pool, draft_pool), pages, room)


def publish(row, total: int, n_pages: int) -> None:
    """The marker is cleared first and written last."""
    view = row_view(row)
    view[COL_MARKER] = 0
    view[COL_LO], view[COL_HI] = split(total)
    view[COL_PAGES] = int(n_pages)
    view[COL_MARKER] = MARKER


def published(row):
    lo, hi, marker, pages = read_cols(row, COL_LO, COL_PAGES + 1)  # one read of the four columns
    if marker != MARKER:
        return None
    return join(lo, hi), pages


def _req_pool_idx(req):
    kv = getattr(req, "kv", None)
    if kv is not None and hasattr(kv, "req_pool_idx"):
        return kv.req_pool_idx
    return req.req_pool_idx


def sent_pages(scheduler, req, end_idx: Optional[int]) -> List[int]:
    """Physical prefill pages of the range this request transfers, in transfer order."""
    start = getattr(req, "disagg_decode_prefix_len", None)
    if start is None:
        start = getattr(req, "_kvguard_send_start", 0)
    end = end_idx if end_idx is not None else len(req.origin_input_ids)
    ps = int(scheduler.token_to_kv_pool_allocator.page_size)
    locs = scheduler.req_to_token_pool.req_to_token[_req_pool_idx(req), int(start):int(end)]
    return [int(x) // ps for x in locs[::ps].tolist()]


def _send_kv_chunk(original: Callable) -> Callable:
    def send_kv_chunk(self, req, *args, **kwargs):
        if not hasattr(req, "_kvguard_send_start"):
            req._kvguard_send_start = int(getattr(req, "start_send_idx", 0) or 0)
        last_chunk = kwargs.get("last_chunk", args[0] if args else False)
        if last_chunk and not _is_fake(req):
            try:
                idx = getattr(req, "metadata_buffer_index", -1)
                pool = self.token_to_kv_pool_allocator.get_kvcache()
                draft = _draft_pool_of(getattr(self, "disagg_prefill_bootstrap_queue", None))
                if idx is not None and idx >= 0 and transfer_components.kv_buffers(pool) is not None:
                    end_idx = kwargs.get("end_idx", args[1] if len(args) > 1 else None)
                    pages = sent_pages(self, req, end_idx)
                    publish(self.disagg_metadata_buffers.cached_tokens[idx],
                            digest(pool, pages, req.bootstrap_room, draft), len(pages))
            except Exception as exc:  # noqa: BLE001 - decode fails the unpublished row closed
                log.warning("kvguard could not checksum room %s: %s", getattr(req, "bootstrap_room", "?"), exc)
        return original(self, req, *args, **kwargs)

    return send_kv_chunk


def _send_metadata(original: Callable) -> Callable:
    def send_metadata(self, kv_indices, *args, **kwargs):
        queue = getattr(_current, "queue", None)
        pool = _pool_of(queue) if queue is not None and head_sliced(self) is None else None
        if pool is not None and transfer_components.kv_buffers(pool) is not None and kv_indices is not None:
            self._kvguard_checksum = ([int(p) for p in kv_indices], pool, _draft_pool_of(queue))
        return original(self, kv_indices, *args, **kwargs)

    return send_metadata


def check(receiver, row, room: int) -> Optional[str]:
    """Why the landed KV does not match prefill's digest; "unverified"; or None."""
    stamped = getattr(receiver, "_kvguard_checksum", None)
    if stamped is None:
        return None  # no reservation seen, or a pool without per-layer page buffers
    got = published(row)
    if got is None:
        return "unverified"
    pages, pool, draft = stamped
    want, n = got
    have = digest(pool, pages, room, draft)
    if have == want and n == len(pages):
        return None
    return (f"KV checksum mismatch for room {room}: prefill sent {n} pages with digest {want & (2**64 - 1):016x}, "
            f"decode holds {len(pages)} pages with digest {have & (2**64 - 1):016x} (pages {pages[:8]}"
            f"{' ...' if len(pages) > 8 else ''})")


def _commit(unverified_policy: str) -> Callable[[Callable], Callable]:
    def factory(original: Callable) -> Callable:
        def _commit_transfer_to_req(self, decode_req, *args, **kwargs):
            receiver = getattr(decode_req, "kv_receiver", None)
            if receiver is not None and not _is_fake(decode_req.req):
                reason = head_sliced(receiver)
                if reason is not None:
                    return refuse(decode_req, receiver, reason, "transfer_checksum")
            room = landed_room(self, decode_req) if receiver is not None else None
            if room is None:
                return original(self, decode_req, *args, **kwargs)
            from ..engine import metrics

            problem = check(receiver, self.metadata_buffers.cached_tokens[decode_req.metadata_buffer_index], room)
            if problem is None:
                return original(self, decode_req, *args, **kwargs)
            if problem == "unverified":
                metrics.count("checksum_unverified")
                message = unverified(unverified_policy, room, "a KV checksum")
                if message is None:
                    return original(self, decode_req, *args, **kwargs)
            else:
                metrics.count("checksum_mismatches")
                message = "kvguard: " + problem
            return fail_closed(decode_req, room, message)

        return _commit_transfer_to_req

    return factory


class TransferChecksumGuard(Guard):
    name = "transfer_checksum"
    suspendable = True  # hybrid_pool_check may switch it off on a node it cannot cover (warn)
    protects = "decode never commits KV whose digest (bound to room and page position) differs from prefill's"
    targets = (SEND_CHUNK, POP_PREALLOCATED, RESERVE, RESERVE_FAKE, COMMIT)

    def decide(self, ctx) -> Decision:
        for t in self.targets:
            ctx.require(t.key)
        return Decision(ACTIVE, "64-bit digest of the sent pages in cached_tokens[:, 10:14], verified before commit",
                        patches=tuple(t.key for t in self.targets))

    def wrappers(self, ctx) -> Dict[str, Callable[[Callable], Callable]]:
        return {
            SEND_CHUNK.key: _send_kv_chunk,
            POP_PREALLOCATED.key: _pop_preallocated,
            RESERVE.key: _send_metadata,
            RESERVE_FAKE.key: _send_metadata,
            COMMIT.key: _commit(ctx.config.get("coverage_unverified")),
        }
