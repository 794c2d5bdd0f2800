"""Decode destination pages stay allocated until every prefill rank writing them has drained.

On 0.5.10-0.5.20 decode frees a failed transfer's pages at once (abort, timeout,
one prefill rank's Failed; docs/design/page-lifetime.md D1-D4) while a prefill
transfer worker may still be writing them over Mooncake: the late write lands in
pages that now belong to another request. Upstream has nothing to wait on: no ABORT
up to 0.5.12, an ABORT_ACK that prefill sends before the drain and decode drops in
0.5.13-0.5.18, and in 0.5.19-0.5.20 an opt-in hold that drops every ack. (0.5.21+:
upstream's own hold, see decode_deferred_release.)

kvguard, both roles (Mooncake backend):

* decode pins a room's destination pages and metadata row when it publishes them
  (``MooncakeKVReceiver.send_metadata``). A page freed while pinned is diverted at the
  allocator's free sink (the page hold of prefill_source_hold) and held; a metadata
  row freed while pinned is held too;
* when the request leaves the transfer queue with its transfer complete, the pins go;
  when it leaves any other way (failed, aborted, timed out), decode sends each prefill
  rank that writes the room (``bootstrap_infos``, dummies excluded) a drain request
  on that rank's bootstrap socket, naming a kvguard reply socket;
* prefill (every release) marks the room Failed, refuses every later chunk of it, and
  answers once no chunk of the room is queued or in flight (``transfer_drain``);
* when every rank has answered, the pins go and the held pages and row are released
  on the scheduler thread. A hold older than ``--kvguard-quarantine-after`` is
  quarantined: logged, counted, never freed blind; released if the answer comes later.

A prefill without kvguard cannot answer (its bootstrap server's ``/route`` lacks the
``X-KVGuard-Drain`` header, and kvguard then sends it nothing it cannot parse): decode
keeps that room's pages until the quarantine bound and says why (fail closed).
"""

from __future__ import annotations

import logging
import queue as queue_mod
import threading
import time
import urllib.request
from typing import Callable, Dict, List, Optional, Tuple

from ..lifetime import peer_liveness, transfer_components, transfer_drain
from ..lifetime.push_sockets import PushSockets
from ..engine.process import SCHEDULER_INIT
from ..engine.guard import ACTIVE, OFF, Decision, Guard
from ..engine.targets import target
from ..lifetime.page_hold import HOLDS, ROWS, PageHold, bind_at_scheduler_init
from .prefill_source_hold import page_list, release_drained

log = logging.getLogger("sglang_kvguard")

SEND_METADATA = target(
    "mooncake.MooncakeKVReceiver.send_metadata",
    "sglang.srt.disaggregation.mooncake.conn:MooncakeKVReceiver.send_metadata",
    why="decode: publishes a room's destination pages and metadata row to prefill",
)
POP_TRANSFERRED = target(
    "disagg.decode.DecodeTransferQueue.pop_transferred",
    "sglang.srt.disaggregation.decode:DecodeTransferQueue.pop_transferred",
    why="decode: where requests leave the transfer queue (complete, failed or aborted)",
)
START_PREFILL_THREAD = target(
    "mooncake.MooncakeKVManager.start_prefill_thread",
    "sglang.srt.disaggregation.mooncake.conn:MooncakeKVManager.start_prefill_thread",
    why="prefill: its bootstrap thread reads the socket kvguard's drain requests arrive on",
)
ROUTE_GET = target(
    "common.CommonKVBootstrapServer._handle_route_get",
    "sglang.srt.disaggregation.common.conn:CommonKVBootstrapServer._handle_route_get",
    why="prefill bootstrap server: tells decode that this prefill answers drain requests",
)

ROLE = "decode"
_SWEEP_EVERY = 1.0
_ROUTE_TTL = 60.0
_STRAY_AFTER = 5.0  # seconds a pinned room may be outside the transfer queue (it enters it in the same step)


class _Room:
    __slots__ = ("room", "rid", "pages", "meta", "ranks", "addr", "since", "acked", "quarantined", "local_ip",
                 "pinned_at", "watches")

    def __init__(self, room: int, pages: List[int], meta: Optional[int], ranks, addr: str) -> None:
        self.room = room
        self.rid = "?"
        self.pages = pages
        self.meta = meta
        self.ranks = ranks  # [(ip, port)] of the prefill ranks that write this room
        self.addr = addr
        self.since: Optional[float] = None  # set when the drain was requested
        self.acked: set = set()
        self.quarantined = False
        self.local_ip: Optional[str] = None  # decode's address (the KV manager's), for the answers
        self.pinned_at = time.monotonic()
        self.watches: list = []  # peer_liveness handles of its prefill ranks


