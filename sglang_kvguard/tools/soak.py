"""Chaos soak: mixed traffic, aborts and cache flushes through a PD deployment's router.

What an operator runs against a staging deployment (``kvguard probe --soak N URL``)
and what the server tier runs with process control added (freezes, a killed and
restarted node: ``tests/server/test_chaos_soak.py``, ``scripts/soak.sh``).

Traffic: ``N`` greedy requests with token-id prompts of mixed lengths (short, at the
deployment's limit, over it), streamed or not, from ``concurrency`` clients at once.
Some are aborted the way a load balancer does it (the client disconnects and
``/abort_request`` with the request's rid goes to every prefill and decode node),
some are aborted and still read to the end, some clients just go away. A background
thread asks every node to ``/flush_cache`` at random moments.

Checked:

* every 200 answer equals the greedy answer of its prompt sent alone (an aborted one
  may stop early: then it must be a prefix of it);
* every over-limit prompt ends in a 4xx (or, streamed, an error event) that names the
  real limit, never in an answer;
* every request that was not cut off on purpose ends within ``bound_s``;
* requests that were neither aborted nor sent while a node was down or frozen succeed;
* no node dies (the caller says which deaths it caused);
* after the traffic, once idle: free KV tokens (free + evictable), free metadata
  slots, and the pages kvguard holds or quarantines are back at their starting values
  on every node (needs kvguard's gauges, ``--enable-metrics``; skipped otherwise).

The prompts and the plan are derived from ``seed``; two runs with the same seed send
the same requests (their timing differs).
"""

from __future__ import annotations

import json
import random
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .http import HttpClient

GAUGES = ("kvguard_kv_free_tokens", "kvguard_kv_evictable_tokens", "kvguard_metadata_free_slots",
          "kvguard_kv_held_pages", "kvguard_kv_quarantined_pages")
LIMIT_RE = re.compile(r"maximum allowed length \((\d+) tokens\)")


class SoakError(Exception):
    """The soak could not run (unreachable endpoint, no usable limit)."""


@dataclass
class ChaosEvent:
    """Process control the caller performs while the traffic runs (e.g. SIGSTOP a node)."""

    at: int  # start it when request number ``at`` is sent
    name: str  # "freeze", "restart", ...
    action: Callable[[], None]  # blocks until the node is back
    settle_s: float = 3.0  # after ``action`` returns, requests still count as inside the window
    quiet: bool = False  # run it once the clients have paused and nothing is in flight


@dataclass
class SoakConfig:
    url: str  # the router
    requests: int = 150
    concurrency: int = 6
    seed: int = 0
    max_new_tokens: int = 16
    limit: Optional[int] = None  # longest prompt the deployment must accept (default: discovered)
    nodes: Sequence[str] = ()  # prefill/decode URLs for aborts and flushes (default: the router's /workers)
    token_range: Tuple[int, int] = (100, 250)
    bound_s: float = 90.0  # every request that is not cut off ends within this
    abort_share: float = 0.3  # requests aborted on every node (half disconnect, half read on)
    disconnect_share: float = 0.1  # clients that go away without an abort
    stream_share: float = 0.5
    over_share: float = 0.15
    near_share: float = 0.15
    distinct_prompts: int = 12  # short prompts; each gets a reference answer
    flush_every_s: float = 4.0  # mean seconds between /flush_cache rounds; 0: none
    lulls: int = 3  # times the clients pause until nothing is in flight, then every node is flushed
    settle_s: float = 90.0  # how long to wait for resources to come back after the traffic
    chaos: Sequence[ChaosEvent] = ()
    alive: Optional[Callable[[], Dict[str, bool]]] = None  # node -> alive, from the caller
    expected_deaths: Sequence[str] = ()


@dataclass
class Outcome:
    idx: int
    kind: str  # short | near | over
    tokens: int
    stream: bool
    action: str  # none | abort_disconnect | abort_read | disconnect
    delay: float
    rid: str
    t0: float = 0.0
    t1: float = 0.0
    status: int = 0  # HTTP status; 0: no answer
    text: Optional[str] = None
    finish: Optional[str] = None  # finish_reason type
    error: Optional[str] = None  # error message (4xx body, stream error event, transport error)
    timed_out: bool = False
    error_code: Optional[int] = None  # status_code of a finish_reason "abort" (200 answers)
    abort_in_flight: bool = False
    in_chaos: bool = False

    def answered(self) -> bool:
        return self.status == 200 and self.error is None and self.text is not None


