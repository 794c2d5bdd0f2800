"""decode_rejection_notice against SGLang's real bootstrap server and TransferInfo.

* the notice's frames, parsed by the real (unpatched) ``TransferInfo.from_zmq``, are an
  inert dummy registration that can never complete, so a prefill without kvguard is
  not disturbed;
* guarded, ``from_zmq`` (what the Mooncake bootstrap thread calls) records the room
  with decode's original message and status;
* the decode door hands the notice to the background sender, which finds the prefill
  ranks through SGLang's real ``CommonKVBootstrapServer`` and reaches each one's ZMQ
  socket (only the room's own DP rank when prefill follows the bootstrap room).

Failing the prefill request through upstream's poll and abort path needs real
Mooncake managers: see tests/server/test_decode_admission_fit.py.
"""

from __future__ import annotations

import json
import os
import time
import types
import urllib.request

import pytest

os.environ["KVGUARD_AUTO_INSTALL"] = "0"

pytestmark = pytest.mark.component

MESSAGE = "Input length (600 tokens) exceeds the maximum allowed length (513 tokens)."


def test_an_unguarded_prefill_parses_the_notice_as_an_inert_dummy(sgl):
    from sglang.srt.disaggregation.mooncake.conn import TransferInfo

    from sglang_kvguard.guards import decode_rejection_notice as drn

    frames = drn.encode(4242, "127.0.0.1", 23456, 400, MESSAGE)
    assert len(frames) == 8
    info = TransferInfo.from_zmq(frames)
    assert info.is_dummy and info.room == 4242
    assert info.mooncake_session_id == drn.NOTICE_SID
    assert info.required_dst_info_num == 2**31 - 1  # the room never becomes WaitingForInput
    assert (info.endpoint, info.dst_port) == ("127.0.0.1", 23456)  # decode's own socket, nothing foreign
    assert 4242 not in drn._notices


def test_guarded_prefill_records_the_notice(sgl, kvguard):
    from sglang.srt.disaggregation.mooncake.conn import TransferInfo

    from sglang_kvguard.guards import decode_rejection_notice as drn

    assert {g.name: g.state for g in kvguard.guards}["decode_rejection_notice"] == "active"
    drn._notices.pop(4243, None)
    info = TransferInfo.from_zmq(drn.encode(4243, "127.0.0.1", 23456, 400, MESSAGE))
    assert info.is_dummy
    status, message, _ = drn._notices.pop(4243)
    assert (status, message) == (400, MESSAGE)
    # an ordinary registration is untouched
    real = drn.encode(4244, "127.0.0.1", 23456, 400, MESSAGE)
    real[3] = b"127.0.0.1:9999"
    TransferInfo.from_zmq(real)
    assert 4244 not in drn._notices


