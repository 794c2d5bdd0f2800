"""Tell prefill, promptly and with the original error, that decode rejected a request.

The mirror of :mod:`rejection_notice`. In PD mode the router sends each request to
prefill and decode and answers its client when both halves have answered. When
decode refuses a request at its admission door (an over-length prompt: its own
validation, or kvguard's decode_admission_fit bound; a client abort before
bootstrap), decode never registers with prefill, and no release up to 0.5.23 tells
prefill: prefill's sender waits in ``Bootstrapping`` until
``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` (300 s by default), then answers 500.
The router's client waits that long for decode's 400 (measured on 0.5.19 with
kvguard's decode_admission_fit: a 600-token prompt on a 1024-token decode pool).

kvguard, Mooncake backend (design: docs/design/admission-notify.md):

* decode, at the door (kvguard's on 0.5.10-0.5.20, upstream's
  ``Scheduler.retire_unadmitted_request`` on 0.5.21+): hand the room, the prefill's
  bootstrap address and the request's own message and status to a background
  thread (the scheduler thread never blocks). That thread asks prefill's bootstrap
  server for the prefill ranks (``GET /route``, cached) and sends each one, on a
  kvguard-owned ZMQ PUSH socket, an 8-frame message shaped like a *dummy*
  ``TransferInfo`` whose session id is :data:`NOTICE_SID` and whose required info
  count can never be reached. The original error travels in frame 6, which upstream
  never reads for a dummy info. A prefill without kvguard stores one inert dummy
  entry for that room and otherwise ignores it, on every release.
* prefill: ``TransferInfo.from_zmq`` (called by the Mooncake bootstrap thread) picks
  the notice up. On the scheduler thread, at the next ``pop_bootstrapped``, the
  request with that room fails through upstream's own path
  (``record_failure`` + ``update_status(Failed)`` -> poll ``Failed`` ->
  ``prepare_abort``), where kvguard substitutes the original message and status
  (400). The request never reached the waiting queue, so nothing was prefilled.

The same notice goes out when decode aborts a room that has not concluded
(``/abort_request``, a client that went away; ``MooncakeKVReceiver.abort`` on 0.5.10,
``CommonKVReceiver.abort`` from 0.5.11, Mooncake managers only), status 500, "decode
aborted the request: <reason>". Upstream's own word does not survive a prefill whose
half of the request has not arrived yet: 0.5.10-0.5.12 send nothing; from 0.5.13
prefill drops the ``ABORT`` of an unknown room, or marks a room that only has
decode's transfer info ``Failed``, which the sender created for the arriving request
sets back to ``Bootstrapping``. Prefill then kept its half in the bootstrap queue until
the bootstrap timeout (300 s) and the router's client waited (CI, 0.5.19,
``test_abort_phases``: a router retry aborted on decode alone; reproduced in
``test_a_decode_abort_that_overtakes_the_prefill_half_ends_it``, both before and
after decode's handshake). A room already past prefill's bootstrap queue is left to
upstream's ``ABORT``; its notice expires unused.
"""

from __future__ import annotations

import json
import logging
import queue as queue_mod
import threading
import time
import urllib.request
from typing import Callable, Dict, List, Optional, Tuple

from ..lifetime import transfer_components
from ..lifetime.push_sockets import PushSockets
from ..engine.process import pd_role
from ..engine import suspension
from ..engine.guard import ACTIVE, Decision, Guard
from ..engine.targets import target
from . import admission_drain, rejection_notice
from .decode_destination_hold import START_PREFILL_THREAD
from .prefill_source_hold import POP_BOOTSTRAPPED

log = logging.getLogger("sglang_kvguard")

NOTICE_SID = rejection_notice.DECODE_NOTICE_SID
NEVER = b"2147483647"  # required_dst_info_num: the room never becomes WaitingForInput
_TTL = 600.0
_ROUTE_TTL = 60.0
_MAX_RANKS = 1024
_APPLY_GRACE = 1.0  # seconds to wait for the bootstrap thread to store the dummy entry