_lock = threading.Lock()
_rooms: Dict[int, _Room] = {}
_last_sweep = {"t": 0.0}
_warned = {"page_size": False}


# ----------------------------------------------------------------------------- decode: pins


def rank_addresses(infos) -> List[Tuple[str, int]]:
    """(ip, port) of the prefill ranks in a receiver's ``bootstrap_infos``, dummy ranks
    excluded: dicts up to 0.5.20, objects from 0.5.21. A rank without an address raises
    (the caller then holds nothing on a partial list of writers)."""
    out = []
    for info in infos:
        if isinstance(info, dict):
            if not info.get("is_dummy"):
                out.append((str(info["rank_ip"]), int(info["rank_port"])))
        elif not getattr(info, "is_dummy", False):
            out.append((str(info.rank_ip), int(info.rank_port)))
    return out


def _hold() -> Optional[PageHold]:
    h = HOLDS.get(ROLE)
    return h if h is not None and h._allocator_ref is not None else None


def _send_metadata(original: Callable) -> Callable:
    def send_metadata(self, kv_indices, aux_index=None, *args, **kwargs):
        hold = _hold()
        room = getattr(self, "bootstrap_room", None)
        infos = getattr(self, "bootstrap_infos", None)
        if hold is None or room is None or not infos:
            return original(self, kv_indices, aux_index, *args, **kwargs)
        try:
            mgr_ps = getattr(getattr(getattr(self, "kv_mgr", None), "kv_args", None), "page_size", hold.page_size)
            if int(mgr_ps or hold.page_size) != hold.page_size:
                if not _warned["page_size"]:
                    _warned["page_size"] = True
                    log.error("kvguard decode_destination_hold: transfer page size %s differs from the allocator's "
                              "%d; destination pages are not held", mgr_ps, hold.page_size)
                return original(self, kv_indices, aux_index, *args, **kwargs)
            pages = page_list(kv_indices)
            # pages its state components are written at (the DSA/NSA indexer, MXFP8 block
            # scales): up to 0.5.22 from page 0, a decode radix-cache prefix included
            state = args[0] if args else kwargs.get("state_indices")
            positions = transfer_components.page_state_positions(
                getattr(getattr(self, "kv_mgr", None), "kv_args", None))
            pages = list(dict.fromkeys(pages + transfer_components.state_pages(state, positions)))
            ranks = rank_addresses(infos)
            rec = _Room(int(room), pages, None if aux_index is None else int(aux_index), ranks,
                        str(getattr(self, "bootstrap_addr", "")))
            rec.local_ip = getattr(getattr(self, "kv_mgr", None), "local_ip", None)
            hold.pin(pages)
            with _lock:
                old = _rooms.pop(int(room), None)
                _rooms[int(room)] = rec
            ROWS.pin(rec.meta)
            if old is not None:  # the room was published again (re-bootstrap): the old pins go
                _unpin(old, hold)
        except Exception as exc:  # noqa: BLE001 - never break the scheduler; the room is just not held
            log.error("kvguard decode_destination_hold: pinning room %s failed (not held): %s", room, exc)
        return original(self, kv_indices, aux_index, *args, **kwargs)

    return send_metadata


def _unpin(rec: _Room, hold: PageHold) -> None:
    hold.unpin(rec.pages)
    ROWS.unpin(rec.meta)


def held_metadata_rows() -> int:
    return ROWS.held()


# ----------------------------------------------------------------------------- decode: drain requests and answers


