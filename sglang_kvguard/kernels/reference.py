"""Pure-torch reference implementations of the KV integrity kernels.

Everything here runs on any torch device (CPU or CUDA) and is bit-for-bit the
definition the Triton kernels in :mod:`.triton_kernels` are tested against.
The 64-bit mixing (:func:`mix64`, :func:`bind_digest`) is shared by both paths.

Word view: a KV buffer is a contiguous tensor whose first dimension is token rows;
each row is read as ``row_bytes // 4`` little-endian 32-bit words (row bytes must be
a multiple of 4).  Physical page ``p`` covers rows ``[p*page_size, (p+1)*page_size)``
and its words are numbered ``i = 0 .. W-1`` in row-major order (``W = page_size *
row_words``).

Integer arithmetic notes (why this is identical on CPU and CUDA):

* mod 2^32 sums are computed with torch's int32 ``sum(dtype=torch.int32)`` and
  int32 multiplies; whatever the accumulator width a backend picks, the result
  truncated to 32 bits is the exact sum mod 2^32.
* 64-bit mixing uses int64 multiply/add/xor, which wrap mod 2^64 on both devices,
  and :func:`_srl` emulates a logical right shift for negative int64.
* reductions over int64 (``sum``) are exact modular sums, so their order does not
  matter.
"""

from __future__ import annotations

from typing import Sequence

import torch

MASK32 = 0xFFFFFFFF
MASK64 = 0xFFFFFFFFFFFFFFFF

GOLDEN = 0x9E3779B97F4A7C15
_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB

# domain-separation constants ("kvgdBUF0", "kvgdROOM", "kvgdTOTL", "kvgdCNRY")
C_BUF = 0x6B76676442554630
C_ROOM = 0x6B766764524F4F4D
C_TOTAL = 0x6B766764544F544C
C_CANARY = 0x6B766764434E5259
CANARY_IF_ZERO = 0x5A17C0DE

# Pages are processed in groups of about this many bytes so that the second pass
# over a group (column sums) is served from L2.
_CHUNK_BYTES = 512 * 1024


def to_signed64(x: int) -> int:
    """Python int -> the int64 with the same low 64 bits."""
    x &= MASK64
    return x - (1 << 64) if x >> 63 else x


def to_unsigned64(x: int) -> int:
    return int(x) & MASK64


def to_signed32(x: int) -> int:
    x &= MASK32
    return x - (1 << 32) if x >> 31 else x


_C1_S = to_signed64(_C1)
_C2_S = to_signed64(_C2)
_GOLDEN_S = to_signed64(GOLDEN)


# --------------------------------------------------------------------------- mixing


def mix64_int(x: int) -> int:
    """splitmix64 step on a Python int: finalizer(x + golden). Returns 0 <= v < 2^64."""
    z = (int(x) + GOLDEN) & MASK64
    z = ((z ^ (z >> 30)) * _C1) & MASK64
    z = ((z ^ (z >> 27)) * _C2) & MASK64
    return z ^ (z >> 31)