TRANSFER_INFO_FROM_ZMQ = target(
    "mooncake.TransferInfo.from_zmq",
    "sglang.srt.disaggregation.mooncake.conn:TransferInfo.from_zmq",
    why="prefill: the Mooncake bootstrap thread parses each decode registration here",
)
BOOTSTRAP_ADDR = target(
    "disagg.decode._bootstrap_addr",
    "sglang.srt.disaggregation.decode:_bootstrap_addr",
    why="decode: the prefill bootstrap server a request belongs to (read, not patched)",
)
RECEIVER_ABORT = target(
    "mooncake.MooncakeKVReceiver.abort",
    "sglang.srt.disaggregation.mooncake.conn:MooncakeKVReceiver.abort",
    "sglang.srt.disaggregation.common.conn:CommonKVReceiver.abort",
    why="decode: a room aborted before its transfer info reached prefill; prefill is told (Mooncake managers)",
)
_lock = threading.Lock()
# prefill side: room -> (status, message, time received)
_notices: Dict[int, Tuple[int, str, float]] = {}


# ---------------------------------------------------------------------------
# wire format


def encode(room: int, local_ip: str, rank_port: int, status: int, message: str) -> List[bytes]:
    """The 8 frames of a decode rejection notice (a dummy TransferInfo to upstream)."""
    payload = json.dumps({"v": 1, "status": int(status), "message": str(message)}).encode("utf-8")
    return [str(int(room)).encode("ascii"), str(local_ip).encode("ascii"), str(int(rank_port)).encode("ascii"),
            NOTICE_SID.encode("ascii"), b"", b"", payload, NEVER]


def decode_notice(msg) -> Optional[Tuple[int, int, str]]:
    """(room, status, message) if ``msg`` is a kvguard decode rejection notice."""
    if len(msg) != 8 or msg[3] != NOTICE_SID.encode("ascii"):
        return None
    data = json.loads(bytes(msg[6]).decode("utf-8"))
    return int(bytes(msg[0]).decode("ascii")), int(data["status"]), str(data["message"])


# ---------------------------------------------------------------------------
# decode side


class _Notifier:
    """Background thread: resolve prefill ranks over HTTP, send notices over ZMQ."""

    def __init__(self):
        self.q: "queue_mod.Queue" = queue_mod.Queue()
        self.routes: Dict[str, Tuple[float, List[Tuple[str, int]], Optional[int], bool]] = {}
        self.sockets = PushSockets()
        self.thread = threading.Thread(target=self._run, name="kvguard-decode-rejection-notice", daemon=True)
        self.thread.start()

    def submit(self, item) -> None:
        self.q.put(item)

    def _get(self, addr: str, dp: int, cp: int, tp: int, pp: int) -> Optional[dict]:
        url = (f"http://{addr}/route?prefill_dp_rank={dp}&prefill_cp_rank={cp}"
               f"&target_tp_rank={tp}&target_pp_rank={pp}")
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:  # noqa: S310 - the request's own bootstrap server
                return json.loads(resp.read().decode("utf-8"))
        except Exception as exc:  # noqa: BLE001
            log.debug("kvguard decode_rejection_notice: GET %s failed: %s", url, exc)
            return None

    def ranks(self, addr: str, room: int) -> List[Tuple[str, int]]:
        cached = self.routes.get(addr)
        if cached is None or time.monotonic() - cached[0] > _ROUTE_TTL or not cached[1]:
            info = self._get(addr, -1, -1, -1, -1) or {}
            dp = int(info.get("dp_size") or 1)
            cp = int(info.get("attn_cp_size") or 1)
            tp = int(info.get("attn_tp_size") or 1)
            pp = int(info.get("pp_size") or 1)
            follow = bool(info.get("follow_bootstrap_room", True))
            ranks = []
            for d in range(dp):
                for c in range(cp):
                    for t in range(tp):
                        for p in range(pp):
                            if len(ranks) >= _MAX_RANKS:
                                break
                            r = self._get(addr, d, c, t, p)
                            if r and r.get("rank_ip") and r.get("rank_port"):
                                ranks.append((d, str(r["rank_ip"]), int(r["rank_port"])))
            cached = (time.monotonic(), ranks, dp, follow)
            self.routes[addr] = cached
        _, ranks, dp, follow = cached
        if follow and dp and dp > 1:
            # the prefill's own load balancer put the room on this DP rank
            return [(ip, port) for d, ip, port in ranks if d == room % dp]
        return [(ip, port) for _d, ip, port in ranks]

    def send(self, addr: str, frames: List[bytes], room: int, what: str = "rejected") -> int:
        import zmq

        sent = 0
        for ip, port in self.ranks(addr, room):
            try:
                self.sockets.get(ip, port).send_multipart(frames, flags=zmq.DONTWAIT)
                sent += 1
            except Exception as exc:  # noqa: BLE001
                log.warning("kvguard: could not tell prefill rank %s:%s that decode %s room %s: %s",
                            ip, port, what, room, exc)
        return sent

    def _run(self) -> None:
        from ..engine import metrics

        while True:
            addr, room, frames, message, what = self.q.get()
            try:
                sent = self.send(addr, frames, room, what)
            except Exception as exc:  # noqa: BLE001 - keep the thread alive
                log.warning("kvguard: decode rejection notice for room %s failed: %s", room, exc)
                sent = 0
            if sent:
                metrics.count("decode_rejection_notices", n=sent)
                log.info("told %d prefill rank(s) at %s that decode %s room %s: %s", sent, addr, what, room, message)
            else:
                log.warning("kvguard: no prefill rank at %s could be told that decode %s room %s; "
                            "prefill answers after its bootstrap timeout", addr, what, room)


