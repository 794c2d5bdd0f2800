"""kvguard's one HTTP client (sglang_kvguard/tools/http.py), against real local HTTP
servers: answers never raise, no answer is status 0 with its reason, retries only for a
connection that was never made, and no pooled connection outlives a server restart."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from sglang_kvguard.tools import http

REPO = Path(__file__).resolve().parents[2]


class _Server:
    def __init__(self, port: int = 0, name: str = "a"):
        peers = self.peers = []

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive possible, as SGLang's servers do

            def log_message(self, *a):
                pass

            def _send(self, status, text):
                raw = text.encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):
                peers.append(self.client_address[1])
                if self.path == "/slow":
                    time.sleep(2)
                if self.path == "/text":
                    return self._send(200, "not json")
                self._send(200, json.dumps({"server": name, "path": self.path}))

            def do_POST(self):
                peers.append(self.client_address[1])
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"null")
                self._send(400, json.dumps({"error": {"message": "too long", "got": body}}))

        ThreadingHTTPServer.allow_reuse_address = True
        self.srv = ThreadingHTTPServer(("127.0.0.1", port), H)
        self.port = self.srv.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.srv.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.srv.shutdown()
        self.srv.server_close()


@pytest.fixture
def server():
    s = _Server()
    yield s
    s.stop()


def test_an_http_error_is_an_answer_with_its_status_text_and_json(server):
    r = http.request("POST", server.url + "/generate", {"text": "x"}, timeout=5)
    assert r.status == 400 and not r.ok and r.error is None and not r.timed_out
    assert r.body == {"error": {"message": "too long", "got": {"text": "x"}}} and r.json == r.body
    assert "too long" in r.text and r.elapsed == r.latency_s > 0
    ok = http.request("GET", server.url + "/text", timeout=5)
    assert ok.ok and ok.text == "not json" and ok.body is None


def test_no_answer_is_status_0_with_the_reason():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = http.request("GET", f"http://127.0.0.1:{port}/health", timeout=2)
    assert r.status == 0 and not r.timed_out and "ConnectError" in r.error, r
    bad = http.request("GET", "no-scheme/health", timeout=2)
    assert bad.status == 0 and bad.error, bad


def test_a_timeout_says_how_long_it_waited(server):
    t0 = time.monotonic()
    r = http.request("GET", server.url + "/slow", timeout=0.5)
    assert r.status == 0 and r.timed_out and r.error.startswith("no answer within 0.5 s"), r
    assert time.monotonic() - t0 < 1.9


def test_retries_only_a_connection_that_was_never_made():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = []

    def late_start():
        time.sleep(0.4)
        started.append(_Server(port, "late"))

    t = threading.Thread(target=late_start)
    t.start()
    try:
        r = http.request("GET", f"http://127.0.0.1:{port}/health", timeout=2, retries=5)
        assert r.status == 200 and r.body["server"] == "late", r
    finally:
        t.join()
        for s in started:
            s.stop()


def test_no_pooled_connection_outlives_a_server_restart():
    a = _Server(0, "a")
    port = a.port
    client = http.HttpClient(5)  # the default: one connection per request
    try:
        assert client.get(a.url + "/x").body["server"] == "a"
        assert client.get(a.url + "/y").body["server"] == "a"
        assert a.peers[0] != a.peers[1], "two requests shared one connection"
        a.stop()
        b = _Server(port, "b")
        try:
            r = client.get(b.url + "/z")
            assert r.ok and r.body["server"] == "b", r
        finally:
            b.stop()
    finally:
        client.close()


def test_the_tools_have_no_http_of_their_own():
    """probe, soak, preflight and the demo deployment all go through tools/http.py."""
    for rel in ("sglang_kvguard/tools", "sglang_kvguard/demo", "sglang_kvguard/cli.py"):
        path = REPO / rel
        for f in ([path] if path.is_file() else sorted(path.glob("*.py"))):
            if f.name == "http.py":
                continue
            text = f.read_text()
            assert not re.search(r"^\s*(import|from) (urllib|http\.client)\b|httpx\.Client\(", text, re.M), (
                f"{f.relative_to(REPO)} does HTTP on its own; use sglang_kvguard.tools.http")
