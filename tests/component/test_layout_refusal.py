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


# --- transfer backends (session 17) -------------------------------------------------

NOTICE_GUARDS = {"rejection_notice", "decode_rejection_notice", "mooncake_batch_bound"}


def _manager(module: str, cls: str):
    """SGLang's real transfer manager class of a backend, built without ``__init__``."""
    import importlib

    klass = getattr(importlib.import_module(module), cls)
    return klass.__new__(klass)


def test_mooncake_and_the_fake_test_backend_have_no_backend_gap(sgl, make_side):
    assert hpc.backend_gaps(None, _mooncake_manager()) == []
    with make_side("decode") as side:  # SGLang's fake backend: nothing is transferred
        assert hpc.scheduler_backend_gaps(side.scheduler) == []


@pytest.mark.parametrize("module,cls,backend", [
    ("sglang.srt.disaggregation.nixl.conn", "NixlKVManager", "nixl"),
    ("sglang.srt.disaggregation.ascend.conn", "AscendKVManager", "ascend"),  # a MooncakeKVManager subclass
])
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_another_transfer_backend_is_refused_naming_the_guards_that_rest_on_mooncake(sgl, make_side, mode,
                                                                                     module, cls, backend):
    """kvguard's holds, notices and batch bound patch Mooncake's transfer path, and its
    content guards have only been verified on it: on NIXL or Ascend they would report
    active over transfers they never see. The node refuses at start, naming them."""
    import types

    kv = _manager(module, cls)
    whys = hpc.backend_gaps(types.SimpleNamespace(disaggregation_transfer_backend=backend), kv)
    assert len(whys) == 1 and f"the transfer backend is {backend} ({cls})" in whys[0], whys
    active = EVERY_GUARD | NOTICE_GUARDS
    with make_side(mode) as side:
        kv_args, draft = hpc.transfer_kv_args(side.scheduler)
        with pytest.raises(hpc.HybridPoolUnguarded) as err:
            hpc.check_pools(side.mode, side.allocator, side.req_to_token_pool, "refuse", set(active),
                            kv_args=kv_args, draft_pool=draft, backend=tuple(whys))
    msg = str(err.value)
    assert _named(msg) == set(hpc.MOONCAKE_GUARDS[mode]), msg
    assert {"prefill": {"prefill_source_hold", "rejection_notice", "mooncake_batch_bound"},
            "decode": {"decode_destination_hold", "destination_canary", "transfer_coverage"}}[mode] <= _named(msg)


def test_with_warn_on_another_backend_the_notices_are_suspended_too(sgl, make_side):
    import types

    from sglang_kvguard.engine import suspension
    from sglang_kvguard.guards import rejection_notice

    whys = hpc.backend_gaps(types.SimpleNamespace(disaggregation_transfer_backend="nixl"),
                            _manager("sglang.srt.disaggregation.nixl.conn", "NixlKVManager"))
    try:
        with make_side("prefill") as side:
            kv_args, draft = hpc.transfer_kv_args(side.scheduler)
            assert hpc.check_pools("prefill", side.allocator, side.req_to_token_pool, "warn",
                                   set(EVERY_GUARD | NOTICE_GUARDS), kv_args=kv_args, draft_pool=draft,
                                   backend=tuple(whys)) == "warn"
        assert set(hpc.MOONCAKE_GUARDS["prefill"]) <= suspension.SUSPENDED

        class Queue:  # the door hook must not send a Mooncake notice through another backend
            kv_manager = None

        sent = []
        original = rejection_notice.note_prefill_rejection
        rejection_notice.note_prefill_rejection = lambda *a, **k: sent.append(a)
        try:
            rejection_notice._on_door_drain(Queue(), object())
        finally:
            rejection_notice.note_prefill_rejection = original
        assert sent == []
    finally:
        suspension.reset()


def test_the_scheduler_constructor_wrapper_reads_the_backend_of_the_pd_queue(sgl, make_side):
    """The production path: after SGLang's Scheduler.__init__, the wrapper reads the
    transfer manager that the PD queue built (here SGLang's real NixlKVManager class)."""
    import types

    with make_side("prefill") as side:
        nixl = _manager("sglang.srt.disaggregation.nixl.conn", "NixlKVManager")
        nixl.kv_args = side.scheduler.disagg_prefill_bootstrap_queue.kv_manager.kv_args

        class Built:  # what SGLang's Scheduler.__init__ leaves behind
            pass

        def constructor(self, queue):
            self.disaggregation_mode = "prefill"
            self.server_args = types.SimpleNamespace(disaggregation_transfer_backend="nixl")
            self.token_to_kv_pool_allocator = side.allocator
            self.req_to_token_pool = side.req_to_token_pool
            self.disagg_prefill_bootstrap_queue = queue

        with pytest.raises(hpc.HybridPoolUnguarded) as err:
            hpc._scheduler_init("refuse")(constructor)(Built(), types.SimpleNamespace(kv_manager=nixl))
        assert "the transfer backend is nixl (NixlKVManager)" in str(err.value)
        assert "rejection_notice" in _named(str(err.value))
        same = types.SimpleNamespace(kv_manager=side.scheduler.disagg_prefill_bootstrap_queue.kv_manager)
        assert hpc._scheduler_init("refuse")(constructor)(Built(), same) is None  # the fake backend: ok
