"""abort_state_release on SGLang's real ``TokenizerManager._handle_abort_req``.

The scheduler aborted a queued request and sent its ``AbortReq`` back; the tokenizer
manager hands the client the abort. Up to 0.5.12.post1 it leaves the request's
``rid_to_state`` entry behind for good, so the next request with that rid (a router
retry) is refused as a duplicate. The manager is built without its ``__init__`` (which
would start the ZMQ sockets and load a tokenizer): only what ``_handle_abort_req``
reads is set; the request state is SGLang's own ``ReqState`` of a real
``GenerateReqInput``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import types

import pytest

os.environ["KVGUARD_AUTO_INSTALL"] = "0"

pytestmark = pytest.mark.component

RID = "kvguard-soak-0-32"


def _manager_with_one_request(rid=RID):
    from sglang.srt.managers import tokenizer_manager as tm_mod
    from sglang.srt.managers.io_struct import GenerateReqInput

    tm = tm_mod.TokenizerManager.__new__(tm_mod.TokenizerManager)
    obj = GenerateReqInput(text="hello", sampling_params={"max_new_tokens": 4}, rid=rid)
    fields = {f.name for f in dataclasses.fields(tm_mod.ReqState)}
    kwargs = dict(out_list=[], finished=False, event=asyncio.Event(), obj=obj)
    if "created_time" in fields:
        kwargs["created_time"] = 0.0
    if "time_stats" in fields:
        kwargs["time_stats"] = tm_mod.APIServerReqTimeStats() if hasattr(tm_mod, "APIServerReqTimeStats") else None
    state = tm_mod.ReqState(**kwargs)
    tm.__dict__.update(
        rid_to_state={rid: state},
        server_args=types.SimpleNamespace(weight_version="default", skip_tokenizer_init=False,
                                          incremental_streaming_output=False, enable_lora=False),
        enable_metrics=False,
        enable_lora=False,  # 0.5.23 reads it from the manager
        _config_updates=[],  # 0.5.17: configuration changes recorded since start
        child_rid_to_logical_rid={},  # 0.5.17: n>1 sampling children
    )
    return tm, state


def _scheduler_aborts(tm, rid=RID):
    """What the tokenizer manager's result loop does with the scheduler's AbortReq
    (0.5.18+ read the weight version from the published configuration)."""
    import _sglang_components as sgl
    from sglang.srt.managers.io_struct import AbortReq

    with sgl.sglang_config():
        tm._handle_abort_req(AbortReq(rid=rid))


def test_unguarded_release_keeps_or_frees_the_rid_as_upstream_does(sgl):
    """The defect, on the release under test: 0.5.10-0.5.12.post1 keep the entry."""
    tm, state = _manager_with_one_request()
    _scheduler_aborts(tm)
    assert state.finished and state.out_list, "the client's waiter was not handed the abort"
    if sgl.at_least("0.5.13"):
        assert RID not in tm.rid_to_state
    else:
        assert tm.rid_to_state.get(RID) is state, "upstream now frees the rid itself: the guard is a no-op there"


def test_guarded_the_rid_is_free_after_the_abort_reached_the_client(sgl, kvguard):
    tm, state = _manager_with_one_request()
    _scheduler_aborts(tm)
    assert state.finished and state.out_list
    assert state.out_list[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert RID not in tm.rid_to_state


def test_guarded_an_unrelated_or_newer_state_is_left_alone(sgl, kvguard):
    """A retry that already took the rid again (a new state) is not the aborted one."""
    tm, state = _manager_with_one_request()
    other, _ = _manager_with_one_request("another-rid")
    tm.rid_to_state["another-rid"] = other.rid_to_state["another-rid"]
    _scheduler_aborts(tm)
    assert "another-rid" in tm.rid_to_state and not tm.rid_to_state["another-rid"].finished
