"""KV integrity kernels: page digests, canaries and per-page generation tags.

Public API (every ``buffers`` argument is a list of contiguous KV buffers whose first
dimension is token rows, e.g. SGLang's ``k_buffer[layer]`` / ``v_buffer[layer]`` or
MLA ``kv_buffer[layer]``; rows are read as 32-bit words)::

    page_sums(buffers, page_ids, page_size) -> int64 [n_buffers, n_pages, 2]
    bind_digest(sums, room, page_ids, logical_idx=None, generations=None)
        -> (per_page int64 [n_pages], total int64 0-dim)
    digest_pages(buffers, page_ids, page_size, room, logical_idx=None, generations=None)
        -> (per_page, total)
    canary_word(room, page_id) -> int            # 32-bit, never 0
    stamp_canary(buffers, page_ids, page_size, room) -> None   # in place
    canary_counts(buffers, page_ids, page_size, room) -> int64 [n_pages]
    canary_full_count(buffers, page_size) -> int  # count of a never-written page
    bump_generations(gens, page_ids) -> None     # gens: int32 [num_pages], in place
    generation_mismatch(pool_gens, page_ids, recorded) -> bool [n]
    record_generations(pool_gens, req_to_token, rec_gens, rec_len, rows, start, end, page_size)
        -> None                                   # per-request records, in place
    batch_generation_mismatch(pool_gens, req_to_token, rec_gens, rec_len, rows, page_size)
        -> bool [n_rows]                          # one launch for a whole batch

Dispatch (per call, from the device of the tensors): ``KVGUARD_KERNELS=triton`` forces
the Triton kernels, ``KVGUARD_KERNELS=torch`` forces the pure-torch reference, and the
default (``auto``) uses Triton for CUDA tensors and the reference otherwise.  In
``auto`` mode a CUDA tensor with Triton not importable falls back to the reference
(logged once); a forced ``triton`` never falls back.  Triton is imported only when the
Triton path is taken; SGLang is never imported.  See ``docs/kernels.md``.
"""

from __future__ import annotations

import logging
import os

import torch

from . import reference
from .reference import bind_digest, canary_word, mix64, mix64_int

__all__ = [
    "page_sums",
    "bind_digest",
    "digest_pages",
    "canary_word",
    "stamp_canary",
    "canary_counts",
    "canary_full_count",
    "bump_generations",
    "generation_mismatch",
    "record_generations",
    "batch_generation_mismatch",
    "backend_for",
    "mix64",
    "mix64_int",
]

_log = logging.getLogger(__name__)
_warned = False


def _mode() -> str:
    mode = os.environ.get("KVGUARD_KERNELS", "auto").strip().lower() or "auto"
    if mode in ("torch", "reference", "ref"):
        return "torch"
    if mode in ("triton", "auto"):
        return mode
    raise ValueError(f"KVGUARD_KERNELS must be 'auto', 'triton' or 'torch', got {mode!r}")


def backend_for(device) -> str:
    """'triton' or 'torch': the implementation a call on ``device`` would use."""
    mode = _mode()
    if mode != "auto":
        return mode
    if torch.device(device).type != "cuda":
        return "torch"
    try:
        import triton  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the install
        global _warned
        if not _warned:
            _warned = True
            _log.warning("kvguard kernels: Triton not importable (%s); using the torch reference on CUDA", exc)
        return "torch"
    return "triton"


def _impl(device):
    if backend_for(device) == "triton":
        from . import triton_kernels

        if torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            raise RuntimeError(
                "KVGUARD_KERNELS=triton on CPU tensors needs TRITON_INTERPRET=1 set before Triton is imported"
            )
        return triton_kernels
    return reference


def _device_of(buffers):
    if isinstance(buffers, torch.Tensor):
        raise TypeError("pass a list of KV buffers, not a single tensor")
    for b in buffers:
        if isinstance(b, torch.Tensor):
            return b.device
    return torch.device("cpu")


def page_sums(buffers, page_ids, page_size: int) -> torch.Tensor:
    """Per (buffer, page) Fletcher pair ``(A, B)``, int64 ``[n_buffers, n_pages, 2]``.

    Over the page's words ``w_i`` (uint32, row-major, ``i = 0..W-1``):
    ``A = sum w_i mod 2^32``, ``B = sum (i+1) w_i mod 2^32``.
    """
    buffers = list(buffers) if not isinstance(buffers, torch.Tensor) else buffers
    return _impl(_device_of(buffers)).page_sums(buffers, page_ids, page_size)


def digest_pages(buffers, page_ids, page_size: int, room: int, logical_idx=None, generations=None):
    """``bind_digest(page_sums(...), ...)``: ``(per_page int64 [n_pages], total int64)``."""
    sums = page_sums(buffers, page_ids, page_size)
    return bind_digest(sums, room, page_ids, logical_idx, generations)


def stamp_canary(buffers, page_ids, page_size: int, room: int) -> None:
    """Fill every word of each listed page, in every buffer, with ``canary_word(room, page)``."""
    buffers = list(buffers) if not isinstance(buffers, torch.Tensor) else buffers
    _impl(_device_of(buffers)).stamp_canary(buffers, page_ids, page_size, room)


def canary_counts(buffers, page_ids, page_size: int, room: int) -> torch.Tensor:
    """Per listed page: how many of its words (over all buffers) still hold its canary."""
    buffers = list(buffers) if not isinstance(buffers, torch.Tensor) else buffers
    return _impl(_device_of(buffers)).canary_counts(buffers, page_ids, page_size, room)


def canary_full_count(buffers, page_size: int) -> int:
    """The :func:`canary_counts` value of a page no one has written since stamping."""
    return sum(int(page_size) * reference.as_words(b).shape[1] for b in buffers)


def bump_generations(gens: torch.Tensor, page_ids) -> None:
    """``gens[p] += 1`` (wrapping int32) once per occurrence of ``p`` in ``page_ids``."""
    _impl(gens.device).bump_generations(gens, page_ids)


def generation_mismatch(pool_gens: torch.Tensor, page_ids, recorded) -> torch.Tensor:
    """``pool_gens[page_ids[i]] != recorded[i]`` as bool ``[n]``."""
    return _impl(pool_gens.device).generation_mismatch(pool_gens, page_ids, recorded)


def record_generations(pool_gens, req_to_token, rec_gens, rec_len, rows, start, end, page_size: int) -> None:
    """Record, per row, the current generation of the pages behind slots ``[start, end)``;
    ``rec_len[row] = end``. ``rec_gens`` is int32 ``[rows, ceil(tokens / page_size)]``."""
    _impl(rec_gens.device).record_generations(pool_gens, req_to_token, rec_gens, rec_len, rows, start, end, page_size)


def batch_generation_mismatch(pool_gens, req_to_token, rec_gens, rec_len, rows, page_size: int):
    """Per row: does any recorded page now carry a different generation? bool ``[n_rows]``."""
    return _impl(rec_gens.device).batch_generation_mismatch(pool_gens, req_to_token, rec_gens, rec_len, rows,
                                                            page_size)
