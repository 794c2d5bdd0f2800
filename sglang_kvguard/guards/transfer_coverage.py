"""Decode verifies that what prefill transferred covers exactly what decode reserved.

The incident: prefill turned a rejected prompt into a one-token stub, sent one page
and reported success; decode had reserved eight pages for the prompt and attended
over all eight, seven of which still held other users' KV. No release up to 0.5.23
compares what was sent with what was reserved.

kvguard, on every release (any transfer backend that moves SGLang's metadata rows):

* prefill, when it fills a request's metadata row for the last chunk
  (``MetadataBuffers.set_buf``), also writes into the row's spare ``cached_tokens``
  columns (7-15 are unused from 0.5.10 to 0.5.23; the row travels with the
  transfer's auxiliary data): column 7 = prompt tokens whose KV it sent, column 8 =
  pages its sender declared (``num_kv_indices``; the sender only reports success
  once exactly that many were sent), column 9 = a marker saying kvguard wrote them.
  The marker is cleared first and written last, so a half-written row never looks
  published;
* decode records, per receiver, how many pages it reserved for the transfer
  (``send_metadata``) and, before it commits a finished transfer to the request
  (``DecodeTransferQueue._commit_transfer_to_req``, i.e. before the request can join
  a decode batch), compares tokens and pages. Any difference fails the request
  closed through upstream's own corruption path: ``prepare_abort`` with 500 and a
  message naming both numbers, the receiver cleared, the pages and metadata slot
  given back by the queue (the transfer has completed, so nothing can still write
  them), a log line with the room, a counter.

A row without the marker means the prefill did not publish (no kvguard there): by
default that fails the request too (``--kvguard-coverage-unverified fail``); ``allow``
lets it through with a counter and a rate-limited warning, for rolling upgrades.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable, Dict, Optional, Tuple

from ..engine.config import Flag, register_flag
from ..engine.guard import ACTIVE, Decision, Guard
from ..engine.targets import target
from . import _faults
from ._fail_closed import fail_request as _fail
from ._row import read_cols, row_view

log = logging.getLogger("sglang_kvguard")

COL_TOKENS = 7
COL_PAGES = 8
COL_MARKER = 9
MARKER = 0x4B564731  # "KVG1"; fits a signed int32
FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # upstream's warm-up requests (disaggregation.utils)

register_flag(
    Flag(
        "coverage_unverified",
        "fail",
        "What decode does with a transfer whose prefill did not publish its coverage (no kvguard on prefill): "
        "fail the request (default) or allow it with a counter.",
        choices=("fail", "allow"),
    )
)

PUBLISH = target(
    "disagg.utils.MetadataBuffers.set_buf",
    "sglang.srt.disaggregation.utils:MetadataBuffers.set_buf",
    why="prefill: fills the metadata row that travels with the last chunk",
)
RESERVE = target(
    "disagg.receiver.send_metadata",
    "sglang.srt.disaggregation.mooncake.conn:MooncakeKVReceiver.send_metadata",
    "sglang.srt.disaggregation.common.conn:CommonKVReceiver.send_metadata",
    why="decode: tells prefill which pages it reserved for the transfer",
)
RESERVE_FAKE = target(
    "disagg.fake.FakeKVReceiver.send_metadata",
    "sglang.srt.disaggregation.fake.conn:FakeKVReceiver.send_metadata",
    why="decode, fake transfer backend (warm-up requests, tests): pages reserved",
)
COMMIT = target(
    "disagg.decode.DecodeTransferQueue._commit_transfer_to_req",
    "sglang.srt.disaggregation.decode:DecodeTransferQueue._commit_transfer_to_req",
    why="decode: a finished transfer becomes part of the request (before any decode batch)",
)

_last_warning = {"t": 0.0}


class CoverageMismatch(Exception):
    pass


def publish(row, tokens: int, pages: int) -> None:
    """Write kvguard's coverage into one ``cached_tokens`` row (prefill): the marker is
    cleared first and written last, so a half-written row never looks published."""
    view = row_view(row)
    view[COL_MARKER] = 0
    view[COL_TOKENS] = int(tokens)
    view[COL_PAGES] = int(pages)
    view[COL_MARKER] = MARKER


def published(row) -> Optional[Tuple[int, int]]:
    """(tokens, pages) prefill published in ``row``, or None (one read of the columns)."""
    tokens, pages, marker = read_cols(row, COL_TOKENS, COL_MARKER + 1)
    if marker != MARKER:
        return None
    return tokens, pages


def _set_buf(original: Callable) -> Callable:
    def set_buf(self, req, *args, **kwargs):
        ret = original(self, req, *args, **kwargs)
        idx = getattr(req, "metadata_buffer_index", None)
        if idx is None or idx < 0:
            return ret
        sender = getattr(req, "disagg_kv_sender", None)
        pages = getattr(sender, "num_kv_indices", None)
        publish(self.cached_tokens[idx], len(req.origin_input_ids), -1 if pages is None else pages)
        return ret

    return set_buf


def _send_metadata(original: Callable) -> Callable:
    def send_metadata(self, kv_indices, *args, **kwargs):
        try:
            self._kvguard_reserved_pages = len(kv_indices)
        except TypeError:
            pass
        return original(self, kv_indices, *args, **kwargs)

    return send_metadata


def _is_fake(req) -> bool:
    return getattr(req, "bootstrap_host", None) == FAKE_BOOTSTRAP_HOST


def check(decode_req, row, expected_room) -> Optional[str]:
    """Why this finished transfer does not cover the reservation, or None."""
    req = decode_req.req
    got = published(row)
    want_tokens = len(req.origin_input_ids)
    receiver = getattr(decode_req, "kv_receiver", None)
    want_pages = getattr(receiver, "_kvguard_reserved_pages", None)
    if got is None:
        return "unverified"
    tokens, pages = got
    problems = []
    if tokens != want_tokens:
        problems.append(f"prefill sent KV for {tokens} prompt tokens, decode reserved {want_tokens}")
    if want_pages is not None and pages >= 0 and pages != want_pages:
        problems.append(f"prefill sent {pages} pages, decode reserved {want_pages}")
    if not problems:
        return None
    return "; ".join(problems)


def landed_room(queue, decode_req) -> Optional[int]:
    """The request's bootstrap room when a real (not warm-up) transfer's metadata row
    has landed and is this request's; None when upstream should judge the row (not
    ready yet, or upstream's own metadata-corruption case)."""
    req = decode_req.req
    idx = getattr(decode_req, "metadata_buffer_index", None)
    room = getattr(req, "bootstrap_room", None)
    if _is_fake(req) or room is None or idx is None or idx < 0:
        return None
    try:
        if int(queue.metadata_buffers.bootstrap_room[idx][0].item()) != room:
            return None
    except Exception:  # noqa: BLE001 - let upstream judge the row
        return None
    return room


