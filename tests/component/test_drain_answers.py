"""Prefill's answer to decode's drain request waits for every chunk of the room.

decode_destination_hold (0.5.10-0.5.20) keeps a failed transfer's decode pages until
each prefill rank answers ``KVGUARD_DRAIN/1``. The answer is a promise that nothing
more is written into those pages, so it must wait for the room's queued and in-flight
chunks, and no chunk of the room may be queued after it.

Here: SGLang's real ``FastQueue`` and ``TransferKVChunk`` behind prefill_source_hold's
queue wrapper (the test thread plays the transfer worker), the real
``MooncakeKVManager.update_status`` / ``record_failure`` (on a manager built without
its transfer engine: only its status tables are set), and a real ZMQ socket that
receives the answers. The full path runs through real servers in
tests/server/test_abort_phases.py and tests/server/test_decode_quarantine.py.
"""

from __future__ import annotations

import os
import threading

import pytest

os.environ["KVGUARD_AUTO_INSTALL"] = "0"

pytestmark = pytest.mark.component

transfer_chunk = pytest.importorskip("_sglang_components").transfer_chunk  # needs torch + SGLang

ROOM = 4242


def _manager():
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    m = object.__new__(MooncakeKVManager)  # status tables only: no engine, sockets or threads
    m.request_status = {}
    m.failure_records = {}
    m.failure_lock = threading.Lock()
    m.deferred_bootstrap = None
    m._deferred_ack_targets = {}
    m._deferred_ack_poisoned_rooms = set()
    m._staging_outstanding = {}
    m.local_ip, m.rank_port = "127.0.0.1", 1
    from sglang.srt.disaggregation.utils import DisaggregationMode

    m.disaggregation_mode = DisaggregationMode.PREFILL  # drains are answered on prefill (read by 0.5.11's update_status)
    return m


@pytest.fixture
def answers():
    import zmq

    from sglang_kvguard.lifetime import transfer_drain

    transfer_drain.reset()
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")

    def recv(timeout_ms: int):
        if not pull.poll(timeout_ms):
            return None
        return transfer_drain.decode_drained(pull.recv_multipart())

    yield port, recv
    pull.close(0)
    ctx.term()
    transfer_drain.reset()


def _queue():
    from sglang.srt.disaggregation.common.utils import FastQueue

    from sglang_kvguard.guards.prefill_source_hold import _PinningQueue
    from sglang_kvguard.lifetime.page_hold import PageHold

    q = _PinningQueue(FastQueue(), PageHold("prefill"))
    q.consumer_wrapped = True
    return q


def test_answer_waits_for_queued_and_in_flight_chunks(sgl, answers):
    from sglang.srt.disaggregation.base.conn import KVPoll

    from sglang_kvguard.lifetime import transfer_drain

    port, recv = answers
    mgr = _manager()
    transfer_drain.set_identity(mgr)
    mgr.update_status(ROOM, KVPoll.Bootstrapping)
    mgr.update_status(ROOM, KVPoll.Transferring)
    q = _queue()
    q.put(transfer_chunk(ROOM, [1, 2]))
    q.put(transfer_chunk(ROOM, [3]))
    assert transfer_drain.outstanding(ROOM) == 2

    transfer_drain.drain_requested(mgr, ROOM, "127.0.0.1", port)
    assert mgr.request_status[ROOM] == KVPoll.Failed
    assert "kvguard drain request" in mgr.failure_records[ROOM]
    assert recv(300) is None, "answered while two chunks were still queued"

    q.get()  # the worker takes the first chunk and is sending it
    assert recv(300) is None, "answered while a chunk was in flight"
    q.get()  # first chunk done; the second in flight
    assert recv(300) is None
    q.finish_current()  # the worker is done with the room
    assert recv(3000) == (ROOM, "127.0.0.1:1")
    assert transfer_drain.outstanding(ROOM) == 0


