"""page_generation on SGLang's real decode allocator, request pool and prealloc queue.

The bug class: a page that a live decode request still uses is freed behind its back
(upstream's early-release paths, docs/design/page-lifetime.md D1-D5) and handed to
the next request. kvguard bumps the page's generation at the allocator's real free
sink, records generations when ``DecodePreallocQueue._pre_alloc`` reserves a row, and
checks a batch's records in one kernel before the decode forward.

The batch here is a plain container of real ``Req`` objects (the scheduler's
``update_running_batch`` and ``ScheduleBatch`` run in the server tier,
tests/server/test_page_generation_faults.py); everything that frees, allocates or
records is SGLang's own code.
"""

from __future__ import annotations

import os

import pytest

os.environ["KVGUARD_AUTO_INSTALL"] = "0"

pytestmark = pytest.mark.component

PROMPT = 40  # 3 pages of 16


class _Batch:
    def __init__(self, reqs):
        self.reqs = list(reqs)
        self.kept = None

    def filter_batch(self, keep_indices=None, **_):
        self.kept = keep_indices
        self.reqs = [self.reqs[i] for i in keep_indices]


def _reserve(d, n, room0):
    reqs = [d.new_req(PROMPT, bootstrap_room=room0 + i) for i in range(n)]
    for r in reqs:
        d.prealloc_queue.add(r)
    pre, failed = d.prealloc_queue.pop_preallocated()
    assert not failed and [x.req for x in pre] == reqs
    for x in pre:  # the transfer landed: the metadata slot goes back (what a commit does)
        d.metadata_allocator.free(x.metadata_buffer_index)
        x.req.metadata_buffer_index = -1
    return reqs


class _Overlay:
    """The scheduler's server args with some fields switched (0.5.2x's ServerArgs is frozen)."""

    def __init__(self, inner, **fields):
        self.__dict__.update(fields, _inner=inner)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _reserve_ids(d, room, ids):
    req = d.new_req(len(ids), bootstrap_room=room, input_ids=ids)
    d.prealloc_queue.add(req)
    pre, failed = d.prealloc_queue.pop_preallocated()
    assert not failed and [x.req for x in pre] == [req]
    d.metadata_allocator.free(pre[0].metadata_buffer_index)  # the transfer landed
    return [req]


