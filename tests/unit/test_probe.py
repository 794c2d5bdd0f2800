"""``kvguard probe`` and its pytest plugin against tiny in-thread HTTP endpoints.

The endpoints below are models of deployments for testing the probe's logic only
(the real thing is tests/server/test_probe_live.py):

* ``vulnerable``: advertises a context longer than it can hold; prompts between its
  scheduler limit and the context are answered 200, fast, with ``prompt_tokens`` of
  the long prompt and an output derived from the previous requests (other tenants'
  KV), as in the incident;
* ``correct``: 400 above its limit;
* ``slow500``: answers over-limit prompts with 500 after a delay (the error does not
  reach the client as a client error, and late).
"""
from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import socket
import threading
import time
import xml.etree.ElementTree as ET
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


from sglang_kvguard import cli
from sglang_kvguard.tools import probe
from sglang_kvguard.tools.probe import FAIL, PASS, SKIP, WARN, ProbeConfig, run_probe, to_junit

pytest_plugins = ["pytester"]

MRL = 101  # the fake scheduler admits len < MRL, i.e. limit 100
CONTEXT = 400
POOL = 600


class FakeDeployment:
    def __init__(self, kind: str, *, completions_ids: bool = True, delay: float = 0.0,
                 per_token_s: float = 0.0, limits: bool = True, stable: bool = True):
        self.kind = kind
        self.completions_ids = completions_ids  # False: 422 on token-id prompts, like sglang-router
        self.delay = delay
        self.per_token_s = per_token_s
        self.limits = limits
        self.stable = stable
        self.history = []  # what "the pool" last held
        self.lock = threading.Lock()
        self.requests = []
        self.counter = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, status, body):
                data = json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass  # the probe gave up (timeout)

            def do_GET(self):
                if self.path == "/v1/models":
                    m = {"id": "fake-model", "object": "model"}
                    if fake.limits:
                        m["max_model_len"] = CONTEXT
                    return self._send(200, {"object": "list", "data": [m]})
                if self.path == "/server_info" and fake.limits:
                    return self._send(200, {"context_length": CONTEXT, "max_total_num_tokens": POOL,
                                            "page_size": 16, "internal_states": [{"max_req_input_len": MRL}]})
                if self.path == "/health":
                    return self._send(200, {})
                return self._send(404, {"error": "not found"})

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}")
                if self.path == "/v1/completions":
                    ids = body.get("prompt")
                    if not fake.completions_ids and isinstance(ids, list):
                        return self._send(422, {"error": "prompt: data did not match any variant of StringOrArray"})
                    status, out = fake.answer(ids, body.get("max_tokens", 16))
                    if status != 200:
                        return self._send(status, out)
                    return self._send(200, {"choices": [{"text": " ".join(f"t{i}" for i in out["ids"])}],
                                            "usage": {"prompt_tokens": out["prompt_tokens"],
                                                      "completion_tokens": len(out["ids"])}})
                if self.path == "/generate":
                    status, out = fake.answer(body.get("input_ids"), body["sampling_params"]["max_new_tokens"])
                    if status != 200:
                        return self._send(status, out)
                    return self._send(200, {"text": "x", "output_ids": out["ids"],
                                            "meta_info": {"prompt_tokens": out["prompt_tokens"]}})
                return self._send(404, {"error": "not found"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.block_on_close = False
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @staticmethod
    def _h(*parts) -> list:
        d = hashlib.sha256(json.dumps(parts).encode()).digest()
        return list(d)

    def answer(self, ids, max_tokens):
        if not isinstance(ids, list) or not ids:
            return 400, {"error": "bad prompt"}
        n = len(ids)
        with self.lock:
            self.requests.append(n)
            self.counter += 1
            counter = self.counter
        if n >= CONTEXT or n + max_tokens > CONTEXT:
            return 400, {"error": f"The input ({n} tokens) is longer than the model's context length"}
        if n >= MRL:  # the scheduler cannot hold it
            if self.kind == "correct":
                return 400, {"error": f"Input length ({n} tokens) exceeds the maximum allowed length ({MRL} tokens)"}
            if self.kind == "slow500":
                time.sleep(self.delay)
                return 500, {"error": "KVTransferError: timed out in KVPoll.WaitingForInput"}
            with self.lock:  # vulnerable: whatever the pool held last
                foreign = list(self.history[-3:])
            return 200, {"ids": self._h("foreign", foreign)[:max_tokens], "prompt_tokens": n}
        time.sleep(self.per_token_s * n)
        with self.lock:
            self.history.append(ids[:8])
        salt = [] if self.stable else [counter]
        return 200, {"ids": self._h("own", ids, salt)[:max_tokens], "prompt_tokens": n}

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _by_name(rep):
    return {c.name: c for c in rep.checks}


# ----------------------------------------------------------------------------- probe logic


def test_vulnerable_deployment_fails_with_the_incident():
    with FakeDeployment("vulnerable", per_token_s=0.002) as fake:
        rep = run_probe(ProbeConfig(fake.url, timeout=10))
    checks = _by_name(rep)
    assert rep.error is None, rep.error
    assert rep.discovery.limit == MRL - 1
    assert rep.discovery.api == "completions"
    oc = checks["over_capacity"]
    assert oc.status == FAIL
    assert "answered a prompt the deployment cannot hold: the incident" in oc.reason
    assert [r["status"] for r in oc.measurements["requests"]] == [200, 200]
    assert [r["tokens"] for r in oc.measurements["requests"]] == [MRL - 1 + 16, 2 * (MRL - 1)]
    assert oc.measurements["requests"][0]["prompt_tokens"] == MRL - 1 + 16
    le = checks["limit_edges"]
    assert le.status == FAIL and "limit + 1 (101 tokens)" in le.reason and "HTTP 200" in le.reason
    assert checks["prompt_tokens"].status == PASS
    ct = checks["cross_tenant"]
    assert ct.status == FAIL, ct.reason
    assert "output depends on other tenants' traffic" in ct.reason and "over-limit victim" in ct.reason
    sp = checks["prefill_speed"]
    assert sp.status == WARN and "suspiciously fast" in sp.reason
    assert rep.exit_code == 1


def test_correct_deployment_passes():
    with FakeDeployment("correct") as fake:
        rep = run_probe(ProbeConfig(fake.url, timeout=10))
    checks = _by_name(rep)
    assert rep.exit_code == 0, probe.render(rep)
    for name in ("over_capacity", "limit_edges", "prompt_tokens", "cross_tenant"):
        assert checks[name].status == PASS, (name, checks[name].reason)
    assert [r["status"] for r in checks["over_capacity"].measurements["requests"]] == [400, 400]
    le = checks["limit_edges"].measurements
    assert le["at_limit"]["status"] == 200 and le["at_limit"]["prompt_tokens"] == MRL - 1
    assert le["limit_plus_1"]["status"] == 400
    # no per-token cost in this fake: not measurable, never a FAIL
    assert checks["prefill_speed"].status in (SKIP, PASS, WARN)


def test_500_after_a_delay_is_not_a_client_error():
    with FakeDeployment("slow500", delay=0.3) as fake:
        rep = run_probe(ProbeConfig(fake.url, timeout=10, only=["over_capacity"]))
    oc = _by_name(rep)["over_capacity"]
    assert oc.status == FAIL
    assert "does not reach the client as a client error (HTTP 500 after 0." in oc.reason
    assert all(r["status"] == 500 and r["latency_s"] >= 0.3 for r in oc.measurements["requests"])
    assert "KVTransferError" in oc.measurements["requests"][0]["body"]
    assert rep.exit_code == 1


def test_no_answer_within_the_timeout():
    with FakeDeployment("slow500", delay=3) as fake:
        t0 = time.monotonic()
        rep = run_probe(ProbeConfig(fake.url, timeout=0.5, only=["over_capacity"]))
        assert time.monotonic() - t0 < 2.9
    oc = _by_name(rep)["over_capacity"]
    assert oc.status == FAIL and "no answer within 0.5 s" in oc.reason
    assert oc.measurements["requests"][0]["status"] == 0


def test_output_depending_on_traffic_fails_for_a_normal_victim():
    class Leaky(FakeDeployment):
        def answer(self, ids, max_tokens):
            status, out = super().answer(ids, max_tokens)
            if status == 200 and len(ids) == 32:  # the normal victim: reads the last tenant's data
                with self.lock:
                    other = [h for h in self.history if h != ids[:8]][-1:]
                    out["ids"] = self._h("leak", other)[:max_tokens]
            return status, out

    with Leaky("correct", completions_ids=False) as fake:
        rep = run_probe(ProbeConfig(fake.url, timeout=10, only=["cross_tenant"], concurrency=1))
    assert rep.discovery.api == "generate"  # fell back from the 422
    ct = _by_name(rep)["cross_tenant"]
    assert ct.status == FAIL and "normal victim's greedy output changed between traffic sets" in ct.reason


def test_nondeterministic_output_is_only_a_warning():
    with FakeDeployment("correct", stable=False) as fake:
        rep = run_probe(ProbeConfig(fake.url, timeout=10, only=["cross_tenant"]))
    ct = _by_name(rep)["cross_tenant"]
    assert ct.status == WARN and "not reproducible even back to back" in ct.reason
    assert rep.exit_code == 0


def test_limit_flag_and_router_fallback():
    with FakeDeployment("correct", completions_ids=False, limits=False) as fake:
        rep = run_probe(ProbeConfig(fake.url, timeout=10, limit=MRL - 1, only=["limit_edges", "prompt_tokens"]))
        assert rep.discovery.limit_source == "--limit"
        assert rep.discovery.api == "generate" and "422" in rep.discovery.api_note
        assert rep.exit_code == 0, probe.render(rep)
        # no limits anywhere and no --limit: a usage error
        rep = run_probe(ProbeConfig(fake.url, timeout=10))
        assert rep.exit_code == 2 and "--limit" in rep.error


# ----------------------------------------------------------------------------- CLI, JSON, JUnit


def test_cli_exit_codes_json_and_junit(tmp_path, capsys):
    jpath, xpath = tmp_path / "r.json", tmp_path / "r.xml"
    with FakeDeployment("vulnerable") as fake:
        rc = cli.main(["probe", fake.url, "--timeout", "10", "-q", "--json", str(jpath), "--junit", str(xpath)])
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAIL  over_capacity" in out and "probe: FAIL" in out
    rep = json.loads(jpath.read_text())
    assert rep["exit_code"] == 1 and rep["ok"] is False
    assert rep["discovery"]["limit"] == MRL - 1
    assert [c["name"] for c in rep["checks"]] == list(probe.CHECKS)
    suite = ET.parse(xpath).getroot().find("testsuite")
    cases = {tc.get("name"): tc for tc in suite.findall("testcase")}
    assert set(cases) == set(probe.CHECKS)
    assert "the incident" in cases["over_capacity"].find("failure").get("message")
    assert cases["prompt_tokens"].find("failure") is None
    assert int(suite.get("failures")) == sum(1 for c in rep["checks"] if c["status"] == "FAIL")

    with FakeDeployment("correct") as fake:
        rc = cli.main(["probe", fake.url, "-q", "--only", "over_capacity,limit_edges", "--json", "-"])
    cap = capsys.readouterr()
    assert rc == 0
    rep = json.loads(cap.out)
    assert [c["status"] for c in rep["checks"]] == [PASS, PASS]
    assert "probe: PASS" in cap.err


def test_cli_usage_errors_and_unreachable(capsys):
    assert cli.main(["probe", "http://127.0.0.1:1", "--only", "bogus"]) == 2
    assert "unknown check" in capsys.readouterr().err
    assert cli.main(["probe"]) == 2  # argparse: URL missing
    capsys.readouterr()
    rc = cli.main(["probe", f"http://127.0.0.1:{_free_port()}", "-q", "--timeout", "2"])
    out = capsys.readouterr().out
    assert rc == 2 and "endpoint unreachable" in out and "probe: ERROR" in out


def test_junit_of_an_error_report_is_valid():
    rep = probe.Report("http://x", None, [], error="endpoint unreachable: http://x")
    root = ET.fromstring(to_junit(rep))
    assert root.find("testsuite/testcase/error").get("message").startswith("endpoint unreachable")


def test_probe_module_is_stdlib_only():
    import ast
    import sys

    tree = ast.parse(open(probe.__file__, encoding="utf-8").read())
    mods = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            mods.add(node.module.split(".")[0])
    assert mods <= set(sys.stdlib_module_names) | {"__future__"}, mods


# ----------------------------------------------------------------------------- pytest plugin


def _plugin_args():
    """``-p`` the plugin unless the installed distribution already registers it."""
    eps = md.entry_points(group="pytest11")
    if any(ep.value == "kvguard_pytest" for ep in eps):
        return []
    return ["-p", "kvguard_pytest"]


def test_plugin_is_inert_without_the_option(pytester):
    pytester.makepyfile(test_a="def test_one():\n    pass\n")
    pytester.makeconftest(
        "import sys\n"
        "def pytest_sessionfinish(session):\n"
        "    bad = [m for m in ('sglang', 'torch', 'sglang_kvguard.tools.probe') if m in sys.modules]\n"
        "    assert not bad, bad\n"
    )
    res = pytester.runpytest_subprocess(*_plugin_args(), "-v")
    res.assert_outcomes(passed=1)
    assert "kvguard-probe" not in res.stdout.str() and "kvguard probe" not in res.stdout.str()
    res = pytester.runpytest_subprocess(*_plugin_args(), "--help")
    assert "--kvguard-url" in res.stdout.str()


def test_plugin_fails_and_passes_with_the_probe(pytester):
    with FakeDeployment("vulnerable") as fake:
        res = pytester.runpytest_inprocess(*_plugin_args(), f"--kvguard-url={fake.url}", "--kvguard-timeout=10",
                                           "-k", "over_capacity or prompt_tokens", "-rA")
    res.assert_outcomes(passed=1, failed=1, deselected=3)
    out = res.stdout.str()
    assert "kvguard-probe::over_capacity" in out or "over_capacity" in out
    assert "answered a prompt the deployment cannot hold: the incident" in out
    assert "== kvguard probe ==" in out.replace("=" * 5, "==") or "kvguard probe" in out
    # the probe ran only the selected checks
    assert "limit_edges" not in out.split("kvguard probe")[-1].split("probe:")[0]

    with FakeDeployment("correct") as fake:
        res = pytester.runpytest_inprocess(*_plugin_args(), f"--kvguard-url={fake.url}", "--kvguard-limit=100",
                                           "-k", "kvguard and not prefill_speed", "--junitxml=j.xml")
    res.assert_outcomes(passed=4, deselected=1)
    xml = (pytester.path / "j.xml").read_text()
    assert 'name="cross_tenant"' in xml and "kvguard_status" in xml


def test_plugin_reports_an_unreachable_endpoint_as_failures(pytester):
    res = pytester.runpytest_inprocess(*_plugin_args(), f"--kvguard-url=http://127.0.0.1:{_free_port()}",
                                       "--kvguard-timeout=2", "-k", "over_capacity")
    res.assert_outcomes(failed=1, deselected=4)
    assert "endpoint unreachable" in res.stdout.str()


def test_total_length_rule_by_release():
    from sglang_kvguard.tools.discovery import _strict_total

    assert _strict_total("0.5.10") and _strict_total("0.5.10.post1")
    assert not _strict_total("0.5.11") and not _strict_total("0.5.23")
    assert not _strict_total(None) and not _strict_total("unknown")
