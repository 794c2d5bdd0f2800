"""Audit of hybrid_pool_check against more of SGLang's real pools (beyond MHA, MLA,
DSA/NSA, draft pools, MXFP8, pooled DSA indexer, layer-split DSA, SWA, Mamba and
HiSparse, which have their own tests).

Each PD role is built on CPU from the release's real pool class, with the release's
real ``PrefillBootstrapQueue`` / ``DecodePreallocQueue`` registering what it registers
with the (fake) transfer backend; kvguard's start-up decision is then taken from that
registration exactly as the scheduler-constructor wrapper takes it.

What "right" means here (``_audit``): every page guard the start-up check leaves
covering a node must check exactly what a transfer moves and the pages it lands in.
The transfer is modelled as Mooncake performs it from the registered ``KVArgs``:
for each registered buffer ``i`` and page ``p``, the ``item_len`` bytes at
``ptr + p * item_len`` go from prefill's buffer ``i`` to decode's buffer ``i`` (the KV
and the components sent at the KV page ids). Then

* a covering ``destination_canary`` stamps the reserved pages and, after that
  complete transfer, reports none unwritten, and writes nothing outside them;
* a covering ``transfer_checksum`` gives equal prefill and decode digests exactly
  when every per-page buffer decode reads at those pages (KV, scales, indexer rows)
  equals prefill's.

The audit found four configurations kvguard got wrong (FP4 MLA and FP4 MHA scales
that are never transferred, ROCm's vectorized_5d page-row layout, a KV-sharded
prefill); they were fixed in the same session and each test below says so. A fifth
(session 14): upstream's own copy writing outside the reservation where the registered
item length is not one page of the layout (0.5.13-0.5.15 vectorized_5d) must make
kvguard name every page guard on both nodes.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from sglang_kvguard.lifetime import transfer_components as tc
from sglang_kvguard.guards import hybrid_pool_check as hpc

pytestmark = [pytest.mark.component, pytest.mark.usefixtures("fake_manager_keeps_kv_args")]

PRE = set(tc.PAGE_GUARDS["prefill"])
DEC = set(tc.PAGE_GUARDS["decode"]) - {tc.DEFERRED}  # upstream's hold; judged elsewhere
CANARY, CHECKSUM = tc.CANARY, tc.CHECKSUM
ROOM = 424242
# per-page buffers a decode attention kernel reads at a page (what a landed page is)
STATE_ATTRS = ("k_buffer", "v_buffer", "kv_buffer", "k_scale_buffer", "v_scale_buffer", "kv_scale_buffer",
               "index_k_with_scale_buffer")


# ----------------------------------------------------------------------------- helpers
def _named(msg: str) -> set:
    return {line[4:].split(":", 1)[0] for line in msg.splitlines() if line.startswith("  - ")}


def _decision(side, allocator=None) -> set:
    """The page guards kvguard's start-up check names for this real PD side (empty: ok)."""
    kv_args, draft = hpc.transfer_kv_args(side.scheduler)
    assert kv_args is not None, "the real queue built no KVArgs"
    active = PRE if side.mode == "prefill" else DEC
    try:
        hpc.check_pools(side.mode, allocator or side.allocator, side.req_to_token_pool, "refuse", set(active),
                        kv_args=kv_args, draft_pool=draft)
    except hpc.HybridPoolUnguarded as exc:
        return _named(str(exc))
    return set()


def _tensors(pool) -> dict:
    """data_ptr -> tensor for every tensor the pool holds in its attributes."""
    out = {}
    for value in list(vars(pool).values()) + [getattr(pool, a, None) for a in STATE_ATTRS]:
        items = value if isinstance(value, (list, tuple)) else [value]
        for t in items:
            if isinstance(t, torch.Tensor) and t.numel():
                out.setdefault(t.data_ptr(), t)
    return out


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).reshape(-1)


