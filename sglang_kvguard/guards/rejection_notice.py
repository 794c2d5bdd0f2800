"""Tell decode, promptly and with the original error, that prefill rejected a request.

In PD mode the router sends each request to prefill and decode. When prefill rejects
it at its admission door (an over-length prompt, a client abort), no release up to
0.5.23 tells decode: decode keeps the pages it reserved and waits for a KV transfer
until its timeout (300 s by default), then answers 500, and the router retries.

kvguard (design: docs/design/admission-notify.md), Mooncake backend:

* prefill, at the door: remember the bootstrap room with the request's own
  message and status; as soon as decode's transfer info for that room is known
  (already, or later through ``update_status(room, WaitingForInput)``), send to each
  decode endpoint a kvguard notice framed as an AUX message (a decode without
  kvguard logs and drops it) followed by upstream's own 3-frame ``Failed`` status,
  then forget the room's transfer info (upstream leaks it);
* decode: ``MooncakeKVManager._handle_aux_data`` picks the notice up; when upstream's
  own failure path then aborts the request (``prepare_abort(..., 500)``), kvguard
  substitutes the original message and status (400), so the client of the router
  gets the prefill's 400 within a second or two, and decode releases its pages
  through upstream's abort path.

The same notice covers a room that prefill *ends* before sending any of its KV: an
abort (``/abort_request``, a client that hung up) or upstream's bootstrap timeout in
the bootstrap queue. No release up to 0.5.23 tells decode then either: decode keeps
its reservation in ``WaitingForInput`` until its own waiting timeout (300 s by
default) and the router's client waits with it; a decode whose handshake comes after
prefill gave up (its prealloc queue was full) waits the same. The hook is the
sender's ``failure_exception`` (prefill calls it for every failed room, every
release): if nothing was sent yet (``curr_idx == 0``; a transfer that started fails
through upstream's own path, which tells decode), decode is told now if its transfer
info is known, else when it arrives (the same ``update_status`` hook). A sender that
does not own its room (0.5.23's duplicate room) tells nobody: the room is another
request's.
"""

from __future__ import annotations

import json
import logging
import queue as queue_mod
import struct
import threading
import time
import urllib.request
from typing import Callable, Dict, NamedTuple, Tuple

from ..lifetime import transfer_components
from ..lifetime.push_sockets import PushSockets
from ..engine import suspension
from ..engine.guard import ACTIVE, Decision, Guard
from ..engine.targets import target
from . import _req, admission_drain

log = logging.getLogger("sglang_kvguard")

MARKER = b"KVGUARD_REJECT/1"
# Session id of decode_rejection_notice's dummy TransferInfo (decode -> prefill); such
# an entry in ``transfer_infos`` is not a decode endpoint to notify. It ends in ":0"
# because upstream's ``add_transfer_request`` (every release 0.5.10-0.5.23) shards a
# room's chunks by ``sum(int(sid.rsplit(":", 1)[1]))`` over the room's registrations: a
# notice stored for a room whose next chunk is still to be queued (decode aborted it
# while prefill ran its forward) made that ``int()`` raise in the prefill scheduler's
# ``send_kv_chunk`` and killed it (CI, 0.5.10, test_abort_phases, session 17). Port 0
# adds nothing to the sum: the room's chunks go to the shard they would go to anyway.
# Version 1 ("kvguard-decode-reject/1") had no port; a prefill running it does not
# recognise a version-2 notice (run one kvguard version across a deployment).
DECODE_NOTICE_SID = "kvguard-decode-reject/2:0"
_BAD_LEN = struct.pack(">I", 0xFFFFFFFF)  # upstream's aux parser drops a length mismatch
_TTL = 600.0

