"""Cost of covering the DSA indexer (and draft KV) in the canary and the checksum.

kvguard stamps and digests every buffer a PD transfer writes at the KV page ids
(``transfer_components.page_groups``). On a DSA model (DeepSeek-V3.2 / GLM-5 class)
that is the MLA latent KV (per token: 512 + 64 values) plus the indexer's keys (per
token: 128 fp8 bytes + one fp32 scale, stored as one 8448-byte row per 64-token page),
and with MTP the draft layer's latent KV. This benchmark times, for one request's pages:

* ``digest``: ``transfer_components.digest`` (prefill and decode each run it once per request);
* ``stamp`` + ``count``: the destination canary (decode, once per request each);

for the KV alone (what kvguard covered before) and with the indexer and draft KV, and
prints one JSON object with the ratio. The cost is per transfer (not per decode step).

    python benchmarks/bench_dsa_coverage.py [--device cuda] [--layers 61] [--pages 128] [--dtype bf16|fp8]

Defaults are sized for a CPU run in about a minute (8 layers, 64 pages = 4096 tokens);
``scripts/gpu-check.sh`` runs it on a GPU with the model's 61 layers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time

os.environ.setdefault("KVGUARD_AUTO_INSTALL", "0")

import torch  # noqa: E402

from sglang_kvguard.lifetime import transfer_components as tc  # noqa: E402

PAGE = 64
KV_DIM = 512 + 64  # kv_lora_rank + qk_rope_head_dim
INDEX_ROW = PAGE * (128 + 4)  # fp8 keys + fp32 scale per token, one row per page


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _time(fn, device, min_time=0.3):
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(3):
        reps, t0 = 0, time.perf_counter()
        while True:
            fn()
            reps += 1
            if reps >= 3 and time.perf_counter() - t0 >= min_time:
                break
        _sync(device)
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--pages", type=int, default=64, help="pages of one request (64 tokens each)")
    ap.add_argument("--pool-pages", type=int, default=0, help="pages in the pool (default: 4x --pages)")
    ap.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16", help="latent KV storage")
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--out", default="", help="also write the JSON here")
    a = ap.parse_args()

    pool_pages = a.pool_pages or 4 * a.pages
    rows = pool_pages * PAGE
    kv_bytes = KV_DIM * 2 if a.dtype == "bf16" else 656  # DSA's fp8 latent layout: 656 bytes per token
    gen = torch.Generator().manual_seed(0)

    def layer(nbytes_per_row, nrows):
        return torch.randint(-2**31, 2**31 - 1, (nrows, nbytes_per_row // 4), generator=gen,
                             dtype=torch.int32).to(a.device).view(torch.uint8)

    kv = [layer(kv_bytes, rows) for _ in range(a.layers)]
    draft = [layer(kv_bytes, rows) for _ in range(a.draft_layers)]
    indexer = [layer(INDEX_ROW, pool_pages + 1) for _ in range(a.layers)]
    pages = random.Random(1).sample(range(pool_pages), a.pages)
    room = 0x1234567

    sets = {
        "kv": [tc.PageGroup("kv", kv, PAGE)],
        "kv+indexer": [tc.PageGroup("kv", kv, PAGE), tc.PageGroup("indexer", indexer, 1)],
        "kv+draft+indexer": [tc.PageGroup("kv", kv, PAGE), tc.PageGroup("draft_kv", draft, PAGE),
                             tc.PageGroup("indexer", indexer, 1)],
    }
    out = {"device": a.device, "machine": platform.processor() or platform.machine(),
           "torch_threads": torch.get_num_threads(), "layers": a.layers, "draft_layers": a.draft_layers,
           "pages": a.pages, "tokens": a.pages * PAGE, "kv_dtype": a.dtype, "kv_bytes_per_token": kv_bytes,
           "indexer_bytes_per_token": INDEX_ROW // PAGE}
    if torch.device(a.device).type == "cuda":
        out["gpu"] = torch.cuda.get_device_name()
    for name, groups in sets.items():
        nbytes = sum(len(g.buffers) * (g.buffers[0].shape[1] if g.buffers else 0) * g.rows_per_page * a.pages
                     for g in groups)
        t_digest = _time(lambda: tc.digest(groups, pages, room), a.device)
        t_stamp = _time(lambda: tc.stamp_canary(groups, pages, room), a.device)
        t_count = _time(lambda: tc.unwritten(groups, pages, room), a.device)
        out[name] = {"bytes": nbytes, "digest_ms": round(t_digest * 1e3, 3), "stamp_ms": round(t_stamp * 1e3, 3),
                     "count_ms": round(t_count * 1e3, 3),
                     "digest_GBps": round(nbytes / t_digest / 1e9, 2)}
    base = out["kv"]
    for name in ("kv+indexer", "kv+draft+indexer"):
        for k in ("digest_ms", "stamp_ms", "count_ms"):
            out[name][k.replace("_ms", "_ratio")] = round(out[name][k] / base[k], 3) if base[k] else None
        out[name]["bytes_ratio"] = round(out[name]["bytes"] / base["bytes"], 3)
    text = json.dumps(out, indent=2)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
