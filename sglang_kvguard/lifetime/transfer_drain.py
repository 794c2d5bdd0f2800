"""Prefill side of the decode destination hold: when has a room's transfer drained?

Decode (kvguard's decode_destination_hold, 0.5.10-0.5.20) keeps a failed transfer's
destination pages until every prefill rank that writes them confirms that nothing
more will be written. Upstream has no usable signal there (docs/design/page-lifetime.md
D1-D4): no ABORT up to 0.5.12; an ABORT_ACK sent before the drain and dropped by
decode in 0.5.13-0.5.18; an opt-in that drops acks in 0.5.19-0.5.20.

This module is the prefill half, in every prefill scheduler process:

* ``enqueued(room)`` / ``finished(room)``: called by prefill_source_hold's transfer
  queue wrapper when a chunk of the room is queued and when the worker is done with
  it (its futures included): the room's outstanding chunks;
* a room one of whose Mooncake batches failed (``finished(room, unsettled=...)``) is
  not confirmed: Mooncake does not cancel a failed batch, so it may still write; only
  when the peer of every such batch is gone (``settle(room)``, peer_liveness) may it be;
* ``drain_requested(...)``: decode asked (``KVGUARD_DRAIN/1`` on the KV manager's
  bootstrap socket). The room is marked aborted: the manager's status becomes
  Failed (if the room is known and not yet Success) and ``gate_chunk`` refuses every
  later chunk of it. When no chunk of the room is outstanding, each waiting decode
  endpoint gets ``KVGUARD_DRAINED/1`` on the reply socket it named.
"""

from __future__ import annotations

import logging
import queue as queue_mod
import threading
import time
from typing import Dict, List, Optional, Set, Tuple

log = logging.getLogger("sglang_kvguard")

DRAIN_REQUEST = b"KVGUARD_DRAIN/1"
DRAINED = b"KVGUARD_DRAINED/1"
ROUTE_HEADER = "X-KVGuard-Drain"  # on the prefill bootstrap server's /route answers: this prefill acks drains
ABORTED_TTL = 600.0

_lock = threading.RLock()
_outstanding: Dict[int, int] = {}
_aborted: Dict[int, float] = {}
_waiters: Dict[int, Set[Tuple[str, int]]] = {}
_unsettled: Dict[int, str] = {}  # rooms a failed Mooncake batch may still write (kept: never confirmed)
_unsettled_n: Dict[int, int] = {}  # how many of the room's chunks are unsettled
_identity: Dict[str, str] = {"rank": ""}
stats = {"requests": 0, "acks": 0, "chunks_refused": 0, "withheld": 0}


def encode_request(room: int, reply_ip: str, reply_port: int) -> List[bytes]:
    return [DRAIN_REQUEST, str(int(room)).encode("ascii"), str(reply_ip).encode("ascii"),
            str(int(reply_port)).encode("ascii")]


def decode_request(msg) -> Optional[Tuple[int, str, int]]:
    if len(msg) != 4 or bytes(msg[0]) != DRAIN_REQUEST:
        return None
    return int(bytes(msg[1])), bytes(msg[2]).decode("ascii"), int(bytes(msg[3]))


def encode_drained(room: int, rank: str) -> List[bytes]:
    return [DRAINED, str(int(room)).encode("ascii"), rank.encode("ascii")]


def decode_drained(msg) -> Optional[Tuple[int, str]]:
    if len(msg) != 3 or bytes(msg[0]) != DRAINED:
        return None
    return int(bytes(msg[1])), bytes(msg[2]).decode("ascii")


# ----------------------------------------------------------------------------- counting


def enqueued(room) -> None:
    if room is None:
        return
    with _lock:
        _outstanding[int(room)] = _outstanding.get(int(room), 0) + 1


def finished(room, unsettled: str = "") -> None:
    """The worker is done with one chunk of ``room``. ``unsettled``: why one of its
    Mooncake batches may still be writing (it failed, and Mooncake does not cancel a
    failed batch): the room is then never confirmed drained."""
    if room is None:
        return
    room = int(room)
    with _lock:
        if unsettled:
            _unsettled.setdefault(room, unsettled)
            _unsettled_n[room] = _unsettled_n.get(room, 0) + 1
        n = _outstanding.get(room, 0) - 1
        if n > 0:
            _outstanding[room] = n
            return
        _outstanding.pop(room, None)
        targets = _waiters.pop(room, None)
        withheld = room in _unsettled
    if targets:
        if withheld:
            _withhold(room, len(targets))
        else:
            _send_acks(room, targets)


