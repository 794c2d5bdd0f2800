"""transfer_coverage on real PD queues and metadata buffers.

Prefill side: SGLang's own ``PrefillBootstrapQueue`` admits the request, pops it with a
metadata slot, and ``MetadataBuffers.set_buf`` fills its row (kvguard publishes
the tokens and pages it sent into the row's spare columns). The transfer of the
auxiliary data is what Mooncake does with every metadata buffer: a byte copy of the
request's row into decode's row; here it is a tensor copy of every row-indexed buffer.
Decode side: SGLang's own ``DecodePreallocQueue`` reserves the pages,
``DecodeTransferQueue.pop_transferred`` commits the transfer (the fake backend's
receiver reports success). The mismatch is produced by SGLang's own code path:
``validate_input_length(..., allow_auto_truncate=True)`` on the prefill node cuts the
prompt to the prefill limit, while decode (larger limit) reserved the full prompt, so
prefill "succeeds" with fewer tokens and pages than decode reserved.
"""

from __future__ import annotations

import os
from http import HTTPStatus

import pytest

os.environ["KVGUARD_AUTO_INSTALL"] = "0"  # this module installs and uninstalls explicitly

pytestmark = pytest.mark.component

PROMPT = 600
PREFILL_LIMIT = 250
HOST = "127.0.0.1"  # a real (not warm-up) bootstrap host: upstream checks the row's room


@pytest.fixture
def kvguard(install_kvguard):
    """This module installs with flags: conftest's ``install_kvguard``."""
    return install_kvguard


def _row_buffers(buffers):
    """Every tensor of ``MetadataBuffers`` that has one row per metadata slot."""
    size = buffers.output_ids.shape[0]
    return {
        name: t
        for name, t in vars(buffers).items()
        if hasattr(t, "shape") and len(t.shape) >= 1 and t.shape[0] == size
    }


def _prefill_row(sgl, make_side, room: int, *, truncate: bool):
    """Run the prefill half up to the last chunk's ``set_buf``; returns the row."""
    from sglang.srt.managers.utils import validate_input_length

    with make_side("prefill") as p:
        req = p.new_req(PROMPT, bootstrap_room=room)
        if truncate:
            assert validate_input_length(req, PREFILL_LIMIT, True) is None
            assert len(req.origin_input_ids) == PREFILL_LIMIT
        p.bootstrap_queue.add(req, p.kv_pool.head_num)
        popped = p.bootstrap_queue.pop_bootstrapped()
        if isinstance(popped, tuple):
            popped = popped[0]
        assert popped == [req]
        req.output_ids.append(17)  # the first generated token
        p.metadata_buffers.set_buf(req)  # what send_kv_chunk(last_chunk=True) does
        idx = req.metadata_buffer_index
        row = {name: t[idx].clone() for name, t in _row_buffers(p.metadata_buffers).items()}
        sgl.release_metadata_slot(p, req)
        return row