UPDATE_STATUS = target(
    "disagg.common.CommonKVManager.update_status",
    "sglang.srt.disaggregation.common.conn:CommonKVManager.update_status",
    why="prefill: decode's transfer info for a room is complete (late notice)",
)
HANDLE_AUX = target(
    "mooncake.MooncakeKVManager._handle_aux_data",
    "sglang.srt.disaggregation.mooncake.conn:MooncakeKVManager._handle_aux_data",
    why="decode: receives kvguard's rejection notice",
)
CHECK_CAPACITY = target(
    "disagg.prefill.PrefillBootstrapQueue._check_if_req_exceed_kv_capacity",
    "sglang.srt.disaggregation.prefill:PrefillBootstrapQueue._check_if_req_exceed_kv_capacity",
    why="prefill: upstream's own capacity rejection before a sender exists (every release)",
)
SENDER_FAILURE = target(
    "mooncake.MooncakeKVSender.failure_exception",
    "sglang.srt.disaggregation.mooncake.conn:MooncakeKVSender.failure_exception",
    "sglang.srt.disaggregation.mooncake.conn:MooncakeFailureExceptionMixin.failure_exception",
    "sglang.srt.disaggregation.common.conn:CommonKVSender.failure_exception",
    why="prefill: a room ends before any of its KV was sent (abort, bootstrap timeout): decode is told",
)
PREPARE_ABORT = target(
    "disagg.utils.prepare_abort",
    "sglang.srt.disaggregation.utils:prepare_abort",
    why="decode: the abort of a failed transfer carries the original error",
)

_lock = threading.Lock()
# decode side: room -> (status, message, time)
_received: Dict[int, Tuple[int, str, float]] = {}
_received_cv = threading.Condition(_lock)
# prefill side: rooms still waiting for decode's transfer info live on each kv
# manager (``kv._kvguard_rejected``); one PUSH socket per decode endpoint (``_push``).


def _reason(req) -> Tuple[int, str]:
    r = _req.abort_reason(req)
    status = getattr(r, "status_code", None) or 400
    return int(status), str(getattr(r, "message", None) or "request rejected by prefill")


_push = PushSockets()


def _socket(endpoint: str, port: int):
    return _push.get(endpoint, port)


class Pending(NamedTuple):
    """A notice for decode that waits for decode's transfer info (its endpoint)."""

    status: int
    message: str
    event: str  # the metric counted when it is sent
    what: str  # what happened to the room, for the log
    room_end: bool  # True: prefill ended the room (remembered once told); False: its door rejected it
    t: float  # monotonic time it was noted (last: _prune reads v[-1])


def _send_notices(kv, room: int, status: int, message: str, event: str = "rejection_notices",
                  what: str = "was rejected") -> int:
    """Send notice + Failed to every decode endpoint known for ``room``; returns how many."""
    import zmq

    infos = getattr(kv, "transfer_infos", {}).get(room) or {}
    targets = {(i.endpoint, int(i.dst_port)) for i in infos.values()
               if getattr(i, "endpoint", None) and getattr(i, "mooncake_session_id", None) != DECODE_NOTICE_SID}
    payload = json.dumps({"status": status, "message": message}).encode("utf-8")
    rank = str(getattr(getattr(kv, "kv_args", None), "engine_rank", 0) or 0).encode()
    sent = 0
    for endpoint, port in sorted(targets):
        try:
            sock = _socket(endpoint, port)
            sock.send_multipart([b"AUX_DATA", str(room).encode(), b"0", b"0", _BAD_LEN, payload, MARKER], flags=zmq.DONTWAIT)
            sock.send_multipart([str(room).encode(), b"0", rank], flags=zmq.DONTWAIT)  # KVPoll.Failed == 0
            sent += 1
        except Exception as exc:  # noqa: BLE001 - never break the scheduler thread
            log.warning("could not send the rejection notice for room %s to %s:%s: %s", room, endpoint, port, exc)
    if sent:
        # upstream never clears these for a room without a sender
        for attr in ("transfer_infos", "request_status", "req_to_decode_prefix_len"):
            getattr(kv, attr, {}).pop(room, None)
        from ..engine import metrics

        metrics.count(event, n=sent)
        log.info("told %d decode endpoint(s) that room %s %s: %s", sent, room, what, message)
    return sent


def _prune(table: dict) -> None:
    now = time.monotonic()
    for k in [k for k, v in table.items() if now - v[-1] > _TTL]:
        table.pop(k, None)


