"""Fault injection for testing the integrity guards through real servers.

Off unless the decode node runs with ``KVGUARD_FAULT_INJECTION=1``; then a request
whose ``rid`` starts with ``kvguard-fault-<kind>-`` has its landed KV corrupted just
before decode's commit-time checks, the way a faulty transfer would leave it:

* ``bitflip``: one bit of one word of the second transferred page (first buffer);
* ``swap``: the first two transferred pages exchange content (every buffer);
* ``unwritten``: the last reserved page is put back to its canary, as if the transfer
  never wrote it;
* ``freed``: the last reserved page is freed behind the request's back (the request
  keeps using it), as upstream's early-release paths do (docs/design/page-lifetime.md).

Never set it in production: it exists so that tests can show each fault is caught
over real Mooncake transfers (tests/server/test_integrity_faults.py).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("sglang_kvguard")

ENV = "KVGUARD_FAULT_INJECTION"
PREFIX = "kvguard-fault-"


def maybe_inject(decode_req, queue=None) -> None:
    if os.environ.get(ENV) != "1":
        return
    rid = str(getattr(decode_req.req, "rid", "") or "")
    if not rid.startswith(PREFIX):
        return
    kind = rid[len(PREFIX):].split("-", 1)[0]
    receiver = getattr(decode_req, "kv_receiver", None)
    stamped = getattr(receiver, "_kvguard_checksum", None)
    canary = getattr(receiver, "_kvguard_canary", None)
    if stamped is None and canary is None:
        return
    import torch

    from .destination_canary import kv_buffers

    pages, pool = stamped if stamped is not None else (canary[0], canary[2])
    bufs = kv_buffers(pool)
    ps = int(pool.page_size)
    if kind == "bitflip" and len(pages) > 1:
        words = bufs[0][pages[1] * ps:(pages[1] + 1) * ps].reshape(-1).view(torch.int32)
        words[3] ^= 1 << 7
    elif kind == "swap" and len(pages) > 1:
        a, b = pages[0], pages[1]
        for buf in bufs:
            tmp = buf[a * ps:(a + 1) * ps].clone()
            buf[a * ps:(a + 1) * ps].copy_(buf[b * ps:(b + 1) * ps])
            buf[b * ps:(b + 1) * ps].copy_(tmp)
    elif kind == "freed" and queue is not None:
        alloc = getattr(getattr(queue, "scheduler", None), "token_to_kv_pool_allocator", None)
        if alloc is None:
            alloc = queue.tree_cache.token_to_kv_pool_allocator
        alloc.free(torch.tensor([pages[-1] * ps], dtype=torch.int64, device=bufs[0].device))
    elif kind == "unwritten" and canary is not None:
        from .. import kernels

        kernels.stamp_canary(bufs, [canary[0][-1]], ps, canary[1])
    else:
        return
    log.warning("fault injection (%s=1): %s applied to rid=%s", ENV, kind, rid)
