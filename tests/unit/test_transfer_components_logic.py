"""kvguard's reading of a KVArgs (both shapes upstream has used) without SGLang."""
from __future__ import annotations

import types

import pytest

from sglang_kvguard import transfer_components as tc


class Buf:
    def __init__(self, ptr):
        self.ptr = ptr

    def data_ptr(self):
        return self.ptr


def _pool(*ptrs, attr="k_buffer"):
    return types.SimpleNamespace(**{attr: [Buf(p) for p in ptrs]})


def test_plain_kv_and_aux():
    args = types.SimpleNamespace(kv_data_ptrs=[1, 2], aux_data_ptrs=[9], state_types=[], state_data_ptrs=[])
    comps = {c.name: c for c in tc.describe(args, _pool(1, 2))}
    assert set(comps) == {"kv", "aux"} and comps["kv"].gaps == {}
    assert tc.gaps_for("decode", comps.values(), None) == {}


def test_old_single_state_type_is_a_component_every_page_guard_misses():  # 0.5.10-0.5.12 shape
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
    names = [c.name for c in tc.describe(args, _pool(1, attr="kv_buffer"))]
    assert names == ["kv", "state:dsa", "state:dsa_tail"]


@pytest.mark.parametrize("registered, pool, name", [
    ([1, 2, 3], (1, 2), "kv_unplaced"),   # a registered KV buffer kvguard does not stamp
    ([1], (1, 2), "kv_unregistered"),     # kvguard would stamp a buffer never transferred (layer split)
])
def test_kv_buffers_that_do_not_match_are_named(registered, pool, name):
    args = types.SimpleNamespace(kv_data_ptrs=registered)
    comps = {c.name: c for c in tc.describe(args, _pool(*pool))}
    assert set(comps[name].gaps) == {"destination_canary", "transfer_checksum"}


def test_draft_pool_is_recognised_by_its_own_registration():
    draft = types.SimpleNamespace(get_contiguous_buf_infos=lambda: ([3, 4], [0, 0], [0, 0]))
    args = types.SimpleNamespace(kv_data_ptrs=[1, 2, 3, 4])
    comps = {c.name: c for c in tc.describe(args, _pool(1, 2), draft)}
    assert comps["draft_kv"].buffers == 2 and "kv_unplaced" not in comps
    assert set(tc.gaps_for("decode", comps.values(), {"page_generation", "destination_canary"})) == {
        "destination_canary"}
