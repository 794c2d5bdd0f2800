"""prefill_source_hold on SGLang's real allocator, transfer queue and chunk type.

The prefill scheduler frees a request's KV while the Mooncake transfer worker may still
be reading it (design: docs/design/page-lifetime.md, P1). Here the real
``PagedTokenToKVPoolAllocator`` of a prefill side, SGLang's own ``FastQueue`` and
``TransferKVChunk`` are used; kvguard wraps the queue the way its
``transfer_worker`` wrapper does, and the test thread plays the transfer worker
(``get()`` the chunk, read the pages, ``get()`` the next one).

* unguarded: pages freed while their chunk is in flight are handed to the next
  allocation at once (the hazard);
* guarded: the free is diverted, the pages stay out of the free list (and out of
  the next allocation) until the worker has moved past the chunk, then come back on
  the scheduler thread; futures left running by the worker hold them too; a page
  held past the bound is quarantined, never freed blind, and released when its
  transfer finally drains; the leak checker's session-held term includes them.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading

import pytest

os.environ["KVGUARD_AUTO_INSTALL"] = "0"

pytestmark = pytest.mark.component

transfer_chunk = pytest.importorskip("_sglang_components").transfer_chunk  # needs torch + SGLang

PAGE = 16


def _fast_queue():
    from sglang.srt.disaggregation.common.utils import FastQueue

    return FastQueue()


@pytest.fixture
def guarded():
    import sglang_kvguard

    report = sglang_kvguard.install()
    states = {g.name: g.state for g in report.guards}
    assert states["prefill_source_hold"] == "active", report.as_dict()
    try:
        yield report
    finally:
        sglang_kvguard.uninstall()
        from sglang_kvguard.lifetime.page_hold import HOLDS

        HOLDS.clear()


def _pages(tokens):
    return sorted({int(t) // PAGE for t in tokens.tolist()})


def _setup(side, quarantine_after=300.0):
    from sglang_kvguard.guards import prefill_source_hold as g

    hold = g.bind_allocator(side.allocator, quarantine_after)
    manager = type("Manager", (), {})()
    manager.transfer_queues = [_fast_queue()]
    queue = g._proxy_for(manager, manager.transfer_queues[0])
    assert isinstance(queue, g._PinningQueue)
    queue.consumer_wrapped = True  # what the transfer_worker wrapper does
    return g, hold, queue


def test_unguarded_pages_in_flight_are_reused_at_once(make_side):
    with make_side("prefill", num_tokens=256) as p:
        a = p.allocator.alloc(4 * PAGE)
        rest = p.allocator.alloc(p.allocator.available_size())  # fill the pool
        assert p.allocator.available_size() == 0
        # a's chunk is queued/in flight; the scheduler frees a (abort, Failed poll)
        p.allocator.free(a)
        b = p.allocator.alloc(4 * PAGE)
        assert _pages(b) == _pages(a)  # the next request writes the pages being sent
        p.allocator.free(b)
        p.allocator.free(rest)


def test_guarded_pages_in_flight_are_held_until_the_worker_moves_on(make_side, guarded):
    with make_side("prefill", num_tokens=256) as p:
        g, hold, queue = _setup(p)
        total = p.allocator.available_size()
        a = p.allocator.alloc(4 * PAGE)
        rest = p.allocator.alloc(p.allocator.available_size())
        queue.put(transfer_chunk(7001, _pages(a)))
        got, sending, next_chunk = [], threading.Event(), threading.Event()

        def worker():  # one transfer worker thread per queue, as in SGLang
            got.append(queue.get().room)  # sending 7001 ...
            sending.set()
            next_chunk.wait(10)
            got.append(queue.get())  # ... done: asks for its next chunk

        t = threading.Thread(target=worker, daemon=True)
        t.start()
        assert sending.wait(5) and got == [7001]

        p.allocator.free(a)  # the scheduler releases the aborted request
        assert p.allocator.available_size() == 0
        assert p.allocator.alloc(PAGE) is None  # nothing to hand out: no reuse
        assert hold.held_tokens() == 4 * PAGE
        assert g.total_held_tokens() == 4 * PAGE  # what the leak checker adds

        next_chunk.set()
        import time

        deadline = time.monotonic() + 5
        while not hold._releasable and time.monotonic() < deadline:
            time.sleep(0.01)
        assert p.allocator.available_size() == 0  # still held until the scheduler thread runs
        assert g.release_drained(p.allocator) == 4
        assert p.allocator.available_size() == 4 * PAGE
        assert hold.held_tokens() == 0
        queue.put(None)  # wake the worker thread (0.5.23's teardown sentinel)
        t.join(5)
        assert got == [7001, None]
        p.allocator.free(rest)
        p.allocator.free(p.allocator.alloc(4 * PAGE))
        assert p.allocator.available_size() == total


def _all_rows(md):
    return [md.alloc() for _ in range(md.available_size())]


def test_unguarded_metadata_row_in_flight_is_reused_at_once(make_side):
    """The worker sends a room's aux data (first token, logprobs, hidden states) from
    prefill's metadata row with its last chunk; the scheduler may free the row first."""
    with make_side("prefill", num_tokens=256) as p:
        md = p.metadata_allocator
        rows = _all_rows(md)
        md.free(rows[3])  # aborted while its last chunk is queued
        assert md.alloc() == rows[3]  # the next request writes its metadata there
        for r in rows:
            md.free(r)