def _registered(kv_args) -> list:
    """[(ptr, item_len)] a transfer moves at the KV page ids: the KV (target then
    draft) and the state components sent at KV page ids (DSA/NSA indexer)."""
    out = list(zip(tc._ptrs(kv_args.kv_data_ptrs), [int(x) for x in kv_args.kv_item_lens]))
    types = getattr(kv_args, "state_types", None)
    if types is not None:  # 0.5.13+: one list per component
        for t, ptrs, lens in zip(types, kv_args.state_data_ptrs, kv_args.state_item_lens):
            if str(getattr(t, "value", t)) in tc.PAGE_STATE_TYPES:
                out += list(zip(tc._ptrs(ptrs), [int(x) for x in lens]))
    elif str(getattr(kv_args, "state_type", "none")) in tc.PAGE_STATE_TYPES:
        out += list(zip(tc._ptrs(kv_args.state_data_ptrs), [int(x) for x in kv_args.state_item_lens]))
    return out


def _transfer(src_pool, src_args, dst_pool, dst_args, pages) -> None:
    """What Mooncake does for these pages: entry i's item at page p, prefill -> decode."""
    src, dst = _registered(src_args), _registered(dst_args)
    assert len(src) == len(dst), (len(src), len(dst))
    st, dt = _tensors(src_pool), _tensors(dst_pool)
    for (sp, sl), (dp, dl) in zip(src, dst):
        assert sp in st and dp in dt, "a registered buffer is not one of the pool's tensors"
        assert sl == dl
        s, d = _flat(st[sp]), _flat(dt[dp])
        for p in pages:
            d[p * dl:(p + 1) * dl] = s[p * sl:(p + 1) * sl]


def _page_buffers(pool) -> list:
    """[(name, tensor, rows per page)] of the per-page buffers decode reads."""
    slots = int(pool.size) + int(pool.page_size)
    out = []
    for attr in STATE_ATTRS:
        value = getattr(pool, attr, None)
        for i, t in enumerate(value if isinstance(value, (list, tuple)) else []):
            if not isinstance(t, torch.Tensor) or not t.numel():
                continue
            rows = t.shape[0]
            rpp = pool.page_size if rows == slots else 1 if rows * pool.page_size >= slots else None
            assert rpp is not None, f"{attr}[{i}] {tuple(t.shape)}: rows are neither tokens nor pages"
            out.append((f"{attr}[{i}]", t, rpp))
    return out


def _rows(t, rpp, pages):
    return torch.cat([t[p * rpp:(p + 1) * rpp].reshape(-1).view(torch.uint8) for p in pages])


def _fill(pool, seed):
    g = torch.Generator().manual_seed(seed)
    for _, t, _ in _page_buffers(pool):
        _flat(t).copy_(torch.randint(0, 256, (t.numel() * t.element_size(),), generator=g, dtype=torch.uint8))


@contextlib.contextmanager
def _pair(make_side, **kw):
    """A prefill and a decode side of one configuration, with kvguard's decision for each."""
    with make_side("prefill", **kw) as p:
        named_p = _decision(p)
        with make_side("decode", **kw) as d:
            yield p, d, named_p, _decision(d)