def _srl(t: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of an int64 tensor (torch's >> is arithmetic)."""
    return (t >> k) & ((1 << (64 - k)) - 1)


def mix64(t: torch.Tensor) -> torch.Tensor:
    """splitmix64 step on an int64 tensor (wrap-around), bit-equal to :func:`mix64_int`."""
    z = t + _GOLDEN_S
    z = (z ^ _srl(z, 30)) * _C1_S
    z = (z ^ _srl(z, 27)) * _C2_S
    return z ^ _srl(z, 31)


# --------------------------------------------------------------------------- inputs


def as_words(buf: torch.Tensor) -> torch.Tensor:
    """View a KV buffer as int32 words ``[rows, row_words]`` (no copy)."""
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"KV buffer must be a torch.Tensor, got {type(buf).__name__}")
    if buf.dim() == 0:
        raise ValueError("KV buffer must have a leading token-row dimension")
    if not buf.is_contiguous():
        raise ValueError("KV buffer must be contiguous (kvguard reads rows as raw 32-bit words)")
    rows = buf.shape[0]
    row_elems = 1
    for s in buf.shape[1:]:
        row_elems *= int(s)
    row_bytes = row_elems * buf.element_size()
    if row_bytes % 4 != 0 or row_bytes == 0:
        raise ValueError(
            f"KV buffer rows must be a non-zero multiple of 4 bytes to be read as 32-bit words; "
            f"got {row_bytes} bytes per row (shape {tuple(buf.shape)}, dtype {buf.dtype})"
        )
    if (buf.storage_offset() * buf.element_size()) % 4 != 0:
        raise ValueError("KV buffer data must start on a 4-byte boundary")
    b8 = buf.view(rows, row_elems).view(torch.uint8)
    return b8.view(torch.int32)


def check_buffers(buffers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Validate a list of KV buffers; return their int32 word views."""
    if isinstance(buffers, torch.Tensor):
        raise TypeError("pass a list of KV buffers, not a single tensor")
    words = [as_words(b) for b in buffers]
    if words:
        dev = words[0].device
        for w in words[1:]:
            if w.device != dev:
                raise ValueError(f"all KV buffers must be on one device; got {dev} and {w.device}")
    return words


def as_page_ids(page_ids, device) -> torch.Tensor:
    if isinstance(page_ids, torch.Tensor):
        if page_ids.dtype.is_floating_point or page_ids.dtype == torch.bool:
            raise TypeError(f"page ids must be integers, got {page_ids.dtype}")
        return page_ids.reshape(-1).to(device=device, dtype=torch.int64)
    return torch.as_tensor(list(page_ids), dtype=torch.int64, device=device).reshape(-1)


def check_page_range(ids: torch.Tensor, n_valid: int, what: str = "page id") -> None:
    """Raise IndexError if any id is outside [0, n_valid). One host sync."""
    if ids.numel() == 0:
        return
    lo, hi = torch.aminmax(ids)
    lo, hi = int(lo), int(hi)
    if lo < 0 or hi >= n_valid:
        raise IndexError(f"{what} out of range: ids span [{lo}, {hi}], valid range is [0, {n_valid})")


def pages_in(words: torch.Tensor, page_size: int) -> int:
    return words.shape[0] // page_size


def _check_page_size(page_size) -> int:
    page_size = int(page_size)
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    return page_size


# --------------------------------------------------------------------------- page sums


def _is_contiguous_run(ids: torch.Tensor) -> bool:
    n = ids.numel()
    if n <= 1:
        return True
    if ids.device.type != "cpu":
        return False
    first = int(ids[0])
    return int(ids[-1]) - first == n - 1 and bool(torch.all(ids[1:] - ids[:-1] == 1))


def page_sums(buffers, page_ids, page_size: int) -> torch.Tensor:
    """Per (buffer, page) Fletcher pair ``(A, B)`` as int64 ``[n_buf, n_pages, 2]``.

    ``A = sum_i w_i mod 2^32`` and ``B = sum_i (i+1) * w_i mod 2^32`` over the page's
    words read as uint32, ``i`` the word index inside the page (row-major).
    """
    page_size = _check_page_size(page_size)
    words = check_buffers(buffers)
    device = words[0].device if words else torch.device("cpu")
    ids = as_page_ids(page_ids, device)
    n = ids.numel()
    out = torch.zeros((len(words), n, 2), dtype=torch.int64, device=device)
    if n == 0 or not words:
        return out
    check_page_range(ids, min(pages_in(w, page_size) for w in words))
    contiguous = _is_contiguous_run(ids)
    for b, w in enumerate(words):
        out[b] = _page_sums_one(w, ids, page_size, contiguous)
    return out


def _page_chunks(w: torch.Tensor, ids: torch.Tensor, page_size: int, contiguous: bool):
    """Yield ``(s, e, pages[ids[s:e]])`` as ``[k, page_size, R]`` int32 chunks of ~_CHUNK_BYTES.

    Non-contiguous ids are gathered into one reused buffer, so that the passes over
    a chunk after the gather read from cache.
    """
    R = w.shape[1]
    n_pages_buf = w.shape[0] // page_size
    pages = w[: n_pages_buf * page_size].view(n_pages_buf, page_size, R)
    n = ids.numel()
    step = max(1, _CHUNK_BYTES // (page_size * R * 4))
    first = int(ids[0]) if contiguous and n else 0
    gather = None
    for s in range(0, n, step):
        e = min(n, s + step)
        if contiguous:
            yield s, e, pages[first + s : first + e]
            continue
        if gather is None or gather.shape[0] != e - s:
            gather = torch.empty((e - s, page_size, R), dtype=torch.int32, device=w.device)
        torch.index_select(pages, 0, ids[s:e], out=gather)
        yield s, e, gather


def _page_sums_one(w: torch.Tensor, ids: torch.Tensor, page_size: int, contiguous: bool) -> torch.Tensor:
    """(A, B) for one buffer's word view ``w`` [rows, R]; int64 [n, 2]."""
    R = w.shape[1]
    n = ids.numel()
    # B = sum_{r,c} (r*R + c + 1) w[r,c] = R * sum_r r*rowsum[r] + sum_c (c+1)*colsum[c]
    rowsum = torch.empty((n, page_size), dtype=torch.int32, device=w.device)
    colsum = torch.empty((n, R), dtype=torch.int32, device=w.device)
    for s, e, chunk in _page_chunks(w, ids, page_size, contiguous):
        torch.sum(chunk, dim=2, dtype=torch.int32, out=rowsum[s:e])
        torch.sum(chunk, dim=1, dtype=torch.int32, out=colsum[s:e])
    r_w = torch.arange(page_size, dtype=torch.int32, device=w.device)
    c_w = torch.arange(1, R + 1, dtype=torch.int32, device=w.device)
    a = rowsum.sum(dim=1, dtype=torch.int32)
    bsum = (rowsum * r_w).sum(dim=1, dtype=torch.int32) * R + (colsum * c_w).sum(dim=1, dtype=torch.int32)
    return torch.stack((a, bsum), dim=1).to(torch.int64) & MASK32


def page_sums_naive(buffers, page_ids, page_size: int) -> torch.Tensor:
    """Slow, obviously-correct int64 definition of :func:`page_sums` (for tests)."""
    page_size = _check_page_size(page_size)
    words = check_buffers(buffers)
    device = words[0].device if words else torch.device("cpu")
    ids = as_page_ids(page_ids, device)
    out = torch.zeros((len(words), ids.numel(), 2), dtype=torch.int64, device=device)
    for b, w in enumerate(words):
        check_page_range(ids, pages_in(w, page_size))
        for j, p in enumerate(ids.tolist()):
            v = w[p * page_size : (p + 1) * page_size].reshape(-1).to(torch.int64) & MASK32
            i = torch.arange(1, v.numel() + 1, dtype=torch.int64, device=device)
            out[b, j, 0] = int(v.sum()) & MASK32
            out[b, j, 1] = int((v * i).sum()) & MASK32
    return out


# --------------------------------------------------------------------------- digest


def buffer_keys(n_buf: int, device) -> torch.Tensor:
    return mix64(torch.arange(n_buf, dtype=torch.int64, device=device) + to_signed64(C_BUF))


def bind_digest(sums: torch.Tensor, room: int, page_ids, logical_idx=None, generations=None):
    """Bind page sums to their place: returns ``(per_page int64 [n_pages], total int64 0-dim)``.

    Values are uint64 bit patterns stored in int64.  ``page_ids`` (the physical pages
    the sums were taken from) only fixes ``n_pages`` and the device: the physical page
    number is deliberately *not* mixed in, so the prefill and decode copies of the
    same request content (in different physical pages) have equal digests.
    ``logical_idx`` defaults to ``0..n_pages-1``; ``generations`` (per listed page,
    int32 tags) default to 0.
    """
    if sums.dim() != 3 or sums.shape[-1] != 2:
        raise ValueError(f"sums must be [n_buffers, n_pages, 2], got {tuple(sums.shape)}")
    device = sums.device
    n_buf, n = sums.shape[0], sums.shape[1]
    ids = as_page_ids(page_ids, device)
    if ids.numel() != n:
        raise ValueError(f"{ids.numel()} page ids for sums over {n} pages")
    if logical_idx is None:
        logical = torch.arange(n, dtype=torch.int64, device=device)
    else:
        logical = as_page_ids(logical_idx, device)
        if logical.numel() != n:
            raise ValueError(f"{logical.numel()} logical indices for {n} pages")
    if generations is None:
        gens = torch.zeros(n, dtype=torch.int64, device=device)
    else:
        gens = as_page_ids(generations, device) & MASK32
        if gens.numel() != n:
            raise ValueError(f"{gens.numel()} generations for {n} pages")
    s = sums.to(torch.int64)
    word = (s[..., 0] & MASK32) | ((s[..., 1] & MASK32) << 32)  # [n_buf, n]
    m = mix64(word ^ buffer_keys(n_buf, device)[:, None])
    content = m.sum(dim=0, dtype=torch.int64) if n_buf else torch.zeros(n, dtype=torch.int64, device=device)
    room_key = to_signed64(mix64_int(to_signed64(int(room)) ^ to_signed64(C_ROOM)))
    ctx = mix64(mix64(logical ^ room_key) ^ gens)
    per_page = mix64(content ^ ctx)
    total_key = to_signed64(mix64_int((n + C_TOTAL) & MASK64))
    total = mix64(per_page.sum(dtype=torch.int64) ^ total_key)
    return per_page, total


def bind_digest_int(sums_list, room: int, logical, gens) -> tuple[list[int], int]:
    """Python-int definition of :func:`bind_digest` (for known-answer tests).

    ``sums_list[b][j] = (A, B)``; returns unsigned 64-bit values.
    """
    n_buf = len(sums_list)
    n = len(logical)
    room_key = mix64_int((int(room) ^ C_ROOM) & MASK64)
    per = []
    for j in range(n):
        content = 0
        for b in range(n_buf):
            a, bb = sums_list[b][j]
            word = (a & MASK32) | ((bb & MASK32) << 32)
            content = (content + mix64_int(word ^ mix64_int(b + C_BUF))) & MASK64
        ctx = mix64_int(mix64_int((logical[j] & MASK64) ^ room_key) ^ (gens[j] & MASK32))
        per.append(mix64_int(content ^ ctx))
    total = mix64_int((sum(per) & MASK64) ^ mix64_int((n + C_TOTAL) & MASK64))
    return per, total


# --------------------------------------------------------------------------- canaries


def canary_word(room: int, page_id: int) -> int:
    """The 32-bit canary of physical page ``page_id`` for request ``room`` (never 0)."""
    v = mix64_int(mix64_int((int(room) ^ C_CANARY) & MASK64) ^ (int(page_id) & MASK64)) & MASK32
    return v if v else CANARY_IF_ZERO


def canary_words(room: int, ids: torch.Tensor) -> torch.Tensor:
    """Vectorised :func:`canary_word`: int32 tensor (bit pattern) per page id."""
    key = to_signed64(mix64_int((int(room) ^ C_CANARY) & MASK64))
    v = mix64(ids.to(torch.int64) ^ key) & MASK32
    v = torch.where(v == 0, torch.full_like(v, CANARY_IF_ZERO), v)
    return (((v + (1 << 31)) & MASK32) - (1 << 31)).to(torch.int32)


def stamp_canary(buffers, page_ids, page_size: int, room: int) -> None:
    page_size = _check_page_size(page_size)
    words = check_buffers(buffers)
    if not words:
        return
    ids = as_page_ids(page_ids, words[0].device)
    if ids.numel() == 0:
        return
    check_page_range(ids, min(pages_in(w, page_size) for w in words))
    can = canary_words(room, ids)
    for w in words:
        R = w.shape[1]
        pages = w[: pages_in(w, page_size) * page_size].view(-1, page_size * R)
        pages.index_copy_(0, ids, can[:, None].expand(-1, page_size * R).contiguous())


def canary_counts(buffers, page_ids, page_size: int, room: int) -> torch.Tensor:
    page_size = _check_page_size(page_size)
    words = check_buffers(buffers)
    device = words[0].device if words else torch.device("cpu")
    ids = as_page_ids(page_ids, device)
    out = torch.zeros(ids.numel(), dtype=torch.int64, device=device)
    if ids.numel() == 0:
        return out
    check_page_range(ids, min(pages_in(w, page_size) for w in words))
    can = canary_words(room, ids)
    contiguous = _is_contiguous_run(ids)
    for w in words:
        for s, e, chunk in _page_chunks(w, ids, page_size, contiguous):
            eq = chunk.view(e - s, -1) == can[s:e, None]
            out[s:e] += eq.sum(dim=1, dtype=torch.int64)
    return out


# --------------------------------------------------------------------------- generations


def check_generations(gens: torch.Tensor) -> None:
    if not isinstance(gens, torch.Tensor) or gens.dtype != torch.int32 or gens.dim() != 1:
        raise ValueError("generation tags must be a 1-D int32 tensor [num_pages]")
    if not gens.is_contiguous():
        raise ValueError("generation tags must be contiguous")


def wrap_int32(x: torch.Tensor) -> torch.Tensor:
    return (((x.to(torch.int64) + (1 << 31)) & MASK32) - (1 << 31)).to(torch.int32)


def bump_generations(gens: torch.Tensor, page_ids) -> None:
    """``gens[p] += 1`` (wrapping int32) for each occurrence of ``p`` in ``page_ids``.

    A page id listed k times is incremented k times (index_add semantics).
    """
    check_generations(gens)
    ids = as_page_ids(page_ids, gens.device)
    if ids.numel() == 0:
        return
    check_page_range(ids, gens.numel())
    uniq, counts = torch.unique(ids, return_counts=True)
    gens[uniq] = wrap_int32(gens[uniq].to(torch.int64) + counts)


def generation_mismatch(pool_gens: torch.Tensor, page_ids, recorded) -> torch.Tensor:
    """``pool_gens[page_ids[i]] != recorded[i]`` as a bool tensor."""
    check_generations(pool_gens)
    ids = as_page_ids(page_ids, pool_gens.device)
    rec = as_page_ids(recorded, pool_gens.device)
    if rec.numel() != ids.numel():
        raise ValueError(f"{rec.numel()} recorded generations for {ids.numel()} pages")
    if ids.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=pool_gens.device)
    check_page_range(ids, pool_gens.numel())
    return pool_gens.index_select(0, ids) != wrap_int32(rec)


# --------------------------------------------------------------------------- per-request generation records
#
# ``rec_gens[row, slot]`` is the generation a request recorded for the page behind
# ``req_to_token[row, slot * page_size]``; ``rec_len[row]`` is how many slots of the
# row are recorded. ``row`` is the request's req_to_token row (``req_pool_idx``).


def check_records(req_to_token: torch.Tensor, rec_gens: torch.Tensor, rec_len: torch.Tensor, page_size: int) -> int:
    page_size = _check_page_size(page_size)
    if req_to_token.dim() != 2 or req_to_token.dtype not in (torch.int32, torch.int64):
        raise ValueError("req_to_token must be a 2-D int32/int64 tensor [rows, tokens]")
    width = -(-req_to_token.shape[1] // page_size)
    if rec_gens.dtype != torch.int32 or tuple(rec_gens.shape) != (req_to_token.shape[0], width):
        raise ValueError(f"rec_gens must be int32 [{req_to_token.shape[0]}, {width}], got "
                         f"{rec_gens.dtype} {tuple(rec_gens.shape)}")
    if rec_len.dtype != torch.int32 or tuple(rec_len.shape) != (req_to_token.shape[0],):
        raise ValueError(f"rec_len must be int32 [{req_to_token.shape[0]}]")
    if not (rec_gens.is_contiguous() and rec_len.is_contiguous()):
        raise ValueError("generation records must be contiguous")
    return width


def _row_pages(req_to_token: torch.Tensor, rows: torch.Tensor, page_size: int, n_pages: int) -> torch.Tensor:
    """Page id behind every slot of the given rows, int64 [n_rows, width] (clamped to the pool)."""
    toks = req_to_token[:, ::page_size].index_select(0, rows).to(torch.int64)
    return torch.div(toks, page_size, rounding_mode="floor").clamp_(0, n_pages - 1)


def record_generations(pool_gens, req_to_token, rec_gens, rec_len, rows, start, end, page_size: int) -> None:
    """For each i: ``rec_gens[rows[i], s] = pool_gens[page(rows[i], s)]`` for ``start[i] <= s < end[i]``,
    then ``rec_len[rows[i]] = end[i]``. Rows must be distinct."""
    check_generations(pool_gens)
    width = check_records(req_to_token, rec_gens, rec_len, page_size)
    rows = as_page_ids(rows, rec_gens.device)
    if rows.numel() == 0:
        return
    start = as_page_ids(start, rec_gens.device)
    end = as_page_ids(end, rec_gens.device).clamp(0, width)
    span = int((end - start).clamp(min=0).max())
    if span <= 8:  # a decode step adds at most a slot or two per row: touch only those
        base = start.clamp(0, width)
        for d in range(span):
            slot = base + d
            ok = slot < end
            if not bool(ok.any()):
                continue
            r, sl = rows[ok], slot[ok]
            toks = req_to_token[r, sl * page_size].to(torch.int64)
            pages = torch.div(toks, page_size, rounding_mode="floor").clamp_(0, pool_gens.numel() - 1)
            rec_gens[r, sl] = pool_gens[pages]
    else:
        slots = torch.arange(width, device=rec_gens.device)
        mask = (slots[None, :] >= start[:, None]) & (slots[None, :] < end[:, None])
        pages = _row_pages(req_to_token, rows, page_size, pool_gens.numel())
        fresh = pool_gens[pages]
        rec_gens.index_copy_(0, rows, torch.where(mask, fresh, rec_gens.index_select(0, rows)))
    rec_len.index_copy_(0, rows, end.to(torch.int32))


def batch_generation_mismatch(pool_gens, req_to_token, rec_gens, rec_len, rows, page_size: int) -> torch.Tensor:
    """bool [n_rows]: some recorded slot ``s < rec_len[row]`` of the row has
    ``pool_gens[page(row, s)] != rec_gens[row, s]``."""
    check_generations(pool_gens)
    width = check_records(req_to_token, rec_gens, rec_len, page_size)
    rows = as_page_ids(rows, rec_gens.device)
    if rows.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=rec_gens.device)
    slots = torch.arange(width, device=rec_gens.device)
    mask = slots[None, :] < rec_len.index_select(0, rows).to(torch.int64)[:, None]
    pages = _row_pages(req_to_token, rows, page_size, pool_gens.numel())
    bad = (pool_gens[pages] != rec_gens.index_select(0, rows)) & mask
    return bad.any(dim=1)


def mismatched_slots(pool_gens, req_to_token, rec_gens, rec_len, row: int, page_size: int):
    """Host-side detail for one row (the slow path after a mismatch):
    ``[(slot, page, recorded_gen, current_gen), ...]``."""
    n = int(rec_len[row])
    toks = req_to_token[row, : n * page_size : page_size].to(torch.int64).cpu()
    pages = torch.div(toks, page_size, rounding_mode="floor").clamp_(0, pool_gens.numel() - 1)
    cur = pool_gens.cpu()[pages]
    rec = rec_gens[row, :n].cpu()
    return [(s, int(pages[s]), int(rec[s]), int(cur[s])) for s in torch.nonzero(cur != rec).flatten().tolist()]