def test_guarded_metadata_row_of_a_last_chunk_is_held_until_the_worker_moves_on(make_side, guarded):
    from sglang_kvguard.lifetime.page_hold import ROWS

    with make_side("prefill", num_tokens=256) as p:
        g, hold, queue = _setup(p)
        md = p.metadata_allocator
        rows = _all_rows(md)
        row = rows[3]
        a = p.allocator.alloc(2 * PAGE)
        queue.put(transfer_chunk(7010, _pages(a), aux_index=row))
        md.free(row)  # freed while queued: held
        assert md.available_size() == 0 and ROWS.held() == 1
        assert queue.get().room == 7010  # the worker sends it, aux row included
        assert md.alloc() is None  # nothing to hand out: no reuse
        queue.finish_current()  # the worker moved on
        assert md.available_size() == 0  # released on the scheduler thread only
        p.bootstrap_queue.pop_bootstrapped()  # the prefill scheduler's loop (kvguard flushes there)
        assert md.available_size() == 1 and ROWS.held() == 0
        assert md.alloc() == row
        # a chunk that is not its room's last carries no aux data: its row is not pinned
        queue.put(_not_last(transfer_chunk(7011, _pages(a), aux_index=row)))
        md.free(row)
        assert md.available_size() == 1
        assert queue.get().room == 7011
        queue.finish_current()
        g.release_drained(p.allocator)
        for r in rows:
            if r != row:
                md.free(r)
        p.allocator.free(a)


def _not_last(chunk):
    import dataclasses

    return dataclasses.replace(chunk, is_last_chunk=False)


def test_unpinned_frees_pass_straight_through(make_side, guarded):
    with make_side("prefill", num_tokens=256) as p:
        g, hold, queue = _setup(p)
        a = p.allocator.alloc(2 * PAGE)
        b = p.allocator.alloc(2 * PAGE)
        queue.put(transfer_chunk(7002, _pages(a)))
        before = p.allocator.available_size()
        p.allocator.free(b)  # b is not being sent
        assert p.allocator.available_size() == before + 2 * PAGE
        p.allocator.free(a)  # a is queued (not yet dequeued): held
        assert p.allocator.available_size() == before + 2 * PAGE
        assert queue.get().room == 7002
        queue.finish_current()
        g.release_drained(p.allocator)
        assert p.allocator.available_size() == before + 4 * PAGE


