"""What a PD transfer moves, read from what upstream registered with its transfer
backend, against what the page guards cover (issue: the incident's model class).

Each test builds SGLang's real pools (MHA, MLA, DSA/NSA with the indexer, a draft
model's pool) and the real PD queue for the role: the queue's own ``_init_kv_manager``
builds the ``KVArgs`` the transfer backend is given (fake backend here; Mooncake is
given the same). kvguard's start-up check must call the node covered only when every
registered component is covered by every active page guard of the role, and
otherwise refuse naming each component and guard.
"""

from __future__ import annotations

import inspect
import os

import pytest

from sglang_kvguard.lifetime import transfer_components as tc
from sglang_kvguard.guards import hybrid_pool_check as hpc

pytestmark = pytest.mark.usefixtures("fake_manager_keeps_kv_args")

PREFILL_GUARDS = {"prefill_source_hold", "transfer_checksum"}
DECODE_GUARDS = {"page_generation", "decode_destination_hold", "destination_canary", "transfer_checksum"}


def _registered(side):
    kv_args, draft = hpc.transfer_kv_args(side.scheduler)
    if kv_args is None:
        from sglang.srt.disaggregation.fake.conn import FakeKVManager

        if "self.kv_args = args" not in inspect.getsource(FakeKVManager.__init__):
            pytest.skip("this release's fake transfer backend does not keep the KVArgs it was given (0.5.10-0.5.11; "
                        "Mooncake's manager does on every release: the server tier reads it there)")
    assert kv_args is not None, "the real queue built no KVArgs"
    return kv_args, draft


def _check(side, role, active, policy="refuse"):
    kv_args, draft = _registered(side)
    return hpc.check_pools(role, side.allocator, side.req_to_token_pool, policy, active,
                           kv_args=kv_args, draft_pool=draft)


def _components(side):
    kv_args, draft = _registered(side)
    return {c.name: c for c in tc.describe(kv_args, side.kv_pool, draft)}


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_mha_pool_every_registered_buffer_is_covered(make_side, role):
    with make_side(role) as side:
        comps = _components(side)
        assert set(comps) == {"kv", "aux"}, comps
        assert comps["kv"].buffers == 2 * 2  # K and V of 2 layers
        assert _check(side, role, PREFILL_GUARDS if role == "prefill" else DECODE_GUARDS) == "ok"


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_mla_pool_latent_kv_is_covered(make_side, sgl, role):
    with make_side(role, kv_pool=sgl.make_mla_pool) as side:
        comps = _components(side)
        assert set(comps) == {"kv", "aux"}, comps
        assert comps["kv"].buffers == 2  # one latent buffer per layer
        assert _check(side, role, PREFILL_GUARDS if role == "prefill" else DECODE_GUARDS) == "ok"


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_dsa_pool_indexer_state_is_covered(make_side, sgl, role):
    """The indexer's keys (one row per KV page) are stamped, digested, held and tagged
    with the KV pages (test_mla_dsa_draft_integrity.py shows each guard catching them)."""
    active = PREFILL_GUARDS if role == "prefill" else DECODE_GUARDS
    with make_side(role, kv_pool=sgl.make_dsa_pool, page_size=64) as side:
        comps = _components(side)
        states = [n for n in comps if n.startswith("state:")]
        assert states, f"the DSA indexer is not among the registered components: {comps}"
        assert all(n in ("state:dsa", "state:nsa") for n in states), states
        assert all(not comps[n].gaps for n in states), comps
        assert _check(side, role, active) == "ok"


def _pooled_dsa_pool(sgl):
    """The release's DSA pool with pooled index keys (``index_kpool=2``)."""
    def pooled(n, page):
        return sgl.call_supported(
            sgl.dsa_pool_class(), size=n, page_size=page, dtype=sgl.torch.bfloat16,
            kv_lora_rank=sgl.MLA_KV_LORA_RANK, qk_rope_head_dim=sgl.MLA_ROPE_DIM, layer_num=2, device=sgl.DEVICE,
            index_head_dim=sgl.DSA_INDEX_HEAD_DIM, enable_memory_saver=False,
            kv_cache_dim=sgl.MLA_KV_LORA_RANK + sgl.MLA_ROPE_DIM, start_layer=0, end_layer=1, index_kpool=2)
    return pooled