_dp_jobs: "queue_mod.Queue" = queue_mod.Queue()
_dp_worker: Dict[str, threading.Thread] = {}


def _post_dp_ranks() -> None:
    while True:
        url, payload = _dp_jobs.get()
        try:
            req = urllib.request.Request(url, data=json.dumps(payload).encode("utf-8"), method="POST",
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=5) as resp:  # noqa: S310 - this node's own bootstrap server
                resp.read()
        except Exception as exc:  # noqa: BLE001
            log.warning("kvguard: could not register the DP rank of rejected room %s at %s: %s",
                        payload.get("bootstrap_room"), url, exc)


def register_dp_rank(bootstrap_queue, req) -> bool:
    """Tell the bootstrap server which DP rank holds a rejected room, as a sender would.

    With data parallelism and a load balancer other than ``follow_bootstrap_room``,
    decode learns a room's prefill DP rank only from ``/query_dp_ranks``, which the
    room's *sender* fills (``CommonKVSender._register_prefill_dp_rank``, every release).
    A request rejected at the door has no sender, so decode would keep asking, with no
    timeout, and never register: the notice could never reach it. kvguard posts the
    same registration (off the scheduler thread); decode then registers, and the
    ``update_status(WaitingForInput)`` hook sends the notice.
    """
    kv = getattr(bootstrap_queue, "kv_manager", None)
    args = getattr(kv, "server_args", None)
    if args is None or int(getattr(args, "dp_size", 1) or 1) <= 1:
        return False
    if getattr(req, "disagg_prefill_dp_rank", None) is not None:
        return False  # decode was told the DP rank by the router
    host, port = getattr(req, "bootstrap_host", None), getattr(bootstrap_queue, "bootstrap_port", None)
    room = getattr(req, "bootstrap_room", None)
    if host is None or port is None or room is None:
        return False
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

    if host == FAKE_BOOTSTRAP_HOST:
        return False
    addr = f"[{host}]:{int(port)}" if ":" in str(host) else f"{host}:{int(port)}"
    with _lock:
        if not (_dp_worker.get("t") and _dp_worker["t"].is_alive()):
            _dp_worker["t"] = threading.Thread(target=_post_dp_ranks, name="kvguard-register-dp-rank", daemon=True)
            _dp_worker["t"].start()
    _dp_jobs.put((f"http://{addr}/register_dp_rank",
                  {"bootstrap_room": int(room), "dp_rank": int(getattr(kv, "attn_dp_rank", 0) or 0)}))
    return True


def note_prefill_rejection(kv, req, bootstrap_queue=None) -> None:
    """Prefill door: remember the room and tell decode now if it already registered."""
    room = getattr(req, "bootstrap_room", None)
    if kv is None or room is None:
        return
    if bootstrap_queue is not None:
        try:
            register_dp_rank(bootstrap_queue, req)
        except Exception as exc:  # noqa: BLE001
            log.warning("kvguard: DP rank registration for rejected room %s failed: %s", room, exc)
    status, message = _reason(req)
    with _lock:
        pending = kv.__dict__.setdefault("_kvguard_rejected", {})
        _prune(pending)
        infos = getattr(kv, "transfer_infos", {}).get(room)
        if infos and _send_notices(kv, room, status, message):
            return
        pending[room] = Pending(status, message, "rejection_notices", "was rejected", False, time.monotonic())


def _on_door_drain(queue, req) -> None:
    if suspension.is_suspended("rejection_notice"):  # a hook, not a wrapper: checked here
        return
    note_prefill_rejection(getattr(queue, "kv_manager", None), req, queue)


ROOM_END = "ended by prefill before any KV was sent"


def _is_mooncake_sender(sender) -> bool:
    try:
        from sglang.srt.disaggregation.base.conn import BaseKVSender
    except Exception:  # noqa: BLE001
        return False
    kv = getattr(sender, "kv_mgr", None)
    return isinstance(sender, BaseKVSender) and kv is not None and transfer_components.is_mooncake_manager(kv)


