"""kvguard's reading of a KVArgs (both shapes upstream has used) without SGLang."""
from __future__ import annotations

import types

import pytest

from sglang_kvguard.lifetime import transfer_components as tc


class Buf:
    def __init__(self, ptr, shape=(64, 8)):
        self.ptr = ptr
        self.shape = shape

    def data_ptr(self):
        return self.ptr

    def dim(self):
        return len(self.shape)

    def numel(self):
        n = 1
        for s in self.shape:
            n *= s
        return n

    def __getitem__(self, i):  # one leading row, 2-byte elements
        return types.SimpleNamespace(nbytes=self.numel() // self.shape[0] * 2)


def _pool(*ptrs, attr="k_buffer", page_size=16, **extra):
    return types.SimpleNamespace(page_size=page_size, size=64, **{attr: [Buf(p) for p in ptrs]}, **extra)


def test_plain_kv_and_aux():
    args = types.SimpleNamespace(kv_data_ptrs=[1, 2], aux_data_ptrs=[9], state_types=[], state_data_ptrs=[])
    comps = {c.name: c for c in tc.describe(args, _pool(1, 2))}
    assert set(comps) == {"kv", "aux"} and comps["kv"].gaps == {}
    assert tc.gaps_for("decode", comps.values(), None) == {}


def test_old_single_state_type_is_a_component_every_page_guard_misses():  # 0.5.10-0.5.12 shape
    # an "nsa" state whose buffers are not the pool's page-indexed indexer rows
    args = types.SimpleNamespace(kv_data_ptrs=[1], state_type="nsa", state_data_ptrs=[5, 6])
    comps = tc.describe(args, _pool(1, attr="kv_buffer"))
    state = [c for c in comps if c.name == "state:nsa"]
    assert state and state[0].buffers == 2
    gaps = tc.gaps_for("prefill", comps, None)
    assert set(gaps) == {"prefill_source_hold", "transfer_checksum"}


def test_per_component_state_types():  # 0.5.13+ shape, enum members
    dsa = types.SimpleNamespace(value="dsa")
    tail = types.SimpleNamespace(value="dsa_tail")
    args = types.SimpleNamespace(kv_data_ptrs=[1], state_types=[dsa, tail], state_data_ptrs=[[5, 6], [7]])
    comps = tc.describe(args, _pool(1, attr="kv_buffer"))
    assert [c.name for c in comps] == ["kv", "state:dsa", "state:dsa_tail"]
    assert all(c.gaps for c in comps[1:])  # the pool has no indexer rows at those pointers


def _indexer_pool(*ptrs, **kw):
    pages = 64 // 16 + 1
    return _pool(1, attr="kv_buffer", index_k_with_scale_buffer=[Buf(p, (pages, 16 * 132)) for p in ptrs], **kw)


def test_indexer_rows_at_the_kv_page_ids_are_covered():
    dsa = types.SimpleNamespace(value="dsa")
    args = types.SimpleNamespace(kv_data_ptrs=[1], state_types=[dsa], state_data_ptrs=[[5, 6]])
    comps = {c.name: c for c in tc.describe(args, _indexer_pool(5, 6))}
    assert comps["state:dsa"].gaps == {}
    groups = tc.page_groups(_indexer_pool(5, 6))
    assert [(g.component, g.rows_per_page) for g in groups] == [("kv", 16), ("indexer", 1)]
    assert tc.page_state_positions(args) == [0]
    assert tc.page_state_positions(types.SimpleNamespace(state_type="nsa")) == [-1]
    assert tc.page_state_positions(types.SimpleNamespace(state_type="mamba")) == []
    scale = types.SimpleNamespace(value="block_scale")
    swa_scale = types.SimpleNamespace(value="block_scale_swa")
    assert tc.page_state_positions(types.SimpleNamespace(state_types=[swa_scale, scale, dsa])) == [1, 2]


@pytest.mark.parametrize("pool_kw, ptrs", [
    (dict(index_kpool=2), [5, 6]),   # pooled index keys: not at the KV page ids
    (dict(), [5]),                   # an indexer layer kvguard would stamp is not registered
])
def test_indexer_state_kvguard_cannot_place_is_refused(pool_kw, ptrs):
    dsa = types.SimpleNamespace(value="dsa")
    args = types.SimpleNamespace(kv_data_ptrs=[1], state_types=[dsa], state_data_ptrs=[ptrs])
    comps = {c.name: c for c in tc.describe(args, _indexer_pool(5, 6, **pool_kw))}
    assert set(comps["state:dsa"].gaps) == set(tc.ALL_PAGE_GUARDS)


def test_state_pages_of_both_kvargs_shapes():
    assert tc.state_pages([[0, 1, 2], [9]], [0]) == [0, 1, 2]
    assert tc.state_pages([0, 1, 2], [-1]) == [0, 1, 2]
    assert tc.state_pages(None, [0]) == [] and tc.state_pages([[1]], []) == []


@pytest.mark.parametrize("registered, pool, name", [
    ([1, 2, 3], (1, 2), "kv_unplaced"),   # a registered KV buffer kvguard does not stamp
    ([1], (1, 2), "kv_unregistered"),     # kvguard would stamp a buffer never transferred (layer split)
])
def test_kv_buffers_that_do_not_match_are_named(registered, pool, name):
    args = types.SimpleNamespace(kv_data_ptrs=registered)
    comps = {c.name: c for c in tc.describe(args, _pool(*pool))}
    assert set(comps[name].gaps) == {"destination_canary", "transfer_checksum"}


def test_draft_pool_kvguard_cannot_stamp_is_refused_for_canary_and_checksum():
    draft = types.SimpleNamespace(get_contiguous_buf_infos=lambda: ([3, 4], [0, 0], [0, 0]))
    args = types.SimpleNamespace(kv_data_ptrs=[1, 2, 3, 4])
    comps = {c.name: c for c in tc.describe(args, _pool(1, 2), draft)}
    assert comps["draft_kv"].buffers == 2 and "kv_unplaced" not in comps
    assert set(tc.gaps_for("decode", comps.values(), {"page_generation", "destination_canary"})) == {
        "destination_canary"}


def test_draft_pool_with_page_buffers_is_covered():
    draft = _pool(3, 4)
    draft.get_contiguous_buf_infos = lambda: ([3, 4], [0, 0], [0, 0])
    args = types.SimpleNamespace(kv_data_ptrs=[1, 2, 3, 4])
    comps = {c.name: c for c in tc.describe(args, _pool(1, 2), draft)}
    assert comps["draft_kv"].gaps == {}
    assert [g.component for g in tc.page_groups(_pool(1, 2), draft)] == ["kv", "draft_kv"]


def test_layer_split_placeholders_are_refused_for_canary_and_checksum_and_never_stamped():
    pool = _pool(1, 2)
    pool.kv_buffer = []
    pool.k_buffer = [Buf(1), Buf(0, (0, 8))]  # the second layer is another rank's
    args = types.SimpleNamespace(kv_data_ptrs=[1])
    comps = {c.name: c for c in tc.describe(args, pool)}
    assert set(comps["kv_layer_split"].gaps) == {"destination_canary", "transfer_checksum"}
    assert "kv_unregistered" not in comps
    assert [len(g.buffers) for g in tc.page_groups(pool)] == [1]


@pytest.mark.parametrize("item_len, flagged", [(8 * 2 * 16, False), (8 * 2 * 16 * 16, True), (8 * 2, True)])
def test_registered_item_length_must_be_one_page_of_the_layout(item_len, flagged):
    """Mooncake moves page p at byte p * item_len: an item length that is not one page of
    the buffer's layout lands outside the reservation, which no page guard watches."""
    args = types.SimpleNamespace(kv_data_ptrs=[1, 2], kv_item_lens=[8 * 2 * 16, item_len], aux_data_ptrs=[],
                                 state_types=[], state_data_ptrs=[])
    comps = {c.name: c for c in tc.describe(args, _pool(1, 2))}
    assert ("kv_item_len" in comps) == flagged
    if flagged:
        assert comps["kv_item_len"].buffers == 1
        assert set(tc.gaps_for("decode", comps.values(), None)) == set(tc.PAGE_GUARDS["decode"])
        assert set(tc.gaps_for("prefill", comps.values(), None)) == set(tc.PAGE_GUARDS["prefill"])


def test_item_lengths_that_cannot_be_paired_with_buffers_are_not_guessed():
    args = types.SimpleNamespace(kv_data_ptrs=[1, 2], kv_item_lens=[7], state_types=[], state_data_ptrs=[])
    assert "kv_item_len" not in {c.name for c in tc.describe(args, _pool(1, 2))}