@dataclass
class SoakReport:
    config: Dict[str, Any]
    limit: int
    limit_source: str
    counts: Dict[str, int] = field(default_factory=dict)
    problems: List[str] = field(default_factory=list)
    outcomes: List[Outcome] = field(default_factory=list)
    baseline: Dict[str, Dict[str, float]] = field(default_factory=dict)
    after: Dict[str, Dict[str, float]] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        keys = ("requests", "answered", "rejected", "aborts_sent", "aborts_landed", "disconnects", "flushes",
                "freezes", "restarts", "mismatches", "over_answered", "bad_rejections", "hangs",
                "unexpected_errors", "deaths", "leaks")
        return "kvguard soak: " + " ".join(f"{k}={self.counts.get(k, 0)}" for k in keys)

    def as_dict(self) -> Dict[str, Any]:
        return {
            "ok": self.ok, "summary": self.summary(), "limit": self.limit, "limit_source": self.limit_source,
            "counts": self.counts, "problems": self.problems, "notes": self.notes, "config": self.config,
            "baseline": self.baseline, "after": self.after,
            "outcomes": [o.__dict__ for o in self.outcomes],
        }


# ----------------------------------------------------------------------------- HTTP


def _error_text(body: str) -> str:
    try:
        obj = json.loads(body)
    except ValueError:
        return body[:500]
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            return str(err.get("message") or err)[:500]
        return str(err)[:500]
    return body[:500]


def _stream_error(o: "Outcome", finish_reason: Dict[str, Any]) -> None:
    """A request SGLang ended itself (``finish_reason`` ``abort`` with a message, e.g. a
    streamed prompt over the limit: the HTTP status was already 200) is an error answer."""
    if finish_reason.get("type") == "abort":
        msg = finish_reason.get("message")
        code = finish_reason.get("status_code")
        o.error = f"[{code}] {msg}" if code else str(msg or "aborted")
        o.error_code = int(code) if isinstance(code, int) else None


# ----------------------------------------------------------------------------- the soak