def _pages(sgl, d, req):
    row = d.req_to_token_pool.req_to_token[sgl.req_pool_idx(req)][:PROMPT]
    return [int(t) // d.page_size for t in row[::d.page_size].tolist()]


def _free_behind_its_back(d, page):
    import torch

    d.allocator.free(torch.tensor([page * d.page_size], dtype=torch.int64))


def test_reused_page_is_caught_and_only_owned_pages_are_freed(sgl, make_side, kvguard):
    from sglang_kvguard.guards import page_generation as pg

    with make_side("decode") as d:
        table = pg.bind(d.allocator, d.req_to_token_pool)
        aborts = []
        d.scheduler.send_abort_output = lambda obj, req: aborts.append((obj, req))
        before = sgl.snapshot(d)
        a, b = _reserve(d, 2, 81000)
        assert int(table.rec_len[sgl.req_pool_idx(a)]) == 3  # recorded at _pre_alloc
        assert table.mismatched([a, b]) == []

        stolen = _pages(sgl, d, a)[-1]
        _free_behind_its_back(d, stolen)  # the bug: a still uses it
        (c,) = _reserve(d, 1, 81010)
        assert stolen in _pages(sgl, d, c), "the freed page went to the next request"
        assert table.mismatched([a, b, c]) == [0]

        batch = _Batch([a, b, c])
        pg.fail_mismatched(d.scheduler, batch, [0], table)
        assert batch.reqs == [b, c]
        reason = a.finished_reason
        assert type(reason).__name__ == "FINISH_ABORT" and reason.status_code == 500
        assert f"page {stolen}" in reason.message
        assert [r for _, r in aborts] == [a] and aborts[0][0].rid == a.rid
        assert aborts[0][0].finished_reason["status_code"] == 500
        # a's row and its two pages are free again; the stolen page stayed with c
        assert stolen in _pages(sgl, d, c) and table.mismatched([b, c]) == []
        for r in (b, c):
            sgl.release_req_kv(r, d.tree_cache)
        assert sgl.snapshot(d) == before, "every page back exactly once, no double free"


def test_without_the_guard_the_page_is_freed_twice(sgl, make_side):
    """The harness sees the bug: unguarded, the request that lost its page frees it
    again when it ends, and the pool counts a page it does not have (double free)."""
    with make_side("decode") as d:
        before = sgl.snapshot(d)
        a, b = _reserve(d, 2, 82000)
        stolen = _pages(sgl, d, a)[-1]
        _free_behind_its_back(d, stolen)
        (c,) = _reserve(d, 1, 82010)
        assert stolen in _pages(sgl, d, c)
        for r in (a, b, c):
            sgl.release_req_kv(r, d.tree_cache)
        after = sgl.snapshot(d)
        assert after["free_pages"] == before["free_pages"] + 1, (before, after)


def test_decode_growth_and_row_reuse_are_not_mismatches(sgl, make_side, kvguard):
    import torch

    from sglang_kvguard.guards import page_generation as pg

    with make_side("decode") as d:
        table = pg.bind(d.allocator, d.req_to_token_pool)
        a, b = _reserve(d, 2, 83000)
        ps = d.page_size
        # a decode step crosses a page boundary: a new page from the real allocator
        row = sgl.req_pool_idx(a)
        loc = d.allocator.alloc(ps)
        d.req_to_token_pool.req_to_token[row, 48:48 + ps] = loc.to(torch.int32)
        table.extend([a, b], torch.tensor([49, PROMPT]))
        assert int(table.rec_len[row]) == 4
        assert table.mismatched([a, b]) == []
        # a ends, its row and pages go to a request kvguard never recorded
        d.allocator.free(loc)
        sgl.release_req_kv(a, d.tree_cache)
        (c,) = _reserve(d, 1, 83010)
        del c._kvguard_generation_row  # as if reserved by a path kvguard does not wrap
        first_seen = table.stats["first_seen"]
        assert table.mismatched([b, c]) == []
        assert table.stats["first_seen"] == first_seen + 1


def test_a_step_without_page_crossings_skips_the_record_and_a_crossing_row_is_guarded(sgl, make_side, kvguard):
    """GenerationTable.extend on CPU skips the kernel on a step where no row grew into a
    new page, but not on a step where one of them did: the page a row grew into is
    recorded, so its free behind the request's back is caught at the next check."""
    import torch

    from sglang_kvguard.guards import page_generation as pg

    with make_side("decode") as d:
        table = pg.bind(d.allocator, d.req_to_token_pool)
        a, b = _reserve(d, 2, 83100)
        ra, rb = sgl.req_pool_idx(a), sgl.req_pool_idx(b)
        ps = d.page_size
        assert (int(table.rec_len[ra]), int(table.rec_len[rb])) == (3, 3)
        skipped = table.stats["extend_skipped"]
        table.extend([a, b], torch.tensor([PROMPT + 1, PROMPT + 1]))  # both still inside page 3
        assert table.stats["extend_skipped"] == skipped + 1
        assert (int(table.rec_len[ra]), int(table.rec_len[rb])) == (3, 3)
        loc = d.allocator.alloc(ps)  # b's step crosses into a fourth page, a's does not
        d.req_to_token_pool.req_to_token[rb, 48:48 + ps] = loc.to(torch.int32)
        table.extend([a, b], torch.tensor([PROMPT + 2, 49]))
        assert table.stats["extend_skipped"] == skipped + 1
        assert (int(table.rec_len[ra]), int(table.rec_len[rb])) == (3, 4)
        assert table.mismatched([a, b]) == []
        d.allocator.free(loc)  # b's new page freed behind its back and handed out again
        assert d.allocator.alloc(ps) is not None
        assert table.mismatched([a, b]) == [1]


def test_free_sink_bumps_every_freed_page_once_per_free(sgl, make_side, kvguard):
    import torch

    from sglang_kvguard.guards import page_generation as pg

    with make_side("decode") as d:
        table = pg.bind(d.allocator, d.req_to_token_pool)
        ps = d.page_size
        loc = d.allocator.alloc(3 * ps)
        pages = sorted({int(t) // ps for t in loc.tolist()})
        g0 = table.gens[pages].clone()
        d.allocator.free(loc)  # through the release's real sink (free or _release_page_ids)
        assert bool((table.gens[pages] != g0).all())
        other = [p for p in range(1, table.gens.numel() - 1) if p not in pages][:4]
        assert int(table.gens[other].abs().sum()) == 0, "pages not freed keep their generation"
        # a free inside a free group is tagged when the group really frees
        loc = d.allocator.alloc(3 * ps)
        grouped = sorted({int(t) // ps for t in loc.tolist()})
        g1 = table.gens[grouped].clone()
        d.allocator.free_group_begin()
        d.allocator.free(loc)
        assert torch.equal(table.gens[grouped], g1), "not freed yet: the group is still open"
        d.allocator.free_group_end()
        assert bool((table.gens[grouped] != g1).all())


def test_a_failed_request_gives_back_its_lock_on_a_shared_radix_prefix(sgl, make_side, kvguard):
    """Decode's radix cache on (--disaggregation-decode-enable-radix-cache): a request
    reserved over a cached prefix locks the prefix's tree node (upstream's
    ``_match_prefix_and_lock``). When the request fails closed, its own pages are freed,
    the shared prefix pages stay in the cache, and the lock goes back: the prefix is
    evictable again and the tree protects nothing."""
    from sglang.srt.disaggregation.decode import DecodePreallocQueue
    from sglang.srt.mem_cache.common import release_kv_cache

    from sglang_kvguard.guards import page_generation as pg

    if not hasattr(DecodePreallocQueue, "_match_prefix_and_lock"):
        pytest.skip("no decode radix cache in this release")
    import inspect

    with make_side("decode", decode_radix_cache=True,
                   config={"disaggregation_decode_enable_radix_cache": True}) as d:
        # the prealloc queue reads the switch from the scheduler's server args (up to
        # 0.5.2x; later from the published configuration, set above)
        d.scheduler.server_args = _Overlay(d.scheduler.server_args, disaggregation_decode_enable_radix_cache=True)
        table = pg.bind(d.allocator, d.req_to_token_pool)
        d.scheduler.send_abort_output = lambda obj, req: None
        ids = list(range(100, 100 + 64))  # 4 full pages
        (a0,) = _reserve_ids(d, 84000, ids)
        a0.output_ids = a0.origin_input_ids[:0]
        a0.skip_radix_cache_insert = False
        kw = {"checkpoint": True} if "checkpoint" in inspect.signature(release_kv_cache).parameters else {}
        release_kv_cache(a0, d.tree_cache, **kw)  # the prefix goes into the tree
        cached = d.tree_cache.evictable_size()
        assert cached >= 48, cached
        before = sgl.snapshot(d)

        (a,) = _reserve_ids(d, 84001, ids + list(range(500, 532)))
        assert d.tree_cache.protected_size() > 0, "upstream did not lock the shared prefix"
        row = d.req_to_token_pool.req_to_token[sgl.req_pool_idx(a)][:96]
        pages = [int(t) // d.page_size for t in row[::d.page_size].tolist()]
        stolen = pages[-1]
        _free_behind_its_back(d, stolen)
        assert table.mismatched([a]) == [0]
        pg.fail_mismatched(d.scheduler, _Batch([a]), [0], table)
        after = sgl.snapshot(d)
        assert after["protected"] == 0, "the failed request still locks the shared prefix"
        assert after["evictable"] == before["evictable"], "the shared prefix left the cache"
        assert after == before, (before, after)


def test_a_step_without_frees_skips_the_kernel_but_a_row_checked_before_a_free_is_checked_again(sgl, make_side,
                                                                                              kvguard):
    """The epoch skip: a batch whose rows were all verified since the last free skips the
    kernel; a free between two checks makes every row count again, including a row that
    was not in the batch checked in between (the per-row epoch, not a global 'clean')."""
    from sglang_kvguard.guards import page_generation as pg

    with make_side("decode") as d:
        table = pg.bind(d.allocator, d.req_to_token_pool)
        d.scheduler.send_abort_output = lambda obj, req: None
        a, b = _reserve(d, 2, 83000)
        assert table.mismatched([a, b]) == []
        checked = table.stats["checked"]
        assert table.mismatched([a, b]) == [] and table.mismatched([b]) == []  # no free since: skipped
        assert table.stats["checked"] == checked and table.stats["skipped"] >= 3

        stolen = _pages(sgl, d, a)[-1]
        _free_behind_its_back(d, stolen)  # a is not in the next batch
        assert table.mismatched([b]) == []  # b is checked (an epoch passed) and clean
        (c,) = _reserve(d, 1, 83010)  # takes the stolen page; no further free
        assert stolen in _pages(sgl, d, c)
        assert table.mismatched([a, b, c]) == [0], "a was verified before the free: it must be checked again"
        assert table.mismatched([a]) == [0], "a mismatch is never remembered as clean"
        pg.fail_mismatched(d.scheduler, _Batch([a, b, c]), [0], table)
        for r in (b, c):
            sgl.release_req_kv(r, d.tree_cache)
