"""preflight's checks on node reports (the live test is in tests/server)."""
from sglang_kvguard.tools.preflight import Node, check, render


def _n(url, mode, pool, limit, ctx):
    return Node(url, "0.5.19", mode, pool, limit, ctx, 16)


def test_incident_configuration_fails_twice():
    res = check([_n("p", "prefill", 256, 250, 1024), _n("d", "decode", 2048, 1018, 1024)])
    assert res.exit_code == 1
    msgs = [f.message for f in res.findings if f.level == "FAIL"]
    assert any("holds 256 tokens but it advertises a context of 1024" in m for m in msgs)
    assert any("decode accepts prompts up to 1018 tokens but prefill p holds only 250" in m for m in msgs)
    assert "preflight: FAIL" in render(res)


def test_healthy_configuration_passes_with_a_note_under_2x():
    res = check([_n("p", "prefill", 1500, 1018, 1024), _n("d", "decode", 4096, 1018, 1024)])
    assert res.exit_code == 0
    assert [f.level for f in res.findings] == ["NOTE"]
    res = check([_n("p", "prefill", 4096, 1018, 1024), _n("d", "decode", 4096, 1018, 1024)])
    assert res.exit_code == 0 and res.findings == []


def test_unreachable_node_is_an_error():
    res = check([Node("x", error="refused")])
    assert res.exit_code == 2
    assert "ERROR x: refused" in render(res)