class _Drains:
    """Background thread: ask prefill ranks for drains; a reply socket for their answers."""

    def __init__(self, local_ip: str) -> None:
        import zmq

        self.q: "queue_mod.Queue" = queue_mod.Queue()
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        host = f"[{local_ip}]" if ":" in local_ip else local_ip
        if ":" in local_ip:
            self.pull.setsockopt(zmq.IPV6, 1)
        self.reply_ip = local_ip
        self.reply_port = self.pull.bind_to_random_port(f"tcp://{host}")
        self.sockets = PushSockets(self.ctx)
        self.capable: Dict[str, Tuple[float, bool]] = {}
        self.sender = threading.Thread(target=self._send_loop, name="kvguard-decode-drain-requests", daemon=True)
        self.receiver = threading.Thread(target=self._recv_loop, name="kvguard-decode-drain-answers", daemon=True)
        self.sender.start()
        self.receiver.start()

    def prefill_answers(self, addr: str) -> bool:
        cached = self.capable.get(addr)
        if cached is not None and time.monotonic() - cached[0] < _ROUTE_TTL:
            return cached[1]
        url = (f"http://{addr}/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1")
        ok = False
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:  # noqa: S310 - the room's own bootstrap server
                ok = resp.headers.get(transfer_drain.ROUTE_HEADER) == "1"
        except Exception as exc:  # noqa: BLE001
            log.warning("kvguard decode_destination_hold: GET %s failed: %s", url, exc)
            return False  # not cached: asked again next time
        self.capable[addr] = (time.monotonic(), ok)
        return ok

    def _send_loop(self) -> None:
        import zmq

        from ..engine import metrics

        while True:
            rec: _Room = self.q.get()
            try:
                if not self.prefill_answers(rec.addr):
                    log.error("kvguard decode_destination_hold: the prefill at %s does not answer drain requests "
                              "(no kvguard there?); room %s keeps its %d page(s) until the quarantine bound and "
                              "then stays quarantined", rec.addr, rec.room, len(rec.pages))
                    metrics.count("drain_requests_unanswerable")
                    continue
                frames = transfer_drain.encode_request(rec.room, self.reply_ip, self.reply_port)
                for ip, port in rec.ranks:
                    self.sockets.get(ip, port).send_multipart(frames, flags=zmq.DONTWAIT)
                metrics.count("drain_requests", n=len(rec.ranks))
            except Exception as exc:  # noqa: BLE001 - keep the thread alive
                log.warning("kvguard decode_destination_hold: drain request for room %s failed: %s", rec.room, exc)

    def _recv_loop(self) -> None:
        while True:
            try:
                msg = self.pull.recv_multipart()
                ans = transfer_drain.decode_drained(msg)
                if ans is not None:
                    answered(*ans)
            except Exception as exc:  # noqa: BLE001 - keep the thread alive
                log.warning("kvguard decode_destination_hold: bad drain answer: %s", exc)


_drains: Dict[str, _Drains] = {}


def _drain_service(local_ip: str) -> _Drains:
    with _lock:
        d = _drains.get("d")
        if d is None:
            d = _drains["d"] = _Drains(local_ip)
        return d


def answered(room: int, rank: str) -> None:
    """Reply thread: a prefill rank says the room has drained there."""
    hold = _hold()
    with _lock:
        rec = _rooms.get(room)
        if rec is None or rec.since is None:
            return
        rec.acked.add(rank)
        done = all(f"{ip}:{port}" in rec.acked for ip, port in rec.ranks) or (
            len(rec.acked) >= len(rec.ranks) and all(any(a.endswith(f":{port}") for a in rec.acked)
                                                      for _ip, port in rec.ranks))
        if not done:
            return
        _rooms.pop(room, None)
    if hold is not None:
        _unpin(rec, hold)
    for entry in rec.watches:
        peer_liveness.watch().cancel(entry)
    waited = time.monotonic() - rec.since
    if rec.quarantined:
        from ..engine import metrics

        metrics.count("pages_released_from_quarantine", n=len(rec.pages), role=ROLE)
        log.warning("kvguard decode_destination_hold: room %s drained after %.0f s; its %d quarantined page(s) "
                    "are released", room, waited, len(rec.pages))
    else:
        log.info("kvguard decode_destination_hold: room %s drained on %d prefill rank(s) after %.3f s; its %d "
                 "page(s) are released", room, len(rec.ranks), waited, len(rec.pages))


def _request_drain(rec: _Room, local_ip: Optional[str]) -> None:
    rec.since = time.monotonic()
    if not rec.ranks:
        return
    if local_ip is None:
        log.error("kvguard decode_destination_hold: no local address to receive drain answers; room %s stays held",
                  rec.room)
        return
    _drain_service(local_ip).q.put(rec)
    _watch_ranks(rec)


def _watch_ranks(rec: _Room) -> None:
    """A prefill rank that is gone (its bootstrap socket refuses connections) writes
    nothing any more: it counts as having answered the room's drain request."""
    w = peer_liveness.watch()
    for ip, port in rec.ranks:
        rank = f"{ip}:{port}"
        rec.watches.append(w.watch([rank], lambda rank=rank: _rank_gone(rec.room, rank), what=f"room {rec.room}"))