def reserved_pages(sgl, side, req, n_tokens=PROMPT):
    """Decode's pages for the prompt, in token order (the order it sends them to prefill)."""
    row = side.req_to_token_pool.req_to_token[sgl.req_pool_idx(req)][:n_tokens]
    return [int(x) // side.page_size for x in row[::side.page_size].tolist()]


def write_pages(side, pages):
    """What Mooncake does on decode: whole pages of every layer's K and V are written."""
    import torch

    from sglang_kvguard.guards.destination_canary import kv_buffers

    gen = torch.Generator().manual_seed(1234)
    ps = side.page_size
    for buf in kv_buffers(side.kv_pool):
        for p in pages:
            chunk = buf[p * ps:(p + 1) * ps]
            chunk.copy_(torch.randn(chunk.shape, generator=gen).to(chunk.dtype))


def _decode_commit(sgl, make_side, room: int, row, written=None, fault=None, digest_room=None):
    """Reserve on decode, land the KV pages (all, or the first ``written``) and ``row``
    as the transfer's aux data, commit.

    Prefill's KV checksum is part of the row; the component tier has no prefill forward
    pass, so the digest prefill would publish over the same bytes is computed here with
    kvguard's own functions (prefill's real path runs in the server tier). ``fault(d,
    pages)`` then corrupts what landed; ``digest_room`` binds the digest to another
    request (a page replayed from it)."""
    with make_side("decode") as d:
        before = sgl.snapshot(d)
        req = d.new_req(PROMPT, bootstrap_room=room)
        d.prealloc_queue.add(req)
        preallocated, failed = d.prealloc_queue.pop_preallocated()
        assert not failed and [dr.req for dr in preallocated] == [req]
        assert sgl.snapshot(d)["free_pages"] < before["free_pages"]
        pages = reserved_pages(sgl, d, req)
        write_pages(d, pages if written is None else pages[:written])
        idx = preallocated[0].metadata_buffer_index
        for name, t in _row_buffers(d.metadata_buffers).items():
            t[idx].copy_(row[name])
        from sglang_kvguard.guards import transfer_checksum as tcs

        tcs.publish(d.metadata_buffers.cached_tokens[idx],
                    tcs.digest(d.kv_pool, pages, digest_room or room), len(pages))
        if fault is not None:
            fault(d, pages)
        # The fake backend's queues need the warm-up host up to here; the commit must
        # treat this as a real transfer (upstream skips its own room check for
        # warm-up requests, and so does kvguard), so give it a real host now.
        req.bootstrap_host = HOST
        d.transfer_queue.extend(preallocated)
        transferred = d.transfer_queue.pop_transferred()
        streamed = [r for reqs, _ in d.scheduler.stream_recorder.calls for r in reqs]
        if transferred:
            sgl.release_req_kv(req, d.tree_cache)
        after = sgl.snapshot(d)
        return req, transferred, streamed, before, after


def test_short_transfer_is_failed_before_commit(sgl, make_side, kvguard):
    kvguard()
    room = 77001
    row = _prefill_row(sgl, make_side, room, truncate=True)
    req, transferred, streamed, before, after = _decode_commit(sgl, make_side, room, row)
    assert transferred == [], "decode committed a transfer that covers 250 of 600 tokens"
    reason = req.finished_reason
    assert type(reason).__name__ == "FINISH_ABORT"
    assert reason.status_code == HTTPStatus.INTERNAL_SERVER_ERROR
    assert "250" in reason.message and "600" in reason.message, reason.message
    assert streamed == [req], "the client must get the error"
    assert req.output_ids == [] or len(req.output_ids) == 0, "nothing from the bad transfer was committed"
    # pages and metadata slot went back through the queue's own abort path
    assert after == before


def test_full_transfer_is_committed(sgl, make_side, kvguard):
    kvguard()
    room = 77002
    row = _prefill_row(sgl, make_side, room, truncate=False)
    req, transferred, streamed, before, after = _decode_commit(sgl, make_side, room, row)
    assert transferred == [req]
    assert req.finished_reason is None
    assert list(req.output_ids) == [17]
    assert after == before


def test_unpublished_row_fails_closed_by_default(sgl, make_side, kvguard):
    import sglang_kvguard

    room = 77003
    row = _prefill_row(sgl, make_side, room, truncate=False)  # prefill without kvguard
    kvguard()
    req, transferred, streamed, before, after = _decode_commit(sgl, make_side, room, row)
    assert transferred == []
    assert "did not publish" in req.finished_reason.message
    assert after == before
    sglang_kvguard.uninstall()

    kvguard(KVGUARD_COVERAGE_UNVERIFIED="allow")
    req, transferred, streamed, before, after = _decode_commit(sgl, make_side, room, row)
    assert transferred == [req]


def test_without_the_guard_the_short_transfer_is_committed(sgl, make_side):
    """The harness sees the bug: unguarded, decode commits 250 tokens of KV for a
    600-token reservation and the request goes on to decode over unwritten pages."""
    room = 77004
    row = _prefill_row(sgl, make_side, room, truncate=True)
    req, transferred, streamed, before, after = _decode_commit(sgl, make_side, room, row)
    assert transferred == [req]
    assert req.finished_reason is None


def test_unwritten_reserved_pages_are_caught_by_the_canary(sgl, make_side, kvguard):
    """Coverage numbers agree, but the transfer wrote only 1 of the reserved pages (the
    incident's 1-of-8 shape): the destination canary still sits in the others."""
    kvguard()
    room = 77005
    row = _prefill_row(sgl, make_side, room, truncate=False)
    req, transferred, streamed, before, after = _decode_commit(sgl, make_side, room, row, written=1)
    assert transferred == []
    msg = req.finished_reason.message
    n = -(-PROMPT // 16)
    assert f"{n - 1} of {n} KV pages reserved for this request were never written" in msg, msg
    assert streamed == [req]
    assert after == before


def test_canary_alone_catches_it_with_coverage_off(sgl, make_side, kvguard):
    kvguard(KVGUARD_DISABLE="transfer_coverage")
    room = 77006
    row = _prefill_row(sgl, make_side, room, truncate=True)
    req, transferred, streamed, before, after = _decode_commit(sgl, make_side, room, row, written=1)
    assert transferred == []
    assert "were never written" in req.finished_reason.message


def _flip_one_bit(d, pages):
    from sglang_kvguard.guards.destination_canary import kv_buffers

    buf = kv_buffers(d.kv_pool)[3]
    word = buf[pages[2] * d.page_size:(pages[2] + 1) * d.page_size].view(-1).view(torch_int32())
    word[5] ^= 1 << 7


def _swap_two_pages(d, pages):
    from sglang_kvguard.guards.destination_canary import kv_buffers

    ps = d.page_size
    for buf in kv_buffers(d.kv_pool):
        a, b = pages[1], pages[4]
        tmp = buf[a * ps:(a + 1) * ps].clone()
        buf[a * ps:(a + 1) * ps].copy_(buf[b * ps:(b + 1) * ps])
        buf[b * ps:(b + 1) * ps].copy_(tmp)


def torch_int32():
    import torch

    return torch.int32


@pytest.mark.parametrize("fault", [_flip_one_bit, _swap_two_pages], ids=["bit-flip", "swap"])
def test_corrupted_transfer_fails_the_checksum(sgl, make_side, kvguard, fault):
    kvguard()
    room = 77010
    row = _prefill_row(sgl, make_side, room, truncate=False)
    req, transferred, streamed, before, after = _decode_commit(sgl, make_side, room, row, fault=fault)
    assert transferred == []
    assert "KV checksum mismatch for room 77010" in req.finished_reason.message, req.finished_reason.message
    assert streamed == [req]
    assert after == before


def test_digest_bound_to_another_request_fails_the_checksum(sgl, make_side, kvguard):
    kvguard()
    room = 77011
    row = _prefill_row(sgl, make_side, room, truncate=False)
    req, transferred, *_ = _decode_commit(sgl, make_side, room, row, digest_room=77012)
    assert transferred == []
    assert "KV checksum mismatch" in req.finished_reason.message
