"""Triton kernels (interpreter on CPU, real launches on CUDA) against the torch reference."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from _kernels_helpers import ROW_SHAPES, make_buffers  # noqa: E402
from sglang_kvguard import kernels as K  # noqa: E402
from sglang_kvguard.kernels import reference as ref  # noqa: E402
from sglang_kvguard.kernels import triton_kernels as tk  # noqa: E402

ROOM = 0x0FEDCBA987654321
IDS = [6, 0, 3, 3, 1]  # non-contiguous, repeated


def _cpu(bufs):
    return [b.detach().cpu().clone() for b in bufs]


@pytest.fixture
def launches():
    """Snapshot of the launch counters; call to get the deltas."""
    before = dict(tk.LAUNCHES)
    return lambda: {k: tk.LAUNCHES[k] - before[k] for k in tk.LAUNCHES}


@pytest.mark.parametrize("dtype", list(ROW_SHAPES))
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_page_sums_bit_exact(dtype, page_size, device, force_triton, launches):
    bufs = make_buffers(3, page_size * 7, ROW_SHAPES[dtype], dtype, device, seed=page_size + 1)
    got = K.page_sums(bufs, IDS, page_size)
    assert got.device.type == device
    assert torch.equal(got.cpu(), ref.page_sums(_cpu(bufs), IDS, page_size))
    assert launches()["page_sums"] == 1  # one launch for all buffers
    assert K.page_sums(bufs, [], page_size).shape == (3, 0, 2)


def test_page_sums_mixed_row_widths(device, force_triton, launches):
    # K/V buffers of one width plus an MLA-like buffer of another: one launch per width
    bufs = make_buffers(2, 16 * 4, (2, 4), torch.bfloat16, device, seed=1)
    bufs.insert(1, make_buffers(1, 16 * 4, (5,), torch.float32, device, seed=2)[0])
    ids = [3, 1, 1]
    assert torch.equal(K.page_sums(bufs, ids, 16).cpu(), ref.page_sums(_cpu(bufs), ids, 16))
    assert launches()["page_sums"] == 2


def test_page_sums_large_page_loops_over_blocks(device, force_triton):
    # 64 rows x 72 words = 4608 words per page: several BLOCK steps and a masked tail
    bufs = make_buffers(2, 64 * 3, (36, 4), torch.float16, device, seed=4)
    assert torch.equal(K.page_sums(bufs, [2, 0], 64).cpu(), ref.page_sums(_cpu(bufs), [2, 0], 64))


def test_digest_same_on_both_paths(device, monkeypatch, launches):
    bufs = make_buffers(4, 16 * 6, (2, 4), torch.bfloat16, device, seed=12)
    monkeypatch.setenv("KVGUARD_KERNELS", "triton")
    per_t, tot_t = K.digest_pages(bufs, [5, 2, 4], 16, ROOM, generations=[1, 2, 3])
    assert launches()["page_sums"] == 1
    monkeypatch.setenv("KVGUARD_KERNELS", "torch")
    per_r, tot_r = K.digest_pages(_cpu(bufs), [5, 2, 4], 16, ROOM, generations=[1, 2, 3])
    assert launches()["page_sums"] == 1  # the torch path launched nothing
    assert torch.equal(per_t.cpu(), per_r) and int(tot_t) == int(tot_r)


def test_auto_mode_uses_triton_exactly_for_cuda(monkeypatch, device, launches):
    monkeypatch.delenv("KVGUARD_KERNELS", raising=False)
    bufs = make_buffers(1, 8, (4,), torch.float32, device)
    K.page_sums(bufs, [0, 1], 4)
    assert launches()["page_sums"] == (1 if device == "cuda" else 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8, torch.float32])
def test_canary_stamp_and_count(dtype, device, force_triton, launches):
    page_size = 16
    bufs = make_buffers(3, page_size * 6, ROW_SHAPES[dtype], dtype, device, seed=21)
    before = [b.clone() for b in bufs]
    K.stamp_canary(bufs, [4, 1, 4], page_size, ROOM)
    # the reference stamps the same bits
    ref_bufs = _cpu(before)
    ref.stamp_canary(ref_bufs, [4, 1], page_size, ROOM)
    for b, r in zip(bufs, ref_bufs):
        assert torch.equal(b.cpu().view(torch.uint8), r.view(torch.uint8))
    # other pages untouched
    for b, o in zip(bufs, before):
        for p in (0, 2, 3, 5):
            rows = slice(p * page_size, (p + 1) * page_size)
            assert torch.equal(b[rows].cpu().view(torch.uint8), o[rows].cpu().view(torch.uint8))
    full = K.canary_full_count(bufs, page_size)
    counts = K.canary_counts(bufs, [1, 4, 0, 1], page_size, ROOM)
    assert counts.cpu().tolist()[:2] == [full, full] and counts.cpu().tolist()[3] == full
    assert torch.equal(counts.cpu(), ref.canary_counts(_cpu(bufs), [1, 4, 0, 1], page_size, ROOM))
    # a page stamped for another room does not count
    assert K.canary_counts(bufs, [1], page_size, ROOM + 1).cpu().tolist() == [0]
    # any write into one row of page 4 lowers its count, and only its count
    raw = bufs[2].view(bufs[2].shape[0], -1).view(torch.uint8)
    raw[4 * page_size + 7, :4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8, device=device)
    after = K.canary_counts(bufs, [1, 4], page_size, ROOM).cpu().tolist()
    assert after[0] == full and after[1] == full - 1
    d = launches()
    assert d["stamp"] == 1 and d["count"] == 3


@pytest.mark.parametrize("page_size", [1, 64])
def test_canary_counts_random_data(page_size, device, force_triton):
    bufs = make_buffers(2, page_size * 4, (2, 2), torch.int8, device, seed=page_size)
    # plant a few canary words into page 2 by hand
    can = ref.canary_word(ROOM, 2)
    w0 = bufs[0].view(bufs[0].shape[0], -1).view(torch.int32)
    w0[2 * page_size, 0] = ref.to_signed32(can)
    got = K.canary_counts(bufs, [2, 3, 2], page_size, ROOM)
    assert torch.equal(got.cpu(), ref.canary_counts(_cpu(bufs), [2, 3, 2], page_size, ROOM))
    assert got.cpu().tolist()[0] >= 1


def test_generations_bit_exact(device, force_triton, launches):
    g = torch.Generator().manual_seed(3)
    gens = torch.randint(-(2**31), 2**31 - 1, (3000,), dtype=torch.int32, generator=g)
    gens[7] = 2**31 - 1  # wraps
    gens[8] = -1
    ids = torch.randint(0, 3000, (2500,), generator=g).tolist() + [7, 8, 8, 9, 9, 9]
    dev_gens = gens.clone().to(device)
    K.bump_generations(dev_gens, ids)
    ref_gens = gens.clone()
    ref.bump_generations(ref_gens, ids)
    assert torch.equal(dev_gens.cpu(), ref_gens)
    assert int(ref_gens[7]) == -(2**31) and int(ref_gens[8]) == 1
    assert int(ref_gens[9]) == int(gens[9]) + 3 + ids[:-6].count(9)
    recorded = ref_gens[torch.tensor(ids[:1200])].clone()
    recorded[::7] += 1
    recorded[5] = -(2**31)
    got = K.generation_mismatch(dev_gens, ids[:1200], recorded.to(device))
    assert got.dtype == torch.bool
    assert torch.equal(got.cpu(), ref.generation_mismatch(ref_gens, ids[:1200], recorded))
    assert got.cpu().sum().item() >= 1200 // 7
    assert K.generation_mismatch(dev_gens, [], []).numel() == 0
    K.bump_generations(dev_gens, [])
    d = launches()
    assert d["bump"] == 1 and d["mismatch"] == 1


def test_triton_path_validates_like_reference(device, force_triton):
    with pytest.raises(IndexError):
        K.page_sums([torch.zeros(8, 4, device=device)], [2], 4)
    with pytest.raises(ValueError, match="multiple of 4 bytes"):
        K.page_sums([torch.zeros(8, 3, dtype=torch.float16, device=device)], [0], 4)
    with pytest.raises(IndexError):
        K.bump_generations(torch.zeros(4, dtype=torch.int32, device=device), [4])


def test_kernels_are_interpreted_on_cpu_and_compiled_on_cuda(device):
    from triton.runtime.interpreter import InterpretedFunction

    interpreted = isinstance(tk._page_sums_kernel, InterpretedFunction)
    assert interpreted == (device == "cpu")


@pytest.mark.parametrize("page_size", [1, 16])
def test_records_and_batch_mismatch_bit_exact(page_size, device, force_triton, launches):
    from _kernels_helpers import make_records, naive_mismatch

    r2t, gens, rec, rec_len = make_records(page_size, rows=7, tokens=600, n_pages=300)
    width = rec.shape[1]
    rows, start, end = [6, 0, 3, 4], [0, 0, 2, 5], [width, 7, width - 1, 5]
    d_r2t, d_gens, d_rec, d_len = (t.clone().to(device) for t in (r2t, gens, rec, rec_len))
    K.record_generations(d_gens, d_r2t, d_rec, d_len, rows, start, end, page_size)
    ref.record_generations(gens, r2t, rec, rec_len, rows, start, end, page_size)
    assert torch.equal(d_rec.cpu(), rec) and torch.equal(d_len.cpu(), rec_len)
    # a decode step: one or two new slots per row (the reference's narrow path)
    rows2, start2, end2 = [6, 0, 3], [width - 2, 7, width - 1], [width, 8, width]
    ref.bump_generations(gens, [int(r2t[6, (width - 1) * page_size]) // page_size])
    K.bump_generations(d_gens, [int(r2t[6, (width - 1) * page_size]) // page_size])
    K.record_generations(d_gens, d_r2t, d_rec, d_len, rows2, start2, end2, page_size)
    ref.record_generations(gens, r2t, rec, rec_len, rows2, start2, end2, page_size)
    assert torch.equal(d_rec.cpu(), rec) and torch.equal(d_len.cpu(), rec_len)
    for bump in ([], [int(r2t[0, 3 * page_size]) // page_size], [int(r2t[3, (width - 2) * page_size]) // page_size]):
        K.bump_generations(d_gens, bump)
        ref.bump_generations(gens, bump)
        got = K.batch_generation_mismatch(d_gens, d_r2t, d_rec, d_len, [0, 1, 3, 4, 6], page_size)
        want = ref.batch_generation_mismatch(gens, r2t, rec, rec_len, [0, 1, 3, 4, 6], page_size)
        assert got.dtype == torch.bool and torch.equal(got.cpu(), want)
        assert want.tolist() == naive_mismatch(gens, r2t, rec, rec_len, [0, 1, 3, 4, 6], page_size)
    assert want.any()
    assert K.batch_generation_mismatch(d_gens, d_r2t, d_rec, d_len, [], page_size).numel() == 0
    d = launches()
    assert d["record"] == 2 and d["batch_mismatch"] == 3


def test_dsa_indexer_rows_bit_exact(device, force_triton):
    """The DSA indexer's layout (``index_k_with_scale_buffer``: one uint8 row of 64 tokens'
    fp8 keys and fp32 scales per KV page, 8448 bytes) is read with one row per page."""
    bufs = make_buffers(2, 9, (64 * (128 + 4),), torch.uint8, device, seed=5)
    pages = [7, 2, 8, 2]
    got = K.page_sums(bufs, pages, 1)
    assert torch.equal(got.cpu(), ref.page_sums(_cpu(bufs), pages, 1))
    K.stamp_canary(bufs, [2, 7], 1, ROOM)
    ref_bufs = _cpu(make_buffers(2, 9, (64 * (128 + 4),), torch.uint8, "cpu", seed=5))
    ref.stamp_canary(ref_bufs, [2, 7], 1, ROOM)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(bufs, ref_bufs))
    full = K.canary_full_count(bufs, 1)
    assert full == 2 * 64 * 132 // 4
    assert K.canary_counts(bufs, [2, 7, 8], 1, ROOM).cpu().tolist() == [full, full, 0]
