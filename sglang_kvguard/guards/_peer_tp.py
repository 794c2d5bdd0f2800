"""Head-sliced transfers: MHA KV between prefill and decode of different attention TP.

When prefill and decode run with different attention tensor-parallel sizes on a model
that is not MLA, SGLang's transfer backends (Mooncake, Ascend, NIXL, Mori: every
receiver built on ``CommonKVReceiver``) do not move whole pages: with prefill TP > decode
TP every decode page is written as head slices by several prefill ranks (and the
metadata row is last-writer-wins among them); with prefill TP < decode TP each decode
row is cut from a wider prefill row (``send_kvcache_slice``, or the opt-in staging path
that scatters the same slices on decode). MLA models (and, from 0.5.16, hybrid-MLA
ones) always send whole pages from one rank per page, whatever the TP sizes.

The page guards that reason about whole pages (``destination_canary``: a page counts
as written when any word lost its canary; ``transfer_checksum``: prefill digests its
own rows, decode its own) cannot verify such a transfer, so decode fails it closed.

Decode learns the prefill's attention TP lazily, per prefill bootstrap address, from
the bootstrap server's ``/route`` reply (``PrefillServerInfo.attn_tp_size``), and
copies it onto the receiver in ``CommonKVReceiver.init`` (``self.prefill_info``), which
runs before ``send_metadata``. On every release 0.5.10-0.5.23 (checked against the
wheels; tests/engine/test_peer_tp_attributes.py checks the running one):

* ``receiver.prefill_info.attn_tp_size`` (``PrefillServerInfo``, common/conn.py);
* ``receiver.kv_mgr.attn_tp_size`` and ``receiver.kv_mgr.is_mla_backend``
  (``CommonKVManager.__init__``);
* ``receiver.kv_mgr.is_hybrid_mla_backend`` from 0.5.16 on (absent before: False).

The fake transfer backend's receiver has no ``prefill_info``: not head-sliced.
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

log = logging.getLogger("sglang_kvguard")

_logged_addrs = set()
_lock = threading.Lock()


def _tp(value) -> Optional[int]:
    if isinstance(value, bool):
        return None
    try:
        n = int(value)
    except (TypeError, ValueError):
        return None
    return n if n > 0 else None


def head_sliced(receiver) -> Optional[str]:
    """Why ``receiver``'s transfer is head-sliced (MHA, attention TP differs between
    prefill and decode, both known and > 0), or None. Never raises."""
    try:
        info = getattr(receiver, "prefill_info", None)
        mgr = getattr(receiver, "kv_mgr", None)
        if info is None or mgr is None:
            return None
        p = _tp(getattr(info, "attn_tp_size", None))
        d = _tp(getattr(mgr, "attn_tp_size", None))
        if p is None or d is None or p == d:
            return None
        if not hasattr(mgr, "is_mla_backend"):
            return None  # not a CommonKVManager: nothing known about its layout
        if getattr(mgr, "is_mla_backend", False) or getattr(mgr, "is_hybrid_mla_backend", False):
            return None  # MLA pages travel whole, from one rank each
        how = ("each decode page is written as head slices by several prefill ranks"
               if p > d else "each decode page is cut from a slice of one prefill rank's wider rows")
        return f"prefill attention TP {p}, decode attention TP {d}, MHA (non-MLA) model: {how}"
    except Exception:  # noqa: BLE001 - a guard must never break the wrapped upstream call
        return None


def message(reason: str, guard: str) -> str:
    """The request's failure message (the client sees it)."""
    return (f"kvguard: cannot verify this transfer: {reason}; {guard} checks whole pages written by "
            f"one prefill rank and cannot verify head-sliced KV, so the request fails closed. "
            f"Run prefill and decode with the same attention TP size, or start decode with "
            f"--kvguard-disable destination_canary,transfer_checksum")


def refuse(decode_req, receiver, reason: str, guard: str) -> bool:
    """Fail ``decode_req`` closed through upstream's corruption path (500), count it and
    log an ERROR once per prefill bootstrap address; the value to return from
    ``_commit_transfer_to_req``."""
    from ..engine import metrics
    from ._fail_closed import fail_request as _fail

    text = message(reason, guard)
    addr = getattr(receiver, "bootstrap_addr", None)
    with _lock:
        first = addr not in _logged_addrs
        _logged_addrs.add(addr)
    req = getattr(decode_req, "req", None)
    if first:
        log.error("%s (prefill %s; logged once per prefill address, first request rid=%s room=%s)",
                  text, addr, getattr(req, "rid", "?"), getattr(req, "bootstrap_room", "?"))
    else:
        log.debug("request rid=%s failed closed: head-sliced transfer from %s",
                  getattr(req, "rid", "?"), addr)
    metrics.count("head_sliced_transfers_refused", guard=guard)
    _fail(decode_req, text)
    return True  # "remove from the queue": 0.5.10-0.5.12 read this, later releases ignore it