def test_no_chunk_is_queued_after_the_request(sgl, answers):
    from sglang.srt.disaggregation.base.conn import KVPoll

    from sglang_kvguard.lifetime import transfer_drain

    port, recv = answers
    mgr = _manager()
    # decode gave up before this prefill had heard of the room: answered at once...
    transfer_drain.drain_requested(mgr, ROOM, "127.0.0.1", port)
    assert recv(3000) is not None
    # ...and when the request reaches prefill later, its chunk is refused and the room fails
    mgr.update_status(ROOM, KVPoll.Bootstrapping)
    with transfer_drain.locked():
        assert not transfer_drain.gate_chunk(mgr, ROOM)
    assert mgr.request_status[ROOM] == KVPoll.Failed
    assert transfer_drain.gate_chunk(mgr, ROOM + 1), "other rooms are not affected"


def test_answer_waits_for_transfer_futures_the_worker_left_running(sgl, answers):
    import concurrent.futures

    from sglang_kvguard.lifetime import transfer_drain
    from sglang_kvguard.guards.prefill_source_hold import _TrackingExecutor

    port, recv = answers
    mgr = _manager()
    q = _queue()
    release = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        ex = _TrackingExecutor(pool, q)
        q.put(transfer_chunk(ROOM, [5]))
        q.get()
        ex.submit(release.wait, 30)  # a layer transfer still writing after the worker moved on
        try:
            transfer_drain.drain_requested(mgr, ROOM, "127.0.0.1", port)
            q.finish_current()
            assert recv(300) is None, "answered while a transfer future was still running"
        finally:
            release.set()
        assert recv(3000) is not None


def test_a_failed_send_is_never_confirmed_and_its_pages_stay_held(sgl, answers, peer_watch):
    """Mooncake gives up on a batch (-1) without cancelling it: the room is never
    confirmed drained and the chunk's source pages stay pinned (then quarantined)."""
    import concurrent.futures

    from sglang_kvguard.lifetime import transfer_drain
    from sglang_kvguard.guards.prefill_source_hold import _TrackingExecutor, _transfer_data

    port, recv = answers
    mgr = _manager()
    q = _queue()
    calls = []

    def upstream_transfer_data(self, session, blocks):  # what Mooncake answers on its timeout
        calls.append((session, blocks))
        return -1 if session == "timed-out" else 0

    wrapped = _transfer_data(upstream_transfer_data)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        ex = _TrackingExecutor(pool, q)
        q.put(transfer_chunk(ROOM, [7, 8]))
        q.put(transfer_chunk(ROOM + 1, [9]))
        q.get()
        # layers go out on executor threads, as in send_kvcache
        assert ex.submit(wrapped, mgr, "ok", [(1, 2, 3)]).result() == 0
        assert ex.submit(wrapped, mgr, "timed-out", [(4, 5, 6)]).result() == -1
        transfer_drain.drain_requested(mgr, ROOM, "127.0.0.1", port)
        q.get()  # done with ROOM; the next room's chunk is in flight
        assert recv(500) is None, "confirmed a room whose failed batch may still write"
        assert transfer_drain.is_unsettled(ROOM)
        assert q._hold.pinned(7) and q._hold.pinned(8), "the failed chunk's source pages were unpinned"
        assert wrapped(mgr, "ok", [(1, 2, 3)]) == 0  # worker thread, ROOM + 1
        transfer_drain.drain_requested(mgr, ROOM + 1, "127.0.0.1", port)
        q.finish_current()
        assert recv(3000) == (ROOM + 1, "127.0.0.1:1"), "a room whose sends succeeded is confirmed"
        assert not q._hold.pinned(9) and q._hold.pinned(7)
        transfer_drain.drain_requested(mgr, ROOM, "127.0.0.1", port)  # asked again later: still not
        assert recv(500) is None
    assert len(calls) == 3


@pytest.fixture
def peer_watch(monkeypatch):
    """prefill_source_hold's peer watch, driven by hand (no background thread)."""
    from sglang_kvguard.lifetime import peer_liveness

    w = peer_liveness.PeerWatch(interval=3600.0, autostart=False)
    monkeypatch.setattr(peer_liveness, "WATCH", w)
    return w


def _closed_port() -> int:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now: a connect is refused
    return port


