"""A hypothesis stateful model of prefill page ownership, run against SGLang's real
paged allocator, FastQueue and TransferKVChunk with kvguard's prefill_source_hold.

Steps, named like the actions of the SPIN model (models/pd_transfer.pml, where they
are written ``@Name``; tests/unit/test_formal_model.py checks that the names agree):
``PagedTokenToKVPoolAllocator_alloc`` allocates a request's pages;
``RadixCache_match_prefix`` shares a live request's pages with a new request (a prefix
hit in the radix cache: a page is freed when its last user ends; the SPIN model leaves
prefix sharing out); ``MooncakeKVManager_add_transfer_request`` queues a transfer chunk
of a request's pages; ``MooncakeKVManager_transfer_worker`` takes the next chunk
(finishing the previous one) or goes idle; ``PagedTokenToKVPoolAllocator_free``: a
request ends (completion, abort or timeout at any phase: the scheduler frees its
pages, whatever the transfer is doing); ``PrefillBootstrapQueue_pop_bootstrapped``:
the scheduler thread releases drained pages (kvguard does it in that call, every loop
iteration); ``quarantine_bound_passes``: the hold's clock (no upstream call; the SPIN
model's quarantine step has no hook name either). After every step:

* no page belongs to two live requests, and a new allocation never returns a page a
  live request owns or a queued / in-flight transfer still reads;
* no page is in the allocator's free list while a transfer references it;
* every live request still finds the generation it recorded on each of its pages
  (kvguard's page_generation tags, bumped at the allocator's real free sink), and a
  page handed out again never carries a generation an earlier owner recorded;
* free pages + pages of live requests + pages kvguard holds == the pool;
* when everything has ended and drained, every page is free again (held and
  quarantined pages come back once their transfer drains).

Run without kvguard, the same model finds the hazard (a freed in-flight page in the
free list, or handed to the next request).

Not modelled yet (issue 3): the decode side's own hold (kvguard's decode hold before
0.5.21).
"""

from __future__ import annotations

import os
import time
from collections import deque

import pytest

os.environ["KVGUARD_AUTO_INSTALL"] = "0"

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test  # noqa: E402

pytestmark = pytest.mark.component

transfer_chunk = pytest.importorskip("_sglang_components").transfer_chunk  # needs torch + SGLang

PAGE = 16
SEEN = {"diverted": 0, "quarantined": 0, "released_from_quarantine": 0}
POOL_TOKENS = 256  # 16 pages


def _free_page_ids(allocator) -> list:
    ids = []
    for name in ("free_pages", "release_pages"):
        t = getattr(allocator, name, None)
        if t is not None:
            ids.extend(int(x) for x in t.tolist())
    return ids


