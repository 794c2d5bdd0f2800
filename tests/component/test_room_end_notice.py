"""rejection_notice, second half: prefill tells decode when it *ends* a room before
sending any of its KV (an abort, upstream's bootstrap timeout).

No release up to 0.5.23 does: decode keeps its pages reserved in ``WaitingForInput``
until its own waiting timeout, and the client of the router waits with it. The chaos
soak (tests/server/test_chaos_soak.py) hung on exactly this on 0.5.19: a client hung
up, prefill aborted the room in its bootstrap queue, decode never heard, its full
prealloc queue stalled behind the reservation, and later prefill rooms timed out in
``Bootstrapping`` before decode's handshake came.

Here the sender and its manager are SGLang's real ``MooncakeKVSender`` and
``MooncakeKVManager`` classes (each release's own ``failure_exception``, ``clear`` and
``update_status`` run, under kvguard's wrappers), built without their ``__init__`` (which
would start a Mooncake engine and the bootstrap threads): only the tables those
methods use are set. Decode's endpoint is a real ZMQ PULL socket; the frames it gets
are what decode's Mooncake thread parses (the kvguard notice as an AUX message, then
upstream's 3-frame ``Failed`` status).
"""

from __future__ import annotations

import os
import threading
import types

import pytest

os.environ["KVGUARD_AUTO_INSTALL"] = "0"

pytestmark = pytest.mark.component


@pytest.fixture
def decode_endpoint():
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    sock.setsockopt(zmq.RCVTIMEO, 2000)
    yield sock, port
    sock.close(linger=0)
    ctx.term()


def _frames(sock, n=2):
    import zmq

    got = []
    for _ in range(n):
        try:
            got.append(sock.recv_multipart())
        except zmq.Again:
            break
    return got


def _manager():
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    kv = MooncakeKVManager.__new__(MooncakeKVManager)
    kv.__dict__.update(request_status={}, failure_records={}, failure_lock=threading.Lock(), transfer_infos={},
                       req_to_decode_prefix_len={}, kv_args=types.SimpleNamespace(engine_rank=0),
                       # read by 0.5.23's clear(): no deferred bootstrap, no staging, no abort acks
                       deferred_bootstrap=None, _staging_ctx=None, _staging_outstanding={},
                       _deferred_ack_poisoned_rooms=set(), _deferred_ack_targets={})
    return kv, KVPoll


def _sender(kv, room, curr_idx=0):
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender

    s = MooncakeKVSender.__new__(MooncakeKVSender)
    s.__dict__.update(kv_mgr=kv, bootstrap_room=room, curr_idx=curr_idx, conclude_state=None, init_time=None,
                      _owns_bootstrap_room=True,
                      trace_ctx=types.SimpleNamespace(trace_req_finish=lambda: None))  # tracing off
    return s


def _fail(sender, reason):
    """What prefill does for an aborted room (abort(): record_failure) and then for every
    failed room in its bootstrap queue (failure_exception())."""
    sender.kv_mgr.record_failure(sender.bootstrap_room, reason)
    with pytest.raises(Exception, match=reason) as err:
        sender.failure_exception()
    assert type(err.value).__name__ == "KVTransferError"


def _decode_registers(kv, room, port, KVPoll):
    """What prefill's bootstrap thread does when decode's handshake for ``room`` arrives."""
    info = types.SimpleNamespace(endpoint="127.0.0.1", dst_port=port, mooncake_session_id="decode-session")
    kv.transfer_infos.setdefault(room, {})["decode-session"] = info
    kv.update_status(room, KVPoll.WaitingForInput)


def _assert_notice(frames, room, needle):
    import json

    from sglang_kvguard.guards.rejection_notice import MARKER

    assert len(frames) == 2, frames
    aux, status = frames
    assert aux[0] == b"AUX_DATA" and aux[1] == str(room).encode() and aux[6] == MARKER
    body = json.loads(aux[5])
    assert body["status"] == 500 and needle in body["message"], body
    assert status[:2] == [str(room).encode(), b"0"]  # upstream's own Failed (KVPoll.Failed == 0)


def test_unguarded_prefill_never_tells_decode_of_an_abort(sgl, decode_endpoint):
    sock, port = decode_endpoint
    kv, KVPoll = _manager()
    _fail(_sender(kv, 91001), "Aborted by AbortReq.")
    _decode_registers(kv, 91001, port, KVPoll)
    assert _frames(sock, 1) == []
    assert kv.request_status.get(91001) == KVPoll.WaitingForInput  # decode now waits for KV that never comes


def test_abort_before_decode_registered_is_told_when_it_registers(sgl, kvguard, decode_endpoint):
    sock, port = decode_endpoint
    kv, KVPoll = _manager()
    _fail(_sender(kv, 91002), "Aborted by AbortReq.")
    assert _frames(sock, 1) == []  # nobody to tell yet
    _decode_registers(kv, 91002, port, KVPoll)
    _assert_notice(_frames(sock), 91002, "Aborted by AbortReq.")
    assert 91002 not in kv.transfer_infos and 91002 not in kv.request_status  # nothing left behind