_notifier: Dict[str, _Notifier] = {}


def _get_notifier() -> _Notifier:
    with _lock:
        n = _notifier.get("n")
        if n is None or not n.thread.is_alive():
            n = _notifier["n"] = _Notifier()
        return n


def notify_room(kv_manager, addr: str, room, status: int, message: str, what: str = "rejected") -> bool:
    """Queue a notice for ``room`` to the prefill at bootstrap address ``addr`` (``what``
    decode did with it, for the log: "rejected" at its door, or "aborted")."""
    local_ip, rank_port = getattr(kv_manager, "local_ip", None), getattr(kv_manager, "rank_port", None)
    if local_ip is None or rank_port is None or room is None or not addr:
        return False
    frames = encode(int(room), local_ip, rank_port, status, message)
    _get_notifier().submit((addr, int(room), frames, message, what))
    return True


def notify_prefill(prealloc_queue, req) -> bool:
    """Decode door: queue a notice for the request's prefill; never blocks or raises."""
    try:
        from sglang.srt.disaggregation import decode as decode_mod
        from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

        room = getattr(req, "bootstrap_room", None)
        host = getattr(req, "bootstrap_host", None)
        if room is None or host is None or host == FAKE_BOOTSTRAP_HOST:
            return False
        status, message = rejection_notice._reason(req)
        return notify_room(getattr(prealloc_queue, "kv_manager", None), decode_mod._bootstrap_addr(req), room,
                           status, message)
    except Exception as exc:  # noqa: BLE001 - never break the scheduler thread
        log.warning("kvguard: could not queue the decode rejection notice: %s", exc)
        return False


ABORT_NOTICED = "_kvguard_abort_noticed"


def notify_abort(receiver) -> bool:
    """Decode aborted ``receiver``'s room before it concluded: tell its prefill.

    Upstream's own word to prefill does not survive a prefill that does not know the
    room yet, the case of a request whose decode half is aborted before its prefill
    half arrives (a router retry aborted on decode alone; a gateway abort that reaches
    decode first): 0.5.10-0.5.12 send nothing; from 0.5.13 prefill drops the ``ABORT``
    of an unknown room, or marks a room that only has decode's transfer info ``Failed``
    and the sender created for the arriving request sets it back to ``Bootstrapping``.
    Either way prefill keeps that half in its bootstrap queue until its bootstrap
    timeout (300 s), and the router's client waits with it. A kvguard notice is kept
    by prefill and fails the room in its bootstrap queue when the request is there;
    a room that is already past the bootstrap queue is left to upstream's ``ABORT``."""
    try:
        if getattr(receiver, ABORT_NOTICED, False):
            return False
        kv = getattr(receiver, "kv_mgr", None)
        room = getattr(receiver, "bootstrap_room", None)
        addr = getattr(receiver, "bootstrap_addr", None)
        if kv is None or room is None or not addr or not transfer_components.is_mooncake_manager(kv):
            return False
        from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

        if str(addr).startswith(str(FAKE_BOOTSTRAP_HOST)):
            return False
        setattr(receiver, ABORT_NOTICED, True)
        reason = (getattr(kv, "failure_records", None) or {}).get(room) or "Aborted by AbortReq."
        return notify_room(kv, addr, room, 500, f"decode aborted the request: {reason}", what="aborted")
    except Exception as exc:  # noqa: BLE001 - never break the scheduler thread
        log.warning("kvguard: could not queue the decode abort notice: %s", exc)
        return False


def _receiver_abort(original: Callable) -> Callable:
    def abort(self, *args, **kwargs):
        concluded = getattr(self, "conclude_state", None) is not None
        out = original(self, *args, **kwargs)
        if not concluded:  # a room that already ended (Success, or a failure prefill reported) needs no word
            notify_abort(self)
        return out

    return abort