def _machine(make_side, guarded: bool):
    from sglang.srt.disaggregation.common.utils import FastQueue

    import torch

    from sglang_kvguard.guards import page_generation as pg
    from sglang_kvguard.guards import prefill_source_hold as g

    class PageOwnership(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self._ctx = make_side("prefill", num_tokens=POOL_TOKENS, page_size=PAGE)
            self.side = self._ctx.__enter__()
            self.alloc = self.side.allocator
            self.total_pages = len(_free_page_ids(self.alloc))
            self.initial_available = self.alloc.available_size()
            from sglang_kvguard.lifetime.page_hold import HOLDS

            HOLDS.clear()  # one fresh hold per example, as per scheduler process
            self.hold = g.bind_allocator(self.alloc, 300.0)
            manager = type("Manager", (), {})()
            manager.transfer_queues = [FastQueue()]
            self.queue = g._proxy_for(manager, manager.transfer_queues[0])
            self.queue.consumer_wrapped = True  # what kvguard's transfer_worker wrapper does
            # generation tags on the same allocator (kvguard tags decode pools; the
            # sink and the bookkeeping are the same on this one)
            self.table = pg.bind(self.alloc, self.side.req_to_token_pool) if guarded else None
            self.recorded = {}  # rid -> generations of its pages when it got them
            self.past = {}  # page -> generations earlier owners recorded
            self.users = {}  # page -> number of live requests using it (prefix sharing)
            self.live = {}  # rid -> (tokens, pages)
            self.queued = deque()  # (rid, pages) waiting for the worker
            self.inflight = None  # (rid, pages) the worker is sending
            self.next_rid = 1

        # -- helpers
        def referenced(self) -> set:
            refs = set()
            for _rid, pages in self.queued:
                refs.update(pages)
            if self.inflight is not None:
                refs.update(self.inflight[1])
            return refs

        def live_pages(self) -> set:
            out = set()
            for _t, pages in self.live.values():
                out.update(pages)
            return out

        def gens(self, pages) -> list:
            return [int(x) for x in self.table.gens[pages].tolist()] if self.table is not None else []

        def start(self, tokens, pages, fresh) -> None:
            rid = self.next_rid
            self.next_rid += 1
            self.live[rid] = (tokens, pages)
            for p in pages:
                self.users[p] = self.users.get(p, 0) + 1
            self.recorded[rid] = self.gens(pages)
            for p, gen in zip(pages, self.recorded[rid]):
                if p in fresh:
                    assert gen not in self.past.get(p, ()), f"page {p} handed out again with an earlier owner's generation"
                self.past.setdefault(p, set()).add(gen)

        # -- rules
        @rule(n=st.integers(1, 4))
        def PagedTokenToKVPoolAllocator_alloc(self, n):
            tokens = self.alloc.alloc(n * PAGE)
            if tokens is None:
                return
            pages = sorted({int(t) // PAGE for t in tokens.tolist()})
            assert not set(pages) & self.live_pages(), f"pages {pages} handed to two live requests"
            assert not set(pages) & self.referenced(), f"pages {pages} handed out while a transfer reads them"
            self.start(tokens, pages, fresh=set(pages))

        @precondition(lambda self: self.live)
        @rule(data=st.data())
        def RadixCache_match_prefix(self, data):
            rid = data.draw(st.sampled_from(sorted(self.live)))
            tokens, pages = self.live[rid]
            self.start(tokens, pages, fresh=set())

        @precondition(lambda self: self.live)
        @rule(data=st.data())
        def MooncakeKVManager_add_transfer_request(self, data):
            rid = data.draw(st.sampled_from(sorted(self.live)))
            pages = self.live[rid][1]
            self.queue.put(transfer_chunk(rid, pages))
            self.queued.append((rid, pages))

        @rule()
        def MooncakeKVManager_transfer_worker(self):
            if self.queued:
                item = self.queue.get()  # finishes the previous chunk, takes the next
                rid, pages = self.queued.popleft()
                assert item.room == rid
                self.inflight = (rid, pages)
            elif self.inflight is not None:
                self.queue.finish_current()  # done, queue empty: the worker idles
                self.inflight = None

        @precondition(lambda self: self.live)
        @rule(data=st.data())
        def PagedTokenToKVPoolAllocator_free(self, data):
            rid = data.draw(st.sampled_from(sorted(self.live)))
            _tokens, pages = self.live.pop(rid)
            self.recorded.pop(rid)
            last = []
            for p in pages:
                self.users[p] -= 1
                if not self.users[p]:
                    del self.users[p]
                    last.append(p)
            if last:  # the radix cache frees a shared page when its last user ends
                self.alloc.free((torch.tensor(last)[:, None] * PAGE + torch.arange(PAGE)).reshape(-1))

        @rule()
        def PrefillBootstrapQueue_pop_bootstrapped(self):
            if guarded:
                g.release_drained(self.alloc)

        @rule()
        def quarantine_bound_passes(self):
            self.hold.sweep(now=time.monotonic() + 10_000)

        # -- invariants
        @invariant()
        def no_freed_page_is_still_referenced(self):
            free = set(_free_page_ids(self.alloc))
            assert not free & self.referenced(), f"free list holds pages a transfer reads: {sorted(free & self.referenced())}"
            assert not free & self.live_pages()

        @invariant()
        def live_requests_find_their_generations(self):
            if self.table is None:
                return
            for rid, (_tokens, pages) in self.live.items():
                assert self.gens(pages) == self.recorded[rid], f"request {rid} would read a page that changed owner"

        @invariant()
        def pages_add_up(self):
            free = len(_free_page_ids(self.alloc))
            assert free + len(self.live_pages()) + self.hold.held_pages() == self.total_pages

        def teardown(self):
            try:
                if guarded:
                    while self.queued:
                        self.queue.get()
                        self.queued.popleft()
                    self.queue.finish_current()
                    self.inflight = None
                    if self.users:
                        self.alloc.free((torch.tensor(sorted(self.users))[:, None] * PAGE
                                         + torch.arange(PAGE)).reshape(-1))
                    self.live.clear()
                    self.users.clear()
                    g.release_drained(self.alloc)
                    assert self.hold.held_pages() == 0 and self.hold.quarantined_pages() == 0
                    assert self.alloc.available_size() == self.initial_available
            finally:
                for key in SEEN:  # after the final drain, which releases what was quarantined
                    SEEN[key] += self.hold.stats.get(key, 0)
                self._ctx.__exit__(None, None, None)

    return PageOwnership


SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))


def test_page_ownership_model_holds_with_kvguard(make_side):
    import sglang_kvguard
    from sglang_kvguard.lifetime.page_hold import HOLDS

    from sglang_kvguard.guards import prefill_source_hold as g

    report = sglang_kvguard.install()
    wait, g.ALLOC_WAIT = g.ALLOC_WAIT, 0.0  # one thread plays the worker too: a failed alloc must not wait
    try:
        states = {x.name: x.state for x in report.guards}
        assert states["prefill_source_hold"] == "active" and states["page_generation"] == "active"
        for key in SEEN:
            SEEN[key] = 0
        run_state_machine_as_test(_machine(make_side, guarded=True), settings=SETTINGS)
        # the model did reach the states that matter: frees of pages in flight were
        # diverted, held pages were quarantined, and quarantined pages came back
        assert SEEN["diverted"] > 0 and SEEN["quarantined"] > 0 and SEEN["released_from_quarantine"] > 0, SEEN
    finally:
        g.ALLOC_WAIT = wait
        sglang_kvguard.uninstall()
        HOLDS.clear()


def test_page_ownership_model_finds_the_hazard_without_kvguard(make_side):
    from sglang_kvguard.lifetime.page_hold import HOLDS

    try:
        with pytest.raises(AssertionError, match="transfer reads"):
            run_state_machine_as_test(_machine(make_side, guarded=False), settings=SETTINGS)
    finally:
        HOLDS.clear()