def unverified(policy: str, room: int, what: str) -> Optional[str]:
    """Prefill published no ``what`` for ``room``: the failure message, or None when
    ``--kvguard-coverage-unverified=allow`` lets the transfer through (warned at most
    once a minute)."""
    message = f"kvguard: prefill did not publish {what} for room {room} (is kvguard installed on the prefill nodes?)"
    if policy != "allow":
        return message
    now = time.monotonic()
    if now - _last_warning["t"] > 60:
        _last_warning["t"] = now
        log.warning("%s; allowed by --kvguard-coverage-unverified=allow", message)
    return None


def fail_closed(decode_req, room: int, message: str) -> bool:
    """Log and fail the request through upstream's corruption path; the value to return
    from ``_commit_transfer_to_req``."""
    log.error("request rid=%s room=%s failed closed: %s", getattr(decode_req.req, "rid", "?"), room, message)
    _fail(decode_req, message)
    return True  # "remove from the queue": 0.5.10-0.5.12 read this, later releases ignore it


def _commit(unverified_policy: str) -> Callable[[Callable], Callable]:
    def factory(original: Callable) -> Callable:
        def _commit_transfer_to_req(self, decode_req, *args, **kwargs):
            if _faults.ENV in os.environ:  # tests only (see _faults.py)
                _faults.maybe_inject(decode_req, self)
            room = landed_room(self, decode_req)
            if room is None:
                return original(self, decode_req, *args, **kwargs)
            from ..engine import metrics

            problem = check(decode_req, self.metadata_buffers.cached_tokens[decode_req.metadata_buffer_index], room)
            if problem is None:
                metrics.count("coverage_verified")
                return original(self, decode_req, *args, **kwargs)
            if problem == "unverified":
                metrics.count("coverage_unverified")
                message = unverified(unverified_policy, room, "what it transferred")
                if message is None:
                    return original(self, decode_req, *args, **kwargs)
            else:
                metrics.count("coverage_mismatches")
                message = f"kvguard: transferred KV does not cover the reservation: {problem}"
            return fail_closed(decode_req, room, message)

        return _commit_transfer_to_req

    return factory


class TransferCoverageGuard(Guard):
    name = "transfer_coverage"
    protects = "decode never commits a transfer that covers fewer (or more) tokens or pages than it reserved"
    suspendable = True  # hybrid_pool_check may switch it off on a node whose page layout it has not verified (warn)
    targets = (PUBLISH, RESERVE, RESERVE_FAKE, COMMIT)

    def decide(self, ctx) -> Decision:
        for t in self.targets:
            ctx.require(t.key)
        policy = ctx.config.get("coverage_unverified")
        return Decision(
            ACTIVE,
            f"prefill publishes tokens/pages sent (cached_tokens[:, 7:10]); decode verifies before commit; "
            f"unpublished rows: {policy}",
            patches=tuple(t.key for t in self.targets),
        )

    def wrappers(self, ctx) -> Dict[str, Callable[[Callable], Callable]]:
        return {
            PUBLISH.key: _set_buf,
            RESERVE.key: _send_metadata,
            RESERVE_FAKE.key: _send_metadata,
            COMMIT.key: _commit(ctx.config.get("coverage_unverified")),
        }