def _on_decode_drain(prealloc_queue, req) -> None:
    if suspension.is_suspended("decode_rejection_notice"):  # a hook, not a wrapper: checked here
        return
    notify_prefill(prealloc_queue, req)


def _retire_unadmitted(original: Callable) -> Callable:
    def retire_unadmitted_request(self, req, *args, **kwargs):
        if pd_role(self) == "decode":
            notify_prefill(getattr(self, "disagg_decode_prealloc_queue", None), req)
        return original(self, req, *args, **kwargs)

    return retire_unadmitted_request


# ---------------------------------------------------------------------------
# prefill side

# The room a stored notice's dummy TransferInfo names: never a bootstrap room (those are
# non-negative), so upstream's transfer worker, which marks the room of a dummy entry
# Success at its last chunk (even a Failed one, up to 0.5.22), never acts on a notice.
NOTICE_ROOM = -1


class RoomInfos(dict):
    """One room's decode registrations (Mooncake session id -> TransferInfo), whose
    views are snapshots.

    Upstream's transfer worker iterates ``transfer_infos[room].values()`` (and the
    scheduler its ``keys()``) while the bootstrap thread may store into the same dict:
    a kvguard notice for a room decode aborted mid-transfer does. A plain dict then
    raises "dictionary changed size during iteration" in the worker, which upstream
    turns into a dead transfer thread ("Prefill instance ... is dead"): every later
    transfer hangs, their source pages stay pinned, and the prefill scheduler died on
    its next allocation (chaos soak on 0.5.10, session 16). Iterating a snapshot
    never sees the change."""

    __slots__ = ()

    def values(self):
        return list(dict.values(self))

    def items(self):
        return list(dict.items(self))

    def keys(self):
        return list(dict.keys(self))

    def __iter__(self):
        return iter(list(dict.keys(self)))


class Rooms(dict):
    """``MooncakeKVManager.transfer_infos`` on a prefill: every room's dict is a
    ``RoomInfos`` (upstream creates them as ``transfer_infos[room] = {}`` or
    ``transfer_infos.setdefault(room, {})``, on every supported release)."""

    __slots__ = ()

    def __setitem__(self, room, infos):
        if type(infos) is dict:
            infos = RoomInfos(infos)
        dict.__setitem__(self, room, infos)

    def setdefault(self, room, default=None):
        if type(default) is dict:
            default = RoomInfos(default)
        return dict.setdefault(self, room, default)


def snapshot_rooms(kv_manager) -> bool:
    """Make ``kv_manager.transfer_infos`` a ``Rooms`` (before its bootstrap thread
    starts, while no room is known yet); True if it is one now."""
    infos = getattr(kv_manager, "transfer_infos", None)
    if isinstance(infos, Rooms):
        return True
    if type(infos) is not dict:
        log.warning("kvguard decode_rejection_notice: transfer_infos is a %s, not a dict; notices for rooms "
                    "being transferred are not stored safely", type(infos).__name__)
        return False
    rooms = Rooms()
    for room, per_room in list(infos.items()):
        rooms[room] = per_room
    kv_manager.transfer_infos = rooms
    return True


def _start_prefill_thread(original: Callable) -> Callable:
    def start_prefill_thread(self, *args, **kwargs):
        snapshot_rooms(self)
        return original(self, *args, **kwargs)

    return start_prefill_thread


def _from_zmq(original: Callable) -> Callable:
    def from_zmq(cls, msg, *args, **kwargs):
        try:
            notice = decode_notice(msg)
        except Exception as exc:  # noqa: BLE001 - an exception here would kill bootstrap_thread
            log.warning("kvguard: ignored a malformed decode rejection notice: %s", exc)
            notice = None
        if notice is not None:
            room, status, message = notice
            with _lock:
                _notices[room] = (status, message, time.monotonic())
        info = original(cls, msg, *args, **kwargs)
        if notice is not None:
            try:
                info.room = NOTICE_ROOM
            except Exception as exc:  # noqa: BLE001
                log.warning("kvguard: could not neutralise the room of a notice's dummy entry: %s", exc)
        return info

    return from_zmq


def _drop_dummy(kv, room: int) -> None:
    infos = getattr(kv, "transfer_infos", {}).get(room)
    if infos is not None:
        infos.pop(NOTICE_SID, None)
        if not infos:
            kv.transfer_infos.pop(room, None)