def test_a_failed_send_is_released_only_once_its_peer_is_gone(sgl, answers, peer_watch):
    """A failed batch to a peer that is gone (its session port refuses connections, twice
    in a row) can no longer read the source pages: they are released and the room may be
    confirmed drained. A failed batch to a live peer stays held."""
    import concurrent.futures
    import socket

    from sglang_kvguard.lifetime import transfer_drain
    from sglang_kvguard.guards.prefill_source_hold import _TrackingExecutor, _transfer_data

    port, recv = answers
    mgr = _manager()
    q = _queue()
    live = socket.socket()
    live.bind(("127.0.0.1", 0))
    live.listen(8)
    alive_peer = f"127.0.0.1:{live.getsockname()[1]}"
    dead_peer = f"127.0.0.1:{_closed_port()}"
    wrapped = _transfer_data(lambda self, session, blocks: -1)  # every batch times out
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            ex = _TrackingExecutor(pool, q)
            q.put(transfer_chunk(ROOM, [7, 8]))
            q.put(transfer_chunk(ROOM + 1, [9]))
            q.get()
            assert ex.submit(wrapped, mgr, dead_peer, [(1, 2, 3)]).result() == -1
            q.get()
            assert ex.submit(wrapped, mgr, alive_peer, [(4, 5, 6)]).result() == -1
            q.finish_current()
        assert peer_watch.watched() == 2
        assert peer_watch.poll_once() == 0, "one refused connect is not enough to call a peer gone"
        assert q._hold.pinned(7) and q._hold.pinned(8) and q._hold.pinned(9)
        transfer_drain.drain_requested(mgr, ROOM, "127.0.0.1", port)
        assert recv(300) is None
        assert peer_watch.poll_once() == 1
        assert not q._hold.pinned(7) and not q._hold.pinned(8), "the gone peer's failed send still holds its pages"
        assert q._hold.pinned(9), "released the pages of a failed send whose peer is alive"
        assert not transfer_drain.is_unsettled(ROOM) and transfer_drain.is_unsettled(ROOM + 1)
        transfer_drain.drain_requested(mgr, ROOM, "127.0.0.1", port)  # decode asks again: now it is answered
        assert recv(3000) == (ROOM, "127.0.0.1:1")
        for _ in range(3):
            peer_watch.poll_once()
        assert q._hold.pinned(9) and peer_watch.watched() == 1, "a peer that accepts connections was called gone"
        live.close()
        assert peer_watch.poll_once() == 0 and peer_watch.poll_once() == 1
        assert not q._hold.pinned(9) and not transfer_drain.is_unsettled(ROOM + 1)
    finally:
        live.close()


def test_upstream_drain_ack_is_withheld_for_an_unsettled_room(sgl, answers):
    """0.5.19+: decode's deferred release waits for upstream's ABORT_ACK; prefill never
    sends it for a room whose failed batch may still write (0.5.19-0.5.21 would)."""
    import inspect
    import types

    from sglang.srt.disaggregation.common import conn

    from sglang_kvguard.lifetime import transfer_drain
    from sglang_kvguard.guards.prefill_source_hold import _send_abort_ack

    upstream = getattr(conn.CommonKVManager, "_send_abort_ack", None)
    if upstream is None:
        pytest.skip("no upstream drain ack before 0.5.19")
    sent = []
    mgr = object.__new__(conn.CommonKVManager)
    mgr._send_multipart_locked = lambda addr, frames, **kw: sent.append(frames)
    mgr._prefill_unique_rank = lambda: 0
    wrapped = _send_abort_ack(upstream)
    first = list(inspect.signature(upstream).parameters)[1]

    def ack(room):
        if first == "room":  # 0.5.22+
            wrapped(mgr, room, types.SimpleNamespace(ip="127.0.0.1", port=5, generation=0))
        else:
            wrapped(mgr, "127.0.0.1", 5, room)

    transfer_drain.enqueued(ROOM)
    transfer_drain.finished(ROOM, unsettled="ret=-1")
    ack(ROOM)
    assert sent == [], "acked a room whose failed batch may still write"
    ack(ROOM + 1)
    assert len(sent) == 1, "a settled room's ack goes through"
