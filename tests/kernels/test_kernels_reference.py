"""The pure-torch reference: definition, known answers, detection properties, validation."""

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from _kernels_helpers import ROW_SHAPES, make_buffers  # noqa: E402
from sglang_kvguard import kernels as K  # noqa: E402
from sglang_kvguard.kernels import reference as ref  # noqa: E402

M64 = ref.MASK64
ROOM = 0x123456789ABCDEF0


def _fixed_buffers():
    """Two int32 buffers of 8 rows x 4 words; word i of buffer b = i*2654435761 + 12345*b + 1 (mod 2^32)."""
    i = torch.arange(32, dtype=torch.int64)
    return [ref.wrap_int32(i * 2654435761 + b * 12345 + 1).view(8, 4) for b in range(2)]


def _py_sums(b, page, page_size=2, R=4):
    a = bb = 0
    for j in range(page_size * R):
        w = ((page * page_size * R + j) * 2654435761 + b * 12345 + 1) & 0xFFFFFFFF
        a += w
        bb += (j + 1) * w
    return a & 0xFFFFFFFF, bb & 0xFFFFFFFF


# ----------------------------------------------------------------------------- known answers


def test_mix64_is_splitmix64():
    # first output of the reference splitmix64 generator seeded with 0
    assert ref.mix64_int(0) == 0xE220A8397B1DCDAF
    xs = [0, 1, -1, 2**63 - 1, -(2**63), 0x0123456789ABCDEF, -12345]
    got = ref.mix64(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert [g & M64 for g in got] == [ref.mix64_int(x & M64) for x in xs]


def test_known_answer_sums_and_digest():
    bufs = _fixed_buffers()
    sums = ref.page_sums(bufs, [3, 1], 2)
    expected = [[[4155282468, 3483537836], [3689921444, 3536896876]],
                [[4155381228, 3483982256], [3690020204, 3537341296]]]
    assert sums.tolist() == expected
    assert [[_py_sums(b, p) for p in (3, 1)] for b in range(2)] == [[tuple(x) for x in e] for e in expected]
    per, total = ref.bind_digest(sums, ROOM, [3, 1], [0, 1], [7, -1])
    assert [v & M64 for v in per.tolist()] == [0xAC8EFC3F62E55BEB, 0xB0A77F2DFDC38D9D]
    assert int(total) & M64 == 0xFF5D97E8CB9B2E30
    per2, total2 = ref.bind_digest_int([[tuple(x) for x in s] for s in expected], ROOM, [0, 1], [7, -1])
    assert per2 == [v & M64 for v in per.tolist()] and total2 == int(total) & M64
    assert K.canary_word(ROOM, 5) == 0xE5D8FB8E


def test_digest_pages_matches_bind_digest(force_torch):
    bufs = _fixed_buffers()
    per, total = K.digest_pages(bufs, [3, 1], 2, ROOM, [0, 1], [7, -1])
    assert int(total) & M64 == 0xFF5D97E8CB9B2E30


# ----------------------------------------------------------------------------- definition


@pytest.mark.parametrize("dtype", list(ROW_SHAPES))
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_fast_reference_equals_naive(dtype, page_size):
    bufs = make_buffers(3, page_size * 9, ROW_SHAPES[dtype], dtype, seed=page_size)
    for ids in ([4, 0, 8, 4, 2], [], [0, 1, 2, 3], list(range(9))):
        assert torch.equal(ref.page_sums(bufs, ids, page_size), ref.page_sums_naive(bufs, ids, page_size))


def test_fast_reference_chunking(monkeypatch):
    monkeypatch.setattr(ref, "_CHUNK_BYTES", 64)  # several pages per chunk and a short last chunk
    bufs = make_buffers(2, 4 * 20, (4,), torch.float32, seed=3)
    ids = [19, 3, 3, 7, 0, 11, 12, 13, 5, 2, 18]
    assert torch.equal(ref.page_sums(bufs, ids, 4), ref.page_sums_naive(bufs, ids, 4))
    assert torch.equal(ref.page_sums(bufs, list(range(3, 17)), 4), ref.page_sums_naive(bufs, list(range(3, 17)), 4))


def test_hypothesis_reference_equals_naive():
    hyp = pytest.importorskip("hypothesis")
    st = hyp.strategies

    @hyp.settings(max_examples=40, deadline=None, database=None)
    @hyp.given(
        n_buf=st.integers(1, 3),
        page_size=st.sampled_from([1, 2, 3, 8]),
        row_words=st.integers(1, 6),
        ids=st.lists(st.integers(0, 5), max_size=8),
        seed=st.integers(0, 1000),
    )
    def check(n_buf, page_size, row_words, ids, seed):
        bufs = make_buffers(n_buf, page_size * 6, (row_words,), torch.int32, seed=seed)
        assert torch.equal(ref.page_sums(bufs, ids, page_size), ref.page_sums_naive(bufs, ids, page_size))

    check()


def test_empty_inputs():
    bufs = make_buffers(2, 16, (4,), torch.float32)
    assert ref.page_sums(bufs, [], 4).shape == (2, 0, 2)
    per, total = ref.bind_digest(ref.page_sums(bufs, [], 4), ROOM, [])
    assert per.numel() == 0 and total.dim() == 0
    assert ref.canary_counts(bufs, [], 4, ROOM).numel() == 0
    assert ref.generation_mismatch(torch.zeros(4, dtype=torch.int32), [], []).numel() == 0


# ----------------------------------------------------------------------------- detection


def _digest(bufs, ids, page_size=4, room=ROOM, logical=None, gens=None):
    per, total = ref.bind_digest(ref.page_sums(bufs, ids, page_size), room, ids, logical, gens)
    return [v & M64 for v in per.tolist()], int(total) & M64


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8])
def test_single_bit_flip_changes_only_that_page(dtype):
    bufs = make_buffers(4, 4 * 8, ROW_SHAPES[dtype], dtype, seed=11)
    ids = [5, 2, 7, 0]
    per0, tot0 = _digest(bufs, ids)
    for layer, page_pos, row_in_page, byte in [(0, 0, 0, 0), (3, 2, 3, 5), (1, 1, 2, 7), (2, 3, 1, 3)]:
        flipped = [b.clone() for b in bufs]
        raw = flipped[layer].view(flipped[layer].shape[0], -1).view(torch.uint8)
        for bit in (0, 7):
            raw2 = raw.clone()
            raw2[ids[page_pos] * 4 + row_in_page, byte] ^= 1 << bit
            test = list(flipped)
            test[layer] = raw2.view(dtype).view(bufs[layer].shape)
            per1, tot1 = _digest(test, ids)
            changed = [i for i in range(len(ids)) if per1[i] != per0[i]]
            assert changed == [page_pos]
            assert tot1 != tot0


