"""hybrid_pool_check on SGLang's real HiSparse decode (``--enable-hisparse``).

HiSparse (DSA models, decode instance only; upstream's guide: "Transparent to prefill")
keeps each request's full KV in a host pool and a small hot buffer on the device:

* ``HiSparseDSATokenToKVPool`` (``HiSparseNSATokenToKVPool`` on 0.5.10-0.5.12): the
  device pool, ``num_tokens`` physical slots; its indexer is sized for the logical space;
* ``HiSparseTokenToKVPoolAllocator``: logical pages (``size * host_to_device_ratio``)
  mapped onto device slots, its own alloc/free paths;
* ``HiSparseCoordinator`` builds ``mem_pool_host`` (``MLATokenToKVPoolHost``), the pool
  the decode queue registers with its transfer backend INSTEAD of the device pool
  (``DecodePreallocQueue._init_kv_manager``: ``transfer_kv_pool =
  hisparse_coordinator.mem_pool_host if enable_hisparse``), and decode sends prefill
  host slot ids (``alloc_paged_token_slots``) as the KV destination.

Everything here is SGLang's own class, built on CPU as upstream builds it, with the
release's real ``DecodePreallocQueue`` registering what it registers (fake backend;
Mooncake is given the same ``KVArgs``). One CUDA call is answered by a test stand-in:
``cudaHostRegister`` of the host pool's buffer (``_sglang_components.cpu_host_register``).
The scheduler is the usual attribute stand-in with ``enable_hisparse=True`` and the
real coordinator.

What upstream registered decides what kvguard must name on decode:

* ``page_generation`` and ``decode_destination_hold``: the destination pages come from
  ``HiSparseTokenToKVPoolAllocator`` (logical pages) and the coordinator's host pool
  (host slots), neither of which kvguard tags or holds;
* ``destination_canary`` and ``transfer_checksum``: the registered KV buffers are the
  host pool's (DRAM), not the device pool's per-layer buffers those guards stamp and
  digest; the device buffers are not registered at all;
* ``decode_deferred_release`` (0.5.21+; upstream's hold of a failed transfer's pages):
  covers the host destination only where upstream frees the HiSparse host pages in the
  release it defers (``_release_request`` calls ``hisparse_coordinator.request_finished``,
  0.5.23); 0.5.21-0.5.22 free them in ``pop_transferred``'s failure branch BEFORE
  deciding to defer, so the hold keeps the logical pages while the host pages a late
  prefill write lands in are already free; kvguard names it there
  (``hybrid_pool_check.HISPARSE_HOST_PAGES_DEFERRED`` lists the releases it trusts).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os

import pytest

os.environ["KVGUARD_AUTO_INSTALL"] = "0"  # this module installs and uninstalls explicitly

from sglang_kvguard.lifetime import transfer_components as tc  # noqa: E402
from sglang_kvguard.guards import hybrid_pool_check as hpc  # noqa: E402

pytestmark = [pytest.mark.component, pytest.mark.usefixtures("fake_manager_keeps_kv_args")]

PAGE = 64  # DSA's page size
# the page guards kvguard's own code protects a decode node with (the deferred release
# is upstream's hold, judged per release below)
FOUR = {"page_generation", "decode_destination_hold", "destination_canary", "transfer_checksum"}
PREFILL_GUARDS = set(tc.PAGE_GUARDS["prefill"])


@pytest.fixture
def hisparse(sgl):
    if sgl.hisparse_classes() is None:
        pytest.skip(f"sglang {sgl.SGLANG_VERSION} has no HiSparse (HiSparseCoordinator / HiSparse DSA pool)")
    return sgl


@contextlib.contextmanager
def hisparse_side(sgl, mode="decode"):
    """A PD role started with ``--enable-hisparse --disable-radix-cache`` (page 64)."""
    cfg = dict(disaggregation_mode=mode, disaggregation_transfer_backend="fake", page_size=PAGE,
               enable_hisparse=True, disable_radix_cache=True)
    with sgl.sglang_config(**cfg) as server_args:
        yield sgl.make_hisparse_side(mode, server_args=server_args, page_size=PAGE)


def _registered(side):
    kv_args, draft = hpc.transfer_kv_args(side.scheduler)
    assert kv_args is not None, "the real queue built no KVArgs"
    return kv_args, draft


def _check(side, active, policy="refuse"):
    kv_args, draft = _registered(side)
    return hpc.check_pools(side.mode, side.allocator, side.req_to_token_pool, policy, active,
                           kv_args=kv_args, draft_pool=draft)


def _named(msg):
    """The guards a refusal lists (its '  - guard: why' lines)."""
    return {line[4:].split(":", 1)[0] for line in msg.splitlines() if line.startswith("  - ")}


def _ranges(tensors):
    ts = tensors if isinstance(tensors, (list, tuple)) else [tensors]
    return [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in ts if hasattr(t, "data_ptr")]


def _inside(ptr, ranges):
    return any(lo <= ptr < hi for lo, hi in ranges)


def _host_pages_held_by_upstream_hold():
    """Whether upstream's deferred release of a failed decode transfer also holds the
    HiSparse host pages (the KV destination): None without the deferred release."""
    from sglang.srt.disaggregation.decode import DecodeTransferQueue as Q

    if not hasattr(Q, "_defer_release"):
        return None
    finished = "hisparse_coordinator.request_finished"
    if hasattr(Q, "_release_request") and finished in inspect.getsource(Q._release_request):
        assert "_release_request" in inspect.getsource(Q._do_release)  # the deferred path frees them
        return True
    # 0.5.19-0.5.22: the failure branch frees the host pages, then decides whether to defer
    assert finished in inspect.getsource(Q.pop_transferred), "HiSparse host pages freed somewhere unknown"
    return False


def test_decode_registers_the_coordinators_host_pool_not_the_device_pool(hisparse):
    with hisparse_side(hisparse) as side:
        host = side.hisparse_coordinator.mem_pool_host
        kv_args, _ = _registered(side)
        ptrs = list(kv_args.kv_data_ptrs)
        host_ranges = _ranges(host.kv_buffer)
        device = {b.data_ptr() for b in side.kv_pool.kv_buffer}
        assert type(side.allocator).__name__ == "HiSparseTokenToKVPoolAllocator"
        assert type(side.allocator.get_kvcache()).__name__.startswith("HiSparse")
        assert type(host).__name__ == "MLATokenToKVPoolHost"
        assert len(ptrs) == len(side.kv_pool.kv_buffer) == 2, ptrs  # one per layer
        assert all(_inside(p, host_ranges) for p in ptrs), (ptrs, host_ranges)
        assert not device & set(ptrs), "the device pool's KV buffers are registered"
        # the buffer registered for transfers is the one upstream page-locked for DMA
        assert all(_inside(p, [(a, a + n) for a, n in side.host_registrations]) for p in ptrs)
        # the DSA indexer stays on the device pool (sized for the logical space)
        comps = {c.name: c for c in tc.describe(kv_args, side.allocator.get_kvcache())}
        assert set(comps) >= {"kv_unplaced", "kv_unregistered"}, comps
        assert "kv" not in comps, comps
        assert comps["kv_unplaced"].buffers == len(ptrs)
        assert comps["kv_unregistered"].buffers == len(device)
        states = [n for n in comps if n.startswith("state:")]
        assert states and all(n in ("state:dsa", "state:nsa") for n in states), comps
        # the indexer is sent at the request's logical page ids while the KV goes to host
        # slots: no guard that works from the reservation's page ids may call it covered;
        # the deferred release holds the request, whose own pages carry those rows
        for name in states:
            assert set(comps[name].gaps) == set(tc.ALL_PAGE_GUARDS) - {tc.DEFERRED}, comps[name]


def test_decode_refuses_naming_every_page_guard_that_misses_a_component(hisparse):
    with hisparse_side(hisparse) as side:
        with pytest.raises(hpc.HybridPoolUnguarded) as info:
            _check(side, set(FOUR))
        msg = str(info.value)
        assert "the decode node's KV pool (HiSparse" in msg, msg
        assert _named(msg) == FOUR, msg
        assert "  - page_generation: its allocator HiSparseTokenToKVPoolAllocator" in msg, msg
        assert "  - decode_destination_hold: its allocator HiSparseTokenToKVPoolAllocator" in msg, msg
        for guard in ("destination_canary", "transfer_checksum"):
            line = next(x for x in msg.splitlines() if x.startswith(f"  - {guard}: "))
            assert "kv_unplaced" in line and "kv_unregistered" in line, line
        assert f"--kvguard-disable {','.join(sorted(FOUR))};" in msg, msg
        assert "--kvguard-hybrid-pool=warn" in msg, msg


def test_with_exactly_those_guards_off_the_decode_node_starts_and_each_alone_refuses(hisparse):
    """Complete: nothing else is left claiming coverage. Minimal: each named guard on its
    own (the others off) still refuses, naming only itself."""
    others = set(tc.ALL_PAGE_GUARDS) - FOUR - {"decode_deferred_release"}
    with hisparse_side(hisparse) as side:
        assert _check(side, others) == "ok"
        for guard in sorted(FOUR):
            with pytest.raises(hpc.HybridPoolUnguarded) as info:
                _check(side, others | {guard})
            assert _named(str(info.value)) == {guard}, (guard, str(info.value))


def test_warn_lets_the_decode_node_serve_and_logs_the_same_guards(hisparse, caplog):
    from sglang_kvguard.engine import suspension

    with hisparse_side(hisparse) as side:
        try:
            with caplog.at_level(logging.WARNING, logger="sglang_kvguard"):
                assert _check(side, set(FOUR), policy="warn") == "warn"
            assert _named(caplog.text) == FOUR, caplog.text
            assert suspension.SUSPENDED == FOUR
        finally:
            suspension.reset()


def test_under_warn_the_named_guards_do_not_run_so_nothing_is_stamped_into_the_device_pool(
        hisparse, install_kvguard, torch_alloc_kernels):
    """Accepted with warn, the named guards are suspended in the scheduler process: a
    real reservation (host slot ids sent as the KV destination) must not be stamped by
    the canary into the device pool at those ids, or digested there."""
    import torch

    with hisparse_side(hisparse) as side:

        class Built:
            pass

        def constructor(self):
            self.disaggregation_mode = "decode"
            self.token_to_kv_pool_allocator = side.allocator
            self.req_to_token_pool = side.req_to_token_pool
            self.disagg_decode_prealloc_queue = side.prealloc_queue

        install_kvguard()
        named = _installed_expectation(hpc.active_guards())
        assert "destination_canary" in named
        hpc._scheduler_init("warn")(constructor)(Built())
        assert not named & hpc.active_guards()
        from prometheus_client import REGISTRY

        for guard in named:  # what runs on this node, in /metrics
            assert REGISTRY.get_sample_value("kvguard_guard_state", {"guard": guard, "state": "off"}) == 1, guard
            assert REGISTRY.get_sample_value("kvguard_guard_state", {"guard": guard, "state": "active"}) == 0, guard
        device = [b.clone() for b in side.kv_pool.kv_buffer]
        req = side.new_req(96, bootstrap_room=91000)
        side.prealloc_queue.add(req)
        popped, failed = side.prealloc_queue.pop_preallocated()
        assert not failed and [x.req for x in popped] == [req]
        assert all(torch.equal(a, b) for a, b in zip(device, side.kv_pool.kv_buffer)), \
            "a suspended guard wrote into the device pool"


def _installed_expectation(active):
    """What the installed kvguard must name on this release's HiSparse decode."""
    expected = FOUR & active
    if "decode_deferred_release" in active and _host_pages_held_by_upstream_hold() is False:
        expected.add("decode_deferred_release")
    return expected


