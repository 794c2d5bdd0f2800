"""rejection_notice on real prefill queues: every way prefill rejects a request before
a sender exists leaves the room (with the original message and status) for the
notice to decode. The notice itself travels over Mooncake: see the server tier
(tests/server/test_rejection_notice.py)."""

from __future__ import annotations

import os
from http import HTTPStatus

import pytest

os.environ["KVGUARD_AUTO_INSTALL"] = "0"

pytestmark = pytest.mark.component


def _pending(side):
    return side.bootstrap_queue.kv_manager.__dict__.get("_kvguard_rejected", {})


def test_capacity_rejection_is_remembered_for_decode(sgl, make_side, kvguard):
    """Upstream's own ``_check_if_req_exceed_kv_capacity`` (every release) rejects a
    prompt longer than the pool; kvguard keeps its room, message and 400."""
    with make_side("prefill", num_tokens=512) as p:
        before = sgl.snapshot(p)
        req = p.new_req(700, bootstrap_room=88001)
        p.bootstrap_queue.add(req, p.kv_pool.head_num)
        assert getattr(req, "disagg_kv_sender", None) is None
        assert sgl.snapshot(p) == before
        reason = req.finished_reason
        assert reason.status_code == HTTPStatus.BAD_REQUEST
        status, message = _pending(p)[88001][:2]
        assert status == 400 and message == reason.message and "700" in message


def test_door_rejection_is_remembered_for_decode(sgl, make_side, kvguard):
    from sglang.srt.managers.utils import validate_input_length

    with make_side("prefill") as p:
        req = p.new_req(600, bootstrap_room=88002)
        msg = validate_input_length(req, 250, False)
        req.set_finish_with_abort(msg)
        p.bootstrap_queue.add(req, p.kv_pool.head_num)
        if sgl.at_least("0.5.21"):
            # upstream's door hands the request to Scheduler.retire_unadmitted_request,
            # which kvguard wraps on the real Scheduler class; the component harness's
            # scheduler stand-in records it instead
            assert p.scheduler.retired_unadmitted == [req]
            pytest.skip("retire_unadmitted_request is exercised through real servers (server tier)")
        status, message = _pending(p)[88002][:2]
        assert (status, message) == (400, msg)


def test_admitted_request_leaves_nothing_behind(sgl, make_side, kvguard):
    with make_side("prefill") as p:
        req = p.new_req(40, bootstrap_room=88003)
        p.bootstrap_queue.add(req, p.kv_pool.head_num)
        assert 88003 not in _pending(p)


def _dp_rank_of(port, room, timeout=5.0):
    import time

    from sglang.srt.disaggregation.common.conn import CommonKVReceiver

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = CommonKVReceiver.query_prefill_dp_ranks(f"127.0.0.1:{port}", [room])
        if str(room) in got or room in got:
            return got.get(str(room), got.get(room))
        time.sleep(0.05)
    return None


@pytest.mark.parametrize("guarded", [False, True], ids=["unguarded", "guarded"])
def test_rejected_room_gets_its_dp_rank_registered(sgl, make_side, bootstrap_server, guarded, request):
    """Prefill with DP 2 and a load balancer other than follow_bootstrap_room: decode
    learns a room's DP rank only from /query_dp_ranks, which upstream fills from the
    room's sender. A request rejected before a sender exists is never registered
    (decode would keep asking forever); kvguard registers it, as the sender would."""
    import types

    import sglang_kvguard

    if guarded:
        sglang_kvguard.install()
        request.addfinalizer(sglang_kvguard.uninstall)
    room = 88010
    with make_side("prefill", num_tokens=512) as p:
        q = p.bootstrap_queue
        q.bootstrap_port = bootstrap_server
        q.kv_manager.__dict__.update(
            server_args=types.SimpleNamespace(dp_size=2, load_balance_method="round_robin"), attn_dp_rank=1)
        req = p.new_req(700, bootstrap_room=room)
        req.bootstrap_host = "127.0.0.1"
        q.add(req, p.kv_pool.head_num)  # upstream's own capacity check rejects it (400), every release
        assert getattr(req, "disagg_kv_sender", None) is None
        assert req.finished_reason.status_code == 400
    if guarded:
        assert _dp_rank_of(bootstrap_server, room) == 1
    else:
        assert _dp_rank_of(bootstrap_server, room, timeout=1.0) is None