def test_a_free_touching_a_pinned_page_anywhere_holds_exactly_that_page(make_side, guarded):
    """The busy free's fast path (pages touched, repeats allowed, against the pins) must
    see a pinned page whatever the order of the freed tokens: here its tokens are
    scattered between other pages' tokens and never come first in a page-sized stride."""
    import torch

    with make_side("prefill", num_tokens=256) as p:
        g, hold, queue = _setup(p)
        a = p.allocator.alloc(4 * PAGE)
        pages = _pages(a)
        pinned = pages[2]
        queue.put(transfer_chunk(7003, [pinned]))
        toks = a.tolist()
        mine = [t for t in toks if t // PAGE == pinned]
        rest = [t for t in toks if t // PAGE != pinned]
        order = []
        for i, t in enumerate(rest):  # one pinned token after every third other token
            order.append(t)
            if i % 3 == 2 and mine:
                order.append(mine.pop())
        order = [rest[0]] + order[1:] + mine
        assert sorted(order) == sorted(toks) and order[0] // PAGE != pinned
        before = p.allocator.available_size()
        p.allocator.free(torch.tensor(order, dtype=a.dtype))
        assert p.allocator.available_size() == before + 3 * PAGE  # every page but the pinned one
        assert hold.held_pages() == 1
        assert queue.get().room == 7003
        queue.finish_current()
        g.release_drained(p.allocator)
        assert p.allocator.available_size() == before + 4 * PAGE
        assert hold.held_pages() == 0


def test_running_futures_hold_the_pages(make_side, guarded):
    """0.5.10-0.5.18: after a failed layer the worker cancels and returns early, leaving
    running transfer futures that still read the pages."""
    with make_side("prefill", num_tokens=256) as p:
        g, hold, queue = _setup(p)
        pool = concurrent.futures.ThreadPoolExecutor(2)
        executor = g._TrackingExecutor(pool, queue)
        release = threading.Event()
        a = p.allocator.alloc(3 * PAGE)
        base = p.allocator.available_size()
        queue.put(transfer_chunk(7003, _pages(a)))
        queue.get()
        fut = executor.submit(release.wait, 10)
        queue.finish_current()  # the worker moved on; the future still reads
        p.allocator.free(a)
        g.release_drained(p.allocator)
        assert p.allocator.available_size() == base
        release.set()
        fut.result(5)
        g.release_drained(p.allocator)
        assert p.allocator.available_size() == base + 3 * PAGE
        pool.shutdown()


def test_a_transfer_that_never_drains_is_quarantined_not_freed(make_side, guarded):
    import time

    with make_side("prefill", num_tokens=256) as p:
        g, hold, queue = _setup(p, quarantine_after=0.05)
        a = p.allocator.alloc(2 * PAGE)
        base = p.allocator.available_size()
        queue.put(transfer_chunk(7004, _pages(a)))
        queue.get()  # stuck inside the transfer (peer frozen)
        p.allocator.free(a)
        time.sleep(0.1)
        assert sorted(hold.sweep()) == _pages(a)
        assert hold.quarantined_pages() == 2
        g.release_drained(p.allocator)
        assert p.allocator.available_size() == base  # never freed blind
        queue.finish_current()  # the transfer finally returns (timeout or success)
        assert g.release_drained(p.allocator) == 2
        assert p.allocator.available_size() == base + 2 * PAGE
        assert hold.quarantined_pages() == 0
        assert hold.snapshot()["released_from_quarantine"] == 2


def test_queues_wrapped_before_the_allocator_is_bound_pin_once_a_worker_consumes(make_side, guarded):
    """SGLang builds the KV manager, and starts its workers, inside Scheduler.__init__,
    before kvguard binds the allocator. A queue whose consumer is not kvguard's wrapped
    worker must never pin (nothing would unpin)."""
    from sglang_kvguard.guards import prefill_source_hold as g
    from sglang_kvguard.lifetime.page_hold import HOLDS

    HOLDS.clear()
    manager = type("Manager", (), {})()
    manager.transfer_queues = [_fast_queue()]
    raw = manager.transfer_queues[0]
    queue = g._proxy_for(manager, raw)  # worker start: no hold bound yet
    assert isinstance(queue, g._PinningQueue) and manager.transfer_queues[0] is queue
    assert g._proxy_for(manager, raw) is queue  # one proxy per queue
    queue.put(transfer_chunk(7005, [1, 2]))  # no worker of ours consumes it: no pin
    assert HOLDS["prefill"].snapshot()["pinned"] == 0
    assert queue.get().room == 7005
    with make_side("prefill", num_tokens=256) as p:
        hold = g.bind_allocator(p.allocator)  # end of Scheduler.__init__
        assert hold is HOLDS["prefill"]
        queue.consumer_wrapped = True
        a = p.allocator.alloc(PAGE)
        queue.put(transfer_chunk(7006, _pages(a)))
        assert hold.snapshot()["pinned"] == 1
        queue.get()
        queue.finish_current()
        assert hold.snapshot()["pinned"] == 0
        p.allocator.free(a)


def test_a_failed_allocation_waits_for_held_pages_to_drain(make_side, guarded):
    """The scheduler budgets with free + evictable pages; a page evicted while a
    transfer reads it is held, so the allocation right after can come up short (on
    0.5.23 with aborts during transfers this became a fatal "Prefill out of memory").
    A failed allocation waits, bounded, for held pages to drain and retries."""
    with make_side("prefill", num_tokens=256) as p:
        g, hold, queue = _setup(p)
        a = p.allocator.alloc(4 * PAGE)
        rest = p.allocator.alloc(p.allocator.available_size())
        queue.put(transfer_chunk(7005, _pages(a)))
        sending, drain = threading.Event(), threading.Event()

        def worker():  # SGLang's transfer worker thread
            assert queue.get().room == 7005
            sending.set()
            drain.wait(10)
            queue.finish_current()  # the chunk is done

        t = threading.Thread(target=worker, daemon=True)
        t.start()
        assert sending.wait(5)
        p.allocator.free(a)  # evicted / aborted while being sent: held
        assert hold.held_pages() == 4
        timer = threading.Timer(0.2, drain.set)  # the transfer drains 0.2 s later
        timer.start()
        import time

        t0 = time.monotonic()
        b = p.allocator.alloc(4 * PAGE)
        waited = time.monotonic() - t0
        timer.join()
        t.join(5)
        assert b is not None and _pages(b) == _pages(a), "the allocation should succeed once the pages drained"
        assert 0.15 <= waited < g.ALLOC_WAIT, waited
        assert hold.held_pages() == 0
        p.allocator.free(b)
        p.allocator.free(rest)


def test_a_failed_allocation_waits_for_a_failed_sends_peer_to_be_confirmed_gone(make_side, guarded, monkeypatch):
    """Chaos soak on 0.5.10 (session 17): decode was killed during a send that filled
    the 16-page prefill pool; the send failed, so its pages stay held until
    peer_liveness confirms the peer gone (two refused connects an interval apart), but
    the next allocation gave up after ALLOC_WAIT and upstream's "Prefill out of memory"
    killed the prefill scheduler. While a failed send waits for its peer's verdict, an
    allocation waits long enough for it (here: probes 0.3 s apart, ALLOC_WAIT 0.2 s)."""
    import time

    from sglang_kvguard.lifetime import peer_liveness, transfer_drain

    monkeypatch.setattr(peer_liveness, "WATCH",
                        peer_liveness.PeerWatch(interval=0.3, confirm=2, probe=lambda peer: peer_liveness.REFUSED))
    with make_side("prefill", num_tokens=256) as p:
        g, hold, queue = _setup(p)
        monkeypatch.setattr(g, "ALLOC_WAIT", 0.2)
        try:
            a = p.allocator.alloc(4 * PAGE)
            rest = p.allocator.alloc(p.allocator.available_size())
            queue.put(transfer_chunk(7015, _pages(a)))
            assert queue.get().room == 7015  # the transfer worker sends it ...
            g.current_chunk().failed("127.0.0.1:1", "ret=-1")  # ... to a peer that was killed
            queue.finish_current()
            p.allocator.free(a)  # the request fails and is released: its pages are held
            assert hold.held_pages() == 4 and peer_liveness.watch().watched() == 1
            assert 1.5 <= g.alloc_wait() <= 2.0  # 0.3 s x (2 + 1) + 1 s
            t0 = time.monotonic()
            b = p.allocator.alloc(4 * PAGE)
            waited = time.monotonic() - t0
            assert b is not None, "the allocation gave up before the dead peer was confirmed"
            assert _pages(b) == _pages(a) and 0.3 <= waited < 1.9, waited
            assert hold.held_pages() == 0 and peer_liveness.watch().watched() == 0
            p.allocator.free(b)
            p.allocator.free(rest)
        finally:
            transfer_drain.reset()


def test_admission_never_budgets_the_pages_of_a_failed_send(make_side, guarded, monkeypatch):
    """Issue 18: a send failed to a peer that stays up, so its pages stay pinned until the
    peer is confirmed gone (never, here); the failed request was released into the radix
    cache, where upstream counts them as evictable. Upstream's admission budget
    (``available_size() + evictable_size()``, PrefillAdder / PrefillBudget) admitted a
    request on them, upstream's eviction only moved them to kvguard's hold, and the
    allocation that followed failed: "Prefill out of memory". Guarded, the budget is the
    capacity eviction can really free, a request of the whole budget is allocated after
    upstream's own eviction, and the leak checker's invariant holds at every step."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.common import evict_from_tree_cache
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from sglang_kvguard.lifetime import peer_liveness, transfer_drain

    monkeypatch.setattr(peer_liveness, "WATCH", peer_liveness.PeerWatch(interval=0))  # never confirmed gone
    with make_side("prefill", num_tokens=256) as p:
        g, hold, queue = _setup(p)
        monkeypatch.setattr(g, "ALLOC_WAIT", 0.2)
        alloc, tree = p.allocator, p.tree_cache
        total = alloc.available_size()

        def leak_check(in_use):  # upstream's idle invariant, with kvguard's session-held term
            assert alloc.available_size() + tree.evictable_size() + g.total_held_tokens() == total - in_use

        try:
            a = alloc.alloc(4 * PAGE)
            queue.put(transfer_chunk(7021, _pages(a)))
            assert queue.get().room == 7021
            g.current_chunk().failed("127.0.0.1:1", "ret=-1")  # the batch failed; the peer is alive
            queue.finish_current()
            # the failed request is released: upstream's cache_finished_req puts its pages in the cache
            tree.insert(InsertParams(key=RadixKey(list(range(1000, 1000 + 4 * PAGE))), value=a))
            assert tree.evictable_size() == 4 * PAGE
            leak_check(0)
            budget = alloc.available_size() + tree.evictable_size()
            assert budget == total - 4 * PAGE, "admission counts the failed send's pages as capacity"
            evict_from_tree_cache(tree, budget)  # what the scheduler does before it allocates the batch
            b = alloc.alloc(budget)
            assert b is not None, "a request admitted within the budget found no pages after eviction"
            assert hold.held_pages() == 4 and not set(_pages(b)) & set(_pages(a))
            leak_check(budget)
            assert g.real_available(alloc) == alloc.available_size() == 0
            alloc.free(b)
            leak_check(0)
        finally:
            hold.unstick(_pages(a))
            hold.unpin(_pages(a))
            g.release_drained(alloc)
            transfer_drain.reset()
        assert alloc.available_size() == total


def test_a_failed_allocation_without_held_pages_fails_at_once(make_side, guarded):
    import time

    with make_side("prefill", num_tokens=256) as p:
        _setup(p)
        rest = p.allocator.alloc(p.allocator.available_size())
        t0 = time.monotonic()
        assert p.allocator.alloc(PAGE) is None
        assert time.monotonic() - t0 < 0.1
        p.allocator.free(rest)


def test_alloc_extend_never_runs_its_kernel_over_a_short_free_list(make_side, guarded, monkeypatch):
    """Up to 0.5.22 upstream's paged ``alloc_extend`` launches its kernel over the free
    list and checks the list's length afterwards; short by k pages, the kernel reads k
    entries past the end (the chaos soak on 0.5.10: a segmentation fault in Triton's
    interpreter killed the prefill scheduler). kvguard's hold makes the list short while
    the scheduler budgets the held pages, so kvguard checks before upstream runs. The
    kernel (and 0.5.23's torch path) is watched here: it must never start short."""
    import inspect
    import sys
    import time

    import torch

    with make_side("prefill", num_tokens=256) as p:
        g, hold, queue = _setup(p)
        alloc = p.allocator
        mod = sys.modules[inspect.getmodule(type(alloc)).__name__]
        short_reads, runs = [], []

        def watch(name, real):
            def check(n_pages):
                runs.append(name)
                if n_pages > len(alloc.free_pages):
                    short_reads.append((name, n_pages, len(alloc.free_pages)))
                    raise AssertionError(f"{name} started over a free list of {len(alloc.free_pages)} pages "
                                         f"for {n_pages}")

            if name == "alloc_extend_kernel":
                class Launch:
                    def __getitem__(self, grid):
                        def go(*args, **kwargs):
                            check(NEED)
                            return real[grid](*args, **kwargs)
                        return go
                return Launch()

            def naive(*args, **kwargs):
                check(NEED)
                return real(*args, **kwargs)
            return naive

        for name in ("alloc_extend_kernel", "alloc_extend_naive"):
            if hasattr(mod, name):
                monkeypatch.setattr(mod, name, watch(name, getattr(mod, name)))
        NEED = 4
        a = alloc.alloc(NEED * PAGE)
        rest = alloc.alloc(alloc.available_size())
        queue.put(transfer_chunk(7007, _pages(a)))
        sending, drain = threading.Event(), threading.Event()

        def worker():
            assert queue.get().room == 7007
            sending.set()
            drain.wait(10)
            queue.finish_current()

        t = threading.Thread(target=worker, daemon=True)
        t.start()
        assert sending.wait(5)
        alloc.free(a)  # evicted while being sent: held, off the free list
        assert hold.held_pages() == NEED and len(alloc.free_pages) == 0
        timer = threading.Timer(0.2, drain.set)
        timer.start()
        z = torch.zeros(1, dtype=torch.int64)
        n = torch.tensor([NEED * PAGE], dtype=torch.int64)
        t0 = time.monotonic()
        out = alloc.alloc_extend(prefix_lens=z.clone(), prefix_lens_cpu=z.clone(), seq_lens=n.clone(),
                                 seq_lens_cpu=n.clone(), last_loc=torch.tensor([-1], dtype=torch.int64),
                                 extend_num_tokens=NEED * PAGE)
        waited = time.monotonic() - t0
        timer.join()
        t.join(5)
        assert not short_reads, short_reads
        assert out is not None and _pages(out) == _pages(a), out
        assert runs, "the allocation never ran upstream's allocation path"
        assert 0.15 <= waited < g.ALLOC_WAIT, waited
        alloc.free(out)
        alloc.free(rest)


def _worker_that_will_fail():
    """SGLang's real ``MooncakeKVManager`` (built without ``__init__``) with what its
    ``transfer_worker`` reads, and an item on its queue that is not a chunk: upstream's
    loop fails on it."""
    import threading

    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    kv = MooncakeKVManager.__new__(MooncakeKVManager)
    kv.__dict__.update(transfer_queues=[_fast_queue()], transfer_infos={}, bootstrap_port=8998, _stopped=False,
                       enable_staging=False, attn_tp_rank=0, pp_size=1, attn_cp_size=1, pp_rank=0, attn_cp_rank=0,
                       session_lock=threading.Lock(), failed_sessions=set(), enable_trace=False)
    kv.transfer_queues[0].put(object())
    return kv


def test_a_dead_transfer_worker_stops_the_server_instead_of_leaving_it_hanging(guarded, monkeypatch):
    """SGLang's real ``MooncakeKVManager.transfer_worker`` (built without ``__init__``)
    ends on any exception ("Transfer thread failed ... Prefill instance ... is dead"),
    but only its thread dies: the server keeps admitting requests whose KV is never
    sent. Guarded, the server is stopped the way SGLang stops it when its scheduler
    fails (here the stop is recorded instead of sent)."""
    import threading

    from sglang_kvguard.guards import prefill_source_hold as g

    stops = []
    monkeypatch.setattr(g, "STOP_SERVER", lambda: stops.append(threading.current_thread().name))
    kv = _worker_that_will_fail()  # not a chunk: upstream's loop fails on it
    died = []

    def run():
        try:
            kv.transfer_worker(kv.transfer_queues[0], concurrent.futures.ThreadPoolExecutor(1))
        except BaseException as exc:  # noqa: BLE001
            died.append(exc)

    t = threading.Thread(target=run, name="transfer-worker", daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive()
    assert died, "the worker should have ended with its exception"  # "Transfer thread failed ..." (0.5.10-0.5.22)
    assert stops == ["transfer-worker"]


def test_unguarded_a_dead_transfer_worker_leaves_the_server_up(monkeypatch):
    from sglang_kvguard.guards import prefill_source_hold as g

    stops = []
    monkeypatch.setattr(g, "STOP_SERVER", lambda: stops.append(1))
    kv = _worker_that_will_fail()
    with pytest.raises(Exception):  # noqa: B017 - upstream's own wording differs by release
        kv.transfer_worker(kv.transfer_queues[0], concurrent.futures.ThreadPoolExecutor(1))
    assert stops == []  # upstream: the thread ends, nothing else happens
