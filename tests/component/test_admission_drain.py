"""admission_drain on real PD queues: a rejected request is withdrawn at the door.

The rejection is produced by SGLang's own code path (``validate_input_length`` then
``Req.set_finish_with_abort``, as ``Scheduler.handle_generate_request`` does), and
the doors are SGLang's real ``PrefillBootstrapQueue.add`` / ``DecodePreallocQueue.add``.
On releases before 0.5.21 kvguard's door does the withdrawing; from 0.5.21 upstream's
own door does and kvguard only verifies it, so the same assertions hold everywhere.
"""

from __future__ import annotations

import os
from http import HTTPStatus

import pytest

os.environ["KVGUARD_AUTO_INSTALL"] = "0"  # this module installs and uninstalls explicitly

pytestmark = pytest.mark.component

LIMIT = 250  # the prefill limit of the incident test geometry


def _upstream_doors(sgl):
    return sgl.at_least("0.5.21")


def _reject_over_length(req, limit=LIMIT):
    """Exactly what the scheduler does with a prompt its pool cannot hold."""
    from sglang.srt.managers.utils import validate_input_length

    msg = validate_input_length(req, limit, False)
    assert msg, "the request should be over the limit"
    req.set_finish_with_abort(msg)
    return msg


def _delivered(side, sgl):
    """Requests the door handed back to the client, by either implementation."""
    if _upstream_doors(sgl):
        return list(side.scheduler.retired_unadmitted)
    return [r for reqs, _ in side.scheduler.stream_recorder.calls for r in reqs]


def _assert_delivered_with_original_error(side, sgl, req, msg):
    assert _delivered(side, sgl) == [req]
    if not _upstream_doors(sgl):
        # kvguard's door finished the request with the scheduler's own abort
        reason = req.finished_reason
        assert type(reason).__name__ == "FINISH_ABORT"
        assert reason.message == msg
        assert reason.status_code == HTTPStatus.BAD_REQUEST
        assert reason.err_type == "BadRequestError"
        assert req.finished()


def test_over_length_request_never_reaches_prefill_bootstrap(sgl, make_side, kvguard):
    with make_side("prefill") as p:
        before = sgl.snapshot(p)
        req = p.new_req(600)
        msg = _reject_over_length(req)
        assert "600" in msg
        p.bootstrap_queue.add(req, p.kv_pool.head_num)
        assert req not in p.bootstrap_queue.queue
        assert getattr(req, "disagg_kv_sender", None) is None, "a KV sender was created"
        assert req.metadata_buffer_index < 0
        assert sgl.snapshot(p) == before
        _assert_delivered_with_original_error(p, sgl, req, msg)
        # a normal request behind it is admitted as usual
        ok = p.new_req(40)
        p.bootstrap_queue.add(ok, p.kv_pool.head_num)
        assert ok in p.bootstrap_queue.queue


def test_over_length_request_never_reaches_decode_allocation(sgl, make_side, kvguard):
    with make_side("decode") as d:
        before = sgl.snapshot(d)
        req = d.new_req(600)
        msg = _reject_over_length(req)
        d.prealloc_queue.add(req)
        assert not [dr for dr in d.prealloc_queue.queue if dr.req is req]
        assert getattr(req, "disagg_kv_receiver", None) is None
        preallocated, failed = d.prealloc_queue.pop_preallocated()
        assert not preallocated and not failed
        assert sgl.snapshot(d) == before
        _assert_delivered_with_original_error(d, sgl, req, msg)


def test_client_abort_before_bootstrap_is_drained(sgl, make_side, kvguard):
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    with make_side("prefill") as p:
        before = sgl.snapshot(p)
        req = p.new_req(40)
        req.to_finish = FINISH_ABORT()  # what Scheduler.abort_request sets
        p.bootstrap_queue.add(req, p.kv_pool.head_num)
        assert req not in p.bootstrap_queue.queue
        assert sgl.snapshot(p) == before
        assert _delivered(p, sgl) == [req]


def test_retracted_request_with_pending_abort_passes_untouched(sgl, make_side, kvguard):
    """A retracted request owns its resources; its own queue releases it."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    with make_side("decode") as d:
        req = d.new_req(40)
        req.to_finish = FINISH_ABORT("aborted while running")
        d.prealloc_queue.add(req, is_retracted=True)
        assert req in d.prealloc_queue.retracted_queue
        assert _delivered(d, sgl) == []


def test_without_the_guard_old_releases_admit_the_rejected_stub(sgl, make_side):
    """The harness sees the bug: unguarded, the door admits the 1-token stub."""
    if _upstream_doors(sgl):
        pytest.skip("0.5.21+ drains at the door upstream")
    with make_side("prefill") as p:
        req = p.new_req(600)
        _reject_over_length(req)
        p.bootstrap_queue.add(req, p.kv_pool.head_num)
        assert req in p.bootstrap_queue.queue
        assert getattr(req, "disagg_kv_sender", None) is not None
        p.bootstrap_queue.queue.remove(req)