def _rank_gone(room: int, rank: str) -> None:
    with _lock:
        rec = _rooms.get(room)
        if rec is None or rank in rec.acked:
            return
    from ..engine import metrics

    metrics.count("drain_ranks_gone")
    log.warning("kvguard decode_destination_hold: prefill rank %s of room %s is gone; it counts as drained", rank,
                room)
    answered(room, rank)


# ----------------------------------------------------------------------------- decode: the transfer queue


def _pop_transferred(original: Callable) -> Callable:
    def pop_transferred(self, *args, **kwargs):
        hold = _hold()
        if hold is None:
            return original(self, *args, **kwargs)
        before = list(getattr(self, "queue", ()) or ())
        out = original(self, *args, **kwargs)
        try:
            _after_pop(self, hold, before, out)
        except Exception as exc:  # noqa: BLE001 - never break the decode loop
            log.warning("kvguard decode_destination_hold: bookkeeping after pop_transferred failed: %s", exc)
        return out

    return pop_transferred


def _after_pop(queue, hold: PageHold, before, out) -> None:
    still = {id(dr) for dr in (getattr(queue, "queue", ()) or ())}
    done_ok = {id(r) for r in (out or ())}
    for dr in before:
        if id(dr) in still:
            continue
        room = getattr(dr.req, "bootstrap_room", None)
        with _lock:
            rec = _rooms.get(room) if room is not None else None
            if rec is None or rec.since is not None:
                continue
            rec.rid = str(getattr(dr.req, "rid", "?"))
            if id(dr.req) in done_ok:
                _rooms.pop(room, None)
            rec_ok = id(dr.req) in done_ok
        if rec_ok:  # the transfer completed: the request owns its pages now
            _unpin(rec, hold)
            continue
        _request_drain(rec, rec.local_ip)
        log.info("kvguard decode_destination_hold: room %s (rid=%s) left the transfer queue unfinished; its %d "
                 "page(s) stay held until %d prefill rank(s) confirm the drain", room, getattr(dr.req, "rid", "?"),
                 len(rec.pages), len(rec.ranks))
    alloc = hold._allocator_ref() if hold._allocator_ref is not None else None
    if alloc is not None:
        release_drained(alloc)
    ROWS.flush()
    now = time.monotonic()
    if now - _last_sweep["t"] >= _SWEEP_EVERY:
        _last_sweep["t"] = now
        _drain_strays(queue, now)
        sweep(hold, now)


def _drain_strays(queue, now: float) -> None:
    """A pinned room that is no longer in the transfer queue left it some other way than
    through pop_transferred: it is treated as unfinished (asked for its drain)."""
    in_queue = {getattr(dr.req, "bootstrap_room", None) for dr in (getattr(queue, "queue", ()) or ())}
    with _lock:
        strays = [r for r in _rooms.values() if r.since is None and r.room not in in_queue
                  and now - r.pinned_at > _STRAY_AFTER]
        for r in strays:
            r.since = now  # claimed here; _request_drain sets it again
    for r in strays:
        log.warning("kvguard decode_destination_hold: room %s left the transfer queue without pop_transferred; its "
                    "%d page(s) stay held until %d prefill rank(s) confirm the drain", r.room, len(r.pages),
                    len(r.ranks))
        _request_drain(r, r.local_ip)


def sweep(hold: PageHold, now: float) -> None:
    from ..engine import metrics

    with _lock:
        late = [r for r in _rooms.values() if r.since is not None and not r.quarantined
                and now - r.since >= hold.quarantine_after]
        for r in late:
            r.quarantined = True
    for r in late:
        log.error("kvguard decode_destination_hold: room %s (rid=%s) has waited %.0f s for %d prefill rank(s) to "
                  "confirm that their writes stopped (%d answered); its %d page(s) are quarantined (kept out of the "
                  "free list, never freed blind; released if the drain is confirmed later)",
                  r.room, r.rid, now - r.since, len(r.ranks), len(r.acked), len(r.pages))
        metrics.count("pages_quarantined", n=len(r.pages), role=ROLE)
    hold.rooms_report = True  # the lines above name each room; the hold's own report is INFO
    hold.sweep(now)


def rooms_held() -> Tuple[int, int]:
    """(rooms waiting for a drain, of which quarantined)."""
    with _lock:
        waiting = [r for r in _rooms.values() if r.since is not None]
        return len(waiting), sum(1 for r in waiting if r.quarantined)