def test_swapping_page_data_changes_digest():
    bufs = make_buffers(3, 4 * 8, (4,), torch.float16, seed=5)
    ids = [1, 6]
    per0, tot0 = _digest(bufs, ids)
    swapped = [b.clone() for b in bufs]
    for b in swapped:
        b[4:8], b[24:28] = b[24:28].clone(), b[4:8].clone()
    per1, tot1 = _digest(swapped, ids)
    assert tot1 != tot0 and per1[0] != per0[0] and per1[1] != per0[1]
    # the same pages read in swapped logical order are a different digest as well
    assert _digest(bufs, [6, 1])[1] != tot0


def test_swapping_layers_changes_digest():
    bufs = make_buffers(2, 4 * 4, (4,), torch.float16, seed=6)
    assert _digest(bufs, [0, 2])[1] != _digest(bufs[::-1], [0, 2])[1]


def test_binding_to_room_generation_and_position():
    bufs = make_buffers(2, 4 * 8, (4,), torch.bfloat16, seed=7)
    ids = [3, 4]
    base = _digest(bufs, ids, gens=[1, 1])
    assert _digest(bufs, ids, room=ROOM + 1, gens=[1, 1])[1] != base[1]
    assert _digest(bufs, ids, room=2**63 - 1, gens=[1, 1])[1] != base[1]
    assert _digest(bufs, ids, gens=[1, 2])[0][1] != base[0][1]
    assert _digest(bufs, ids, gens=[1, 2])[0][0] == base[0][0]
    assert _digest(bufs, ids, logical=[0, 2], gens=[1, 1])[1] != base[1]
    # content equal, physical page different: digest equal (prefill and decode pages differ)
    same = [b.clone() for b in bufs]
    for b in same:
        b[28:32] = b[12:16]
    assert _digest(same, [7, 4], gens=[1, 1]) == base