def apply_notices(bootstrap_queue) -> int:
    """Fail, through upstream's path, each queued request decode has rejected."""
    if not _notices:
        return 0
    from sglang.srt.disaggregation.base.conn import KVPoll

    from ..engine import metrics

    kv = getattr(bootstrap_queue, "kv_manager", None)
    now = time.monotonic()
    failed = 0
    with _lock:
        for room in [r for r, v in _notices.items() if now - v[2] > _TTL]:
            _notices.pop(room, None)
            if kv is not None:
                _drop_dummy(kv, room)
        if not _notices or kv is None:
            return 0
        for req in list(getattr(bootstrap_queue, "queue", ())):
            room = getattr(req, "bootstrap_room", None)
            entry = _notices.get(room)
            if entry is None or getattr(req, "disagg_kv_sender", None) is None:
                continue
            stored = NOTICE_SID in (getattr(kv, "transfer_infos", {}).get(room) or {})
            if not stored and now - entry[2] < _APPLY_GRACE:
                continue  # the bootstrap thread is about to store the dummy entry
            _notices.pop(room, None)
            _drop_dummy(kv, room)
            status, message = entry[0], entry[1]
            with rejection_notice._received_cv:
                rejection_notice._received[room] = (status, message, now)
                rejection_notice._received_cv.notify_all()
            kv.record_failure(room, f"decode rejected the request: {message}")
            kv.update_status(room, KVPoll.Failed)
            failed += 1
            log.warning("request rid=%s room=%s was rejected by decode: %s", getattr(req, "rid", "?"), room, message)
    if failed:
        metrics.count("decode_rejections_applied", n=failed)
    return failed


def _pop_bootstrapped(original: Callable) -> Callable:
    def pop_bootstrapped(self, *args, **kwargs):
        if _notices:
            try:
                apply_notices(self)
            except Exception as exc:  # noqa: BLE001
                log.warning("kvguard: applying decode rejection notices failed: %s", exc)
        return original(self, *args, **kwargs)

    return pop_bootstrapped


class DecodeRejectionNoticeGuard(Guard):
    name = "decode_rejection_notice"
    suspendable = True  # hybrid_pool_check switches it off on a non-Mooncake transfer backend (warn)
    protects = ("prefill learns at once, with the original error, that decode rejected a request or aborted it "
                "before its transfer info was sent (Mooncake)")
    targets = (TRANSFER_INFO_FROM_ZMQ, BOOTSTRAP_ADDR, POP_BOOTSTRAPPED, rejection_notice.PREPARE_ABORT,
               RECEIVER_ABORT, START_PREFILL_THREAD, admission_drain.DECODE_DOOR, admission_drain.UPSTREAM_RETIRE)

    def decide(self, ctx) -> Decision:
        for t in (TRANSFER_INFO_FROM_ZMQ, BOOTSTRAP_ADDR, POP_BOOTSTRAPPED, rejection_notice.PREPARE_ABORT,
                  RECEIVER_ABORT, START_PREFILL_THREAD):
            ctx.require(t.key)
        patches = [TRANSFER_INFO_FROM_ZMQ.key, POP_BOOTSTRAPPED.key, rejection_notice.PREPARE_ABORT.key,
                   RECEIVER_ABORT.key, START_PREFILL_THREAD.key]
        if ctx.has(admission_drain.UPSTREAM_RETIRE.key):
            ctx.require(admission_drain.UPSTREAM_RETIRE.key)
            patches.append(admission_drain.UPSTREAM_RETIRE.key)
            how = "notice sent from upstream's decode door (retire_unadmitted_request)"
        elif "admission_drain" in ctx.config.disabled:
            how = "admission_drain is off: no decode door to send from"
        else:
            how = "notice sent from kvguard's decode door"
        return Decision(ACTIVE, how, patches=tuple(patches))

    def wrappers(self, ctx) -> Dict[str, Callable[[Callable], Callable]]:
        return {
            TRANSFER_INFO_FROM_ZMQ.key: _from_zmq,
            POP_BOOTSTRAPPED.key: _pop_bootstrapped,
            rejection_notice.PREPARE_ABORT.key: rejection_notice._prepare_abort,
            RECEIVER_ABORT.key: _receiver_abort,
            START_PREFILL_THREAD.key: _start_prefill_thread,
            admission_drain.UPSTREAM_RETIRE.key: _retire_unadmitted,
        }

    def on_installed(self, ctx) -> None:
        hooks = admission_drain.DECODE_DRAIN_HOOKS
        hooks[:] = [h for h in hooks if h is not _on_decode_drain]
        hooks.append(_on_decode_drain)
