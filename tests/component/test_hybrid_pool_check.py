"""hybrid_pool_check against SGLang's real pools: a plain MHA pool with the paged
allocator passes; a real SWA pool (``SWAKVPool`` + ``SWATokenToKVPoolAllocator``)
and a Mamba request pool make a PD node refuse to start, naming each guard that
would not cover them, unless the operator switches those guards off or accepts the
gap (``--kvguard-hybrid-pool=warn``).
"""

from __future__ import annotations

import inspect
import logging

import pytest
import torch

from _sglang_components import (
    DEVICE,
    call_supported,
    make_kv_pool,
    make_paged_allocator,
    make_req_to_token_pool,
)
from sglang_kvguard.guards import hybrid_pool_check as hpc

PAGE = 4
ALL_PAGE_GUARDS = {"page_generation", "prefill_source_hold", "decode_destination_hold", "destination_canary",
                   "transfer_checksum"}


def _swa_pools(size: int = 64, size_swa: int = 32):
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    try:
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    except ImportError:  # before the allocator package
        from sglang.srt.mem_cache.swa_memory_pool import SWATokenToKVPoolAllocator
    # SWAKVPool passes **kwargs on to its per-layer pools: only keywords they take
    named = inspect.signature(SWAKVPool.__init__).parameters
    kv = SWAKVPool(
        size=size, size_swa=size_swa, page_size=PAGE, dtype=torch.bfloat16, head_num=2, head_dim=16,
        swa_attention_layer_ids=[0], full_attention_layer_ids=[1], device=DEVICE, enable_memory_saver=False,
        **({"enable_kvcache_transpose": False} if "enable_kvcache_transpose" in named else {}),
    )
    alloc = call_supported(SWATokenToKVPoolAllocator, size=size, size_swa=size_swa, page_size=PAGE,
                           dtype=torch.bfloat16, device=DEVICE, kvcache=kv, need_sort=False)
    return alloc


def _plain_allocator(size: int = 64):
    return make_paged_allocator(size, PAGE, make_kv_pool(size, PAGE))


def _mamba_request_pool():
    """SGLang's real ``HybridReqToTokenPool`` class, uninitialised: the check reads only
    its type (building one needs a Mamba model's state shapes)."""
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

    return object.__new__(HybridReqToTokenPool)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_plain_pools_pass(role):
    pool = make_req_to_token_pool(8, 256, decode_pre_alloc=8 if role == "decode" else None)
    assert hpc.pool_gaps(_plain_allocator(), pool) == []
    assert hpc.check_pools(role, _plain_allocator(), pool, "refuse", ALL_PAGE_GUARDS) == "ok"


def test_a_decode_node_on_an_swa_pool_refuses_naming_each_guard_and_the_way_out():
    alloc = _swa_pools()
    pool = make_req_to_token_pool(8, 256, decode_pre_alloc=8)
    with pytest.raises(hpc.HybridPoolUnguarded) as info:
        hpc.check_pools("decode", alloc, pool, "refuse", ALL_PAGE_GUARDS)
    msg = str(info.value)
    assert "decode node" in msg
    assert "SWATokenToKVPoolAllocator is not SGLang's plain token or paged allocator" in msg, msg
    assert "SWAKVPool has no per-layer page buffers" in msg, msg
    for guard in ("page_generation", "decode_destination_hold", "destination_canary", "transfer_checksum"):
        assert f"  - {guard}: " in msg, msg
    assert "prefill_source_hold" not in msg  # a prefill-side guard is not named on decode
    assert ("--kvguard-disable decode_destination_hold,destination_canary,page_generation,transfer_checksum"
            in msg), msg
    assert "--kvguard-hybrid-pool=warn" in msg


def test_a_prefill_node_on_an_swa_pool_names_the_source_hold_and_the_checksum():
    with pytest.raises(hpc.HybridPoolUnguarded) as info:
        hpc.check_pools("prefill", _swa_pools(), make_req_to_token_pool(8, 256), "refuse", ALL_PAGE_GUARDS)
    assert "--kvguard-disable prefill_source_hold,transfer_checksum" in str(info.value)


def test_switching_the_named_guards_off_or_warn_lets_the_node_start(caplog):
    alloc = _swa_pools()
    pool = make_req_to_token_pool(8, 256, decode_pre_alloc=8)
    left = ALL_PAGE_GUARDS - {"page_generation", "decode_destination_hold", "destination_canary",
                              "transfer_checksum"}
    assert hpc.check_pools("decode", alloc, pool, "refuse", left) == "ok"
    with caplog.at_level(logging.WARNING, logger="sglang_kvguard"):
        assert hpc.check_pools("decode", alloc, pool, "warn", ALL_PAGE_GUARDS) == "warn"
    assert "would not protect it" in caplog.text
    # a non-PD node is not checked: the page guards act on PD transfers only
    assert hpc.check_pools("null", alloc, pool, "refuse", ALL_PAGE_GUARDS) == "ok"


def test_a_mamba_request_pool_is_a_gap_for_the_holds_only():
    gaps = hpc.pool_gaps(_plain_allocator(), _mamba_request_pool())
    assert [g for g, _ in gaps] == [hpc.STATE]
    with pytest.raises(hpc.HybridPoolUnguarded) as info:
        hpc.check_pools("decode", _plain_allocator(), _mamba_request_pool(), "refuse", ALL_PAGE_GUARDS)
    msg = str(info.value)
    assert "  - decode_destination_hold: its request pool HybridReqToTokenPool carries" in msg, msg
    assert "page_generation" not in msg and "destination_canary" not in msg


def test_the_scheduler_constructor_wrapper_checks_after_the_pools_exist():
    """The wrapper runs the constructor first (SGLang builds its pools there), then checks."""
    alloc = _swa_pools()
    pool = make_req_to_token_pool(8, 256, decode_pre_alloc=8)

    class Built:  # what SGLang's Scheduler.__init__ leaves behind: role and pools
        pass

    def constructor(self):
        self.disaggregation_mode = "decode"
        self.token_to_kv_pool_allocator = alloc
        self.req_to_token_pool = pool

    wrapped = hpc._scheduler_init("refuse")(constructor)
    with pytest.raises(hpc.HybridPoolUnguarded):
        wrapped(Built())
    assert hpc._scheduler_init("warn")(constructor)(Built()) is None


def test_the_installed_guards_decide_what_is_named():
    """On 0.5.21+ decode's hold is upstream's (decode_destination_hold only answers drain
    requests on prefill there), so it is not named on decode; on older releases it is."""
    import sglang_kvguard
    from sglang_kvguard.engine.runtime import sglang_release
    from packaging.version import Version

    sglang_kvguard.install()
    try:
        active = hpc.active_guards()
        assert {"page_generation", "prefill_source_hold", "destination_canary", "transfer_checksum"} <= active
        own_decode_hold = Version(sglang_release()) < Version("0.5.21")
        assert ("decode_destination_hold" in active) == own_decode_hold
        with pytest.raises(hpc.HybridPoolUnguarded) as info:
            hpc.check_pools("decode", _swa_pools(), make_req_to_token_pool(8, 256, decode_pre_alloc=8), "refuse")
        assert ("decode_destination_hold" in str(info.value)) == own_decode_hold
    finally:
        sglang_kvguard.uninstall()