def _withhold(room: int, n: int) -> None:
    stats["withheld"] += 1
    log.error("kvguard: room %s is not confirmed drained to %d decode endpoint(s): a failed Mooncake send of it "
              "(%s) may still write decode's pages, which decode therefore keeps quarantined",
              room, n, _unsettled.get(room, "?"))


def settle(room) -> None:
    """One unsettled chunk of ``room`` can no longer run (its peer is gone). When the
    last one is settled, the room may be confirmed drained again (decode asks again)."""
    if room is None:
        return
    room = int(room)
    with _lock:
        n = _unsettled_n.get(room, 0) - 1
        if n > 0:
            _unsettled_n[room] = n
            return
        _unsettled_n.pop(room, None)
        _unsettled.pop(room, None)


def is_unsettled(room) -> bool:
    with _lock:
        return room is not None and int(room) in _unsettled


def outstanding(room) -> int:
    with _lock:
        return _outstanding.get(int(room), 0)


def is_aborted(room) -> bool:
    with _lock:
        return room is not None and int(room) in _aborted


def gate_chunk(manager, room) -> bool:
    """Scheduler thread, under the lock the caller holds: may this room's chunk be queued?"""
    if room is None or int(room) not in _aborted:
        return True
    from sglang.srt.disaggregation.base.conn import KVPoll

    stats["chunks_refused"] += 1
    try:
        manager.record_failure(int(room), "decode released its pages for this request (kvguard drain request)")
        manager.update_status(int(room), KVPoll.Failed)
    except Exception as exc:  # noqa: BLE001
        log.warning("kvguard: marking room %s failed after decode's drain request failed: %s", room, exc)
    return False


def locked():
    """The lock that orders ``gate_chunk`` + enqueue against ``drain_requested``."""
    return _lock


def drain_requested(manager, room: int, reply_ip: str, reply_port: int) -> None:
    """Bootstrap thread: decode will not read this room again; ack when it has drained."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    now = time.monotonic()
    with _lock:
        stats["requests"] += 1
        for r in [r for r, t in _aborted.items() if now - t > ABORTED_TTL]:
            _aborted.pop(r, None)
        _aborted[room] = now
        status = getattr(manager, "request_status", {}).get(room)
        if status is not None and status != KVPoll.Success:
            try:
                manager.record_failure(room, "decode released its pages for this request (kvguard drain request)")
                manager.update_status(room, KVPoll.Failed)
            except Exception as exc:  # noqa: BLE001
                log.warning("kvguard: marking room %s failed on decode's drain request failed: %s", room, exc)
        withheld = room in _unsettled
        if _outstanding.get(room, 0) > 0:
            _waiters.setdefault(room, set()).add((reply_ip, int(reply_port)))
            log.info("kvguard: decode asked for room %s to drain; %d chunk(s) still queued or in flight",
                     room, _outstanding[room])
            return
    if withheld:
        _withhold(room, 1)
        return
    _send_acks(room, {(reply_ip, int(reply_port))})


def set_identity(manager) -> None:
    ip, port = getattr(manager, "local_ip", None), getattr(manager, "rank_port", None)
    if ip is not None and port is not None:
        _identity["rank"] = f"{ip}:{port}"


# ----------------------------------------------------------------------------- acks


class _Sender:
    def __init__(self) -> None:
        self.q: "queue_mod.Queue" = queue_mod.Queue()
        from .push_sockets import PushSockets

        self.sockets = PushSockets()
        self.thread = threading.Thread(target=self._run, name="kvguard-drain-acks", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import zmq

        while True:
            room, ip, port = self.q.get()
            try:
                self.sockets.get(ip, port).send_multipart(encode_drained(room, _identity["rank"]), flags=zmq.DONTWAIT)
                stats["acks"] += 1
            except Exception as exc:  # noqa: BLE001 - keep the thread alive
                log.warning("kvguard: could not tell decode %s:%s that room %s drained: %s", ip, port, room, exc)


_sender: Dict[str, _Sender] = {}


def _send_acks(room: int, targets) -> None:
    with _lock:
        s = _sender.get("s")
        if s is None or not s.thread.is_alive():
            s = _sender["s"] = _Sender()
    for ip, port in targets:
        s.q.put((int(room), ip, int(port)))
    log.info("kvguard: room %s has drained on this prefill rank; told %d decode endpoint(s)", room, len(targets))


def reset() -> None:
    """Tests: forget every room."""
    with _lock:
        _outstanding.clear()
        _aborted.clear()
        _waiters.clear()
        _unsettled.clear()
        _unsettled_n.clear()