def test_installed_kvguard_refuses_the_hisparse_decode_scheduler_then_starts_with_the_named_guards_off(
        hisparse, install_kvguard):
    """The production path: the scheduler-constructor wrapper reads what upstream's queue
    registered (``transfer_kv_args``) with the guards this release really activates."""
    import sglang_kvguard

    with hisparse_side(hisparse) as side:

        class Built:  # what SGLang's Scheduler.__init__ leaves behind
            pass

        def constructor(self):
            self.disaggregation_mode = "decode"
            self.token_to_kv_pool_allocator = side.allocator
            self.req_to_token_pool = side.req_to_token_pool
            self.disagg_decode_prealloc_queue = side.prealloc_queue

        install_kvguard()
        active = hpc.active_guards()
        assert {"page_generation", "destination_canary", "transfer_checksum"} <= active, active
        expected = _installed_expectation(active)
        with pytest.raises(hpc.HybridPoolUnguarded) as info:
            hpc._scheduler_init("refuse")(constructor)(Built())
        msg = str(info.value)
        assert _named(msg) == expected, (sorted(active), msg)
        assert f"--kvguard-disable {','.join(sorted(expected))};" in msg, msg

        sglang_kvguard.uninstall()
        install_kvguard(KVGUARD_DISABLE=",".join(sorted(expected)))
        assert not expected & hpc.active_guards()
        assert hpc._scheduler_init("refuse")(constructor)(Built()) is None


