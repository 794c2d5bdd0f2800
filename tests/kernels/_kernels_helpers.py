"""Shared helpers for the kernel tests."""

import torch

# dtype -> element shape of one row; every row is a multiple of 4 bytes
ROW_SHAPES = {
    torch.float16: (2, 4),  # 16 bytes = 4 words
    torch.bfloat16: (3, 2),  # 12 bytes = 3 words (not a multiple of 4 words: unaligned path)
    torch.float32: (2, 2),  # 16 bytes
    torch.uint8: (8,),  # fp8 stand-in, 8 bytes = 2 words
    torch.int8: (2, 6),  # 12 bytes
}
if hasattr(torch, "float8_e4m3fn"):
    ROW_SHAPES[torch.float8_e4m3fn] = (4, 4)  # 16 bytes


def make_buffers(n, rows, row_shape, dtype, device="cpu", seed=0):
    """``n`` contiguous buffers ``[rows, *row_shape]`` of ``dtype`` holding random bits."""
    g = torch.Generator().manual_seed(seed)
    elems = 1
    for s in row_shape:
        elems *= s
    nbytes = rows * elems * torch.empty((), dtype=dtype).element_size()
    out = []
    for _ in range(n):
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
        out.append(raw.view(dtype).view(rows, *row_shape).to(device))
    return out


def make_records(page_size: int, rows: int = 6, tokens: int = 100, n_pages: int = 64, seed: int = 11):
    """A req_to_token table whose rows point at distinct pages (token = page * ps + offset),
    pool generations, and empty records shaped for it."""
    g = torch.Generator().manual_seed(seed)
    width = -(-tokens // page_size)
    r2t = torch.zeros(rows, tokens, dtype=torch.int32)
    for r in range(rows):
        pages = torch.randint(1, n_pages, (width,), generator=g)
        toks = (pages[:, None] * page_size + torch.arange(page_size)[None, :]).reshape(-1)[:tokens]
        r2t[r] = toks.to(torch.int32)
    gens = torch.randint(-(2**31), 2**31 - 1, (n_pages,), dtype=torch.int32, generator=g)
    rec = torch.zeros(rows, width, dtype=torch.int32)
    rec_len = torch.zeros(rows, dtype=torch.int32)
    return r2t, gens, rec, rec_len


def naive_mismatch(gens, r2t, rec, rec_len, rows, page_size):
    out = []
    for r in rows:
        bad = False
        for s in range(int(rec_len[r])):
            page = int(r2t[r, s * page_size]) // page_size
            bad |= int(gens[page]) != int(rec[r, s])
        out.append(bad)
    return out
