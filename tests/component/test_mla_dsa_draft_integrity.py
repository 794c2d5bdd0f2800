"""The incident's model class on SGLang's real pools: MLA latent KV with the DSA/NSA
sparse-attention indexer (``DSATokenToKVPool``; ``NSATokenToKVPool`` before the
rename), page size 64 as DSA requires, a speculative draft model's KV pool, and
MXFP8 block-scaled KV (``MHATokenToKVPoolMXFP8``: scales sent as
``StateType.BLOCK_SCALE``, flat per slot at page 16, interleaved per page at 128).

Upstream registers the indexer's keys with the transfer backend as a state component
(``StateType.DSA``, ``state_type = "nsa"`` on 0.5.10-0.5.12) written at the KV page
ids, and the draft model's KV buffers beside the target's (same page ids). Each test
builds the real pool and the real PD queue for the role (the queue's own
``_init_kv_manager`` builds the ``KVArgs``), lands a transfer the way Mooncake does
(whole pages of every registered buffer) and lets SGLang's own
``DecodeTransferQueue.pop_transferred`` commit it:

* an indexer page (or a draft KV page) the transfer never wrote is caught by the
  destination canary, and committed with the canary off;
* foreign bytes in one indexer row (or draft KV page) are caught by the checksum,
  leave a KV-only digest unchanged (what kvguard digested before), and are committed
  with the checksum off;
* prefill's source hold pins the pages the indexer state of a last chunk reads (the
  request's pages from 0 on 0.5.10-0.5.22, beyond the chunk's own);
* the start-up check calls these pools covered, component by component.
"""

from __future__ import annotations

import os

import pytest

os.environ["KVGUARD_AUTO_INSTALL"] = "0"  # this module installs and uninstalls explicitly

pytestmark = [pytest.mark.component, pytest.mark.usefixtures("fake_manager_keeps_kv_args")]

PROMPT = 600
PAGE = 64  # DSA's page size
TOKENS = 2048
HOST = "127.0.0.1"  # a real (not warm-up) bootstrap host: upstream checks the row's room
PREFILL_GUARDS = {"prefill_source_hold", "transfer_checksum"}
DECODE_GUARDS = {"page_generation", "decode_destination_hold", "destination_canary", "transfer_checksum"}


@pytest.fixture
def kvguard(install_kvguard):
    """This module installs with flags: conftest's ``install_kvguard``."""
    return install_kvguard


def _dsa(sgl):
    return dict(kv_pool=sgl.make_dsa_pool, page_size=PAGE, num_tokens=TOKENS)


def _dsa_with_draft(sgl):
    return dict(kv_pool=sgl.make_dsa_pool, draft_pool=lambda n, page: sgl.make_mla_pool(n, page, layers=1),
                page_size=PAGE, num_tokens=TOKENS)


def _mha_with_draft(sgl):
    return dict(draft_pool=lambda n, page: sgl.make_kv_pool(n, page), page_size=16, num_tokens=TOKENS)


def _mxfp8(page_size):
    def layout(sgl):
        if sgl.mxfp8_pool_class() is None:
            pytest.skip("this release does not transfer MXFP8 KV in PD (no MHATokenToKVPoolMXFP8, or it "
                        "registers no scale buffers)")
        return dict(kv_pool=sgl.make_mxfp8_pool, page_size=page_size, num_tokens=TOKENS)

    return layout


_mxfp8_flat = _mxfp8(16)  # one scale row per token slot
_mxfp8_interleaved = _mxfp8(128)  # upstream's FA4 layout: one scale row per page


def _row_buffers(buffers):
    size = buffers.output_ids.shape[0]
    return {name: t for name, t in vars(buffers).items()
            if hasattr(t, "shape") and len(t.shape) >= 1 and t.shape[0] == size}


def _groups(side):
    from sglang_kvguard.lifetime import transfer_components as tc

    return tc.page_groups(side.kv_pool, side.prealloc_queue.draft_token_to_kv_pool if side.prealloc_queue
                          else side.bootstrap_queue.draft_token_to_kv_pool)


