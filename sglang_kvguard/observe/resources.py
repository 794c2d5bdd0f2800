"""Resource gauges of each scheduler: free KV tokens, evictable tokens, free metadata slots.

The post-mortem's lesson is "measure the pool, do not trust HTTP 200": after a burst
of rejected requests, free pages and metadata slots on both PD nodes must come back
to where they started. Upstream's own numbers differ by release (``/server_info``,
``/get_load``, ``/v1/loads``), so kvguard samples them itself, from SGLang's own
allocators, once a second in a daemon thread of each scheduler process, and exports:

* ``kvguard_kv_free_tokens{role,rank}``: ``token_to_kv_pool_allocator.available_size()``
  as upstream computes it (the free list; without prefill_source_hold's deduction)
* ``kvguard_kv_evictable_tokens{role,rank}``: ``tree_cache.evictable_size()`` (cached
  prefixes that the allocator can take back)
* ``kvguard_metadata_free_slots{role,rank}``: free PD metadata buffer slots
* ``kvguard_kv_held_pages{role,rank}``, ``kvguard_kv_quarantined_pages{role,rank}``:
  pages freed while a transfer still uses them, held (and, past the bound,
  quarantined) by kvguard's page-lifetime guards
* ``kvguard_kv_failed_send_pages{role,rank}`` (prefill): pages a failed Mooncake send
  may still read, pinned until its peer is confirmed gone; admission does not count them

They are served with SGLang's own metrics (``--enable-metrics``, ``GET /metrics``).
``KVGUARD_RESOURCE_GAUGES=0`` turns the sampler off.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref

log = logging.getLogger("sglang_kvguard")

INTERVAL = 1.0
_gauges = {}


def _gauge(name: str, doc: str):
    if name not in _gauges:
        from prometheus_client import Gauge

        kwargs = {"multiprocess_mode": "livemax"} if os.environ.get("PROMETHEUS_MULTIPROC_DIR") else {}
        _gauges[name] = Gauge(name, doc, ["role", "rank"], **kwargs)
    return _gauges[name]


def sample(scheduler) -> dict:
    """Read the scheduler's free tokens, evictable tokens and free metadata slots."""
    out = {}
    alloc = getattr(scheduler, "token_to_kv_pool_allocator", None)
    if alloc is not None:
        from ..guards.prefill_source_hold import real_available
        from ..lifetime.page_hold import hold_for_allocator

        out["kv_free_tokens"] = real_available(alloc)
        hold = hold_for_allocator(alloc)
        if hold is not None:
            out["kv_held_pages"] = hold.held_pages()
            out["kv_quarantined_pages"] = hold.quarantined_pages()
            if hold.role == "prefill":
                out["kv_failed_send_pages"] = len(hold._stuck)
        else:
            from ..guards.decode_deferred_release import deferred_pages

            pages = deferred_pages()  # decode, 0.5.21+: failed transfers held until prefill drains
            if pages is not None:
                out["kv_held_pages"], out["kv_quarantined_pages"] = pages
    tree = getattr(scheduler, "tree_cache", None)
    if tree is not None and hasattr(tree, "evictable_size"):
        out["kv_evictable_tokens"] = int(tree.evictable_size())
    md = getattr(scheduler, "req_to_metadata_buffer_idx_allocator", None)
    if md is not None:
        out["metadata_free_slots"] = int(md.available_size())
    return out


_DOCS = {
    "kv_free_tokens": "free KV tokens in the scheduler's allocator",
    "kv_evictable_tokens": "KV tokens held by the prefix cache that the allocator can evict",
    "metadata_free_slots": "free PD metadata buffer slots",
    "kv_held_pages": "KV pages freed by the scheduler but held by kvguard until the transfer using them drains",
    "kv_quarantined_pages": "held KV pages whose transfer has not drained within --kvguard-quarantine-after",
    "kv_failed_send_pages": ("prefill KV pages a failed Mooncake send may still read, kept until its peer is "
                             "confirmed gone and left out of the admission budget meanwhile"),
}


def _loop(ref, role: str, rank: str) -> None:
    while True:
        scheduler = ref()
        if scheduler is None:
            return
        try:
            for key, value in sample(scheduler).items():
                _gauge("kvguard_" + key, _DOCS[key]).labels(role=role, rank=rank).set(value)
        except Exception as exc:  # noqa: BLE001 - a sampler must never disturb serving
            log.debug("resource sampling failed: %s", exc)
        del scheduler
        time.sleep(INTERVAL)


def start(scheduler) -> None:
    if os.environ.get("KVGUARD_RESOURCE_GAUGES", "1") == "0":
        return
    server_args = getattr(scheduler, "server_args", None)
    role = str(getattr(server_args, "disaggregation_mode", None) or "null")
    rank = str(getattr(scheduler, "tp_rank", 0))
    t = threading.Thread(target=_loop, args=(weakref.ref(scheduler), role, rank), daemon=True, name="kvguard-resources")
    t.start()
