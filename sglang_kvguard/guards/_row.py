"""Reading and writing a few columns of one metadata row (``cached_tokens[idx]``).

The coverage and checksum guards publish their numbers in spare columns of the row
that travels with a transfer's auxiliary data, once per request on each side. On a
CPU tensor (where SGLang keeps its metadata buffers for Mooncake) a numpy view of
the row reads and writes the same memory at about a tenth of the cost of torch's
per-element indexing (1 us against 8 us for a publish on 0.5.19); any other row
(another device, a plain list in unit tests) is indexed directly."""

from __future__ import annotations

from typing import List


def row_view(row):
    """``row`` itself, or a numpy view of the same memory where that is cheaper."""
    device = getattr(row, "device", None)
    if device is not None and getattr(device, "type", None) == "cpu" and hasattr(row, "numpy"):
        try:
            return row.numpy()
        except (RuntimeError, TypeError):  # a dtype numpy lacks, or a tensor that needs grad
            return row
    return row


def read_cols(row, start: int, stop: int) -> List[int]:
    """``row[start:stop]`` as Python ints, in one read."""
    part = row_view(row)[start:stop]
    return [int(v) for v in (part.tolist() if hasattr(part, "tolist") else part)]
