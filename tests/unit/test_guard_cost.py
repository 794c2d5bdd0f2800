"""Guard cost accounting (sglang_kvguard.observe.guard_cost): each wrapper is charged its own
time only, never the upstream call it wraps nor another kvguard wrapper it calls, and
busy time counts only calls that had work. A fake clock makes every figure exact."""

import pytest

from sglang_kvguard.observe import guard_cost as gc


@pytest.fixture
def clock(monkeypatch):
    t = [0]
    monkeypatch.setattr(gc, "_now", lambda: t[0])
    monkeypatch.setattr(gc, "_maybe_flush", lambda: None)
    gc.reset_for_tests()
    yield t
    gc.reset_for_tests()


def _spend(clock, ns):
    clock[0] += ns


def test_a_wrapper_is_charged_its_own_time_not_the_upstream_call(clock):
    def upstream(x):
        _spend(clock, 1000)
        return x + 1

    def factory(original):
        def wrapper(x):
            _spend(clock, 30)  # the guard's check before
            out = original(x)
            _spend(clock, 12)  # and after
            return out

        return wrapper

    f = gc.accounted("page_generation", factory)(upstream)
    assert f(1) == 2 and f(2) == 3
    snap = gc.snapshot()
    assert snap["guard_seconds"] == {"page_generation": 84e-9}
    assert snap["guard_calls"] == {"page_generation": 2}


def test_two_guards_on_one_target_are_each_charged_their_part(clock):
    def upstream():
        _spend(clock, 500)

    def make(cost_before):
        def factory(original):
            def wrapper():
                _spend(clock, cost_before)
                original()

            return wrapper

        return factory

    inner = gc.accounted("transfer_checksum", make(40))(upstream)
    outer = gc.accounted("destination_canary", make(7))(inner)  # the patcher chains them so
    outer()
    assert gc.snapshot()["guard_seconds"] == pytest.approx({"transfer_checksum": 40e-9, "destination_canary": 7e-9})


def test_a_guarded_call_made_inside_a_wrapper_is_not_charged_twice(clock):
    """A wrapper that calls some other guarded upstream function (not its own original)."""

    def free():
        _spend(clock, 100)

    guarded_free = gc.accounted("prefill_source_hold", lambda orig: (lambda: (_spend(clock, 9), orig())[1]))(free)

    def upstream():
        _spend(clock, 1000)

    def factory(original):
        def wrapper():
            _spend(clock, 5)
            guarded_free()  # e.g. a release inside the wrapper
            return original()

        return wrapper

    gc.accounted("decode_destination_hold", factory)(upstream)()
    assert gc.snapshot()["guard_seconds"] == pytest.approx({"decode_destination_hold": 5e-9, "prefill_source_hold": 9e-9})


def test_an_exception_still_charges_and_propagates(clock):
    def upstream():
        _spend(clock, 100)
        raise KeyError("boom")

    def factory(original):
        def wrapper():
            _spend(clock, 3)
            return original()

        return wrapper

    with pytest.raises(KeyError):
        gc.accounted("admission_drain", factory)(upstream)()
    assert gc.snapshot()["guard_seconds"] == {"admission_drain": 3e-9}


def test_busy_time_counts_only_calls_with_work_and_never_twice_when_nested(clock):
    class Queue:
        def __init__(self, n):
            self.queue = list(range(n))

    def step(self):
        _spend(clock, 200)

    busy_step = gc._busy_when(gc._bootstrap_has_work)(step)
    busy_step(Queue(0))  # idle poll: not busy
    busy_step(Queue(3))
    assert gc.snapshot()["busy_seconds"] == pytest.approx(200e-9)

    def run_batch(self):
        _spend(clock, 1000)
        busy_step(Queue(1))  # nested busy call: already inside a busy frame

    gc._busy_when()(run_batch)(object())
    snap = gc.snapshot()
    assert snap["busy_seconds"] == pytest.approx(1400e-9) and snap["busy_calls"] == 2


def test_guard_time_is_split_by_whether_the_scheduler_was_busy(clock):
    def upstream(self):
        _spend(clock, 50)

    def factory(original):
        def wrapper(self):
            _spend(clock, 4)
            return original(self)

        return wrapper

    guarded = gc.accounted("page_generation", factory)(upstream)
    guarded(None)  # idle polling
    gc._busy_when()(lambda self: guarded(self))(None)  # inside a batch
    assert gc.snapshot()["guard_seconds_by_phase"] == pytest.approx(
        {"page_generation/outside": 4e-9, "page_generation/busy": 4e-9})


def test_a_broken_work_test_never_changes_the_call(clock):
    def step(self):
        return "ran"

    assert gc._busy_when(lambda s: 1 / 0)(step)(object()) == "ran"
    assert gc.snapshot()["busy_seconds"] == 0


def test_accounting_is_off_by_default_and_a_config_flag():
    from sglang_kvguard.engine.config import Config, ConfigError

    assert not gc.enabled(Config.from_env({}))
    assert gc.enabled(Config.from_env({"KVGUARD_ACCOUNTING": "on"}))
    with pytest.raises(ConfigError):
        Config.from_env({"KVGUARD_ACCOUNTING": "yes"})


def test_flush_exports_increments_once(clock):
    pytest.importorskip("prometheus_client")
    from prometheus_client import REGISTRY

    gc._add_guard("empty_prompt", 2_000_000)
    gc.flush()
    gc.flush()  # nothing new: no double count
    gc._add_guard("empty_prompt", 1_000_000)
    gc.flush()
    v = REGISTRY.get_sample_value("kvguard_guard_seconds_total", {"guard": "empty_prompt", "phase": "outside"})
    assert v == pytest.approx(0.003)
    assert REGISTRY.get_sample_value("kvguard_guard_calls_total", {"guard": "empty_prompt", "phase": "outside"}) == 2


def test_calibration_measures_the_timing_overhead_and_leaves_the_sums_alone():
    gc.reset_for_tests()
    gc._add_guard("empty_prompt", 5)
    bias = gc.calibrate(2000)
    assert 0 < bias < 50_000  # ns per call: the timer and bookkeeping only
    snap = gc.snapshot()
    assert snap["guard_calls"] == {"empty_prompt": 1} and snap["bias_seconds_per_call"] == pytest.approx(bias / 1e9)
    gc.reset_for_tests()
