"""Smoke tests of the component tier: real SGLang objects on CPU, no guard installed.

They pin down that the builders in ``_sglang_components.py`` produce working
SGLang objects on the installed release, so guard tests built on them start from
a known-good baseline.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.component

PAGE = 16


def test_paged_allocator_alloc_free_counts(sgl, torch_alloc_kernels):
    """(a) The real paged allocator hands out and takes back whole pages on CPU."""
    import torch

    num_tokens = 64 * PAGE
    pool = sgl.make_kv_pool(num_tokens, PAGE)
    alloc = sgl.make_paged_allocator(num_tokens, PAGE, pool)
    start = sgl.free_pages(alloc)
    assert start == 64
    assert alloc.available_size() == num_tokens

    # page-aligned alloc()
    a = alloc.alloc(3 * PAGE)
    assert a is not None and a.numel() == 3 * PAGE
    assert sgl.free_pages(alloc) == start - 3
    assert (a.view(3, PAGE)[:, 0] % PAGE == 0).all()  # each page starts aligned

    # alloc_extend() for a batch of two fresh requests: 20 and 5 tokens -> 2 + 1 pages
    zeros = torch.zeros(2, dtype=torch.int64)
    seq = torch.tensor([20, 5], dtype=torch.int64)
    out = alloc.alloc_extend(zeros, zeros.clone(), seq, seq.clone(), torch.tensor([-1, -1]), 25)
    assert out is not None and out.numel() == 25
    assert sgl.free_pages(alloc) == start - 6
    assert len(set(out.tolist())) == 25
    assert not set(out.tolist()) & set(a.tolist())

    # alloc_decode(): request 0 grows 20 -> 21 (same page), request 1 5 -> 6
    last = torch.tensor([int(out[19]), int(out[24])], dtype=torch.int64)
    seq2 = torch.tensor([21, 6], dtype=torch.int64)
    dec = alloc.alloc_decode(seq2, seq2.clone(), last)
    assert dec.tolist() == [int(out[19]) + 1, int(out[24]) + 1]
    assert sgl.free_pages(alloc) == start - 6

    # a request crossing a page boundary takes exactly one new page
    seq3 = torch.tensor([33], dtype=torch.int64)
    dec3 = alloc.alloc_decode(seq3, seq3.clone(), torch.tensor([5 * PAGE + 15]))
    assert int(dec3[0]) % PAGE == 0
    assert sgl.free_pages(alloc) == start - 7

    # free() works on whole pages: ``dec`` lies inside the pages of ``out`` and is
    # released with them (freeing it again would double-free: upstream has no guard)
    alloc.free(a)
    alloc.free(out)
    alloc.free(dec3)
    assert sgl.free_pages(alloc) == start
    assert alloc.available_size() == num_tokens

    # running out is reported, not over-committed
    assert alloc.alloc((start + 1) * PAGE) is None
    assert sgl.free_pages(alloc) == start

    if torch_alloc_kernels is not None:  # <= 0.5.21: the shim really ran
        assert torch_alloc_kernels["alloc_extend_kernel"].calls >= 1
        assert torch_alloc_kernels["alloc_decode_kernel"].calls >= 2


def test_normal_request_through_both_doors(sgl, make_side):
    """(b) A normal request is admitted at the prefill door and the decode door,
    decode pre-allocates exactly its pages, and everything is released again."""
    input_len = 40
    expected_pages = -(-input_len // PAGE)  # 3

    # ---- prefill door ----------------------------------------------------------
    with make_side("prefill") as p:
        before = sgl.snapshot(p)
        req = p.new_req(input_len)
        p.bootstrap_queue.add(req, p.kv_pool.head_num)
        assert req in p.bootstrap_queue.queue, "prefill door rejected a normal request"
        assert not p.scheduler.stream_recorder.calls, "nothing should be streamed (no abort)"

        bootstrapped = p.bootstrap_queue.pop_bootstrapped()
        if isinstance(bootstrapped, tuple):  # some releases return (reqs, failed)
            bootstrapped = bootstrapped[0]
        assert [r.rid for r in bootstrapped] == [req.rid]
        assert req.metadata_buffer_index >= 0
        assert sgl.snapshot(p)["metadata_slots"] == before["metadata_slots"] - 1
        # the prefill door holds no KV pages before the prefill forward
        assert sgl.snapshot(p)["free_pages"] == before["free_pages"]

        sgl.release_metadata_slot(p, req)
        assert sgl.snapshot(p) == before

    # ---- decode door -----------------------------------------------------------
    with make_side("decode") as d:
        before = sgl.snapshot(d)
        req = d.new_req(input_len)
        d.prealloc_queue.add(req)
        assert [dr.req.rid for dr in d.prealloc_queue.queue] == [req.rid]
        assert sgl.free_pages(d.allocator) == before["free_pages"], "add() must not allocate"

        preallocated, failed = d.prealloc_queue.pop_preallocated()
        assert not failed
        assert [dr.req.rid for dr in preallocated] == [req.rid]
        after_alloc = sgl.snapshot(d)
        assert after_alloc["free_pages"] == before["free_pages"] - expected_pages
        assert after_alloc["req_slots"] == before["req_slots"] - 1
        assert after_alloc["metadata_slots"] == before["metadata_slots"] - 1

        # the request's req_to_token row points at exactly those pages
        row = d.req_to_token_pool.req_to_token[sgl.req_pool_idx(req)][:input_len]
        pages = sorted({int(x) // PAGE for x in row.tolist()})
        assert len(pages) == expected_pages

        d.transfer_queue.extend(preallocated)
        transferred = d.transfer_queue.pop_transferred()
        assert [r.rid for r in transferred] == [req.rid]
        assert len(req.output_ids) == 1  # the first token came "from prefill"
        assert sgl.snapshot(d)["metadata_slots"] == before["metadata_slots"]

        sgl.release_req_kv(req, d.tree_cache)
        assert sgl.snapshot(d) == before

    if d.kernel_shims is not None:
        assert d.kernel_shims["alloc_extend_kernel"].calls >= 1


_INTERPRETER_CHECK = textwrap.dedent(
    """
    import os, random, sys
    assert os.environ.get("TRITON_INTERPRET") == "1"
    sys.path.insert(0, {here!r})
    import torch
    import _sglang_components as c
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.utils import next_power_of_2
    mod = sys.modules[PagedTokenToKVPoolAllocator.__module__]
    ext, dec = mod.alloc_extend_kernel, mod.alloc_decode_kernel
    T = lambda x: torch.tensor(x, dtype=torch.int64)
    rng = random.Random(1234)
    for ps in (1, 4, 16):
        for trial in range(12):
            bs = rng.randint(1, 5)
            pre = [rng.choice([0, rng.randint(0, 70)]) for _ in range(bs)]
            seq = [p + rng.randint(1, 60) for p in pre]
            last = [(1000 + 64 * i) * ps + p - 1 if p else -1 for i, p in enumerate(pre)]
            need = sum(-(-s // ps) - (-(-p // ps)) for p, s in zip(pre, seq))
            free = T(rng.sample(range(1, 5000), need + 3))
            n = sum(s - p for p, s in zip(pre, seq))
            a, b = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int64)
            ext[(bs,)](T(pre), T(seq), T(last), free, a, next_power_of_2(bs), ps)
            c._torch_alloc_extend(T(pre), T(seq), T(last), free, b, next_power_of_2(bs), ps)
            assert torch.equal(a, b), ("extend", ps, pre, seq, a, b)
            seqd = [rng.randint(1, 100) for _ in range(bs)]
            lastd = [(2000 + 64 * i) * ps + (s - 2) % ps for i, s in enumerate(seqd)]
            a, b = torch.empty(bs, dtype=torch.int64), torch.empty(bs, dtype=torch.int64)
            dec[(bs,)](T(seqd), T(lastd), free, a, next_power_of_2(bs), ps)
            c._torch_alloc_decode(T(seqd), T(lastd), free, b, next_power_of_2(bs), ps)
            assert torch.equal(a, b), ("decode", ps, seqd, a, b)
    print("KERNELS-MATCH")
    """
)


def test_torch_alloc_shim_matches_triton_kernels(sgl, tmp_path):
    """The test-side torch replacement gives exactly the indices of SGLang's own
    Triton kernels, run on CPU by Triton's interpreter (TRITON_INTERPRET=1, which
    must be set before import, hence a subprocess)."""
    script = tmp_path / "check.py"
    script.write_text(_INTERPRETER_CHECK.format(here=str(Path(sgl.__file__).parent)))
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "KERNELS-MATCH" in proc.stdout, proc.stdout + proc.stderr