def _write(side, pages, seed=1234, skip=None):
    """What Mooncake does on decode: whole pages of every buffer the transfer registered
    (KV, draft KV, indexer rows). ``skip=(component, page)`` leaves one page of one
    component unwritten."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    for g in _groups(side):
        rpp = g.rows_per_page
        for buf in g.buffers:
            for p in pages:
                if skip == (g.component, p):
                    continue
                chunk = buf[p * rpp:(p + 1) * rpp]
                chunk.copy_(torch.randint(0, 255, chunk.shape, generator=gen, dtype=torch.int32).to(chunk.dtype)
                            if not chunk.dtype.is_floating_point
                            else torch.randn(chunk.shape, generator=gen).to(chunk.dtype))


def _prefill_row(sgl, make_side, room, side_kw):
    with make_side("prefill", **side_kw) as p:
        req = p.new_req(PROMPT, bootstrap_room=room)
        p.bootstrap_queue.add(req, getattr(p.kv_pool, "head_num", 1))  # MLA: one latent head
        popped = p.bootstrap_queue.pop_bootstrapped()
        if isinstance(popped, tuple):
            popped = popped[0]
        assert popped == [req]
        req.output_ids.append(17)
        p.metadata_buffers.set_buf(req)  # what send_kv_chunk(last_chunk=True) does
        idx = req.metadata_buffer_index
        row = {name: t[idx].clone() for name, t in _row_buffers(p.metadata_buffers).items()}
        sgl.release_metadata_slot(p, req)
        return row


def _decode_commit(sgl, make_side, room, side_kw, *, skip=None, fault=None):
    """Reserve on decode, land every registered buffer's pages (but ``skip``) and the
    row, publish prefill's digest of what it sent, apply ``fault``, commit."""
    from sglang_kvguard.guards import transfer_checksum as tcs

    row = _prefill_row(sgl, make_side, room, side_kw)
    with make_side("decode", **side_kw) as d:
        before = sgl.snapshot(d)
        req = d.new_req(PROMPT, bootstrap_room=room)
        d.prealloc_queue.add(req)
        preallocated, failed = d.prealloc_queue.pop_preallocated()
        assert not failed and [dr.req for dr in preallocated] == [req]
        r2t = d.req_to_token_pool.req_to_token[sgl.req_pool_idx(req)][:PROMPT]
        pages = [int(x) // d.page_size for x in r2t[::d.page_size].tolist()]
        # what prefill sent (one page of one component lost on the way if ``skip``),
        # digested as prefill digests what it sends
        _write(d, pages, skip=None if skip is None else (skip[0], pages[skip[1]]))
        digest = tcs.digest(d.kv_pool, pages, room, d.prealloc_queue.draft_token_to_kv_pool)
        idx = preallocated[0].metadata_buffer_index
        for name, t in _row_buffers(d.metadata_buffers).items():
            t[idx].copy_(row[name])
        tcs.publish(d.metadata_buffers.cached_tokens[idx], digest, len(pages))
        kv_only = _kv_only_digest(d, pages, room)
        if fault is not None:
            fault(d, pages)
        kv_only_after = _kv_only_digest(d, pages, room)
        req.bootstrap_host = HOST
        d.transfer_queue.extend(preallocated)
        transferred = d.transfer_queue.pop_transferred()
        if transferred:
            sgl.release_req_kv(req, d.tree_cache)
        return req, transferred, before, sgl.snapshot(d), (kv_only, kv_only_after)


def _kv_only_digest(side, pages, room):
    from sglang_kvguard import kernels
    from sglang_kvguard.lifetime import transfer_components as tc

    _, total = kernels.digest_pages(tc.kv_buffers(side.kv_pool), pages, side.page_size, room)
    return int(total)


def _foreign_bytes(component, page_pos=3):
    def fault(d, pages):
        import torch

        for g in _groups(d):
            if g.component != component:
                continue
            buf = g.buffers[-1]
            rpp = g.rows_per_page
            p = pages[page_pos]
            other = pages[page_pos + 1]  # another page's bytes: what a stale or foreign page holds
            buf[p * rpp:(p + 1) * rpp].copy_(buf[other * rpp:(other + 1) * rpp].clone())
            return
        raise AssertionError(f"no {component} buffers")

    return fault


# ----------------------------------------------------------------------------- canary


@pytest.mark.parametrize("component,layout", [("indexer", _dsa), ("draft_kv", _dsa_with_draft),
                                              ("draft_kv", _mha_with_draft), ("block_scale", _mxfp8_flat),
                                              ("block_scale", _mxfp8_interleaved)],
                         ids=["dsa-indexer", "dsa-draft-mla", "mha-draft", "mxfp8-scale-flat", "mxfp8-scale-paged"])
def test_unwritten_page_of_a_component_is_caught_by_the_canary(sgl, make_side, kvguard, component, layout):
    kvguard(KVGUARD_DISABLE="transfer_checksum,transfer_coverage")
    side_kw = layout(sgl)
    req, transferred, before, after, _ = _decode_commit(sgl, make_side, 88001, side_kw, skip=(component, 4))
    assert transferred == [], f"decode committed a transfer whose {component} page was never written"
    msg = req.finished_reason.message
    n = -(-PROMPT // side_kw["page_size"])
    assert f"1 of {n} KV pages reserved for this request were never written" in msg, msg
    assert f"[{component}: 1]" in msg, msg
    assert after == before


@pytest.mark.parametrize("component,layout", [("indexer", _dsa), ("draft_kv", _mha_with_draft),
                                              ("block_scale", _mxfp8_flat)],
                         ids=["dsa-indexer", "mha-draft", "mxfp8-scale"])
def test_unwritten_page_of_a_component_is_committed_without_the_canary(sgl, make_side, kvguard, component, layout):
    kvguard(KVGUARD_DISABLE="transfer_checksum,transfer_coverage,destination_canary")
    req, transferred, *_ = _decode_commit(sgl, make_side, 88002, layout(sgl), skip=(component, 4))
    assert transferred == [req] and req.finished_reason is None


def test_a_fully_written_dsa_transfer_with_draft_kv_is_committed(sgl, make_side, kvguard):
    kvguard()
    req, transferred, before, after, _ = _decode_commit(sgl, make_side, 88003, _dsa_with_draft(sgl))
    assert transferred == [req], req.finished_reason
    assert req.finished_reason is None
    assert after == before


# ----------------------------------------------------------------------------- checksum


@pytest.mark.parametrize("component,layout", [("indexer", _dsa), ("draft_kv", _dsa_with_draft),
                                              ("draft_kv", _mha_with_draft), ("block_scale", _mxfp8_flat),
                                              ("block_scale", _mxfp8_interleaved)],
                         ids=["dsa-indexer", "dsa-draft-mla", "mha-draft", "mxfp8-scale-flat", "mxfp8-scale-paged"])
def test_foreign_bytes_in_a_component_fail_the_checksum(sgl, make_side, kvguard, component, layout):
    kvguard()
    req, transferred, before, after, (kv_only, kv_only_after) = _decode_commit(
        sgl, make_side, 88010, layout(sgl), fault=_foreign_bytes(component))
    assert kv_only == kv_only_after, "the fault must be invisible to a digest of the target KV alone"
    assert transferred == []
    assert "KV checksum mismatch for room 88010" in req.finished_reason.message, req.finished_reason.message
    assert after == before


@pytest.mark.parametrize("component,layout", [("indexer", _dsa), ("draft_kv", _mha_with_draft),
                                              ("block_scale", _mxfp8_flat)],
                         ids=["dsa-indexer", "mha-draft", "mxfp8-scale"])
def test_foreign_bytes_in_a_component_are_committed_without_the_checksum(sgl, make_side, kvguard, component,
                                                                         layout):
    kvguard(KVGUARD_DISABLE="transfer_checksum")
    req, transferred, *_ = _decode_commit(sgl, make_side, 88011, layout(sgl), fault=_foreign_bytes(component))
    assert transferred == [req] and req.finished_reason is None


# ----------------------------------------------------------------------------- source hold


def _dsa_prefill_chunk(sgl, p, room, chunk_pages, state_pages):
    """A real ``TransferKVChunk`` as prefill's last chunk builds it for a DSA pool:
    its own KV pages, and the indexer state at the request's pages."""
    import numpy as np

    chunk = sgl.transfer_chunk(room, chunk_pages)
    kv_args = p.bootstrap_queue.kv_manager.kv_args
    if getattr(kv_args, "state_types", None) is not None:
        chunk.state_indices = [np.asarray(state_pages, dtype=np.int32) for _ in kv_args.state_types]
    else:
        chunk.state_indices = np.asarray(state_pages, dtype=np.int32)
    return chunk


def test_source_hold_pins_the_pages_the_indexer_state_reads(sgl, make_side, kvguard):
    import threading

    report = kvguard()
    assert {g.name: g.state for g in report.guards}["prefill_source_hold"] == "active"
    from sglang_kvguard.guards import prefill_source_hold as g

    with make_side("prefill", **_dsa(sgl)) as p:
        hold = g.bind_allocator(p.allocator, 300.0)
        manager = type("Manager", (), {})()
        manager.transfer_queues = [sgl_fast_queue()]
        manager.kv_args = p.bootstrap_queue.kv_manager.kv_args  # what upstream registered
        queue = g._proxy_for(manager, manager.transfer_queues[0])
        queue.consumer_wrapped = True
        a = p.allocator.alloc(8 * PAGE)  # the request's 8 pages
        rest = p.allocator.alloc(p.allocator.available_size())
        pages = sorted({int(t) // PAGE for t in a.tolist()})
        # the last chunk sends KV page 7 only, and the indexer rows of pages 0-7
        queue.put(_dsa_prefill_chunk(sgl, p, 88020, pages[-1:], pages))
        got, sending, next_chunk = [], threading.Event(), threading.Event()

        def worker():
            got.append(queue.get().room)
            sending.set()
            next_chunk.wait(10)
            got.append(queue.get())

        t = threading.Thread(target=worker, daemon=True)
        t.start()
        assert sending.wait(5)
        p.allocator.free(a)  # the request is aborted while its last chunk is sent
        assert p.allocator.alloc(PAGE) is None, "a page the indexer state is being read from was handed out"
        assert hold.held_tokens() == 8 * PAGE
        next_chunk.set()
        import time

        deadline = time.monotonic() + 5
        while not hold._releasable and time.monotonic() < deadline:
            time.sleep(0.01)
        assert g.release_drained(p.allocator) == 8
        queue.put(None)
        t.join(5)
        p.allocator.free(rest)


def sgl_fast_queue():
    from sglang.srt.disaggregation.common.utils import FastQueue

    return FastQueue()


# ----------------------------------------------------------------------------- start-up decision


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_dsa_pool_with_draft_is_covered_component_by_component(sgl, make_side, role):
    from sglang_kvguard.lifetime import transfer_components as tc
    from sglang_kvguard.guards import hybrid_pool_check as hpc

    with make_side(role, **_dsa_with_draft(sgl)) as side:
        kv_args, draft = hpc.transfer_kv_args(side.scheduler)
        comps = {c.name: c for c in tc.describe(kv_args, side.kv_pool, draft)}
        assert {"kv", "draft_kv", "aux"} <= set(comps), comps
        states = [n for n in comps if n.startswith("state:")]
        assert states and all(n in ("state:dsa", "state:nsa") for n in states), comps
        for c in comps.values():
            assert not c.gaps, (c.name, c.gaps)
        active = PREFILL_GUARDS if role == "prefill" else DECODE_GUARDS
        assert hpc.check_pools(role, side.allocator, side.req_to_token_pool, "refuse", active,
                               kv_args=kv_args, draft_pool=draft) == "ok"


# ----------------------------------------------------------------------------- generation tags


def test_freed_and_reused_indexer_page_is_caught_by_the_generation_check(sgl, make_side, kvguard):
    """A DSA page freed behind a live request's back goes to the next request, whose
    transfer writes its indexer row: the first request would run top-k selection over
    the other request's keys. The generation check names the page before the forward."""
    import torch

    kvguard()
    from sglang_kvguard.guards import page_generation as pg

    with make_side("decode", **_dsa(sgl)) as d:
        table = pg.bind(d.allocator, d.req_to_token_pool)

        def reserve(room, n=100):  # 2 pages of 64
            req = d.new_req(n, bootstrap_room=room)
            d.prealloc_queue.add(req)
            pre, failed = d.prealloc_queue.pop_preallocated()
            assert not failed and [x.req for x in pre] == [req]
            d.metadata_allocator.free(pre[0].metadata_buffer_index)
            r2t = d.req_to_token_pool.req_to_token[sgl.req_pool_idx(req)][:n]
            return req, [int(x) // PAGE for x in r2t[::PAGE].tolist()]

        a, a_pages = reserve(88030)
        _write(d, a_pages, seed=1)
        indexer = [g for g in _groups(d) if g.component == "indexer"][0].buffers[0]
        stolen = a_pages[-1]
        a_row = indexer[stolen].clone()
        d.allocator.free(torch.tensor([stolen * PAGE], dtype=torch.int64))  # the bug: a still uses it
        c, c_pages = reserve(88031)
        assert stolen in c_pages, "the freed page went to the next request"
        _write(d, c_pages, seed=2)  # c's transfer lands, indexer rows included
        assert not torch.equal(indexer[stolen], a_row), "a's indexer row now holds c's keys"
        assert table.mismatched([a, c]) == [0]


def test_decode_hold_pins_the_pages_the_indexer_state_is_written_at(sgl, make_side, kvguard, monkeypatch):
    """Decode's hold (0.5.10-0.5.20) pins, with the reserved pages, the pages the indexer
    state is written at: up to 0.5.22 the request's pages from 0, a decode radix-cache
    prefix included (shared pages a late write would otherwise reach after eviction)."""
    import numpy as np

    from sglang_kvguard.guards import decode_destination_hold as ddh

    report = kvguard()
    guard = {g.name: g for g in report.guards}["decode_destination_hold"]
    if guard.state != "active" or ddh.SEND_METADATA.key not in guard.patches:
        pytest.skip("decode's hold is upstream's on this release (decode_deferred_release, 0.5.21+)")
    from sglang_kvguard.lifetime.page_hold import HOLDS, bind_hold

    with make_side("decode", **_dsa(sgl)) as d:
        hold = bind_hold("decode", d.allocator)
        prefix = d.allocator.alloc(2 * PAGE)  # a cached prefix (another request's radix pages)
        req = d.new_req(PROMPT, bootstrap_room=88040)
        d.prealloc_queue.add(req)
        pre, failed = d.prealloc_queue.pop_preallocated()
        assert not failed
        receiver = pre[0].kv_receiver  # SGLang's real receiver of the configured backend
        r2t = d.req_to_token_pool.req_to_token[sgl.req_pool_idx(req)][:PROMPT]
        own = [int(x) // PAGE for x in r2t[::PAGE].tolist()]
        prefix_pages = sorted({int(t) // PAGE for t in prefix.tolist()})
        kv_args = d.prealloc_queue.kv_manager.kv_args
        state_pages = np.asarray(prefix_pages + own, dtype=np.int32)
        state = ([state_pages for _ in kv_args.state_types] if getattr(kv_args, "state_types", None) is not None
                 else state_pages)
        monkeypatch.setattr(receiver, "bootstrap_room", 88040, raising=False)
        monkeypatch.setattr(receiver, "bootstrap_infos", [{"rank_ip": "127.0.0.1", "rank_port": 1}], raising=False)
        monkeypatch.setattr(receiver, "kv_mgr", d.prealloc_queue.kv_manager, raising=False)
        sent = []
        ddh._send_metadata(lambda self, *a, **k: sent.append(a))(receiver, np.asarray(own, dtype=np.int32), 0,
                                                                 state)
        assert sent, "upstream's send_metadata did not run"
        for p in prefix_pages + own:
            assert hold.pinned(p), f"page {p} the indexer state is written at is not held"
        d.allocator.free(prefix)  # the radix cache evicts the prefix while the transfer may still write it
        assert hold.held_tokens() == len(prefix_pages) * PAGE, "the evicted prefix went back to the free list"
        ddh._unpin(ddh._rooms.pop(88040), hold)  # the room drained
        HOLDS.pop("decode", None)
