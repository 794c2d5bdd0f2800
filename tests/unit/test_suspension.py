"""engine/suspension.py: a suspended guard's wrappers pass straight through (no SGLang)."""

from sglang_kvguard.engine import suspension


def _factory(calls):
    def factory(original):
        def wrapper(*args, **kwargs):
            calls.append("guard")
            return original(*args, **kwargs) + 1

        return wrapper

    return factory


def test_a_suspended_guard_calls_the_original_only():
    calls = []
    wrapped = suspension.suspendable("destination_canary", _factory(calls))(lambda x: x * 10)
    try:
        assert wrapped(2) == 21 and calls == ["guard"]
        assert suspension.suspend(["destination_canary", "transfer_checksum"]) == {"destination_canary",
                                                                                  "transfer_checksum"}
        assert suspension.suspend(["destination_canary"]) == set()  # already suspended
        assert wrapped(2) == 20 and calls == ["guard"]
        other = suspension.suspendable("page_generation", _factory(calls))(lambda x: x)
        assert other(1) == 2 and calls == ["guard", "guard"]  # not suspended: runs
    finally:
        suspension.reset()
    assert wrapped(2) == 21


def test_only_the_page_guards_can_be_suspended():
    """What hybrid_pool_check may switch off on a node it cannot cover: the page guards,
    and transfer_coverage, which it suspends on page layouts across ranks it has not
    verified (LAYOUT_GUARDS, session 16), and the guards that rest on Mooncake's transfer
    path, which it suspends on any other backend (MOONCAKE_GUARDS, session 17); nothing else."""
    from sglang_kvguard.lifetime import transfer_components as tc
    from sglang_kvguard.activation.install import plan
    from sglang_kvguard.guards.hybrid_pool_check import LAYOUT_GUARDS, MOONCAKE_GUARDS

    _, _, guards = plan()
    suspendable = {g.name for g in guards if g.suspendable}
    layout = {name for names in LAYOUT_GUARDS.values() for name in names}
    assert "transfer_coverage" in layout
    mooncake = {name for names in MOONCAKE_GUARDS.values() for name in names}
    assert {"rejection_notice", "decode_rejection_notice", "mooncake_batch_bound"} <= mooncake
    assert suspendable == set(tc.ALL_PAGE_GUARDS) | layout | mooncake
