"""hybrid_pool_check refuses page layouts across ranks that kvguard has not verified.

kvguard's content guards (``destination_canary``, ``transfer_checksum``,
``transfer_coverage``) stamp, digest and count whole pages at the page ids a transfer
carries, each prefill rank's page going whole to the matching decode rank. Three
upstream layouts break that, and none has run under kvguard (they need several GPUs):

* decode context parallelism (``dcp_size``, 0.5.16+; from 0.5.17 the Mooncake backend
  relayouts a DCP-1 prefill's MLA pages token by token across the decode's DCP ranks);
* KV cache sharding (``kv_shard_size`` on the transfer manager, 0.5.23);
* a context-parallel prefill whose every CP rank sends its shard
  (``enable_all_cp_ranks_for_transfer`` with ``attn_cp_size`` > 1).

A node in one of them must not log its pool as covered: it refuses at start, naming
the layout and the guards, or serves with them suspended under ``--kvguard-hybrid-pool=warn``.
The sides are SGLang's real pools, allocator and queues on CPU with the release's real
``ServerArgs`` (the fake transfer backend); the sharding and CP cases read SGLang's real
``MooncakeKVManager`` class, built without ``__init__`` (which would start a Mooncake
engine) with the attributes upstream's ``__init__`` sets.
"""

from __future__ import annotations

import os

import pytest

os.environ["KVGUARD_AUTO_INSTALL"] = "0"

from sglang_kvguard.guards import hybrid_pool_check as hpc  # noqa: E402

pytestmark = [pytest.mark.component, pytest.mark.usefixtures("fake_manager_keeps_kv_args")]

EVERY_GUARD = {"destination_canary", "transfer_checksum", "transfer_coverage", "page_generation",
               "decode_destination_hold", "decode_deferred_release", "prefill_source_hold"}


def _check(side, policy="refuse"):
    kv_args, draft = hpc.transfer_kv_args(side.scheduler)
    return hpc.check_pools(side.mode, side.allocator, side.req_to_token_pool, policy, set(EVERY_GUARD),
                           kv_args=kv_args, draft_pool=draft, layout=tuple(hpc.scheduler_layout_gaps(side.scheduler)))


def _named(msg):
    return {line[4:].split(":", 1)[0] for line in msg.splitlines() if line.startswith("  - ")}


def _set(scheduler, **fields):
    """Give the scheduler a real ``ServerArgs`` with ``fields`` changed."""
    sa = scheduler.server_args
    try:
        for k, v in fields.items():
            setattr(sa, k, v)
    except Exception:  # 0.5.19+: read-only once resolved; a changed copy of it
        import copy

        clone = copy.copy(sa)
        try:
            import msgspec

            if isinstance(sa, msgspec.Struct):
                clone = msgspec.structs.replace(sa, **fields)
        except ImportError:
            pass
        for k, v in fields.items():
            if getattr(clone, k) != v:
                object.__setattr__(clone, k, v)
        scheduler.server_args = clone


def test_the_plain_layout_is_covered(sgl, make_side):
    for mode in ("prefill", "decode"):
        with make_side(mode) as side:
            assert hpc.scheduler_layout_gaps(side.scheduler) == []
            assert _check(side) == "ok"


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_decode_context_parallelism_is_refused_naming_the_layout_and_the_content_guards(sgl, make_side, mode):
    with make_side(mode) as side:
        if not hasattr(side.scheduler.server_args, "dcp_size"):
            pytest.skip(f"sglang {sgl.SGLANG_VERSION} has no decode context parallelism (dcp_size, 0.5.16+)")
        _set(side.scheduler, dcp_size=2)
        try:
            with pytest.raises(hpc.HybridPoolUnguarded) as err:
                _check(side)
        finally:
            side.scheduler.server_args = side.server_args
    msg = str(err.value)
    assert "decode context parallelism (DCP size 2)" in msg, msg
    want = {"decode": {"destination_canary", "transfer_checksum", "transfer_coverage"},
            "prefill": {"transfer_checksum"}}[mode]
    assert _named(msg) == want, msg  # holds, tags and deferred release act on page ids: not named
    assert "--kvguard-disable" in msg and "--kvguard-hybrid-pool=warn" in msg


def test_with_warn_the_content_guards_are_suspended_on_that_node(sgl, make_side):
    from sglang_kvguard.engine import suspension

    with make_side("decode") as side:
        if not hasattr(side.scheduler.server_args, "dcp_size"):
            pytest.skip(f"sglang {sgl.SGLANG_VERSION} has no decode context parallelism (dcp_size, 0.5.16+)")
        _set(side.scheduler, dcp_size=4)
        try:
            assert _check(side, policy="warn") == "warn"
            assert {"destination_canary", "transfer_checksum", "transfer_coverage"} <= suspension.SUSPENDED
        finally:
            side.scheduler.server_args = side.server_args
            suspension.reset()


def _mooncake_manager(**fields):
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    kv = MooncakeKVManager.__new__(MooncakeKVManager)
    kv.__dict__.update(fields)
    return kv


def test_kv_cache_sharding_is_refused(sgl):
    from sglang.srt.disaggregation.common.conn import CommonKVManager
    import inspect

    if "kv_shard_size" not in inspect.getsource(CommonKVManager.__init__):
        pytest.skip(f"sglang {sgl.SGLANG_VERSION} has no KV cache sharding (kv_shard_size, 0.5.23)")
    whys = hpc.layout_gaps(None, _mooncake_manager(kv_shard_size=2, dcp_size=1, attn_cp_size=1))
    assert len(whys) == 1 and "KV cache sharding (shard size 2)" in whys[0], whys
    assert hpc.layout_gaps(None, _mooncake_manager(kv_shard_size=1, dcp_size=1, attn_cp_size=1)) == []


def test_a_context_parallel_transfer_from_every_cp_rank_is_refused(sgl):
    from sglang.srt.disaggregation.common.conn import CommonKVManager
    import inspect

    if "enable_all_cp_ranks_for_transfer" not in inspect.getsource(CommonKVManager.__init__):
        pytest.skip(f"sglang {sgl.SGLANG_VERSION}: only CP rank 0 transfers (no enable_all_cp_ranks_for_transfer)")
    whys = hpc.layout_gaps(None, _mooncake_manager(attn_cp_size=2, enable_all_cp_ranks_for_transfer=True))
    assert len(whys) == 1 and "attention CP size 2" in whys[0], whys
    # CP rank 0 alone sends whole pages: the plain layout
    assert hpc.layout_gaps(None, _mooncake_manager(attn_cp_size=2, enable_all_cp_ranks_for_transfer=False)) == []