def test_replay_of_another_requests_page_changes_digest():
    bufs = make_buffers(2, 4 * 8, (4,), torch.bfloat16, seed=8)
    req_a, req_b = [1, 2], [5, 6]
    room_a, room_b = 1111, 2222
    good_b = _digest(bufs, req_b, room=room_b)
    replay = [b.clone() for b in bufs]
    for b in replay:  # request B's second page now holds request A's second page
        b[24:28] = b[8:12]
    assert _digest(replay, req_b, room=room_b)[1] != good_b[1]
    # and A's page digests do not validate B, even with identical content
    assert _digest(bufs, req_a, room=room_b)[1] != _digest(bufs, req_a, room=room_a)[1]


# ----------------------------------------------------------------------------- canary, generations


def test_canary_word_never_zero_and_vectorised():
    ids = torch.arange(0, 2000, dtype=torch.int64)
    vec = ref.canary_words(ROOM, ids).tolist()
    assert [v & 0xFFFFFFFF for v in vec] == [ref.canary_word(ROOM, p) for p in range(2000)]
    assert all(ref.canary_word(r, p) != 0 for r in (0, 1, 2**63 - 1) for p in range(300))
    assert ref.canary_word(1, 1) != ref.canary_word(2, 1) != ref.canary_word(2, 2)


def test_reference_canary_stamp_count():
    bufs = make_buffers(2, 4 * 6, (2, 4), torch.bfloat16, seed=9)
    before = [b.clone() for b in bufs]
    ref.stamp_canary(bufs, [1, 4], 4, ROOM)
    full = K.canary_full_count(bufs, 4)
    assert full == 2 * 4 * 4
    assert ref.canary_counts(bufs, [1, 4, 0], 4, ROOM).tolist()[:2] == [full, full]
    for b, o in zip(bufs, before):
        assert torch.equal(b[0:4], o[0:4]) and torch.equal(b[8:16], o[8:16]) and torch.equal(b[20:], o[20:])
    bufs[1][17, 0, 1] = 1.5
    assert ref.canary_counts(bufs, [1, 4], 4, ROOM).tolist() == [full, full - 1]


def test_reference_generations_wrap_and_duplicates():
    gens = torch.tensor([0, 2**31 - 1, -1, 5], dtype=torch.int32)
    ref.bump_generations(gens, [1, 2, 3, 3, 3])
    assert gens.tolist() == [0, -(2**31), 0, 8]
    assert ref.generation_mismatch(gens, [3, 1, 0], [8, 2**31, 1]).tolist() == [False, False, True]


# ----------------------------------------------------------------------------- validation, dispatch


def test_validation_errors():
    with pytest.raises(ValueError, match="multiple of 4 bytes"):
        ref.page_sums([torch.zeros(8, 3, dtype=torch.float16)], [0], 4)
    with pytest.raises(ValueError, match="contiguous"):
        ref.page_sums([torch.zeros(8, 8)[:, ::2]], [0], 4)
    with pytest.raises(IndexError, match="out of range"):
        ref.page_sums([torch.zeros(8, 4)], [2], 4)
    with pytest.raises(IndexError):
        ref.page_sums([torch.zeros(8, 4)], [-1], 4)
    with pytest.raises(ValueError, match="int32"):
        ref.bump_generations(torch.zeros(4, dtype=torch.int64), [0])
    with pytest.raises(ValueError, match="page_size"):
        ref.page_sums([torch.zeros(8, 4)], [0], 0)


