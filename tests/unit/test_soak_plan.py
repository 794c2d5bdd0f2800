"""The soak's own logic without a server: its plan and its verdict (tools/soak.py).

The soak itself runs through real servers (tests/server/test_chaos_soak.py); these
check that its judge can fail: a foreign answer, an over-limit answer, a hang, a
rejection that does not name the limit and a leak each make it fail."""
from __future__ import annotations

import pytest

pytest.importorskip("httpx")

from sglang_kvguard.tools.soak import Outcome, Soak, SoakConfig, SoakReport  # noqa: E402


def _soak(**kw):
    s = Soak(SoakConfig(url="http://127.0.0.1:1", **kw))
    s.limit, s.limit_source = 100, "test"
    return s


def _o(idx, kind, key, **kw):
    o = Outcome(idx=idx, kind=kind, tokens=10, stream=False, action=kw.pop("action", "none"), delay=0.0,
                rid=f"r{idx}")
    o.key = key
    for k, v in kw.items():
        setattr(o, k, v)
    return o


def _judge(outcomes, baseline=None, after=None, **kw):
    s = _soak(**kw)
    rep = SoakReport(config={}, limit=100, limit_source="test", outcomes=outcomes,
                     baseline=baseline or {}, after=after or {})
    s.judge(rep, {"short:0": " a b c", "near:100": " x y"})
    return rep


def test_plan_is_seeded_and_mixed():
    a, b = _soak(requests=200, seed=3), _soak(requests=200, seed=3)
    pa, qa = a.plan()
    pb, qb = b.plan()
    assert pa == pb and [(o.key, o.action, o.stream) for o in qa] == [(o.key, o.action, o.stream) for o in qb]
    kinds = {o.kind for o in qa}
    actions = {o.action for o in qa}
    assert kinds == {"short", "near", "over"}
    assert actions == {"none", "abort_disconnect", "abort_read", "disconnect"}
    assert all(o.action in ("none", "disconnect") for o in qa if o.kind == "over")
    assert max(len(v) for k, v in pa.items() if k.startswith("near")) == 100
    assert min(len(v) for k, v in pa.items() if k.startswith("over")) == 101


def test_clean_run_passes():
    rep = _judge([
        _o(0, "short", "short:0", status=200, text=" a b c", finish="length"),
        _o(1, "over", "over:101", status=400, error="Input length (101 tokens) exceeds the maximum allowed length (100 tokens)."),
        _o(2, "short", "short:0", action="abort_read", status=200, text=" a", finish="abort", error="[None] aborted"),
        _o(3, "near", "near:100", action="disconnect", timed_out=True, error="cut"),
    ])
    assert rep.ok, rep.problems
    assert rep.counts["answered"] == 1 and rep.counts["rejected"] == 1


@pytest.mark.parametrize("bad, counter", [
    (_o(0, "short", "short:0", status=200, text=" a b d", finish="length"), "mismatches"),
    (_o(0, "short", "short:0", action="abort_read", status=200, text=" z", finish="abort", error="x"), "mismatches"),
    (_o(0, "over", "over:101", status=200, text=" q", finish="length"), "over_answered"),
    (_o(0, "over", "over:101", status=400, error="too long"), "bad_rejections"),
    (_o(0, "over", "over:101", status=200, text="", finish="abort", error="[500] prefill died", error_code=500),
     "unexpected_errors"),
    (_o(0, "short", "short:0", timed_out=True, error="no answer"), "hangs"),
    (_o(0, "short", "short:0", status=502, error="bad gateway"), "unexpected_errors"),
])
def test_each_failure_is_caught(bad, counter):
    rep = _judge([bad])
    assert not rep.ok and rep.counts.get(counter) == 1, (rep.counts, rep.problems)


def test_errors_inside_a_chaos_window_are_tolerated_but_hangs_are_not():
    rep = _judge([_o(0, "short", "short:0", status=502, error="bad gateway", in_chaos=True)])
    assert rep.ok, rep.problems
    rep = _judge([_o(0, "short", "short:0", timed_out=True, error="no answer", in_chaos=True)])
    assert not rep.ok


def test_a_leak_and_a_death_are_caught():
    base = {"decode@u": {"kvguard_kv_free_tokens": 100.0, "kvguard_kv_evictable_tokens": 0.0,
                         "kvguard_metadata_free_slots": 8.0, "kvguard_kv_held_pages": 0.0,
                         "kvguard_kv_quarantined_pages": 0.0}}
    after = {"decode@u": dict(base["decode@u"], kvguard_kv_free_tokens=84.0)}
    rep = _judge([], baseline=base, after=after)
    assert rep.counts["leaks"] == 1 and "usable KV tokens 84 after" in rep.problems[0]
    rep = _judge([], alive=lambda: {"decode": False, "prefill": True}, expected_deaths=())
    assert rep.counts["deaths"] == 1