def _pooled_page(sgl) -> int:
    """Page 128 for the pooled pool where the release takes it (measured: 0.5.22, 0.5.23);
    0.5.20 asserts page 64 for DSA off CUDA (found by the rotating-release tier)."""
    from packaging.version import Version

    return 128 if Version(str(sgl.SGLANG_VERSION)) >= Version("0.5.22") else 64


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_pooled_dsa_indexer_is_refused_by_name(make_side, sgl, role):
    """0.5.23's pooled index keys (``index_kpool`` > 1: several KV pages' keys in one
    indexer row) are not at the KV page ids: refused, naming the component and guards."""
    from sglang_kvguard.guards import hybrid_pool_check as hpc2

    if "index_kpool" not in inspect.signature(sgl.dsa_pool_class().__init__).parameters:
        pytest.skip("this release's DSA pool has no pooled index keys")

    pooled = _pooled_dsa_pool(sgl)
    active = PREFILL_GUARDS if role == "prefill" else DECODE_GUARDS
    with make_side(role, kv_pool=pooled, page_size=_pooled_page(sgl)) as side:
        comps = _components(side)
        states = [n for n in comps if n.startswith("state:")]
        assert any(comps[n].gaps for n in states), comps
        with pytest.raises(hpc2.HybridPoolUnguarded) as info:
            _check(side, role, active)
        msg = str(info.value)
        for guard in active:
            assert f"  - {guard}: " in msg, msg
            assert "state:dsa" in msg.split(f"  - {guard}: ", 1)[1].split("\n", 1)[0], (guard, msg)
        assert f"--kvguard-disable {','.join(sorted(active))}" in msg, msg
        assert _check(side, role, set()) == "ok"
        assert _check(side, role, active, policy="warn") == "warn"


def test_draft_kv_is_covered_with_the_target_kv(make_side, sgl):
    with make_side("decode", draft_pool=lambda n, page: sgl.make_kv_pool(n, page)) as side:
        comps = _components(side)
        assert comps["draft_kv"].buffers == 2 * 2, comps
        assert not comps["draft_kv"].gaps, comps
        assert _check(side, "decode", DECODE_GUARDS) == "ok"


def test_an_unreadable_registration_is_never_called_covered(make_side):
    with make_side("decode") as side:
        with pytest.raises(hpc.HybridPoolUnguarded) as info:
            hpc.check_pools("decode", side.allocator, side.req_to_token_pool, "refuse", DECODE_GUARDS,
                            kv_args=None)
        assert "could not be read" in str(info.value)


def _layer_split_pool(sgl):
    try:
        from sglang.srt.mem_cache.dsa_cache_layer_split import LayerSplitDSATokenToKVPool
    except ImportError:
        pytest.skip("this release ships no layer-split DSA pool")

    def build(n, page):
        import contextlib
        import types

        ctx = contextlib.nullcontext()
        try:  # 0.5.2x: one rank, no CP group to broadcast over (stated as the scheduler states it)
            from sglang.srt.runtime_context import get_parallel

            ctx = get_parallel().override(attn_cp_group=types.SimpleNamespace(world_size=1, pynccl_comm=None))
        except ImportError:
            pass
        with ctx:
            return _build(n, page)

    def _build(n, page):
        return sgl.call_supported(
            LayerSplitDSATokenToKVPool, size=n, page_size=page, dtype=sgl.torch.bfloat16,
            kv_lora_rank=sgl.MLA_KV_LORA_RANK, qk_rope_head_dim=sgl.MLA_ROPE_DIM, layer_num=2, device=sgl.DEVICE,
            index_head_dim=sgl.DSA_INDEX_HEAD_DIM, enable_memory_saver=False,
            kv_cache_dim=sgl.MLA_KV_LORA_RANK + sgl.MLA_ROPE_DIM, start_layer=0, end_layer=1,
            layer_shard_rank=0, layer_shard_size=2)

    return build


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_layer_split_dsa_pool_is_refused_by_name_and_never_raises_in_a_guard(make_side, sgl, role):
    """``LayerSplitDSATokenToKVPool``: this rank holds layer 0; layer 1 is a 0-row
    placeholder (registered nowhere). Refused for the canary and the checksum, naming
    the layer split; with the gap accepted, stamping and digesting never index a
    placeholder (they raised IndexError in upstream's send_metadata before)."""
    from sglang_kvguard.lifetime import transfer_components as tc2

    active = PREFILL_GUARDS if role == "prefill" else DECODE_GUARDS
    with make_side(role, kv_pool=_layer_split_pool(sgl), page_size=64) as side:
        comps = _components(side)
        assert "kv_layer_split" in comps, comps
        with pytest.raises(hpc.HybridPoolUnguarded) as info:
            _check(side, role, active)
        msg = str(info.value)
        assert "  - transfer_checksum: kv_layer_split" in msg, msg
        assert "LayerSplitDSATokenToKVPool" in msg, msg
        for guard in ("prefill_source_hold", "page_generation", "decode_destination_hold"):
            assert f"  - {guard}: kv_layer_split" not in msg, msg
        assert _check(side, role, active, policy="warn") == "warn"
        groups = tc2.page_groups(side.kv_pool)
        tc2.stamp_canary(groups, [1, 2], 99)
        assert tc2.unwritten(groups, [1, 2], 99) == {g.component: [1, 2] for g in groups}
        assert isinstance(tc2.digest(groups, [1, 2], 99), int)