def test_dispatch(monkeypatch):
    monkeypatch.delenv("KVGUARD_KERNELS", raising=False)
    assert K.backend_for("cpu") == "torch"
    monkeypatch.setenv("KVGUARD_KERNELS", "triton")
    assert K.backend_for("cpu") == "triton"
    monkeypatch.setenv("KVGUARD_KERNELS", "torch")
    assert K.backend_for("cpu") == "torch"
    monkeypatch.setenv("KVGUARD_KERNELS", "bogus")
    with pytest.raises(ValueError):
        K.backend_for("cpu")


def test_import_does_not_pull_triton_or_sglang():
    code = (
        "import sys, torch\n"
        "had = 'triton' in sys.modules\n"
        "import sglang_kvguard.kernels as K\n"
        "K.page_sums([torch.zeros(4, 4)], [0], 2)\n"
        "assert 'sglang' not in sys.modules, 'sglang imported'\n"
        "assert had or 'triton' not in sys.modules, 'triton imported'\n"
    )
    env = dict(os.environ, KVGUARD_AUTO_INSTALL="0", KVGUARD_KERNELS="auto")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("page_size", [1, 16])
def test_reference_records_and_batch_mismatch(page_size):
    from _kernels_helpers import make_records, naive_mismatch

    r2t, gens, rec, rec_len = make_records(page_size)
    width = rec.shape[1]
    ref.record_generations(gens, r2t, rec, rec_len, [0, 2, 5], [0, 0, 0], [width, 3, 0], page_size)
    assert rec_len.tolist() == [width, 0, 3, 0, 0, 0]
    for s in range(width):
        assert int(rec[0, s]) == int(gens[int(r2t[0, s * page_size]) // page_size])
    assert rec[2, 3:].eq(0).all() and rec[1].eq(0).all()
    # extension: slots [3, 5) of row 2 only
    ref.record_generations(gens, r2t, rec, rec_len, [2], [3], [5], page_size)
    assert rec_len[2] == 5 and rec[2, 5:].eq(0).all()
    rows = [0, 1, 2, 5]
    assert ref.batch_generation_mismatch(gens, r2t, rec, rec_len, rows, page_size).tolist() == [False] * 4
    # a page of row 2 changes owner: only row 2 (and any row sharing that page) mismatches
    page = int(r2t[2, 4 * page_size]) // page_size
    ref.bump_generations(gens, [page])
    got = ref.batch_generation_mismatch(gens, r2t, rec, rec_len, rows, page_size).tolist()
    assert got == naive_mismatch(gens, r2t, rec, rec_len, rows, page_size)
    assert got[2] is True and got[1] is False and got[3] is False
    detail = ref.mismatched_slots(gens, r2t, rec, rec_len, 2, page_size)
    assert (4, page, int(gens[page]) - 1, int(gens[page])) in detail
    # pages recorded past rec_len do not count
    rec_len[2] = 4
    assert ref.batch_generation_mismatch(gens, r2t, rec, rec_len, [2], page_size).tolist() == [
        any(p == page for p in (int(r2t[2, s * page_size]) // page_size for s in range(4)))
    ]


def test_reference_records_validate_shapes():
    r2t = torch.zeros(4, 32, dtype=torch.int32)
    gens = torch.zeros(8, dtype=torch.int32)
    with pytest.raises(ValueError, match="rec_gens must be int32"):
        ref.batch_generation_mismatch(gens, r2t, torch.zeros(4, 3, dtype=torch.int32),
                                      torch.zeros(4, dtype=torch.int32), [0], 16)
    with pytest.raises(ValueError, match="rec_len"):
        ref.record_generations(gens, r2t, torch.zeros(4, 2, dtype=torch.int32),
                               torch.zeros(4, dtype=torch.int64), [0], [0], [1], 16)
