"""Guard cost accounting on SGLang's real classes: with ``KVGUARD_ACCOUNTING=on`` the
page-hold free through a real ``PagedTokenToKVPoolAllocator`` charges the guards that
wrap it (and only them), the allocator's own work is charged to nobody, and the
scheduler's busy-time calls are wrapped; with accounting off (the default) nothing is
timed and ``Scheduler.run_batch`` is untouched."""

import pytest

pytestmark = pytest.mark.component


@pytest.fixture
def kvguard(install_kvguard):
    import sglang_kvguard
    from sglang_kvguard.observe import guard_cost
    from sglang_kvguard.engine.runtime import installed_report

    sglang_kvguard.uninstall()  # the pytest plugin's import may have installed it with the default config
    assert installed_report() is None
    guard_cost.reset_for_tests()
    yield install_kvguard
    guard_cost.reset_for_tests()


def _cycle(sgl, n=200):
    from sglang_kvguard.guards import prefill_source_hold

    ps = 16
    with sgl.sglang_config():
        pool = sgl.make_kv_pool(4096 * ps, ps)
        alloc = sgl.make_paged_allocator(4096 * ps, ps, pool)
        hold = prefill_source_hold.bind_allocator(alloc)
        busy = alloc.alloc(64 * ps)
        hold.pin(sorted({int(t) // ps for t in busy.tolist()}))  # a transfer in flight
        for _ in range(n):
            alloc.free(alloc.alloc(8 * ps))
        hold.unpin(sorted({int(t) // ps for t in busy.tolist()}))
        alloc.free(busy)


def test_accounting_charges_the_page_guards_on_a_real_free_and_wraps_busy_calls(sgl, kvguard):
    import sglang.srt.managers.scheduler as scheduler

    from sglang_kvguard.observe import guard_cost
    from sglang_kvguard.engine.patching import guards_on

    kvguard(KVGUARD_ACCOUNTING="on")
    assert "accounting" in guards_on(scheduler.Scheduler.run_batch)
    assert "accounting" in guards_on(scheduler.Scheduler.process_batch_result)
    _cycle(sgl)
    snap = guard_cost.snapshot()
    assert snap["guard_calls"].get("prefill_source_hold", 0) >= 200, snap
    assert snap["guard_seconds"]["prefill_source_hold"] > 0
    # the free sink's wrappers are all that ran: no other guard is charged
    assert set(snap["guard_calls"]) <= {"prefill_source_hold", "page_generation"}, snap
    assert snap["busy_seconds"] == 0  # no batch ran


def test_accounting_off_times_nothing_and_leaves_run_batch_alone(sgl, kvguard):
    import sglang.srt.managers.scheduler as scheduler

    from sglang_kvguard.observe import guard_cost
    from sglang_kvguard.engine.patching import guards_on

    report = kvguard()
    assert not report.refused
    assert guards_on(scheduler.Scheduler.run_batch) == ()
    _cycle(sgl, n=20)
    assert guard_cost.snapshot()["guard_calls"] == {}