# ----------------------------------------------------------------------------- the table


def _pool_builders(sgl):
    """pool class label -> make_side keyword arguments, for the classes this release ships."""
    out = {
        "MHATokenToKVPool": dict(),
        "MLATokenToKVPool": dict(kv_pool=sgl.make_mla_pool),
        f"{sgl.dsa_pool_class().__name__}": dict(kv_pool=sgl.make_dsa_pool, page_size=64),
        "MHATokenToKVPool + MHA draft": dict(draft_pool=lambda n, page: sgl.make_kv_pool(n, page)),
        f"{sgl.dsa_pool_class().__name__} + MLA draft": dict(
            kv_pool=sgl.make_dsa_pool, draft_pool=lambda n, page: sgl.make_mla_pool(n, page, layers=1), page_size=64),
    }
    if sgl.mxfp8_pool_class() is not None:
        out["MHATokenToKVPoolMXFP8 (page 16)"] = dict(kv_pool=sgl.make_mxfp8_pool)
        out["MHATokenToKVPoolMXFP8 (page 128)"] = dict(kv_pool=sgl.make_mxfp8_pool, page_size=128)
    if "index_kpool" in inspect.signature(sgl.dsa_pool_class().__init__).parameters:
        pooled = _pooled_dsa_pool(sgl)
        out[f"{sgl.dsa_pool_class().__name__} (index_kpool=2)"] = dict(kv_pool=pooled, page_size=_pooled_page(sgl))
    try:
        out["LayerSplitDSATokenToKVPool"] = dict(kv_pool=_layer_split_pool(sgl), page_size=64)
    except pytest.skip.Exception:
        pass
    return out


def test_pool_coverage_table_matches_docs(make_side, sgl):
    """The start-up decision on each pool class this release ships that the CPU test bed
    builds, per role: covered, or the components and the page guards that miss them.
    ``docs/pool-coverage/sglang-<release>.json`` must say the same (rendered into
    docs/compatibility.md by scripts/compat_table.py); KVGUARD_WRITE_POOL_COVERAGE=1
    rewrites it from this run."""
    import json
    from pathlib import Path

    table = {}
    for label, kw in _pool_builders(sgl).items():
        table[label] = {}
        for role in ("prefill", "decode"):
            with make_side(role, **kw) as side:
                comps = _components(side)
                gaps = tc.gaps_for(role, comps.values(), None)
                missed = {}
                for guard, whys in sorted(gaps.items()):
                    for why in whys:
                        missed.setdefault(why.split(" (", 1)[0], []).append(guard)
                table[label][role] = {"components": sorted(c for c in comps if c != "aux"),
                                      "outcome": "refused" if missed else "covered",
                                      "missed": {c: sorted(g) for c, g in sorted(missed.items())}}
    release = sgl.SGLANG_VERSION
    path = Path(__file__).resolve().parents[2] / "docs" / "pool-coverage" / f"sglang-{release}.json"
    text = json.dumps({"release": str(release), "pools": table}, indent=2, sort_keys=True) + "\n"
    if os.environ.get("KVGUARD_WRITE_POOL_COVERAGE") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    if not path.exists():
        pytest.skip(f"no recorded table for {release} (KVGUARD_WRITE_POOL_COVERAGE=1 records one)")
    assert json.loads(path.read_text()) == json.loads(text), (
        f"{path} differs from what this release decides; rerun with KVGUARD_WRITE_POOL_COVERAGE=1 and "
        f"python scripts/compat_table.py")
