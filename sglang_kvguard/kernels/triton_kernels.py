"""Triton kernels for the KV integrity checks (imported only when needed).

One launch covers every buffer: the kernels take a device table of the buffers'
data addresses (int64) and turn the loaded address into a pointer
(``tl.load(table + b).to(tl.pointer_type(tl.int32))``).  This works on CUDA and
under ``TRITON_INTERPRET=1`` (where CPU tensors are passed by their real address
and an int -> pointer cast is a bitcast).  Buffers are grouped by row word count;
SGLang's per-layer K/V buffers all share one, so that is one launch.

Grid of the page kernels: ``(n_pages, n_buffers)``; each program walks one page of
one buffer in ``BLOCK``-word steps, keeping per-lane uint32 accumulators and
reducing once at the end.  All integer arithmetic is uint32/int32 and wraps the
same way on GPU and in the interpreter.  No atomics are used for the page kernels
(each program owns one output slot), so results are deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference as ref

# Incremented on every kernel launch; tests use it to prove the Triton path ran.
LAUNCHES: dict[str, int] = {"page_sums": 0, "stamp": 0, "count": 0, "bump": 0, "mismatch": 0, "record": 0,
                             "batch_mismatch": 0}

_MAX_BLOCK = 2048


@triton.jit
def _page_sums_kernel(table_ptr, ids_ptr, out_ptr, n_pages, W: tl.constexpr, BLOCK: tl.constexpr,
                      ALIGNED: tl.constexpr):
    p = tl.program_id(0)
    b = tl.program_id(1)
    base = tl.load(table_ptr + b).to(tl.pointer_type(tl.uint32))
    page = tl.load(ids_ptr + p)
    start = base + page * W
    offs = tl.arange(0, BLOCK)
    acc_a = tl.zeros([BLOCK], dtype=tl.uint32)
    acc_b = tl.zeros([BLOCK], dtype=tl.uint32)
    for k in range(0, W, BLOCK):
        idx = k + offs
        m = idx < W
        ptrs = start + idx
        if ALIGNED:
            ptrs = tl.max_contiguous(tl.multiple_of(ptrs, 16), BLOCK)
        w = tl.load(ptrs, mask=m, other=0)
        acc_a += w
        acc_b += w * (idx + 1).to(tl.uint32)
    a = tl.sum(acc_a, axis=0)
    bb = tl.sum(acc_b, axis=0)
    o = out_ptr + (b.to(tl.int64) * n_pages + p) * 2
    tl.store(o, a.to(tl.int64) & 0xFFFFFFFF)
    tl.store(o + 1, bb.to(tl.int64) & 0xFFFFFFFF)


@triton.jit
def _stamp_kernel(table_ptr, ids_ptr, canary_ptr, W: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    p = tl.program_id(0)
    b = tl.program_id(1)
    base = tl.load(table_ptr + b).to(tl.pointer_type(tl.int32))
    page = tl.load(ids_ptr + p)
    start = base + page * W
    c = tl.load(canary_ptr + p)
    offs = tl.arange(0, BLOCK)
    val = tl.zeros([BLOCK], dtype=tl.int32) + c
    for k in range(0, W, BLOCK):
        idx = k + offs
        ptrs = start + idx
        if ALIGNED:
            ptrs = tl.max_contiguous(tl.multiple_of(ptrs, 16), BLOCK)
        tl.store(ptrs, val, mask=idx < W)


@triton.jit
def _count_kernel(table_ptr, ids_ptr, canary_ptr, out_ptr, n_pages, W: tl.constexpr, BLOCK: tl.constexpr,
                  ALIGNED: tl.constexpr):
    p = tl.program_id(0)
    b = tl.program_id(1)
    base = tl.load(table_ptr + b).to(tl.pointer_type(tl.int32))
    page = tl.load(ids_ptr + p)
    start = base + page * W
    c = tl.load(canary_ptr + p)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for k in range(0, W, BLOCK):
        idx = k + offs
        m = idx < W
        ptrs = start + idx
        if ALIGNED:
            ptrs = tl.max_contiguous(tl.multiple_of(ptrs, 16), BLOCK)
        w = tl.load(ptrs, mask=m, other=0)
        acc += ((w == c) & m).to(tl.int32)
    tl.store(out_ptr + b.to(tl.int64) * n_pages + p, tl.sum(acc, axis=0))


@triton.jit
def _bump_kernel(gens_ptr, ids_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    ids = tl.load(ids_ptr + offs, mask=m, other=0)
    one = tl.full([BLOCK], 1, dtype=tl.int32)
    tl.atomic_add(gens_ptr + ids, one, mask=m)


@triton.jit
def _mismatch_kernel(gens_ptr, ids_ptr, rec_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    ids = tl.load(ids_ptr + offs, mask=m, other=0)
    g = tl.load(gens_ptr + ids, mask=m, other=0)
    r = tl.load(rec_ptr + offs, mask=m, other=0)
    tl.store(out_ptr + offs, (g != r).to(tl.int8), mask=m)


@triton.jit
def _record_kernel(gens_ptr, r2t_ptr, r2t_stride, rec_ptr, rows_ptr, start_ptr, end_ptr, n_pages, width,
                   PS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i)
    start = tl.load(start_ptr + i)
    end = tl.minimum(tl.load(end_ptr + i), width)
    slots = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    m = (slots >= start) & (slots < end)
    tok = tl.load(r2t_ptr + row * r2t_stride + slots * PS, mask=m, other=0).to(tl.int64)
    page = tl.minimum(tl.maximum(tok // PS, 0), n_pages - 1)
    g = tl.load(gens_ptr + page, mask=m, other=0)
    tl.store(rec_ptr + row * width + slots, g, mask=m)


@triton.jit
def _batch_mismatch_kernel(gens_ptr, r2t_ptr, r2t_stride, rec_ptr, rec_len_ptr, rows_ptr, out_ptr, n_pages, width,
                           PS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i)
    n = tl.load(rec_len_ptr + row).to(tl.int64)
    slots = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    m = slots < n
    tok = tl.load(r2t_ptr + row * r2t_stride + slots * PS, mask=m, other=0).to(tl.int64)
    page = tl.minimum(tl.maximum(tok // PS, 0), n_pages - 1)
    g = tl.load(gens_ptr + page, mask=m, other=0)
    r = tl.load(rec_ptr + row * width + slots, mask=m, other=0)
    bad = tl.sum(((g != r) & m).to(tl.int32), axis=0)
    tl.atomic_max(out_ptr + i, (bad > 0).to(tl.int32))


# --------------------------------------------------------------------------- launchers


def _block(words_per_page: int) -> int:
    return min(_MAX_BLOCK, max(16, triton.next_power_of_2(words_per_page)))


def _num_warps(block: int) -> int:
    return 8 if block >= 2048 else 4 if block >= 512 else 1


def _groups(words: list[torch.Tensor]) -> dict[int, list[int]]:
    """Buffer indices grouped by row word count (one launch per group)."""
    g: dict[int, list[int]] = {}
    for i, w in enumerate(words):
        g.setdefault(int(w.shape[1]), []).append(i)
    return g


def _table(words: list[torch.Tensor], idx: list[int], device, W: int):
    """(address table, ALIGNED): ALIGNED promises 16-byte aligned page starts.

    It is only claimed when every buffer starts on 16 bytes and a page is a multiple
    of 4 words; it lets the compiler emit 128-bit loads/stores on CUDA.
    """
    ptrs = tuple(words[i].data_ptr() for i in idx)
    aligned = W % 4 == 0 and all(p % 16 == 0 for p in ptrs)
    key = (str(device), ptrs)
    table = _TABLES.get(key)
    if table is None:
        # keyed by the addresses themselves, so a cached table is never stale
        if len(_TABLES) >= 32:
            _TABLES.pop(next(iter(_TABLES)))
        table = _TABLES[key] = torch.tensor(ptrs, dtype=torch.int64, device=device)
    return table, aligned


_TABLES: dict = {}


def _prepare(buffers, page_ids, page_size):
    page_size = ref._check_page_size(page_size)
    words = ref.check_buffers(buffers)
    device = words[0].device if words else torch.device("cpu")
    ids = ref.as_page_ids(page_ids, device).contiguous()
    if ids.numel() and words:
        ref.check_page_range(ids, min(ref.pages_in(w, page_size) for w in words))
    return page_size, words, device, ids


def page_sums(buffers, page_ids, page_size: int) -> torch.Tensor:
    page_size, words, device, ids = _prepare(buffers, page_ids, page_size)
    n = ids.numel()
    out = torch.zeros((len(words), n, 2), dtype=torch.int64, device=device)
    if n == 0 or not words:
        return out
    for R, idx in _groups(words).items():
        W = page_size * R
        block = _block(W)
        table, aligned = _table(words, idx, device, W)
        dst = out if len(idx) == len(words) else torch.empty((len(idx), n, 2), dtype=torch.int64, device=device)
        _page_sums_kernel[(n, len(idx))](table, ids, dst, n, W=W, BLOCK=block, ALIGNED=aligned,
                                               num_warps=_num_warps(block))
        LAUNCHES["page_sums"] += 1
        if dst is not out:
            out[torch.tensor(idx, device=device)] = dst
    return out


def stamp_canary(buffers, page_ids, page_size: int, room: int) -> None:
    page_size, words, device, ids = _prepare(buffers, page_ids, page_size)
    n = ids.numel()
    if n == 0 or not words:
        return
    can = ref.canary_words(room, ids).contiguous()
    for R, idx in _groups(words).items():
        W = page_size * R
        block = _block(W)
        table, aligned = _table(words, idx, device, W)
        _stamp_kernel[(n, len(idx))](table, ids, can, W=W, BLOCK=block, ALIGNED=aligned,
                                     num_warps=_num_warps(block))
        LAUNCHES["stamp"] += 1


def canary_counts(buffers, page_ids, page_size: int, room: int) -> torch.Tensor:
    page_size, words, device, ids = _prepare(buffers, page_ids, page_size)
    n = ids.numel()
    out = torch.zeros(n, dtype=torch.int64, device=device)
    if n == 0 or not words:
        return out
    can = ref.canary_words(room, ids).contiguous()
    for R, idx in _groups(words).items():
        W = page_size * R
        block = _block(W)
        cnt = torch.empty((len(idx), n), dtype=torch.int32, device=device)
        table, aligned = _table(words, idx, device, W)
        _count_kernel[(n, len(idx))](table, ids, can, cnt, n, W=W, BLOCK=block, ALIGNED=aligned,
                                     num_warps=_num_warps(block))
        LAUNCHES["count"] += 1
        out += cnt.sum(dim=0, dtype=torch.int64)
    return out


_GEN_BLOCK = 1024


def bump_generations(gens: torch.Tensor, page_ids) -> None:
    ref.check_generations(gens)
    ids = ref.as_page_ids(page_ids, gens.device).contiguous()
    n = ids.numel()
    if n == 0:
        return
    ref.check_page_range(ids, gens.numel())
    _bump_kernel[(triton.cdiv(n, _GEN_BLOCK),)](gens, ids, n, BLOCK=_GEN_BLOCK, num_warps=4)
    LAUNCHES["bump"] += 1


def generation_mismatch(pool_gens: torch.Tensor, page_ids, recorded) -> torch.Tensor:
    ref.check_generations(pool_gens)
    ids = ref.as_page_ids(page_ids, pool_gens.device).contiguous()
    rec = ref.wrap_int32(ref.as_page_ids(recorded, pool_gens.device)).contiguous()
    n = ids.numel()
    if rec.numel() != n:
        raise ValueError(f"{rec.numel()} recorded generations for {n} pages")
    out = torch.zeros(n, dtype=torch.int8, device=pool_gens.device)
    if n == 0:
        return out.view(torch.bool)
    ref.check_page_range(ids, pool_gens.numel())
    _mismatch_kernel[(triton.cdiv(n, _GEN_BLOCK),)](pool_gens, ids, rec, out, n, BLOCK=_GEN_BLOCK, num_warps=4)
    LAUNCHES["mismatch"] += 1
    return out.view(torch.bool)


_REC_BLOCK = 256


def _record_args(pool_gens, req_to_token, rec_gens, rec_len, rows, page_size):
    ref.check_generations(pool_gens)
    width = ref.check_records(req_to_token, rec_gens, rec_len, page_size)
    if req_to_token.stride(1) != 1:
        raise ValueError("req_to_token rows must be contiguous")
    rows = ref.as_page_ids(rows, rec_gens.device).contiguous()
    return width, rows


def record_generations(pool_gens, req_to_token, rec_gens, rec_len, rows, start, end, page_size: int) -> None:
    width, rows = _record_args(pool_gens, req_to_token, rec_gens, rec_len, rows, page_size)
    n = rows.numel()
    if n == 0:
        return
    start = ref.as_page_ids(start, rec_gens.device).contiguous()
    end = ref.as_page_ids(end, rec_gens.device).clamp(0, width).contiguous()
    grid = (n, triton.cdiv(width, _REC_BLOCK))
    _record_kernel[grid](pool_gens, req_to_token, req_to_token.stride(0), rec_gens, rows, start, end,
                         pool_gens.numel(), width, PS=int(page_size), BLOCK=_REC_BLOCK, num_warps=4)
    rec_len.index_copy_(0, rows, end.to(torch.int32))
    LAUNCHES["record"] += 1


def batch_generation_mismatch(pool_gens, req_to_token, rec_gens, rec_len, rows, page_size: int) -> torch.Tensor:
    width, rows = _record_args(pool_gens, req_to_token, rec_gens, rec_len, rows, page_size)
    n = rows.numel()
    out = torch.zeros(n, dtype=torch.int32, device=rec_gens.device)
    if n == 0:
        return out.to(torch.bool)
    grid = (n, triton.cdiv(width, _REC_BLOCK))
    _batch_mismatch_kernel[grid](pool_gens, req_to_token, req_to_token.stride(0), rec_gens, rec_len, rows, out,
                                 pool_gens.numel(), width, PS=int(page_size), BLOCK=_REC_BLOCK, num_warps=4)
    LAUNCHES["batch_mismatch"] += 1
    return out != 0