def _audit(p, d, named_p, named_d, pages) -> list:
    """Problems with kvguard's decision (see the module docstring); [] when right."""
    problems = []
    p_args, _ = hpc.transfer_kv_args(p.scheduler)
    d_args, _ = hpc.transfer_kv_args(d.scheduler)
    _fill(p.kv_pool, 1)
    _fill(d.kv_pool, 2)
    before = {name: t.clone() for name, t, _ in _page_buffers(d.kv_pool)}
    groups = tc.page_groups(d.kv_pool) or []
    canary = CANARY not in named_d
    if canary:
        try:
            tc.stamp_canary(groups, pages, ROOM)  # what destination_canary does at send_metadata
        except Exception as exc:  # noqa: BLE001
            problems.append(f"destination_canary is called covering but its stamp raises: {exc!r}")
            canary = False
    # only a guard's own writes are judged here (before the transfer): upstream's copy may
    # itself reach outside the reservation where its registered item length does not
    # match the layout (0.5.15's vectorized_5d: one page row times page_size)
    others = [q for q in range(d.kv_pool.size // d.kv_pool.page_size) if q not in pages][:16]
    for name, t, rpp in _page_buffers(d.kv_pool):
        if not torch.equal(_rows(before[name], rpp, others), _rows(t, rpp, others)):
            problems.append(f"{name}: rows of pages outside the reservation changed (a guard wrote there)")
    _transfer(p.kv_pool, p_args, d.kv_pool, d_args, pages)
    # upstream's own copy reaching outside the reservation (its registered item length is
    # not one page of the layout): no page guard watches the pages it lands in, so
    # kvguard must name every page guard on both nodes
    spilled = [name for name, t, rpp in _page_buffers(d.kv_pool)
               if not torch.equal(_rows(before[name], rpp, others), _rows(t, rpp, others))]
    if spilled and not (PRE <= named_p and DEC <= named_d):
        problems.append(f"upstream's transfer writes outside the reserved pages ({', '.join(spilled[:3])}) but "
                        f"kvguard leaves {sorted((PRE - named_p) | (DEC - named_d))} covering")
    if canary:
        left = tc.unwritten(groups, pages, ROOM)
        if left:
            problems.append(f"destination_canary is called covering but reports {left} unwritten after a "
                            "transfer that wrote every registered byte of those pages")
    complete = all(torch.equal(_rows(a, rpp, pages), _rows(b, rpp, pages))
                   for (_, a, rpp), (_, b, _) in zip(_page_buffers(p.kv_pool), _page_buffers(d.kv_pool)))
    if CHECKSUM not in named_p and CHECKSUM not in named_d:
        try:
            same = (tc.digest(tc.page_groups(p.kv_pool) or [], pages, ROOM)
                    == tc.digest(tc.page_groups(d.kv_pool) or [], pages, ROOM))
        except Exception as exc:  # noqa: BLE001
            problems.append(f"transfer_checksum is called covering but its digest raises: {exc!r}")
        else:
            if same != complete:
                problems.append(f"transfer_checksum is called covering but its digests {'match' if same else 'differ'}"
                                f" while decode's landed pages {'differ from' if same else 'equal'} prefill's")
    return problems


# ----------------------------------------------------------------------------- harness controls
def test_harness_control_plain_mha_pool_is_covered_and_right(make_side):
    with _pair(make_side, page_size=16, num_tokens=256) as (p, d, named_p, named_d):
        assert named_p == set() and named_d == set()
        assert _audit(p, d, named_p, named_d, [1, 3, 4]) == []


# ----------------------------------------------------------------------------- fp8 MLA / DSA
@pytest.mark.parametrize("pool", ["mla", "dsa"])
def test_fp8_mla_and_dsa_pools_are_covered_and_the_guards_check_what_moves(sgl, make_side, pool):
    """``--kv-cache-dtype fp8_e4m3`` on MLA / DSA: the same pool classes with FP8 latent
    rows (and, for DSA, the indexer at the KV page ids); nothing else registered."""
    build = sgl.make_mla_pool if pool == "mla" else sgl.make_dsa_pool
    kw = dict(kv_pool=lambda n, ps: build(n, ps, dtype=torch.float8_e4m3fn), page_size=64, num_tokens=512)
    with _pair(make_side, **kw) as (p, d, named_p, named_d):
        assert d.kv_pool.kv_buffer[0].dtype in (torch.float8_e4m3fn, torch.uint8)
        assert named_p == set() and named_d == set()
        assert _audit(p, d, named_p, named_d, [1, 2, 5]) == []


# ----------------------------------------------------------------------------- FP4 KV
# Fixed in session 13 (was a kvguard defect, found by this audit): MLATokenToKVPoolFP4 (--kv-
# cache-dtype fp4_e2m1, MLA) registers only kv_buffer for PD
# (MLATokenToKVPool.get_contiguous_buf_infos), never kv_scale_buffer; kvguard calls the node
# covered and its checksum digests kv_buffer alone, so decode commits pages whose FP4 scales
# are stale
def test_mla_fp4_pool_scales_are_not_transferred_so_canary_and_checksum_must_not_claim_them(sgl, make_side):
    with _pair(make_side, kv_pool=sgl.make_mla_fp4_pool, page_size=64, num_tokens=512) as (p, d, named_p, named_d):
        assert type(d.kv_pool).__name__ == "MLATokenToKVPoolFP4"
        registered = set(tc._ptrs(hpc.transfer_kv_args(d.scheduler)[0].kv_data_ptrs))
        assert not registered & {t.data_ptr() for t in d.kv_pool.kv_scale_buffer}  # upstream: scales never move
        assert _audit(p, d, named_p, named_d, [1, 2, 5]) == []


def _mha_fp4_has_recipe(sgl) -> bool:
    import inspect

    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return "quant_method" in inspect.signature(MHATokenToKVPool.__init__).parameters


# Fixed in session 13 (was a kvguard defect, found by this audit): an FP4 MHA pool
# (fp4_mx_block16 recipe) registers only k_buffer/v_buffer for PD
# (MHATokenToKVPool._pd_registerable_tensors) while kvguard's page_groups stamps and digests
# its k_scale_buffer/v_scale_buffer as 'block_scale' rows; the node is called covered, yet a
# complete transfer leaves every reserved page flagged unwritten and the digests unequal
# (describe() only flags unregistered KV, not unregistered scale buffers)
def test_mha_fp4_recipe_pool_scales_are_not_transferred_so_canary_and_checksum_must_not_claim_them(sgl, make_side):
    if not _mha_fp4_has_recipe(sgl):
        pytest.skip("release has no KV quantization recipe (MHATokenToKVPoolFP4: see the next test)")
    with _pair(make_side, kv_pool=sgl.make_mha_fp4_pool, page_size=16, num_tokens=256) as (p, d, named_p, named_d):
        registered = set(tc._ptrs(hpc.transfer_kv_args(d.scheduler)[0].kv_data_ptrs))
        assert d.kv_pool.k_scale_buffer and not registered & {t.data_ptr() for t in d.kv_pool.k_scale_buffer}
        assert _audit(p, d, named_p, named_d, [1, 3, 4]) == []


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_mha_fp4_pool_before_recipes_registers_dequantized_copies_and_is_refused(sgl, make_side, role):
    """0.5.10-era ``MHATokenToKVPoolFP4``: ``get_contiguous_buf_infos`` takes the pointers
    of ``_get_key_buffer(i)``, a freshly DEQUANTIZED tensor, not the pool's buffers.
    kvguard cannot place them: the canary and the checksum are named."""
    if _mha_fp4_has_recipe(sgl):
        pytest.skip("release builds FP4 MHA through a quant_method recipe (previous test)")
    with contextlib.ExitStack() as stack:
        try:
            side = stack.enter_context(make_side(role, kv_pool=sgl.make_mha_fp4_pool, page_size=16, num_tokens=256))
        except ImportError as exc:
            # 0.5.11-0.5.13: _get_key_buffer imports KVFP4QuantizeUtil, which the release no
            # longer ships, so upstream's own PD queue cannot register the pool: such a node
            # dies at start-up, before kvguard has anything to decide
            assert "KVFP4QuantizeUtil" in str(exc), exc
            pytest.skip(f"upstream cannot register MHATokenToKVPoolFP4 for PD on this release ({exc})")
        registered = set(tc._ptrs(hpc.transfer_kv_args(side.scheduler)[0].kv_data_ptrs))
        assert not registered & set(_tensors(side.kv_pool)), "the pool's own buffers are registered"
        expected = {CHECKSUM} if role == "prefill" else {CANARY, CHECKSUM}
        assert _decision(side) == expected


# ----------------------------------------------------------------------------- vectorized_5d (ROCm AITER)
# Fixed in session 13 (was a kvguard defect, found by this audit):
# SGLANG_AITER_KV_CACHE_LAYOUT=vectorized_5d (ROCm) lays MHA K/V out one leading row per PAGE
# (num_blocks, H, D/x, page, x) and registers those buffers; kvguard calls the node covered
# and reads page p as rows p*page_size..: the canary stamps page_size OTHER pages (or raises),
# the digest reads them
def test_vectorized_5d_mha_pool_guards_must_address_whole_page_rows(sgl, make_side):
    if not sgl.has_vectorized_5d_layout():
        pytest.skip("release has no vectorized_5d layout")
    with _pair(make_side, kv_pool=sgl.make_vectorized_5d_pool, page_size=16, num_tokens=512) as (p, d, named_p, named_d):
        assert d.kv_pool.k_buffer[0].shape[0] * 16 == d.kv_pool.size + 16  # rows are pages
        # page 1 alone (stamped rows 16..31: other pages), then a reservation past page 1
        assert _audit(p, d, named_p, named_d, [1]) + _audit(p, d, named_p, named_d, [1, 3]) == []


# Fixed in session 14 (an upstream defect kvguard called covered): on 0.5.13-0.5.15 the
# vectorized_5d pool registers an item length of one page ROW times page_size (its rows
# are already pages), so Mooncake moves page p from byte p * page_size * row: outside the
# reservation, into other requests' pages. 0.5.16+ registers one row. kvguard compares
# each registered item length with one page of the layout and refuses by name.
def test_vectorized_5d_item_length_that_spills_outside_the_reservation_is_refused(sgl, make_side):
    if not sgl.has_vectorized_5d_layout():
        pytest.skip("release has no vectorized_5d layout")
    with _pair(make_side, kv_pool=sgl.make_vectorized_5d_pool, page_size=16, num_tokens=512) as (p, d, named_p, named_d):
        p_args, _ = hpc.transfer_kv_args(p.scheduler)
        d_args, _ = hpc.transfer_kv_args(d.scheduler)
        _fill(p.kv_pool, 1)
        _fill(d.kv_pool, 2)
        before = {name: t.clone() for name, t, _ in _page_buffers(d.kv_pool)}
        _transfer(p.kv_pool, p_args, d.kv_pool, d_args, [1])
        others = [q for q in range(d.kv_pool.size // 16) if q != 1]
        spills = any(not torch.equal(_rows(before[n], r, others), _rows(t, r, others))
                     for n, t, r in _page_buffers(d.kv_pool))
        flagged = [c.name for c in tc.describe(d_args, d.kv_pool) if c.name == "kv_item_len"]
        assert bool(flagged) == spills, (
            f"upstream's copy {'writes' if spills else 'does not write'} outside the reservation, "
            f"kvguard {'names' if flagged else 'does not name'} kv_item_len")
        if spills:
            assert PRE <= named_p and DEC <= named_d, (named_p, named_d)


# ----------------------------------------------------------------------------- page interleave (KV sharding)
# Fixed in session 13 (was a kvguard defect, found by this audit): --enable-kv-cache-sharding
# (0.5.23, PD prefill only): PageInterleavePoolAllocator hands out logical pages l that this
# rank stores at local page l // N (and sends only l % N == rank,
# filter_kv_indices_for_shard_rank); the pool registers its stock buffers, so only the
# allocator gap is raised and prefill_source_hold named, while transfer_checksum digests rows
# at the logical ids
def test_sharded_prefill_names_the_checksum_as_well_as_the_source_hold(sgl, make_side):
    """The pool class (``PageInterleaveMHATokenToKVPool``) cannot be built on CPU: its
    ``_init_page_shard_state`` opens a ``PyNcclCommunicator`` (page_interleave_pool.py).
    It keeps the stock per-layer buffers and inherits ``get_contiguous_buf_infos``, so the
    real stock ``MHATokenToKVPool`` stands in for it; the allocator is the real one."""
    if sgl.page_interleave_allocator_class() is None:
        pytest.skip("release has no KV sharding")
    import numpy as np
    from sglang.srt.disaggregation import utils as dutils

    with make_side("prefill", page_size=16, num_tokens=256) as side:
        alloc = sgl.make_page_interleave_allocator(256, 16, side.kv_pool, shard_size=2)
        n = 16 * 8
        zero, lens = torch.zeros(1, dtype=torch.int64), torch.tensor([n])
        loc = alloc.alloc_extend(zero, zero, lens, lens, torch.tensor([-1]), n, rotation_bases=[None])
        logical = sorted({int(x) // 16 for x in loc.tolist()})
        shard_filter = getattr(dutils, "filter_kv_indices_for_shard_rank", None)  # 0.5.23; 0.5.20-0.5.22 lack it
        if shard_filter is not None:
            local, _ = shard_filter(kv_indices=np.asarray(logical), index_slice=slice(0, len(logical)),
                                    shard_rank=0, shard_size=2)
            assert sorted(int(x) for x in local) != [x for x in logical if x % 2 == 0]  # rows sent are not rows at l
        named = _decision(side, allocator=alloc)
        assert "prefill_source_hold" in named
        assert CHECKSUM in named, named


# ----------------------------------------------------------------------------- refused by name (right)
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_minimax_sparse_pool_is_refused_naming_every_page_guard(sgl, make_side, role):
    """``MiniMaxSparseKVPool``: sparse-layer KV registered through
    ``get_sparse_kv_buf_infos``, the index keys (and dense KV, 0.5.23) as their own state
    components; no per-layer buffers on the pool itself."""
    if sgl.minimax_sparse_pool_class() is None:
        pytest.skip("release has no MiniMax sparse pool")
    with make_side(role, kv_pool=sgl.make_minimax_sparse_pool, page_size=16, num_tokens=256) as side:
        kv_args, draft = hpc.transfer_kv_args(side.scheduler)
        names = {c.name for c in tc.describe(kv_args, side.kv_pool, draft)}
        assert "state:minimax_index_k" in names and "kv_unplaced" in names, names
        assert _decision(side) == (PRE if role == "prefill" else DEC)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_compressed_dsa_indexer_tail_is_refused_naming_every_page_guard(sgl, make_side, role):
    """DSA with ``index_kpool=2`` and ``index_kpool_compress``: a per-request ring row
    (``StateType.DSA_TAIL``) rides beside the pooled indexer."""
    if not sgl.has_dsa_compress_tail():
        pytest.skip("release has no compressed DSA indexer")
    from packaging.version import Version

    if Version(str(sgl.SGLANG_VERSION)) < Version("0.5.22"):
        # the tail needs a pooled indexer (page 128 = 2 x 64); off CUDA 0.5.20-0.5.21 assert
        # DSA page size 64, so the configuration cannot be built on this CPU test bed
        pytest.skip("0.5.20-0.5.21 off CUDA: DSA page size 64 only, the compressed tail needs page 128")
    with make_side(role, kv_pool=sgl.make_dsa_compress_pool, page_size=128, num_tokens=1024) as side:
        kv_args, _ = hpc.transfer_kv_args(side.scheduler)
        assert [str(t.value) for t in kv_args.state_types] == ["dsa", "dsa_tail"]
        assert _decision(side) == (PRE if role == "prefill" else DEC)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_dsa_target_with_a_dsa_draft(sgl, make_side, role):
    """MTP/EAGLE whose draft layer is itself DSA. 0.5.19+: upstream sends the draft's
    indexer in the same ``dsa`` component, which kvguard does not stamp: refused, the
    canary and the checksum at least named. 0.5.10-0.5.12: the draft's indexer is not
    registered at all (a draft-only gap upstream: speculation is verified by the
    target), and every registered buffer is one kvguard stamps: covered."""
    kw = dict(kv_pool=sgl.make_dsa_pool, draft_pool=lambda n, ps: sgl.make_dsa_pool(n, ps, layers=1),
              page_size=64, num_tokens=512)
    with make_side(role, **kw) as side:
        kv_args, draft = hpc.transfer_kv_args(side.scheduler)
        groups = tc.page_groups(side.kv_pool, draft)
        stamped = {p for g in groups for p in tc._buf_ptrs(g.buffers)}
        moved = {p for p, _ in _registered(kv_args)}
        named = _decision(side)
        if moved <= stamped:
            assert sgl.SGLANG_VERSION < sgl.Version("0.5.13")
            assert named == set()
        else:
            assert named >= ({CHECKSUM} if role == "prefill" else {CANARY, CHECKSUM}), named


def test_a_draft_pool_with_another_page_size_is_not_stamped_and_is_named(sgl, make_side):
    """A draft pool whose pages are laid out differently from the target's (here
    another page size) is not one kvguard stamps at the target's page ids."""
    kw = dict(draft_pool=lambda n, ps: sgl.make_kv_pool(n, ps // 2), page_size=16, num_tokens=256)
    with make_side("decode", **kw) as side:
        assert _decision(side) == {CANARY, CHECKSUM}
    with make_side("prefill", **kw) as side:
        assert _decision(side) == {CHECKSUM}


def test_double_sparsity_pool_cannot_register_for_pd_upstream(sgl, make_side):
    """``DoubleSparseTokenToKVPool`` (``--enable-double-sparsity``, 0.5.10) has no
    ``get_contiguous_buf_infos``: upstream's PD queue fails while registering, so the
    node never starts and kvguard has nothing to decide."""
    if sgl.double_sparse_pool_class() is None:
        pytest.skip("release has no double-sparsity pool")
    with pytest.raises((AttributeError, NotImplementedError)):
        with make_side("decode", kv_pool=sgl.make_double_sparse_pool, page_size=16, num_tokens=256):
            pass