def note_prefill_room_end(sender) -> str:
    """Prefill: ``sender``'s room failed. If none of its KV was sent, tell decode (now,
    or when decode's transfer info arrives). Returns what was done, for tests/logs."""
    if not _is_mooncake_sender(sender):
        return "not a Mooncake sender"
    if getattr(sender, "_owns_bootstrap_room", True) is False:
        return "room owned by another sender"
    if int(getattr(sender, "curr_idx", 0) or 0) > 0:
        return "a transfer started: upstream's transfer path tells decode"
    kv, room = sender.kv_mgr, getattr(sender, "bootstrap_room", None)
    if room is None:
        return "no room"
    with getattr(kv, "failure_lock", _lock):
        reason = getattr(kv, "failure_records", {}).get(room)
    message = (f"prefill ended the request before sending its KV cache: "
               f"{reason or 'it failed on another prefill rank'}")
    with _lock:
        pending = kv.__dict__.setdefault("_kvguard_rejected", {})
        done = kv.__dict__.setdefault("_kvguard_room_end_told", {})
        _prune(pending)
        _prune(done)
        if room in pending or room in done:
            return "already noted"
        infos = getattr(kv, "transfer_infos", {}).get(room)
        if infos and _send_notices(kv, room, 500, message, "room_end_notices", ROOM_END):
            done[room] = (time.monotonic(),)
            return "told decode"
        pending[room] = Pending(500, message, "room_end_notices", ROOM_END, True, time.monotonic())
        return "decode is told when its transfer info arrives"


def _sender_failure(original: Callable) -> Callable:
    def failure_exception(self, *args, **kwargs):
        try:
            note_prefill_room_end(self)
        except Exception as exc:  # noqa: BLE001 - never break the scheduler thread
            log.warning("kvguard: could not note the end of room %s for decode: %s",
                        getattr(self, "bootstrap_room", "?"), exc)
        return original(self, *args, **kwargs)

    return failure_exception


def _update_status(original: Callable) -> Callable:
    def update_status(self, bootstrap_room, status, *args, **kwargs):
        pending = self.__dict__.get("_kvguard_rejected")
        if pending and int(status) == 2 and bootstrap_room in pending:  # KVPoll.WaitingForInput
            with _lock:
                entry = pending.pop(bootstrap_room, None)
                if entry is not None and _send_notices(self, bootstrap_room, entry.status, entry.message,
                                                       entry.event, entry.what):
                    if entry.room_end:  # a room prefill ended: remember that decode was told
                        self.__dict__.setdefault("_kvguard_room_end_told", {})[bootstrap_room] = (time.monotonic(),)
                    return None
                if entry is not None:
                    pending[bootstrap_room] = entry
        if (int(status) == 0 and bootstrap_room in _received  # KVPoll.Failed, after a kvguard notice
                and bootstrap_room not in getattr(self, "request_status", {bootstrap_room: None})):
            # decode: the notice's Failed for a room this decode already ended itself
            # (the client's abort reached both nodes). Up to 0.5.18 upstream would store
            # it for good (request_status and failure_records, never cleared again): drop it.
            with _received_cv:
                _received.pop(bootstrap_room, None)
            with getattr(self, "failure_lock", _lock):
                getattr(self, "failure_records", {}).pop(bootstrap_room, None)
            return None
        return original(self, bootstrap_room, status, *args, **kwargs)

    return update_status


def _handle_aux_data(original: Callable) -> Callable:
    def _handle_aux_data(self, msg, *args, **kwargs):
        try:
            if len(msg) >= 7 and msg[6] == MARKER:
                room = int(msg[1].decode("ascii"))
                data = json.loads(msg[5].decode("utf-8"))
                with _received_cv:
                    _prune(_received)
                    _received[room] = (int(data["status"]), str(data["message"]), time.monotonic())
                    _received_cv.notify_all()
                return None
        except Exception as exc:  # noqa: BLE001 - an exception here would kill decode_thread
            log.warning("ignored a malformed kvguard notice: %s", exc)
            return None
        return original(self, msg, *args, **kwargs)

    return _handle_aux_data