def test_bootstrap_timeout_after_decode_registered_is_told_at_once(sgl, kvguard, decode_endpoint):
    sock, port = decode_endpoint
    kv, KVPoll = _manager()
    kv.transfer_infos[91003] = {"decode-session": types.SimpleNamespace(
        endpoint="127.0.0.1", dst_port=port, mooncake_session_id="decode-session")}
    _fail(_sender(kv, 91003), "Request 91003 timed out after 30.0s in KVPoll.Bootstrapping")
    _assert_notice(_frames(sock), 91003, "timed out after 30.0s in KVPoll.Bootstrapping")
    assert 91003 not in kv.transfer_infos


def test_a_started_transfer_is_left_to_upstream(sgl, kvguard, decode_endpoint):
    """Once the sender has sent chunks, upstream's transfer path reports the failure to
    decode (and a failed send may still write: the page holds own that case)."""
    sock, port = decode_endpoint
    kv, KVPoll = _manager()
    kv.transfer_infos[91004] = {"decode-session": types.SimpleNamespace(
        endpoint="127.0.0.1", dst_port=port, mooncake_session_id="decode-session")}
    _fail(_sender(kv, 91004, curr_idx=32), "Failed to send kv chunk of 91004")
    assert _frames(sock, 1) == []


def test_a_sender_that_does_not_own_its_room_tells_nobody(sgl, kvguard, decode_endpoint):
    """0.5.23's deferred bootstrap fails a duplicate room's second sender: the room is the
    first request's, whose decode must not be failed."""
    sock, port = decode_endpoint
    kv, KVPoll = _manager()
    s = _sender(kv, 91005)
    s._owns_bootstrap_room = False
    _fail(s, "Duplicate or cancelled bootstrap room")
    _decode_registers(kv, 91005, port, KVPoll)
    assert _frames(sock, 1) == []


def test_the_notice_counts_and_is_sent_once(sgl, kvguard, decode_endpoint):
    from sglang_kvguard.guards import rejection_notice

    sock, port = decode_endpoint
    kv, KVPoll = _manager()
    s = _sender(kv, 91006)
    _fail(s, "Aborted by AbortReq.")
    assert rejection_notice.note_prefill_room_end(s) == "already noted"
    _decode_registers(kv, 91006, port, KVPoll)
    assert len(_frames(sock)) == 2
    assert rejection_notice.note_prefill_room_end(s) == "already noted"
    _decode_registers(kv, 91006, port, KVPoll)
    assert _frames(sock, 1) == []


def _decode_manager():
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
    from sglang.srt.disaggregation.utils import DisaggregationMode

    kv = MooncakeKVManager.__new__(MooncakeKVManager)
    # what a decode manager's constructor sets and update_status reads (0.5.11 reads the
    # mode for every status)
    kv.__dict__.update(request_status={}, failure_records={}, failure_lock=threading.Lock(),
                       disaggregation_mode=DisaggregationMode.DECODE)
    return kv


def _decode_thread_gets(kv, frames):
    """What decode's Mooncake thread does with the two messages (every release): the AUX
    frame goes to ``_handle_aux_data``; the 3-frame ``Failed`` is recorded as a failure
    and set as the room's status."""
    aux, status = frames
    kv._handle_aux_data(aux)
    room = int(status[0].decode("ascii"))
    kv.record_failure(room, "Failed to get kvcache from prefill instance, it might be dead")
    kv.update_status(room, int(status[1].decode("ascii")))  # upstream passes the int on


@pytest.mark.parametrize("guarded", [False, True], ids=["unguarded", "guarded"])
def test_notice_for_a_room_decode_already_ended_leaves_nothing_on_decode(sgl, decode_endpoint, guarded, request):
    """The client's abort reaches both nodes: decode ends (and clears) its room itself,
    prefill ends its room and tells decode. That Failed must not be stored on decode for
    good: up to 0.5.18 upstream's ``update_status`` stores a Failed for a room it no longer
    knows, and ``failure_records`` keeps the reason, never cleared again (one entry per
    aborted request on a long-running decode)."""
    import sglang_kvguard

    sock, port = decode_endpoint
    room = 91007
    kv, KVPoll = _manager()
    kv.transfer_infos[room] = {"decode-session": types.SimpleNamespace(
        endpoint="127.0.0.1", dst_port=port, mooncake_session_id="decode-session")}
    if guarded:
        sglang_kvguard.install()
        request.addfinalizer(sglang_kvguard.uninstall)
        _fail(_sender(kv, room), "Aborted by AbortReq.")
        frames = _frames(sock)
    else:  # the same two messages, built by the guard's own sender on a throwaway manager
        from sglang_kvguard.guards import rejection_notice

        rejection_notice._send_notices(kv, room, 500, "prefill ended the request: Aborted by AbortReq.")
        frames = _frames(sock)
    dkv = _decode_manager()  # decode already ended the room: nothing left for it
    _decode_thread_gets(dkv, frames)
    if guarded:
        assert room not in dkv.request_status and room not in dkv.failure_records
    else:
        leaked = room in dkv.failure_records or room in dkv.request_status
        assert leaked, "upstream no longer stores a Failed for an unknown room: drop kvguard's clean-up"
