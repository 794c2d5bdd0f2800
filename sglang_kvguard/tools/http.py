"""The one HTTP client of kvguard's operator tools: probe, soak, preflight and the demo
deployment (and, through it, the server tests).

It is built on httpx (a kvguard dependency, and SGLang's). What every caller gets:

* **Answers, not exceptions.** Any HTTP status is an answer: a :class:`Reply` with the
  status, the text and the JSON body (None when the text is not JSON). No answer at all
  (refused, reset, timed out, a bad URL) is status 0 with the reason in ``error`` and
  ``timed_out`` set for a timeout.
* **One timeout per call.** It bounds the connect, each read and each write, as a
  socket timeout does (a server that keeps sending is not cut off; the soak bounds a
  whole stream itself). A timeout reads ``no answer within N s``.
* **Retries only where asked**, and only for a connection that failed before the request
  was sent (refused, or no route): safe for POST too, since the server never saw it.
* **No stale connections by default.** ``keepalive=False`` opens one connection per
  request, as urllib did: a server restarted between two calls (the chaos soak, the
  server tests) never meets a pooled connection of its previous process. The soak's
  load generator asks for pooled connections.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, Optional


@dataclass
class Reply:
    status: int  # 0: no HTTP answer
    latency_s: float
    text: str = ""
    body: Any = None
    error: Optional[str] = None
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    @property
    def elapsed(self) -> float:
        return self.latency_s

    @property
    def json(self) -> Any:  # the demo deployment's name for the parsed body
        return self.body

    def __repr__(self) -> str:  # keep assertion messages short
        body = self.text if len(self.text) <= 600 else self.text[:600] + "...<truncated>"
        return (f"Reply(status={self.status}, elapsed={self.latency_s:.3f}s, error={self.error!r}, "
                f"timed_out={self.timed_out}, body={body!r})")


def describe(exc: BaseException, timeout: Optional[float]) -> str:
    """The error text of a request that got no answer."""
    import httpx

    if isinstance(exc, httpx.TimeoutException):
        return f"no answer within {timeout:g} s ({type(exc).__name__})" if timeout else f"no answer ({type(exc).__name__})"
    return f"{type(exc).__name__}: {exc}"


class HttpClient:
    """A thread-safe client; see the module docstring for what it promises."""

    def __init__(self, timeout: float = 30.0, *, api_key: Optional[str] = None, keepalive: bool = False,
                 max_connections: Optional[int] = None) -> None:
        import httpx

        self.timeout = timeout
        self.api_key = api_key
        limits = httpx.Limits(max_connections=max_connections,
                              max_keepalive_connections=None if keepalive else 0)
        self.client = httpx.Client(timeout=timeout, limits=limits, follow_redirects=True)

    def headers(self, json_body: bool) -> Dict[str, str]:
        h = {"Accept": "application/json"}
        if json_body:
            h["Content-Type"] = "application/json"
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def request(self, method: str, url: str, payload: Any = None, *, timeout: Optional[float] = None,
                retries: int = 0, retry_delay: float = 0.5) -> Reply:
        import httpx

        limit = self.timeout if timeout is None else timeout
        content = None if payload is None else json.dumps(payload).encode()
        t0 = time.monotonic()
        for attempt in range(retries + 1):
            try:
                r = self.client.request(method, url, content=content, headers=self.headers(content is not None),
                                        timeout=limit)
                break
            except (httpx.HTTPError, httpx.InvalidURL, ValueError, OSError) as exc:
                never_sent = isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))  # safe to retry
                if never_sent and attempt < retries:
                    time.sleep(retry_delay * (attempt + 1))
                    continue
                return Reply(0, time.monotonic() - t0, error=describe(exc, limit),
                             timed_out=isinstance(exc, httpx.TimeoutException))
        text = r.text
        try:
            body = json.loads(text) if text else None
        except ValueError:
            body = None
        return Reply(r.status_code, time.monotonic() - t0, text, body)

    def get(self, url: str, *, timeout: Optional[float] = None, retries: int = 0) -> Reply:
        return self.request("GET", url, timeout=timeout, retries=retries)

    def post(self, url: str, payload: Any = None, *, timeout: Optional[float] = None, retries: int = 0) -> Reply:
        return self.request("POST", url, {} if payload is None else payload, timeout=timeout, retries=retries)

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> "HttpClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_shared: Optional[HttpClient] = None
_shared_lock = threading.Lock()


def shared() -> HttpClient:
    """The process's one-shot client (no pooled connections), made on first use."""
    global _shared
    if _shared is None:
        with _shared_lock:
            if _shared is None:
                _shared = HttpClient()
    return _shared


def request(method: str, url: str, payload: Any = None, *, timeout: float = 30.0, retries: int = 0) -> Reply:
    """One request on the shared client (see :class:`HttpClient.request`)."""
    return shared().request(method, url, payload, timeout=timeout, retries=retries)