class Soak:
    def __init__(self, cfg: SoakConfig, log: Optional[Callable[[str], None]] = None, progress: bool = False):
        self.cfg = cfg
        self.log = log or (lambda m: None)
        self.progress = progress
        # pooled connections: the load generator's requests go to a router that stays up
        self.http = HttpClient(cfg.bound_s, keepalive=True, max_connections=256)
        self.url = cfg.url.rstrip("/")
        self.rng = random.Random(f"soak:{cfg.seed}")
        self.nodes: List[Tuple[str, str]] = []  # (url, role)
        self.limit = 0
        self.limit_source = ""
        self._lock = threading.Lock()
        self._windows: List[List[float]] = []  # [start, end or inf]
        self._done = 0
        self.flushes = {"sent": 0, "ok": 0}
        self._stop = threading.Event()

    # -- set-up
    def discover(self) -> None:
        from .discovery import Client, DiscoveryConfig, ProbeError, discover

        dc = DiscoveryConfig(url=self.url, limit=self.cfg.limit, max_tokens=self.cfg.max_new_tokens,
                             nodes=tuple(self.cfg.nodes))
        try:
            disc = discover(Client(self.url, 30), dc)
        except ProbeError as exc:
            raise SoakError(str(exc)) from exc
        self.nodes = [(n.url, n.role or "?") for n in disc.nodes if n.url != self.url]
        if self.cfg.nodes:
            self.nodes = [(n.url, n.role or "?") for n in disc.nodes if n.url in {u.rstrip("/") for u in self.cfg.nodes}]
        if disc.limit is None:
            raise SoakError("no prompt limit could be discovered; pass --limit")
        self.limit, self.limit_source = disc.limit, disc.limit_source or "?"

    def ids(self, n: int, tag: str) -> List[int]:
        lo, hi = self.cfg.token_range
        r = random.Random(f"{self.cfg.seed}:{tag}:{n}")
        return [r.randrange(lo, hi) for _ in range(n)]

    def plan(self) -> Tuple[Dict[str, List[int]], List[Outcome]]:
        cfg, rng, L = self.cfg, self.rng, self.limit
        prompts: Dict[str, List[int]] = {}
        short = []
        for i in range(cfg.distinct_prompts):
            n = rng.randint(4, max(5, L // 3))
            key = f"short:{i}"
            prompts[key] = self.ids(n, key)
            short.append(key)
        near = []
        for n in sorted({L, L - 1, max(2, L - 7)}):
            key = f"near:{n}"
            prompts[key] = self.ids(n, key)
            near.append(key)
        over = []
        for n in sorted({L + 1, L + 2, L + 17, 2 * L + 5}):
            key = f"over:{n}"
            prompts[key] = self.ids(n, key)
            over.append(key)
        plan = []
        for i in range(cfg.requests):
            u = rng.random()
            kind = "over" if u < cfg.over_share else "near" if u < cfg.over_share + cfg.near_share else "short"
            key = rng.choice({"over": over, "near": near, "short": short}[kind])
            a = rng.random()
            if kind == "over":
                action = "disconnect" if a < cfg.disconnect_share else "none"
            elif a < cfg.abort_share / 2:
                action = "abort_disconnect"
            elif a < cfg.abort_share:
                action = "abort_read"
            elif a < cfg.abort_share + cfg.disconnect_share:
                action = "disconnect"
            else:
                action = "none"
            o = Outcome(idx=i, kind=kind, tokens=len(prompts[key]), stream=rng.random() < cfg.stream_share,
                        action=action, delay=round(rng.random(), 3), rid=f"kvguard-soak-{cfg.seed}-{i}")
            o.key = key  # type: ignore[attr-defined]
            plan.append(o)
        return prompts, plan

    # -- one request
    def _payload(self, ids: List[int], stream: bool, rid: Optional[str]) -> Dict[str, Any]:
        p: Dict[str, Any] = {"input_ids": ids, "stream": stream,
                             "sampling_params": {"max_new_tokens": self.cfg.max_new_tokens, "temperature": 0}}
        if rid:
            p["rid"] = rid
        return p

    def send(self, ids: List[int], *, stream: bool, rid: Optional[str], cut_after: Optional[float]) -> Outcome:
        """POST /generate; ``cut_after``: the client goes away after that many seconds."""
        o = Outcome(-1, "", len(ids), stream, "", 0.0, rid or "")
        o.t0 = time.monotonic()
        limit = cut_after if cut_after is not None else self.cfg.bound_s
        import httpx

        try:
            if not stream:
                r = self.http.client.post(self.url + "/generate", json=self._payload(ids, False, rid), timeout=limit)
                o.status = r.status_code
                if r.status_code == 200:
                    body = r.json()
                    o.text = body.get("text")
                    fr = (body.get("meta_info") or {}).get("finish_reason")
                    if isinstance(fr, dict):
                        o.finish = fr.get("type")
                        _stream_error(o, fr)
                else:
                    o.error = _error_text(r.text)
            else:
                with self.http.client.stream("POST", self.url + "/generate", json=self._payload(ids, True, rid),
                                             timeout=limit) as r:
                    o.status = r.status_code
                    if r.status_code != 200:
                        o.error = _error_text(r.read().decode("utf-8", "replace"))
                    else:
                        for line in r.iter_lines():
                            if time.monotonic() - o.t0 > limit:
                                raise httpx.ReadTimeout("stream past its time limit")
                            if not line.startswith("data:"):
                                continue
                            data = line[5:].strip()
                            if data == "[DONE]":
                                break
                            try:
                                ev = json.loads(data)
                            except ValueError:
                                continue
                            if isinstance(ev, dict) and "error" in ev:
                                err = ev["error"]
                                o.error = str(err.get("message") if isinstance(err, dict) else err)[:500]
                                break
                            if isinstance(ev, dict) and "text" in ev:
                                o.text = ev["text"]
                                fr = (ev.get("meta_info") or {}).get("finish_reason")
                                if isinstance(fr, dict):
                                    o.finish = fr.get("type")
                                    _stream_error(o, fr)
                        if o.error is None and o.finish is None:
                            o.error = "stream ended without a finish reason"
        except httpx.TimeoutException as exc:
            o.timed_out, o.error = True, f"no complete answer within {limit:g} s ({type(exc).__name__})"
        except httpx.HTTPError as exc:
            o.error = f"{type(exc).__name__}: {exc}"
        o.t1 = time.monotonic()
        return o

    def abort_everywhere(self, rid: str) -> None:
        for url, role in self.nodes:
            if role in ("prefill", "decode", "?"):
                self.http.post(url + "/abort_request", {"rid": rid}, timeout=30)

    # -- windows in which a node is down or frozen
    def _chaos(self, ev: ChaosEvent) -> None:
        win = [time.monotonic(), float("inf")]
        with self._lock:
            self._windows.append(win)
        self.log(f"soak: {ev.name} (at request {ev.at})")
        try:
            ev.action()
        finally:
            win[1] = time.monotonic() + ev.settle_s
        self.log(f"soak: {ev.name} done")

    def _overlaps(self, o: Outcome) -> bool:
        with self._lock:
            return any(s <= o.t1 and o.t0 <= e for s, e in self._windows)

    def _wait_idle(self, lock: threading.Lock, in_flight: List[int]) -> None:
        """Wait (at most ``bound_s``) until no request is in flight; the clients are paused."""
        deadline = time.monotonic() + self.cfg.bound_s
        while time.monotonic() < deadline:
            with lock:
                if in_flight[0] == 0:
                    return
            time.sleep(0.02)

    def _lull(self, gate: threading.Event, lock: threading.Lock, in_flight: List[int]) -> None:
        """Clients pause; once nothing is in flight every node gets /flush_cache (idle:
        it must succeed, right behind the last requests, rejections among them)."""
        gate.clear()
        self._wait_idle(lock, in_flight)
        for url, _role in self.nodes:
            st = self.http.post(url + "/flush_cache", {}, timeout=30).status
            with self._lock:
                self.flushes["sent"] += 1
                self.flushes["ok"] += st == 200
                self.flushes["lull_sent"] = self.flushes.get("lull_sent", 0) + 1
                self.flushes["lull_ok"] = self.flushes.get("lull_ok", 0) + (st == 200)
        gate.set()

    def _quiet(self, ev: ChaosEvent, gate: threading.Event, lock: threading.Lock, in_flight: List[int]) -> None:
        """A chaos event that needs idle nodes (a flush that only an idle scheduler takes):
        the clients pause, and once nothing is in flight the event runs."""
        gate.clear()
        try:
            self._wait_idle(lock, in_flight)
            self._chaos(ev)
        finally:
            gate.set()

    # -- flushes
    def _flusher(self) -> None:
        rng = random.Random(f"soak-flush:{self.cfg.seed}")
        while not self._stop.wait(rng.expovariate(1.0 / self.cfg.flush_every_s)):
            for url, _role in self.nodes:
                st = self.http.post(url + "/flush_cache", {}, timeout=30).status
                with self._lock:
                    self.flushes["sent"] += 1
                    self.flushes["ok"] += st == 200

    # -- resources
    def resources(self) -> Dict[str, Dict[str, float]]:
        out = {}
        for url, role in self.nodes:
            r = self.http.get(url + "/metrics", timeout=30)
            st, text = r.status, r.text
            if st != 200:
                continue
            vals = {}
            for name in GAUGES:
                m = re.search(rf"^{name}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.M)
                if m:
                    vals[name] = float(m.group(1))
            if vals:
                out[f"{role}@{url}"] = vals
        return out

    @staticmethod
    def _usable(v: Dict[str, float]) -> Tuple[float, float, float, float]:
        return (v.get("kvguard_kv_free_tokens", 0) + v.get("kvguard_kv_evictable_tokens", 0),
                v.get("kvguard_metadata_free_slots", 0), v.get("kvguard_kv_held_pages", 0),
                v.get("kvguard_kv_quarantined_pages", 0))

    # -- the run
    def run(self) -> SoakReport:
        self.discover()
        rep = SoakReport(config={k: v for k, v in self.cfg.__dict__.items() if k not in ("chaos", "alive")},
                         limit=self.limit, limit_source=self.limit_source)
        prompts, plan = self.plan()
        self.log(f"soak: limit {self.limit} ({self.limit_source}); nodes "
                 + (", ".join(f"{r} {u}" for u, r in self.nodes) or "none (no aborts, flushes or leak check)"))
        # references: each answerable prompt alone, twice (the second must equal the first)
        refs: Dict[str, str] = {}
        latencies: List[float] = []
        for key, ids in prompts.items():
            if key.startswith("over:"):
                continue
            a = self.send(ids, stream=False, rid=None, cut_after=None)
            b = self.send(ids, stream=False, rid=None, cut_after=None)
            if not a.answered() or not b.answered():
                raise SoakError(f"reference for {key} ({len(ids)} tokens) not answered: "
                                f"{a.status} {a.error or ''} / {b.status} {b.error or ''}")
            if a.text != b.text:
                raise SoakError(f"greedy answer of {key} differs between two requests sent alone: "
                                f"{a.text!r} vs {b.text!r}; the soak cannot judge mismatches here")
            refs[key] = a.text or ""
            latencies.append(b.t1 - b.t0)
        # aborts and disconnects land within the time a request alone takes (under load
        # requests take longer, so most of them meet their request in flight)
        latencies.sort()
        self.abort_scale = max(0.05, latencies[len(latencies) // 2]) if latencies else 1.0
        time.sleep(2.5)  # kvguard's resource sampler runs once a second
        rep.baseline = self.resources()
        if not rep.baseline:
            rep.notes.append("no kvguard resource gauges on the nodes (--enable-metrics and kvguard needed): "
                             "leak check skipped")

        flusher = None
        if self.cfg.flush_every_s > 0 and self.nodes:
            flusher = threading.Thread(target=self._flusher, daemon=True, name="kvguard-soak-flush")
            flusher.start()
        chaos = sorted(self.cfg.chaos, key=lambda e: e.at)
        todo = list(plan)
        lock = threading.Lock()
        self._sent = 0
        in_flight = [0]
        gate = threading.Event()
        gate.set()

        def one(o: Outcome) -> None:
            ids = prompts[o.key]  # type: ignore[attr-defined]
            o.delay = round(o.delay * self.abort_scale, 3)  # planned as a fraction of a request's time
            cut = o.delay if o.action in ("abort_disconnect", "disconnect") else None
            timer = None
            returned = threading.Event()
            if o.action.startswith("abort"):
                def fire(o=o):
                    o.abort_in_flight = not returned.is_set()
                    self.abort_everywhere(o.rid)
                timer = threading.Timer(o.delay, fire)
                timer.start()
            r = self.send(ids, stream=o.stream, rid=o.rid, cut_after=cut)
            returned.set()
            if timer is not None:
                timer.join()
            for k in ("t0", "t1", "status", "text", "finish", "error", "timed_out", "error_code"):
                setattr(o, k, getattr(r, k))
            if o.action == "abort_disconnect":
                o.abort_in_flight = o.abort_in_flight or r.timed_out  # cut off unanswered: the abort met it in flight

        def worker() -> None:
            while True:
                gate.wait()
                with lock:
                    if not todo:
                        return
                    if not gate.is_set():
                        continue
                    o = todo.pop(0)
                    self._sent = o.idx + 1
                    in_flight[0] += 1
                try:
                    one(o)
                finally:
                    with lock:
                        in_flight[0] -= 1
                with lock:
                    self._done += 1
                    if self.progress:
                        n = self._done
                        bar = "#" * (30 * n // len(plan))
                        sys.stderr.write(f"\rkvguard soak [{bar:<30}] {n}/{len(plan)}")
                        sys.stderr.flush()

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, self.cfg.concurrency))]
        for t in threads:
            t.start()
        # process control runs on this thread: a child process started from a thread
        # that exits would get its parent-death signal (the deployment sets PDEATHSIG)
        n = len(plan)
        lulls = [ChaosEvent(at=n * (k + 1) // (self.cfg.lulls + 1) + 1, name="lull", action=lambda: None)
                 for k in range(self.cfg.lulls)] if self.nodes else []
        for ev in sorted(chaos + lulls, key=lambda e: e.at):
            while self._sent < ev.at and any(t.is_alive() for t in threads):
                time.sleep(0.05)
            if ev.name == "lull":
                self._lull(gate, lock, in_flight)
            elif ev.quiet:
                self._quiet(ev, gate, lock, in_flight)
            else:
                self._chaos(ev)
        for t in threads:
            t.join()
        self._stop.set()
        if flusher is not None:
            flusher.join(timeout=60)
        if self.progress:
            sys.stderr.write("\n")
        for o in plan:
            o.in_chaos = self._overlaps(o)
        rep.outcomes = plan

        # after the traffic: back at the baseline?
        if rep.baseline:
            want = {k: self._usable(v) for k, v in rep.baseline.items()}
            deadline = time.monotonic() + self.cfg.settle_s
            while True:
                rep.after = self.resources()
                got = {k: self._usable(v) for k, v in rep.after.items()}
                if got == want or time.monotonic() > deadline:
                    break
                time.sleep(1.0)
        self.judge(rep, refs)
        self.http.close()
        return rep

    def judge(self, rep: SoakReport, refs: Dict[str, str]) -> None:
        c = rep.counts
        p = rep.problems
        L = self.limit
        c["requests"] = len(rep.outcomes)
        for o in rep.outcomes:
            key = o.key  # type: ignore[attr-defined]
            cut = o.action in ("abort_disconnect", "disconnect")
            tag = f"#{o.idx} {o.kind} {o.tokens} tokens{' stream' if o.stream else ''} {o.action}"
            if o.action.startswith("abort"):
                c["aborts_sent"] = c.get("aborts_sent", 0) + 1
                c["aborts_landed"] = c.get("aborts_landed", 0) + bool(o.abort_in_flight)
            if o.action == "disconnect" or (o.action == "abort_disconnect" and o.timed_out):
                c["disconnects"] = c.get("disconnects", 0) + 1
            if o.kind != "over" and o.status == 200 and o.text:
                # what the client was given must be its own prompt's answer (a prefix of it
                # when the request was ended early)
                ref = refs[key]
                if o.text != ref and not (o.error is not None and ref.startswith(o.text)):
                    c["mismatches"] = c.get("mismatches", 0) + 1
                    p.append(f"{tag}: answer {o.text!r} differs from the prompt's answer alone {ref!r}")
            if o.answered():
                c["answered"] = c.get("answered", 0) + 1
                if o.kind == "over":
                    c["over_answered"] = c.get("over_answered", 0) + 1
                    p.append(f"{tag}: over the limit ({L}) and answered 200: the incident")
                continue
            if o.timed_out:
                if not cut:
                    c["hangs"] = c.get("hangs", 0) + 1
                    p.append(f"{tag}: no answer within {self.cfg.bound_s:g} s")
                continue
            if o.kind == "over":
                named = f"({L} tokens)" in (o.error or "")
                if 400 <= o.status < 500 or (o.status == 200 and o.error_code is not None and 400 <= o.error_code < 500):
                    c["rejected"] = c.get("rejected", 0) + 1
                    if not named and not o.in_chaos:
                        c["bad_rejections"] = c.get("bad_rejections", 0) + 1
                        p.append(f"{tag}: rejected with status {o.status} but not naming the limit {L}: {o.error!r}")
                elif not o.in_chaos:
                    c["unexpected_errors"] = c.get("unexpected_errors", 0) + 1
                    p.append(f"{tag}: over the limit, ended in status {o.status}: {o.error!r}")
                continue
            # an answerable prompt that got no answer
            if o.action.startswith("abort") or o.in_chaos:
                continue
            c["unexpected_errors"] = c.get("unexpected_errors", 0) + 1
            p.append(f"{tag}: status {o.status}: {o.error!r}")
        c["flushes"] = self.flushes["ok"]
        c["flushes_sent"] = self.flushes["sent"]
        if self.flushes.get("lull_sent", 0) > 0 and self.flushes.get("lull_ok", 0) == 0:
            p.append(f"no /flush_cache succeeded, not even on idle nodes ({self.flushes['lull_sent']} sent "
                     "after the clients paused)")
        c["freezes"] = sum(1 for e in self.cfg.chaos if e.name.startswith("freeze"))
        c["restarts"] = sum(1 for e in self.cfg.chaos if e.name.startswith("restart"))
        if self.cfg.alive is not None:
            dead = [n for n, up in self.cfg.alive().items() if not up and n not in self.cfg.expected_deaths]
            c["deaths"] = len(dead)
            for n in dead:
                p.append(f"{n} died")
        if rep.baseline:
            want = {k: self._usable(v) for k, v in rep.baseline.items()}
            got = {k: self._usable(v) for k, v in rep.after.items()}
            names = ("usable KV tokens", "free metadata slots", "held pages", "quarantined pages")
            for node, w in want.items():
                g = got.get(node)
                if g is None:
                    c["leaks"] = c.get("leaks", 0) + 1
                    p.append(f"{node}: no gauges after the traffic")
                    continue
                for name, a, b in zip(names, w, g):
                    if a != b:
                        c["leaks"] = c.get("leaks", 0) + 1
                        p.append(f"{node}: {name} {b:g} after {self.cfg.settle_s:g} s idle, {a:g} before")


def run_soak(cfg: SoakConfig, *, log: Optional[Callable[[str], None]] = None, progress: bool = False) -> SoakReport:
    return Soak(cfg, log=log, progress=progress).run()


def render(rep: SoakReport, *, max_problems: int = 40) -> str:
    lines = [rep.summary(), f"limit: {rep.limit} ({rep.limit_source})"]
    lines += [f"note: {n}" for n in rep.notes]
    if rep.problems:
        lines.append(f"FAIL: {len(rep.problems)} problem(s)")
        lines += [f"  - {p}" for p in rep.problems[:max_problems]]
        if len(rep.problems) > max_problems:
            lines.append(f"  ... and {len(rep.problems) - max_problems} more")
    else:
        lines.append("PASS")
    return "\n".join(lines)