def _register(port: int, *, dp_size: int, dp_rank: int, tp_size: int, tp_rank: int, rank_port: int) -> None:
    body = dict(attn_tp_size=tp_size, attn_tp_rank=tp_rank, attn_cp_size=1, attn_cp_rank=0,
                attn_dp_size=dp_size, attn_dp_rank=dp_rank, pp_size=1, pp_rank=0, system_dp_size=1,
                system_dp_rank=0, rank_ip="127.0.0.1", rank_port=rank_port, page_size=16,
                kv_cache_dtype="auto", load_balance_method="follow_bootstrap_room")
    req = urllib.request.Request(f"http://127.0.0.1:{port}/route", data=json.dumps(body).encode(), method="PUT",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert resp.status == 200


@pytest.fixture
def prefill_ranks(bootstrap_server):
    """The real bootstrap server with 2 DP x 2 TP prefill ranks, each a ZMQ PULL socket."""
    import zmq

    port = bootstrap_server
    ctx = zmq.Context()
    socks = {}
    try:
        for dp in range(2):
            for tp in range(2):
                s = ctx.socket(zmq.PULL)
                s.setsockopt(zmq.LINGER, 0)
                rank_port = s.bind_to_random_port("tcp://127.0.0.1", min_port=20000, max_port=32000)
                socks[(dp, tp)] = s
                _register(port, dp_size=2, dp_rank=dp, tp_size=2, tp_rank=tp, rank_port=rank_port)
        yield port, socks
    finally:
        for s in socks.values():
            s.close()
        ctx.term()


def _received(socks, timeout=5.0):
    import zmq

    got = {}
    poller = zmq.Poller()
    for s in socks.values():
        poller.register(s, zmq.POLLIN)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events = dict(poller.poll(100))
        for key, s in socks.items():
            if s in events:
                got[key] = s.recv_multipart()
        if got and not events:
            break
    return got


class _Decode:
    """The two attributes the notice reads from decode's Mooncake manager."""

    local_ip = "127.0.0.1"
    rank_port = 31999


def test_decode_door_notifies_the_rooms_prefill_rank(sgl, make_side, kvguard, prefill_ranks):
    from sglang.srt.disaggregation.mooncake.conn import TransferInfo
    from sglang.srt.managers.utils import validate_input_length

    from sglang_kvguard.guards import decode_rejection_notice as drn

    port, socks = prefill_ranks
    room = 7001  # follow_bootstrap_room: DP rank 7001 % 2 == 1
    with make_side("decode") as d:
        req = d.new_req(600, bootstrap_room=room)
        req.bootstrap_host, req.bootstrap_port = "127.0.0.1", port
        req.set_finish_with_abort(validate_input_length(req, 513, False))
        d.prealloc_queue.kv_manager.__dict__.update(local_ip=_Decode.local_ip, rank_port=_Decode.rank_port)
        d.prealloc_queue.add(req)
        if sgl.at_least("0.5.21"):
            # upstream's door hands the request to Scheduler.retire_unadmitted_request, which
            # kvguard wraps on the real Scheduler class (server tier); call the notice as it does
            assert d.scheduler.retired_unadmitted == [req]
            assert drn.notify_prefill(d.prealloc_queue, req)
        got = _received(socks)
    assert sorted(got) == [(1, 0), (1, 1)], got  # both TP ranks of DP rank 1, nobody else
    for frames in got.values():
        drn._notices.pop(room, None)
        info = TransferInfo.from_zmq(frames)
        assert int(frames[0]) == room
        assert info.is_dummy and info.room == drn.NOTICE_ROOM  # guarded: the dummy entry names no room
        assert (info.endpoint, info.dst_port) == (_Decode.local_ip, _Decode.rank_port)
        status, message, _ = drn._notices.pop(room)
        assert status == 400 and "Input length (600 tokens)" in message


def test_no_notice_without_a_real_bootstrap_host(sgl, make_side, kvguard):
    from sglang_kvguard.guards import decode_rejection_notice as drn

    with make_side("decode") as d:
        req = d.new_req(600, bootstrap_room=7002)  # the harness's warm-up host (FAKE_BOOTSTRAP_HOST)
        assert drn.notify_prefill(d.prealloc_queue, req) is False


def _receiver(port: int, room: int, *, init_time=None, conclude_state=None):
    """SGLang's real MooncakeKVReceiver and MooncakeKVManager, built without ``__init__``
    (which would start a Mooncake engine): only what ``abort()`` reads is set."""
    import threading
    import types

    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager, MooncakeKVReceiver

    kv = MooncakeKVManager.__new__(MooncakeKVManager)
    kv.__dict__.update(request_status={}, failure_records={}, failure_lock=threading.Lock(),
                       local_ip=_Decode.local_ip, rank_port=_Decode.rank_port)
    r = MooncakeKVReceiver.__new__(MooncakeKVReceiver)
    r.__dict__.update(kv_mgr=kv, bootstrap_room=room, bootstrap_addr=f"127.0.0.1:{port}", init_time=init_time,
                      conclude_state=conclude_state, bootstrap_infos=None, abort_notified=False,
                      trace_ctx=types.SimpleNamespace(abort=lambda **_: None, trace_req_finish=lambda: None))
    return r


@pytest.mark.parametrize("handshake_sent", [False, True], ids=["before-handshake", "after-handshake"])
def test_a_decode_abort_tells_the_rooms_prefill(sgl, kvguard, prefill_ranks, handshake_sent):
    """decode aborts a room (``/abort_request``, a client gone) that has not concluded:
    prefill, which may not know the room yet, is told, so its half fails when it
    arrives instead of waiting for the bootstrap timeout (with or without decode's
    transfer info: upstream's sender sets a room that only has it back to Bootstrapping)."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.mooncake.conn import TransferInfo

    from sglang_kvguard.guards import decode_rejection_notice as drn

    port, socks = prefill_ranks
    room = 7003  # follow_bootstrap_room: DP rank 1
    r = _receiver(port, room, init_time=123.0 if handshake_sent else None)
    r.abort()
    assert r.conclude_state == KVPoll.Failed  # upstream's own abort ran
    got = _received(socks)
    assert sorted(got) == [(1, 0), (1, 1)], got
    for frames in got.values():
        drn._notices.pop(room, None)
        info = TransferInfo.from_zmq(frames)
        assert int(frames[0]) == room
        assert info.is_dummy and info.room == drn.NOTICE_ROOM  # guarded: the dummy entry names no room
        status, message, _ = drn._notices.pop(room)
        assert status == 500, status
        assert message == "decode aborted the request: Aborted by AbortReq.", message
    r.abort()  # told once
    assert _received(socks, timeout=1.0) == {}


def test_an_abort_of_a_concluded_room_is_left_to_upstream(sgl, kvguard, prefill_ranks):
    from sglang.srt.disaggregation.base.conn import KVPoll

    port, socks = prefill_ranks
    r = _receiver(port, 7005, init_time=123.0, conclude_state=KVPoll.Success)  # prefill has finished it
    r.abort()
    assert _received(socks, timeout=1.0) == {}


def test_unguarded_decode_abort_tells_prefill_nothing_it_keeps(sgl, prefill_ranks):
    """Upstream: nothing reaches prefill (0.5.10-0.5.12), or an ``ABORT`` that a prefill
    which does not know the room yet drops (0.5.13+; not sent here: no bootstrap infos)."""
    port, socks = prefill_ranks
    r = _receiver(port, 7007)
    r.abort()
    assert _received(socks, timeout=1.0) == {}


def _prefill_manager(monkeypatch):
    """SGLang's real ``MooncakeKVManager`` (built without ``__init__``, which would start a
    Mooncake engine) whose real ``start_prefill_thread`` runs its bootstrap thread on a
    real ZMQ PULL socket; returns (manager, a PUSH socket connected to it)."""
    import threading

    import zmq
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    ctx = zmq.Context.instance()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    port = pull.bind_to_random_port("tcp://127.0.0.1", min_port=20000, max_port=32000)
    kv = MooncakeKVManager.__new__(MooncakeKVManager)
    kv.__dict__.update(
        server_socket=pull, transfer_infos={}, request_status={}, failure_records={},
        failure_lock=threading.Lock(), session_lock=threading.Lock(), failed_sessions=set(), session_failures={},
        decode_kv_args_table={}, req_to_decode_prefix_len={}, _stopped=False, deferred_bootstrap=None,
        server_args=types.SimpleNamespace(enable_pd_role_switch=False), enable_deferred_decode_kv_release=False,
        local_ip="127.0.0.1", rank_port=port, _worker_threads=[],
    )

    class _Daemon(threading.Thread):  # 0.5.10-0.5.22 start it non-daemon: it would outlive the test
        def __init__(self, *a, **kw):
            kw["daemon"] = True
            super().__init__(*a, **kw)

    monkeypatch.setattr(threading, "Thread", _Daemon)
    kv.start_prefill_thread()
    monkeypatch.setattr(threading, "Thread", _Daemon.__mro__[1])
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(f"tcp://127.0.0.1:{port}")
    return kv, push


def _iterate_while_a_notice_lands(kv, push, room: int):
    """What upstream's transfer worker does with a room being sent (iterate its decode
    registrations) while decode's abort notice for that room reaches the bootstrap thread."""
    from sglang.srt.disaggregation.mooncake.conn import TransferInfo

    from sglang_kvguard.guards import decode_rejection_notice as drn

    decode = drn.encode(room, "127.0.0.1", 23456, 0, "")
    decode[3] = b"127.0.0.1:17001"  # decode's own registration (stored as the bootstrap thread does)
    kv.transfer_infos[room] = {}
    kv.transfer_infos[room]["127.0.0.1:17001"] = TransferInfo.from_zmq(decode)
    it = iter(kv.transfer_infos[room].values())
    first = next(it)
    push.send_multipart(drn.encode(room, "127.0.0.1", 23456, 500, "decode aborted the request: Aborted by AbortReq."))
    deadline = time.monotonic() + 5
    while drn.NOTICE_SID not in dict.keys(kv.transfer_infos[room]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert drn.NOTICE_SID in dict.keys(kv.transfer_infos[room]), "the bootstrap thread never stored the notice"
    return first, it


def test_a_notice_for_a_room_being_sent_never_breaks_the_transfer_worker(sgl, kvguard, monkeypatch):
    """Chaos soak on 0.5.10 (session 16): decode aborted a room prefill was sending; the
    notice, stored by the bootstrap thread into the room's registrations while the
    transfer worker iterated them, raised "dictionary changed size during iteration" in
    the worker, upstream declared the prefill dead, every later transfer hung and the
    prefill scheduler died on its next allocation. Guarded, the worker's iteration is
    over a snapshot, and the notice's entry names no room, so the worker (which marks
    the room of a dummy entry Success at the last chunk) never acts on it."""
    from sglang_kvguard.guards import decode_rejection_notice as drn

    kv, push = _prefill_manager(monkeypatch)
    assert isinstance(kv.transfer_infos, drn.Rooms)
    room = 7011
    try:
        first, it = _iterate_while_a_notice_lands(kv, push, room)
        assert list(it) == []  # the worker finishes the snapshot it started, nothing raised
        assert first.mooncake_session_id == "127.0.0.1:17001"
        stored = dict.__getitem__(kv.transfer_infos[room], drn.NOTICE_SID)
        assert stored.is_dummy and stored.room == drn.NOTICE_ROOM != room
        assert drn._notices.pop(room)[0] == 500
        # the next chunk's iteration sees both, as upstream's own stores would show it
        assert sorted(i.mooncake_session_id for i in kv.transfer_infos[room].values()) == sorted(
            ["127.0.0.1:17001", drn.NOTICE_SID])
    finally:
        push.close()


def test_unguarded_a_store_into_a_room_being_iterated_breaks_the_iteration(sgl, monkeypatch):
    """Upstream's plain dict: the same store raises in the iterating thread (the transfer
    worker, which upstream then turns into a dead prefill)."""
    kv, push = _prefill_manager(monkeypatch)
    assert type(kv.transfer_infos) is dict
    try:
        _, it = _iterate_while_a_notice_lands(kv, push, 7013)
        with pytest.raises(RuntimeError, match="changed size during iteration"):
            list(it)
    finally:
        push.close()


def _queue_a_chunk(kv, room: int):
    """Upstream's real ``MooncakeKVManager.add_transfer_request`` for one non-last chunk of
    ``room`` (what ``send_kv_chunk`` calls on the prefill scheduler thread); returns the
    index of the transfer queue the chunk went to."""
    import queue

    import numpy as np
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
    from sglang.srt.disaggregation.utils import DisaggregationMode

    kv.disaggregation_mode = DisaggregationMode.PREFILL
    kv.request_status[room] = KVPoll.WaitingForInput
    kv.transfer_queues = [queue.Queue() for _ in range(4)]
    MooncakeKVManager.add_transfer_request(kv, room, np.arange(2, dtype=np.int32), slice(0, 2), False)
    queued = [i for i, q in enumerate(kv.transfer_queues) if not q.empty()]
    assert len(queued) == 1, queued
    return queued[0]


def test_a_notice_for_a_room_whose_next_chunk_is_still_to_be_queued_never_breaks_the_scheduler(
        sgl, kvguard, monkeypatch):
    """CI on 0.5.10 (session 17, test_abort_phases): decode aborted a room while prefill
    ran its forward; the notice landed in the room's registrations before the room's last
    chunk was queued, and upstream's ``add_transfer_request``, which shards by the port at
    the end of every registration's session id, raised ``ValueError`` on the notice's id
    in the prefill scheduler thread: the prefill server died. The notice's id now ends in
    port 0, and the chunk goes to the shard it would have gone to without the notice."""
    from sglang_kvguard.guards import decode_rejection_notice as drn

    kv, push = _prefill_manager(monkeypatch)
    room = 7015
    try:
        _iterate_while_a_notice_lands(kv, push, room)
        drn._notices.pop(room, None)
        assert _queue_a_chunk(kv, room) == 17001 % 4  # decode's own port alone decides the shard
    finally:
        push.close()
