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

On a prefill node with the same variable, a transfer of a room whose high 32 bits are
``LATE_WRITE_TAG`` fails the way a Mooncake batch that hit its wall-clock timeout
does: ``_transfer_data`` returns -1 at once while the write itself is still to come.
The write really happens later, over Mooncake, from a background thread: once the
file named by ``KVGUARD_FAULT_LATE_WRITE_GATE`` exists (or after
``KVGUARD_FAULT_LATE_WRITE_S`` seconds, default 5). That is how
tests/server/test_late_write.py lands a late write in decode pages.

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

    from ..lifetime.transfer_components import kv_buffers

    pages, pool = (stamped[0], stamped[1]) if stamped is not None else (canary[0], canary[2])
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


LATE_WRITE_TAG = 0x4B564C57  # "KVLW"
GATE_ENV = "KVGUARD_FAULT_LATE_WRITE_GATE"
DELAY_ENV = "KVGUARD_FAULT_LATE_WRITE_S"


def late_write(room, write):
    """Prefill transfer path: for a tagged room, run ``write`` later and return -1 now."""
    if os.environ.get(ENV) != "1" or room is None or (int(room) >> 32) != LATE_WRITE_TAG:
        return None
    import threading
    import time

    gate, delay = os.environ.get(GATE_ENV), float(os.environ.get(DELAY_ENV, "5"))

    def later() -> None:
        deadline = time.monotonic() + (120.0 if gate else delay)
        while time.monotonic() < deadline and not (gate and os.path.exists(gate)):
            time.sleep(0.01)
        try:
            ret = write()
        except Exception as exc:  # noqa: BLE001
            ret = repr(exc)
        log.warning("fault injection (%s=1): the late write of room %s has landed (ret=%s)", ENV, room, ret)

    threading.Thread(target=later, name="kvguard-fault-late-write", daemon=True).start()
    log.warning("fault injection (%s=1): a Mooncake batch of room %s reports failure (-1) but its write "
                "is still to come", ENV, room)
    return -1