def _prepare_abort(original: Callable) -> Callable:
    def prepare_abort(req, error_message, *args, **kwargs):
        room = getattr(req, "bootstrap_room", None)
        entry = None
        if room is not None:
            with _received_cv:
                entry = _received.pop(room, None)
                if entry is None and "unknown reason from another rank" in str(error_message):
                    # another TP rank's Failed can beat this rank's own notice
                    _received_cv.wait_for(lambda: room in _received, timeout=0.15)
                    entry = _received.pop(room, None)
        if entry is None:
            return original(req, error_message, *args, **kwargs)
        status, message = entry[0], entry[1]
        log.warning("request rid=%s room=%s was rejected by prefill: %s", getattr(req, "rid", "?"), room, message)
        kwargs.pop("status_code", None)
        return original(req, message, status_code=status)

    return prepare_abort


def _check_capacity(original: Callable) -> Callable:
    def _check_if_req_exceed_kv_capacity(self, req, *args, **kwargs):
        rejected = original(self, req, *args, **kwargs)
        if rejected:
            try:
                note_prefill_rejection(getattr(self, "kv_manager", None), req, self)
            except Exception as exc:  # noqa: BLE001
                log.warning("rejection notice failed: %s", exc)
        return rejected

    return _check_if_req_exceed_kv_capacity


def _retire_unadmitted(original: Callable) -> Callable:
    def retire_unadmitted_request(self, req, *args, **kwargs):
        try:
            queue = getattr(self, "disagg_prefill_bootstrap_queue", None)
            if queue is not None:
                note_prefill_rejection(getattr(queue, "kv_manager", None), req, queue)
        except Exception as exc:  # noqa: BLE001
            log.warning("rejection notice failed: %s", exc)
        return original(self, req, *args, **kwargs)

    return retire_unadmitted_request


class RejectionNoticeGuard(Guard):
    name = "rejection_notice"
    suspendable = True  # hybrid_pool_check switches it off on a non-Mooncake transfer backend (warn)
    protects = ("decode learns at once, with the original error, that prefill rejected or ended a request "
                "before sending its KV (Mooncake)")
    targets = (UPDATE_STATUS, HANDLE_AUX, PREPARE_ABORT, CHECK_CAPACITY, SENDER_FAILURE, admission_drain.UPSTREAM_RETIRE)

    def decide(self, ctx) -> Decision:
        for t in (UPDATE_STATUS, HANDLE_AUX, PREPARE_ABORT, CHECK_CAPACITY, SENDER_FAILURE):
            ctx.require(t.key)
        patches = [UPDATE_STATUS.key, HANDLE_AUX.key, PREPARE_ABORT.key, CHECK_CAPACITY.key, SENDER_FAILURE.key]
        if ctx.has(admission_drain.UPSTREAM_RETIRE.key):
            ctx.require(admission_drain.UPSTREAM_RETIRE.key)
            patches.append(admission_drain.UPSTREAM_RETIRE.key)
            how = "notice sent from upstream's door (retire_unadmitted_request)"
        else:
            if "admission_drain" in ctx.config.disabled:
                how = "admission_drain is off: no door to send from"
            else:
                how = "notice sent from kvguard's prefill door"
        return Decision(ACTIVE, how, patches=tuple(patches))

    def wrappers(self, ctx) -> Dict[str, Callable[[Callable], Callable]]:
        return {
            UPDATE_STATUS.key: _update_status,
            HANDLE_AUX.key: _handle_aux_data,
            PREPARE_ABORT.key: _prepare_abort,
            CHECK_CAPACITY.key: _check_capacity,
            SENDER_FAILURE.key: _sender_failure,
            admission_drain.UPSTREAM_RETIRE.key: _retire_unadmitted,
        }

    def on_installed(self, ctx) -> None:
        admission_drain.DOOR_DRAIN_HOOKS[:] = [h for h in admission_drain.DOOR_DRAIN_HOOKS if h is not _on_door_drain]
        admission_drain.DOOR_DRAIN_HOOKS.append(_on_door_drain)
