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
