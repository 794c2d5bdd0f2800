"""Throughput of the KV integrity kernels (sglang_kvguard.kernels); prints one JSON object.

CPU (always): the pure-torch reference digest on one thread against numpy's one-core
memory-read speed (``np.add.reduce`` over a large int32 array).  Goal: ratio >= 0.5.

CUDA (when available): the Triton digest against the same run's device-to-device copy
bandwidth (``dst.copy_(src)``, counted as bytes read + bytes written).  Goal: >= 0.8.

Also: canary stamp/count and generation bump/mismatch timings.

    python benchmarks/bench_kernels.py [--quick] [--no-cuda]

Layout: ``--layers`` layers x (K, V) buffers of ``[rows, heads, head_dim]`` bf16
(SGLang's MHATokenToKVPool), pages of ``--page-size`` rows, a random (non-contiguous)
list of ``--pages`` physical pages, like one request's KV.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

os.environ.setdefault("KVGUARD_AUTO_INSTALL", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402


def _timeit(fn, sync=lambda: None, min_time=0.3, min_reps=3):
    fn()
    sync()
    reps, t0 = 0, time.perf_counter()
    while True:
        fn()
        reps += 1
        if reps >= min_reps and time.perf_counter() - t0 >= min_time:
            break
    sync()
    return (time.perf_counter() - t0) / reps


def _best(fn, sync=lambda: None, rounds=3, **kw):
    return min(_timeit(fn, sync, **kw) for _ in range(rounds))


def _buffers(layers, rows, heads, head_dim, device, dtype=torch.bfloat16):
    bufs = []
    for _ in range(2 * layers):
        b = torch.empty((rows, heads, head_dim), dtype=dtype, device=device)
        b.view(torch.int16).random_(-(2**15), 2**15 - 1)
        bufs.append(b)
    return bufs


def bench_cpu(args, K, ref):
    torch.set_num_threads(1)
    rows = (args.pages * 2 + 1) * args.page_size
    bufs = _buffers(args.layers, rows, args.heads, args.head_dim, "cpu")
    g = torch.Generator().manual_seed(0)
    ids = torch.randperm(rows // args.page_size, generator=g)[: args.pages]
    page_bytes = args.page_size * args.heads * args.head_dim * 2
    nbytes = page_bytes * args.pages * len(bufs)

    os.environ["KVGUARD_KERNELS"] = "torch"
    contig = torch.arange(args.pages)
    sums = K.page_sums(bufs, ids, args.page_size)
    arr = np.random.default_rng(0).integers(-(2**31), 2**31 - 1, size=max(nbytes, 256 << 20) // 4, dtype=np.int32)
    # interleaved rounds, best of each: the ratio stays meaningful on a busy machine
    inf = float("inf")
    t_np = t_digest = t_sums = t_contig = t_bind = inf
    for _ in range(args.rounds):
        t_np = min(t_np, _timeit(lambda: np.add.reduce(arr)))
        t_digest = min(t_digest, _timeit(lambda: K.digest_pages(bufs, ids, args.page_size, 12345)))
        t_sums = min(t_sums, _timeit(lambda: K.page_sums(bufs, ids, args.page_size)))
        t_contig = min(t_contig, _timeit(lambda: K.page_sums(bufs, contig, args.page_size)))
        t_bind = min(t_bind, _timeit(lambda: K.bind_digest(sums, 12345, ids), min_time=0.05))
    np_gbps = arr.nbytes / t_np / 1e9

    t_stamp = _best(lambda: K.stamp_canary(bufs, ids, args.page_size, 7))
    t_count = _best(lambda: K.canary_counts(bufs, ids, args.page_size, 7))
    gens = torch.zeros(args.gen_pool, dtype=torch.int32)
    gids = torch.randint(0, args.gen_pool, (args.gen_ids,), generator=g)
    rec = gens[gids].clone()
    t_bump = _best(lambda: K.bump_generations(gens, gids))
    t_mis = _best(lambda: K.generation_mismatch(gens, gids, rec))
    digest_gbps = nbytes / t_digest / 1e9
    return {
        "threads": 1,
        "load_average_1min": round(os.getloadavg()[0], 2),
        "bytes_digested": nbytes,
        "reference_digest_gbps": round(digest_gbps, 3),
        "reference_page_sums_gbps": round(nbytes / t_sums / 1e9, 3),
        "reference_page_sums_contiguous_ids_gbps": round(nbytes / t_contig / 1e9, 3),
        "bind_digest_ms": round(t_bind * 1e3, 3),
        "numpy_read_gbps": round(np_gbps, 3),
        "ratio_reference_vs_numpy_read": round(digest_gbps / np_gbps, 3),
        "goal_ratio": 0.5,
        "canary_stamp_gbps": round(nbytes / t_stamp / 1e9, 3),
        "canary_count_gbps": round(nbytes / t_count / 1e9, 3),
        "generation_bump_ms": round(t_bump * 1e3, 4),
        "generation_mismatch_ms": round(t_mis * 1e3, 4),
        "generation_ids": args.gen_ids,
    }


def bench_cuda(args, K, ref):
    dev = "cuda"
    sync = torch.cuda.synchronize
    rows = (args.cuda_pages * 2 + 1) * args.page_size
    bufs = _buffers(args.layers, rows, args.heads, args.head_dim, dev)
    ids = torch.randperm(rows // args.page_size, device=dev)[: args.cuda_pages]
    page_bytes = args.page_size * args.heads * args.head_dim * 2
    nbytes = page_bytes * args.cuda_pages * len(bufs)

    os.environ["KVGUARD_KERNELS"] = "triton"
    from sglang_kvguard.kernels import triton_kernels as tk

    before = tk.LAUNCHES["page_sums"]
    t_sums = _best(lambda: K.page_sums(bufs, ids, args.page_size), sync)
    assert tk.LAUNCHES["page_sums"] > before, "Triton kernel did not run"
    t_digest = _best(lambda: K.digest_pages(bufs, ids, args.page_size, 12345), sync)
    ok = torch.equal(
        K.page_sums(bufs, ids[:64], args.page_size).cpu(),
        ref.page_sums([b.cpu() for b in bufs], ids[:64].cpu(), args.page_size),
    )
    src = torch.empty(max(nbytes, 1 << 30) // 4, dtype=torch.int32, device=dev).random_()
    dst = torch.empty_like(src)
    t_copy = _best(lambda: dst.copy_(src), sync)
    copy_gbps = 2 * src.numel() * 4 / t_copy / 1e9
    sums_gbps = nbytes / t_sums / 1e9

    t_stamp = _best(lambda: K.stamp_canary(bufs, ids, args.page_size, 7), sync)
    t_count = _best(lambda: K.canary_counts(bufs, ids, args.page_size, 7), sync)
    gens = torch.zeros(args.gen_pool, dtype=torch.int32, device=dev)
    gids = torch.randint(0, args.gen_pool, (args.gen_ids,), device=dev)
    rec = gens[gids].clone()
    t_bump = _best(lambda: K.bump_generations(gens, gids), sync)
    t_mis = _best(lambda: K.generation_mismatch(gens, gids, rec), sync)
    os.environ["KVGUARD_KERNELS"] = "torch"
    t_ref = _best(lambda: K.page_sums(bufs, ids, args.page_size), sync)
    return {
        "device_name": torch.cuda.get_device_name(0),
        "bytes_digested": nbytes,
        "triton_page_sums_gbps": round(sums_gbps, 1),
        "triton_digest_gbps": round(nbytes / t_digest / 1e9, 1),
        "copy_gbps_read_plus_write": round(copy_gbps, 1),
        "ratio_triton_vs_copy": round(sums_gbps / copy_gbps, 3),
        "goal_ratio": 0.8,
        "bit_exact_vs_cpu_reference": ok,
        "torch_reference_on_cuda_gbps": round(nbytes / t_ref / 1e9, 1),
        "canary_stamp_gbps": round(nbytes / t_stamp / 1e9, 1),
        "canary_count_gbps": round(nbytes / t_count / 1e9, 1),
        "generation_bump_us": round(t_bump * 1e6, 2),
        "generation_mismatch_us": round(t_mis * 1e6, 2),
        "generation_ids": args.gen_ids,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes (seconds)")
    p.add_argument("--no-cuda", action="store_true")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--pages", type=int, default=None, help="pages digested on CPU")
    p.add_argument("--cuda-pages", type=int, default=None)
    args = p.parse_args(argv)
    if args.layers is None:
        args.layers = 4 if args.quick else 16
    if args.pages is None:
        args.pages = 64 if args.quick else 256
    if args.cuda_pages is None:
        args.cuda_pages = 512 if args.quick else 4096
    args.rounds = 3 if args.quick else 7
    args.gen_pool = 1 << 20
    args.gen_ids = 4096

    from sglang_kvguard import kernels as K
    from sglang_kvguard.kernels import reference as ref

    out = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu",
        "torch": torch.__version__,
        "quick": args.quick,
        "layout": {
            "buffers": 2 * args.layers,
            "row_shape": [args.heads, args.head_dim],
            "dtype": "bfloat16",
            "page_size": args.page_size,
            "page_bytes_per_buffer": args.page_size * args.heads * args.head_dim * 2,
        },
        "cpu": bench_cpu(args, K, ref),
    }
    if torch.cuda.is_available() and not args.no_cuda:
        out["cuda"] = bench_cuda(args, K, ref)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