def test_the_prefill_of_a_hisparse_deployment_is_a_plain_dsa_node_and_passes(hisparse, make_side):
    """HiSparse is decode-only; the prefill registers its own device DSA pool (KV and
    indexer at the KV page ids), which the prefill page guards cover."""
    with make_side("prefill", kv_pool=hisparse.make_dsa_pool, page_size=PAGE) as side:
        kv_args, draft = _registered(side)
        comps = {c.name: c for c in tc.describe(kv_args, side.kv_pool, draft)}
        assert "kv" in comps and not any(c.gaps for c in comps.values()), comps
        assert hpc.check_pools("prefill", side.allocator, side.req_to_token_pool, "refuse", PREFILL_GUARDS,
                               kv_args=kv_args, draft_pool=draft) == "ok"


def test_a_prefill_started_with_hisparse_refuses_naming_the_source_hold_and_the_checksum(hisparse):
    """Upstream documents HiSparse as decode-only but does not stop a prefill started
    with it. There the pool's own buffers are registered (they look like plain KV), but
    the logical page ids a transfer carries are mapped onto device slots, so the digest
    at those ids would read other rows: the checksum must not call them covered."""
    with hisparse_side(hisparse, mode="prefill") as side:
        kv_args, _ = _registered(side)
        comps = {c.name: c for c in tc.describe(kv_args, side.kv_pool)}
        assert "kv" in comps, comps  # what describe() alone would call covered
        with pytest.raises(hpc.HybridPoolUnguarded) as info:
            _check(side, PREFILL_GUARDS)
        msg = str(info.value)
        assert _named(msg) == PREFILL_GUARDS, msg
        line = next(x for x in msg.splitlines() if x.startswith("  - transfer_checksum: "))
        assert "maps the logical page ids" in line, line