# ----------------------------------------------------------------------------- prefill half


class _DrainListeningSocket:
    """Wraps the prefill KV manager's bootstrap socket: kvguard drain requests are handled
    here and never reach upstream's bootstrap thread."""

    def __init__(self, sock, manager) -> None:
        self._kvguard_inner = sock
        self._kvguard_manager = manager

    def recv_multipart(self, *args, **kwargs):
        while True:
            msg = self._kvguard_inner.recv_multipart(*args, **kwargs)
            if msg and bytes(msg[0]) == transfer_drain.DRAIN_REQUEST:
                try:
                    req = transfer_drain.decode_request(msg)
                    if req is not None:
                        transfer_drain.drain_requested(self._kvguard_manager, *req)
                except Exception as exc:  # noqa: BLE001 - the bootstrap thread must live
                    log.warning("kvguard: bad drain request ignored: %s", exc)
                continue
            return msg

    def __getattr__(self, name):
        return getattr(self._kvguard_inner, name)


def _start_prefill_thread(original: Callable) -> Callable:
    def start_prefill_thread(self, *args, **kwargs):
        sock = getattr(self, "server_socket", None)
        if sock is not None and not isinstance(sock, _DrainListeningSocket):
            self.server_socket = _DrainListeningSocket(sock, self)
            transfer_drain.set_identity(self)
        return original(self, *args, **kwargs)

    return start_prefill_thread


def _route_get(original: Callable) -> Callable:
    async def _handle_route_get(self, request, *args, **kwargs):
        resp = await original(self, request, *args, **kwargs)
        try:
            resp.headers[transfer_drain.ROUTE_HEADER] = "1"
        except Exception:  # noqa: BLE001 - a header we cannot set only means decode will not ask
            pass
        return resp

    return _handle_route_get


# ----------------------------------------------------------------------------- start-up


def _scheduler_init(quarantine_after: float) -> Callable[[Callable], Callable]:
    return bind_at_scheduler_init(
        ROLE, quarantine_after, "decode_destination_hold: destination pages and metadata rows of Mooncake transfers "
        "stay allocated until every prefill rank writing them has drained")


class DecodeDestinationHoldGuard(Guard):
    name = "decode_destination_hold"
    suspendable = True  # hybrid_pool_check may switch it off on a node it cannot cover (warn)
    protects = ("decode pages and metadata rows of a failed or aborted transfer are never reused while a prefill "
                "rank may still write them (0.5.10-0.5.20; prefill answers drain requests on every release)")
    # The metadata-row free (ReqToMetadataIdxAllocator.free) is wrapped once, by prefill_source_hold, which
    # this guard needs anyway: decode's rows are pinned in the same per-process page_hold.ROWS.
    targets = (SCHEDULER_INIT, SEND_METADATA, POP_TRANSFERRED, START_PREFILL_THREAD, ROUTE_GET)

    def decide(self, ctx) -> Decision:
        if "prefill_source_hold" in ctx.config.disabled:
            return Decision(OFF, "needs prefill_source_hold (it counts each room's queued and in-flight chunks)")
        for t in (START_PREFILL_THREAD, ROUTE_GET):
            ctx.require(t.key)
        patches = [START_PREFILL_THREAD.key, ROUTE_GET.key]
        v = ctx.version
        if v is not None and v.release[:3] >= (0, 5, 21):
            return Decision(ACTIVE, "prefill answers drain requests; decode's hold is upstream's (see "
                            "decode_deferred_release)", patches=tuple(patches))
        for t in (SCHEDULER_INIT, SEND_METADATA, POP_TRANSFERRED):
            ctx.require(t.key)
        patches += [SCHEDULER_INIT.key, SEND_METADATA.key, POP_TRANSFERRED.key]
        return Decision(ACTIVE, "decode holds failed transfers' pages until prefill confirms the drain; prefill "
                        "answers drain requests", patches=tuple(patches))

    def wrappers(self, ctx) -> Dict[str, Callable[[Callable], Callable]]:
        q = float(ctx.config.get("quarantine_after"))
        return {
            SCHEDULER_INIT.key: _scheduler_init(q),
            SEND_METADATA.key: _send_metadata,
            POP_TRANSFERRED.key: _pop_transferred,
            START_PREFILL_THREAD.key: _start_prefill_thread,
            ROUTE_GET.key: _route_get,
        }
