"""``kvguard probe URL``: a live regression suite for the incident's bug class.

"The tests checked status codes and speed, not whether the output belonged to the
prompt." This probe sends a running deployment (an sglang-router in PD mode, a
single SGLang server, or any OpenAI-compatible endpoint that accepts token-id
prompts) the requests that would have caught the incident, and checks the answers:

``over_capacity``  prompts well over the limit (limit + a page, 2 x limit) get a 4xx;
                   HTTP 200 is the incident; a 5xx or no answer within the timeout
                   means the error does not reach the client as a client error.
``limit_edges``    exactly ``limit`` tokens: 200 and ``prompt_tokens == limit``;
                   ``limit + 1``: 4xx.
``prompt_tokens``  a few normal prompts: ``prompt_tokens`` equals what was sent.
``cross_tenant``   greedy victim requests (a normal prompt and an over-limit one),
                   each sent twice back to back after tenant-A traffic set 1, then
                   again after a different traffic set 2 (long prompts that fill the
                   KV pool); a victim whose output changes with other tenants'
                   traffic fails.
``prefill_speed``  (WARN only) time per prompt token on a medium prompt; an answer to
                   a long prompt much faster than that predicts is flagged.

Prompts are token-id lists of exact length, so no tokenizer is needed: first
``/v1/completions`` with ``prompt: [ids]``; where the endpoint refuses that (e.g.
sglang-router answers 422 in PD mode), SGLang's native ``/generate`` with
``input_ids``.

The limit (longest prompt the deployment should accept, in tokens) is ``--limit``
or, by default, the smallest of: each node's ``max_req_input_len - 1`` (SGLang's
scheduler admits ``len < max_req_input_len``) and ``context_length - max_tokens``
(the tokenizer admits ``len < context`` and ``len + max_new_tokens <= context``;
up to 0.5.10, ``< context``, so one less there).
Nodes are the URL itself, every worker a router lists under ``/workers`` (PD
routers hide their workers' limits), and each ``--node URL``.

Exit status: 0 every check passed (WARN and SKIP allowed), 1 a check failed,
2 usage error or the endpoint could not be reached / read.

Standard library only; imports neither SGLang nor torch.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .discovery import Client, Discovery, ProbeError, _int, discover
from .http import Reply

__all__ = [
    "CHECKS",
    "CheckResult",
    "ProbeConfig",
    "ProbeError",
    "Report",
    "main",
    "run_probe",
    "to_junit",
]

PASS, FAIL, WARN, SKIP = "PASS", "FAIL", "WARN", "SKIP"
CHECKS = ("over_capacity", "limit_edges", "prompt_tokens", "cross_tenant", "prefill_speed")
INCIDENT = "answered a prompt the deployment cannot hold: the incident"
EXCERPT = 400


# ----------------------------------------------------------------------------- config


@dataclass
class ProbeConfig:
    url: str
    model: Optional[str] = None
    limit: Optional[int] = None
    timeout: float = 60.0
    only: Optional[Sequence[str]] = None
    api_key: Optional[str] = None
    api: str = "auto"  # auto | completions | generate
    nodes: Sequence[str] = ()
    discover_workers: bool = True
    max_tokens: int = 8
    token_range: Tuple[int, int] = (100, 250)  # [lo, hi): plain tokens in most vocabularies
    page: Optional[int] = None  # tokens over the limit for "limit + a page"; default: page_size, else 64
    concurrency: int = 4
    long_tokens: Optional[int] = None  # tenant-A "long" prompts; default limit // 2
    seed: int = 0

    def checks(self) -> List[str]:
        if not self.only:
            return list(CHECKS)
        unknown = [c for c in self.only if c not in CHECKS]
        if unknown:
            raise ProbeError(f"unknown check(s) {', '.join(unknown)}; known: {', '.join(CHECKS)}")
        return [c for c in CHECKS if c in self.only]


# ----------------------------------------------------------------------------- HTTP


def brief(reply: Reply) -> Dict[str, Any]:
    """What a report keeps of one answer."""
    d: Dict[str, Any] = {"status": reply.status, "latency_s": round(reply.latency_s, 3)}
    if reply.error:
        d["error"] = reply.error
    if reply.status and not 200 <= reply.status < 300:
        d["body"] = reply.text[:EXCERPT]
    return d


# ----------------------------------------------------------------------------- requests


@dataclass
class Answer:
    tokens: int  # prompt length sent
    reply: Reply
    prompt_tokens: Optional[int] = None
    output: Any = None  # output token ids if reported, else text

    @property
    def status(self) -> int:
        return self.reply.status

    def brief(self) -> Dict[str, Any]:
        d = {"tokens": self.tokens, **brief(self.reply)}
        if self.status == 200:
            d["prompt_tokens"] = self.prompt_tokens
            d["output"] = _short(self.output)
        return d


def _short(v: Any) -> Any:
    if isinstance(v, str) and len(v) > 200:
        return v[:200] + "..."
    if isinstance(v, list) and len(v) > 32:
        return v[:32] + ["..."]
    return v


class Prompts:
    def __init__(self, seed: int, token_range: Tuple[int, int]):
        self.seed = seed
        self.lo, self.hi = token_range
        if self.hi - self.lo < 2:
            raise ProbeError(f"token range {self.lo}:{self.hi} is too small")

    def ids(self, n: int, tag: str) -> List[int]:
        rng = random.Random(f"{self.seed}:{tag}:{n}")
        return [rng.randrange(self.lo, self.hi) for _ in range(n)]


class Endpoint:
    """Completion requests with token-id prompts over the chosen API."""

    def __init__(self, client: Client, disc: Discovery, cfg: ProbeConfig):
        self.client, self.disc, self.cfg = client, disc, cfg
        self.api = disc.api or "completions"
        self.count = 0
        self._lock = threading.Lock()

    def complete(self, ids: List[int], max_tokens: Optional[int] = None, api: Optional[str] = None) -> Answer:
        api = api or self.api
        n = self.cfg.max_tokens if max_tokens is None else max_tokens
        with self._lock:
            self.count += 1
        if api == "completions":
            payload: Dict[str, Any] = {"prompt": list(ids), "max_tokens": n, "temperature": 0}
            if self.disc.model:
                payload["model"] = self.disc.model
            r = self.client.request("/v1/completions", payload)
            ans = Answer(len(ids), r)
            if r.status == 200 and isinstance(r.json, dict):
                usage = r.json.get("usage") or {}
                ans.prompt_tokens = _int(usage.get("prompt_tokens"))
                choices = r.json.get("choices") or [{}]
                ans.output = choices[0].get("text") if isinstance(choices[0], dict) else None
            return ans
        payload = {"input_ids": list(ids), "sampling_params": {"max_new_tokens": n, "temperature": 0}}
        r = self.client.request("/generate", payload)
        ans = Answer(len(ids), r)
        if r.status == 200 and isinstance(r.json, dict):
            meta = r.json.get("meta_info") or {}
            ans.prompt_tokens = _int(meta.get("prompt_tokens"))
            ans.output = r.json.get("output_ids") if r.json.get("output_ids") is not None else r.json.get("text")
        return ans


def choose_api(ep: Endpoint, prompts: Prompts) -> None:
    """Which API takes token-id prompts here (a 4-token request)."""
    ids = prompts.ids(4, "api-check")
    want = ep.cfg.api
    tried: List[str] = []
    for api in (("completions", "generate") if want == "auto" else (want,)):
        a = ep.complete(ids, max_tokens=1, api=api)
        path = "/v1/completions" if api == "completions" else "/generate"
        if a.status == 200:
            ep.api = ep.disc.api = api
            ep.disc.api_note = f"{path} with token ids" + (f" ({'; '.join(tried)})" if tried else "")
            return
        tried.append(f"{path} answered {a.status or a.reply.error}: {a.reply.text[:160]}".strip())
    raise ProbeError("no API accepted a 4-token token-id prompt: " + "; ".join(tried))


# ----------------------------------------------------------------------------- results


@dataclass
class CheckResult:
    name: str
    status: str
    reason: str
    measurements: Dict[str, Any] = field(default_factory=dict)
    duration_s: float = 0.0


@dataclass
class Report:
    url: str
    discovery: Optional[Discovery]
    checks: List[CheckResult]
    error: Optional[str] = None
    requests: int = 0
    duration_s: float = 0.0

    @property
    def exit_code(self) -> int:
        if self.error:
            return 2
        return 1 if any(c.status == FAIL for c in self.checks) else 0

    def as_dict(self) -> Dict[str, Any]:
        return {
            "url": self.url,
            "ok": self.exit_code == 0,
            "exit_code": self.exit_code,
            "error": self.error,
            "discovery": asdict(self.discovery) if self.discovery else None,
            "checks": [asdict(c) for c in self.checks],
            "requests": self.requests,
            "duration_s": round(self.duration_s, 3),
        }


def _classify_reject(a: Answer, timeout: float) -> Optional[str]:
    """None if ``a`` is a client error (the wanted answer); else why not."""
    s = a.status
    if 400 <= s < 500 and s not in (408, 429):
        return None
    if s == 200:
        return f"{INCIDENT} (HTTP 200, prompt_tokens={a.prompt_tokens}, {a.reply.latency_s:.2f} s)"
    if s >= 500:
        return (f"the error does not reach the client as a client error (HTTP {s} after "
                f"{a.reply.latency_s:.2f} s)")
    if s == 0 and a.reply.timed_out:
        return f"no answer within {timeout:g} s: the error arrives only after a timeout, if at all"
    if s == 0:
        return f"no HTTP answer ({a.reply.error})"
    return f"HTTP {s} is not a rejection of the prompt"


# ----------------------------------------------------------------------------- checks


class Probe:
    def __init__(self, cfg: ProbeConfig, ep: Endpoint, disc: Discovery, prompts: Prompts):
        self.cfg, self.ep, self.disc, self.prompts = cfg, ep, disc, prompts
        self.limit = int(disc.limit)  # type: ignore[arg-type]
        self.over = self.limit + disc.page
        # Not the limit itself: a mis-sized pool may admit max_req_input_len - 1 tokens at
        # the door yet never schedule them (limit_edges reports that, once).
        self.long = max(2, min(self.limit, cfg.long_tokens or self.limit // 2))

    # 1
    def over_capacity(self) -> CheckResult:
        sizes = sorted({self.over, 2 * self.limit} - {self.limit})
        sizes = [n for n in sizes if n > self.limit]
        answers = [self.ep.complete(self.prompts.ids(n, "over")) for n in sizes]
        meas = {"limit": self.limit, "requests": [a.brief() for a in answers]}
        bad = [(a, _classify_reject(a, self.cfg.timeout)) for a in answers]
        bad = [(a, why) for a, why in bad if why]
        if not bad:
            lat = ", ".join(f"{a.tokens} tokens -> {a.status} in {a.reply.latency_s:.2f} s" for a in answers)
            return CheckResult("over_capacity", PASS, f"every over-limit prompt got a client error ({lat})", meas)
        bad.sort(key=lambda x: 0 if x[0].status == 200 else 1)  # the incident first
        reason = "; ".join(f"{a.tokens} tokens (limit {self.limit}): {why}" for a, why in bad)
        return CheckResult("over_capacity", FAIL, reason, meas)

    # 2
    def limit_edges(self) -> CheckResult:
        at = self.ep.complete(self.prompts.ids(self.limit, "edge"))
        above = self.ep.complete(self.prompts.ids(self.limit + 1, "edge"))
        meas = {"limit": self.limit, "limit_source": self.disc.limit_source, "at_limit": at.brief(),
                "limit_plus_1": above.brief()}
        problems = []
        if at.status != 200:
            why = (f"no answer within {self.cfg.timeout:g} s" if at.reply.timed_out
                   else f"HTTP {at.status or at.reply.error}")
            problems.append(f"a prompt of exactly the limit ({self.limit} tokens) was not served: {why} "
                            f"(the deployment cannot serve the limit it declares; {self.disc.limit_source})")
        elif at.prompt_tokens != self.limit:
            problems.append(f"a prompt of {self.limit} tokens was counted as prompt_tokens={at.prompt_tokens}")
        why = _classify_reject(above, self.cfg.timeout)
        if why:
            if above.status == 200:
                why = (f"answered with HTTP 200 (prompt_tokens={above.prompt_tokens}): the deployment accepts "
                       f"more than the limit; either the limit is wrong (--limit) or it {INCIDENT}")
            problems.append(f"limit + 1 ({self.limit + 1} tokens): {why}")
        if problems:
            return CheckResult("limit_edges", FAIL, "; ".join(problems), meas)
        return CheckResult("limit_edges", PASS,
                           f"{self.limit} tokens -> 200 (prompt_tokens {at.prompt_tokens}), "
                           f"{self.limit + 1} -> {above.status}", meas)

    # 3
    def prompt_tokens(self) -> CheckResult:
        sizes = sorted({n for n in (1, 7, 33, min(self.limit // 2, 512)) if 1 <= n <= self.limit})
        answers = [self.ep.complete(self.prompts.ids(n, "count")) for n in sizes]
        meas = {"requests": [a.brief() for a in answers]}
        fails, missing = [], []
        for a in answers:
            if a.status != 200:
                fails.append(f"{a.tokens} tokens: HTTP {a.status or a.reply.error}")
            elif a.prompt_tokens is None:
                missing.append(a.tokens)
            elif a.prompt_tokens != a.tokens:
                fails.append(f"{a.tokens} tokens sent, prompt_tokens={a.prompt_tokens}")
        if fails:
            return CheckResult("prompt_tokens", FAIL, "; ".join(fails), meas)
        if missing:
            return CheckResult("prompt_tokens", WARN, f"no prompt_tokens reported for {missing}", meas)
        return CheckResult("prompt_tokens", PASS, f"prompt_tokens matched for {sizes}", meas)

    # 4
    def _traffic(self, run: int) -> Dict[str, Any]:
        pool = self.disc.pool_tokens
        long_n = self.long
        n_long = max(2, min(12, math.ceil(pool / long_n) + 1)) if pool else 4
        rng = random.Random(f"{self.cfg.seed}:traffic:{run}")
        jobs = [self.prompts.ids(long_n, f"tenant-a:{run}:long:{i}") for i in range(n_long)]
        jobs += [self.prompts.ids(rng.randint(8, max(8, min(64, self.limit))), f"tenant-a:{run}:short:{i}")
                 for i in range(4)]
        results: List[Optional[Answer]] = [None] * len(jobs)
        lock = threading.Lock()
        todo = list(range(len(jobs)))

        def worker() -> None:
            while True:
                with lock:
                    if not todo:
                        return
                    i = todo.pop(0)
                results[i] = self.ep.complete(jobs[i], max_tokens=max(self.cfg.max_tokens, 16))

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, self.cfg.concurrency))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        statuses: Dict[str, int] = {}
        for a in results:
            k = str(a.status if a else "none")
            statuses[k] = statuses.get(k, 0) + 1
        return {"requests": len(jobs), "long_prompts": n_long, "long_tokens": long_n,
                "tokens": sum(len(j) for j in jobs), "statuses": statuses}

    def cross_tenant(self) -> CheckResult:
        victims = {"normal": self.prompts.ids(min(32, self.limit), "victim-normal"),
                   "over_limit": self.prompts.ids(self.over, "victim-over")}
        runs: List[Dict[str, Any]] = []
        seen: Dict[str, List[List[Answer]]] = {k: [] for k in victims}
        for run in (1, 2):
            traffic = self._traffic(run)
            entry: Dict[str, Any] = {"traffic": traffic, "victims": {}}
            for name, ids in victims.items():
                pair = [self.ep.complete(ids), self.ep.complete(ids)]  # back to back: the control
                seen[name].append(pair)
                entry["victims"][name] = [a.brief() for a in pair]
            runs.append(entry)
        meas = {"victim_tokens": {k: len(v) for k, v in victims.items()}, "runs": runs}
        fails: List[str] = []
        warns: List[str] = []
        # normal victim
        normal = [a for pair in seen["normal"] for a in pair]
        if any(a.status != 200 for a in normal):
            fails.append("the normal victim prompt was not answered after tenant traffic: "
                         + ", ".join(str(a.status or a.reply.error) for a in normal))
        else:
            r1, r2 = seen["normal"]
            stable = r1[0].output == r1[1].output and r2[0].output == r2[1].output
            if r1[0].output != r2[0].output:
                if stable:
                    fails.append("output depends on other tenants' traffic: the normal victim's greedy output "
                                 f"changed between traffic sets ({_short(r1[0].output)!r} -> {_short(r2[0].output)!r})")
                else:
                    warns.append("the normal victim's greedy output is not reproducible even back to back; "
                                 "cross-tenant dependence cannot be judged")
            elif not stable:
                warns.append("the normal victim's greedy output changed between back-to-back requests")
        # over-limit victim
        over = [a for pair in seen["over_limit"] for a in pair]
        answered = [a for a in over if a.status == 200]
        rejected = [a for a in over if _classify_reject(a, self.cfg.timeout) is None]
        if len(rejected) == len(over):
            pass  # a 4xx every time is the wanted answer
        elif answered:
            outs = {json.dumps(a.output) for a in answered}
            if len(outs) > 1:
                fails.append(f"output depends on other tenants' traffic: the over-limit victim ({self.over} tokens) "
                             f"was answered 200 with {len(outs)} different outputs across "
                             f"{len(answered)} identical greedy requests")
            elif len(answered) < len(over):
                fails.append(f"the over-limit victim ({self.over} tokens) was answered 200 on "
                             f"{len(answered)} of {len(over)} identical requests")
            else:
                warns.append(f"the over-limit victim ({self.over} tokens) was answered 200 (see over_capacity); "
                             "its output did not change with the traffic sent here")
        else:
            warns.append("the over-limit victim got neither 200 nor a client error: "
                         + ", ".join(str(a.status or a.reply.error) for a in over))
        bad_traffic = sum(v for k, v in (runs[0]["traffic"]["statuses"].items()) if k != "200") + \
            sum(v for k, v in (runs[1]["traffic"]["statuses"].items()) if k != "200")
        total = runs[0]["traffic"]["requests"] + runs[1]["traffic"]["requests"]
        if bad_traffic * 2 > total:
            warns.append(f"{bad_traffic} of {total} tenant-A requests failed: the pool may not have been filled")
        if fails:
            return CheckResult("cross_tenant", FAIL, "; ".join(fails), meas)
        if warns:
            return CheckResult("cross_tenant", WARN, "; ".join(warns), meas)
        return CheckResult("cross_tenant", PASS,
                           "victim outputs identical across two different tenant traffic sets; "
                           "over-limit victim rejected every time", meas)

    # 5
    def prefill_speed(self) -> CheckResult:
        short, long_ = 8, self.long
        med = max(16, long_ // 2)
        if long_ <= med or med <= short:
            return CheckResult("prefill_speed", SKIP, f"limit {self.limit} too small to measure")

        def best(n: int, tag: str, reps: int = 3) -> Tuple[Optional[float], List[Answer]]:
            # fresh prompts (no prefix-cache hits), one new token; the minimum resists noise
            ans = [self.ep.complete(self.prompts.ids(n, f"speed:{tag}:{i}"), max_tokens=1) for i in range(reps)]
            ok = [a.reply.latency_s for a in ans if a.status == 200]
            return (min(ok) if ok else None), ans

        t_short, a_s = best(short, "short")
        t_med, a_m = best(med, "med")
        t_long, a_l = best(long_, "long")
        overs = [(n, best(n, f"over{n}", reps=1)) for n in sorted({self.over, 2 * self.limit})]
        meas: Dict[str, Any] = {"short": [a.brief() for a in a_s], "medium": [a.brief() for a in a_m],
                                "long": [a.brief() for a in a_l],
                                "over_limit": [a.brief() for _, (_, ans) in overs for a in ans]}
        if t_short is None or t_med is None:
            return CheckResult("prefill_speed", SKIP, "short/medium prompts were not answered", meas)
        per_tok = (t_med - t_short) / (med - short)
        meas.update(seconds_short=round(t_short, 4), seconds_medium=round(t_med, 4),
                    seconds_per_prompt_token=per_tok)
        if per_tok <= 0:
            return CheckResult("prefill_speed", SKIP,
                               f"prefill time not measurable: {med} tokens no slower than {short} "
                               f"({t_med:.3f} s vs {t_short:.3f} s)", meas)
        flagged = []
        for n, t in [(long_, t_long)] + [(n, t) for n, (t, _) in overs]:
            if t is None:
                continue
            expected = t_short + per_tok * (n - short)
            meas.setdefault("expected_s", {})[str(n)] = round(expected, 4)
            meas.setdefault("measured_s", {})[str(n)] = round(t, 4)
            if t < 0.3 * expected and expected - t > 0.05:
                flagged.append(f"{n} tokens answered in {t:.3f} s, {per_tok * 1000:.3f} ms/token predicts "
                               f"{expected:.3f} s")
        if t_long is None and all(t is None for _, (t, _) in overs):
            return CheckResult("prefill_speed", SKIP, f"the long prompt ({long_} tokens) was not answered: "
                               + ", ".join(str(a.status or a.reply.error) for a in a_l), meas)
        if flagged:
            return CheckResult("prefill_speed", WARN,
                               "suspiciously fast (was the prompt prefilled at all?): " + "; ".join(flagged), meas)
        return CheckResult("prefill_speed", PASS,
                           f"{per_tok * 1000:.3f} ms/prompt token; long prompts took as long as predicted", meas)


# ----------------------------------------------------------------------------- driver


def run_probe(cfg: ProbeConfig, *, log: Optional[Callable[[str], None]] = None) -> Report:
    """Run the selected checks; never raises for endpoint behaviour (error -> exit 2)."""
    t0 = time.monotonic()
    client = Client(cfg.url, cfg.timeout, cfg.api_key)
    try:
        names = cfg.checks()
        prompts = Prompts(cfg.seed, cfg.token_range)
        disc = discover(client, cfg)
    except ProbeError as exc:
        return Report(cfg.url, None, [], error=str(exc), duration_s=time.monotonic() - t0)
    ep = Endpoint(client, disc, cfg)
    try:
        choose_api(ep, prompts)
    except ProbeError as exc:
        return Report(cfg.url, disc, [], error=str(exc), requests=ep.count, duration_s=time.monotonic() - t0)
    if disc.limit is None:
        return Report(cfg.url, disc, [], requests=ep.count, duration_s=time.monotonic() - t0,
                      error="cannot discover the deployment's limit (no max_req_input_len or context length "
                            "in /server_info, /v1/models or the router's /workers); pass --limit N or --node URL")
    if disc.limit < 2:
        return Report(cfg.url, disc, [], error=f"limit {disc.limit} is too small", duration_s=time.monotonic() - t0)
    probe = Probe(cfg, ep, disc, prompts)
    results: List[CheckResult] = []
    for name in names:
        if log:
            log(f"kvguard probe: {name} ...")
        c0 = time.monotonic()
        try:
            res = getattr(probe, name)()
        except Exception as exc:  # a probe bug must not hide the other checks
            res = CheckResult(name, FAIL, f"probe error: {type(exc).__name__}: {exc}")
        res.duration_s = round(time.monotonic() - c0, 3)
        results.append(res)
    return Report(cfg.url, disc, results, requests=ep.count, duration_s=time.monotonic() - t0)


def render(rep: Report) -> str:
    lines = [f"kvguard probe {rep.url}"]
    d = rep.discovery
    if d:
        lines.append(f"  model: {d.model or '-'} ({d.model_source or 'none'}); api: {d.api_note or d.api or '-'}")
        lines.append(f"  limit: {d.limit if d.limit is not None else '-'} tokens ({d.limit_source or 'unknown'}); "
                     f"page: {d.page}; largest pool: {d.pool_tokens or '-'} tokens")
        for n in d.nodes:
            bits = [f"{k}={getattr(n, k)}" for k in ("role", "context_length", "max_req_input_len",
                                                      "max_total_num_tokens", "page_size", "version")
                    if getattr(n, k) is not None]
            lines.append(f"  node {n.url}: " + (" ".join(bits) or "no limits reported")
                         + (f" [{n.error}]" if n.error else ""))
    if rep.error:
        lines.append(f"ERROR {rep.error}")
    width = max([len(c.name) for c in rep.checks] + [8])
    for c in rep.checks:
        lines.append(f"{c.status:<4}  {c.name:<{width}}  {c.reason}  [{c.duration_s:.1f} s]")
    counts = {s: sum(1 for c in rep.checks if c.status == s) for s in (PASS, FAIL, WARN, SKIP)}
    verdict = {0: "PASS", 1: "FAIL", 2: "ERROR"}[rep.exit_code]
    lines.append(f"probe: {verdict} ({counts[PASS]} passed, {counts[FAIL]} failed, {counts[WARN]} warnings, "
                 f"{counts[SKIP]} skipped; {rep.requests} requests in {rep.duration_s:.1f} s)")
    return "\n".join(lines)


def to_junit(rep: Report) -> str:
    checks = list(rep.checks)
    suite = ET.Element("testsuite", {
        "name": "kvguard-probe",
        "tests": str(len(checks) or 1),
        "failures": str(sum(1 for c in checks if c.status == FAIL)),
        "errors": "1" if rep.error else "0",
        "skipped": str(sum(1 for c in checks if c.status == SKIP)),
        "time": f"{rep.duration_s:.3f}",
    })
    props = ET.SubElement(suite, "properties")
    ET.SubElement(props, "property", {"name": "url", "value": rep.url})
    if rep.discovery:
        for k in ("model", "limit", "limit_source", "api"):
            v = getattr(rep.discovery, k)
            if v is not None:
                ET.SubElement(props, "property", {"name": k, "value": str(v)})
    if rep.error:
        tc = ET.SubElement(suite, "testcase", {"classname": "kvguard.probe", "name": "setup", "time": "0"})
        ET.SubElement(tc, "error", {"message": rep.error}).text = rep.error
    for c in checks:
        tc = ET.SubElement(suite, "testcase", {"classname": "kvguard.probe", "name": c.name,
                                               "time": f"{c.duration_s:.3f}"})
        detail = json.dumps(c.measurements, indent=1, default=str)
        if c.status == FAIL:
            ET.SubElement(tc, "failure", {"message": c.reason, "type": "kvguard.probe.FAIL"}).text = detail
        elif c.status == SKIP:
            ET.SubElement(tc, "skipped", {"message": c.reason})
        else:
            ET.SubElement(tc, "system-out").text = f"{c.status}: {c.reason}\n{detail}"
    root = ET.Element("testsuites")
    root.append(suite)
    return ET.tostring(root, encoding="unicode", xml_declaration=True)


def _parse_range(s: str) -> Tuple[int, int]:
    try:
        lo, hi = (int(x) for x in s.replace("-", ":").split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI, got {s!r}") from None
    if lo < 0 or hi - lo < 2:
        raise argparse.ArgumentTypeError(f"bad token range {s!r}")
    return lo, hi


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvguard probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("url", help="base URL of the router / server / OpenAI-compatible endpoint")
    ap.add_argument("--model", help="model name for /v1/completions (default: the first of /v1/models)")
    ap.add_argument("--limit", type=int, help="longest prompt the deployment should accept, in tokens "
                    "(default: discovered, see above)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per request (default 60)")
    ap.add_argument("--json", metavar="FILE", help="write the JSON report to FILE ('-': stdout)")
    ap.add_argument("--junit", metavar="FILE", help="write JUnit XML to FILE (one testcase per check)")
    ap.add_argument("--only", help="comma-separated checks: " + ",".join(CHECKS))
    ap.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    ap.add_argument("--api", choices=("auto", "completions", "generate"), default="auto",
                    help="token-id API: /v1/completions prompt=[ids] or SGLang /generate input_ids "
                    "(default auto: completions, else generate)")
    ap.add_argument("--node", action="append", default=[], metavar="URL",
                    help="also read this node's limits (/server_info, /v1/models); repeatable")
    ap.add_argument("--no-workers", action="store_true", help="do not read the router's /workers")
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens generated per probe request (default 8)")
    ap.add_argument("--token-range", type=_parse_range, default=(100, 250), metavar="LO:HI",
                    help="prompt token ids are drawn from [LO, HI) (default 100:250)")
    ap.add_argument("--page", type=int, help="tokens over the limit for the 'limit + a page' prompt "
                    "(default: the nodes' page_size, else 64)")
    ap.add_argument("--concurrency", type=int, default=4, help="parallel tenant-A requests (default 4)")
    ap.add_argument("--long-tokens", type=int, help="length of tenant-A's long prompts in cross_tenant and of "
                    "the long prompt in prefill_speed (default: limit // 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--soak", type=int, metavar="N",
                    help="instead of the checks: a chaos soak of N mixed requests (short, at and over the limit, "
                    "streamed or not; aborts on every node, client disconnects, /flush_cache at random moments); "
                    "fails on a foreign answer, an over-limit answer, a hang or a resource leak (docs/probe.md)")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    return ap


def config_from_args(args: argparse.Namespace) -> ProbeConfig:
    only = [c.strip() for c in args.only.split(",") if c.strip()] if args.only else None
    cfg = ProbeConfig(url=args.url, model=args.model, limit=args.limit, timeout=args.timeout, only=only,
                      api_key=args.api_key, api=args.api, nodes=tuple(args.node),
                      discover_workers=not args.no_workers, max_tokens=args.max_tokens,
                      token_range=args.token_range, page=args.page, concurrency=args.concurrency,
                      long_tokens=args.long_tokens, seed=args.seed)
    cfg.checks()  # validates --only
    if cfg.limit is not None and cfg.limit < 2:
        raise ProbeError("--limit must be at least 2")
    if cfg.timeout <= 0 or cfg.max_tokens < 1 or cfg.concurrency < 1:
        raise ProbeError("--timeout, --max-tokens and --concurrency must be positive")
    return cfg


def main(argv: Optional[List[str]] = None) -> int:
    ap = _parser()
    try:
        args = ap.parse_args(argv)
    except SystemExit as exc:  # argparse: 2 on usage errors, 0 for --help
        return int(exc.code or 0)
    if args.soak is not None:
        return _soak_main(args)
    try:
        cfg = config_from_args(args)
    except ProbeError as exc:
        print(f"kvguard probe: error: {exc}", file=sys.stderr)
        return 2
    log = None if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    rep = run_probe(cfg, log=log)
    text = render(rep)
    if args.json == "-":
        print(json.dumps(rep.as_dict(), indent=2, default=str))
        print(text, file=sys.stderr)
    else:
        print(text)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(rep.as_dict(), f, indent=2, default=str)
    if args.junit:
        with open(args.junit, "w", encoding="utf-8") as f:
            f.write(to_junit(rep))
    return rep.exit_code


def _soak_main(args: argparse.Namespace) -> int:
    from .soak import SoakConfig, SoakError, render, run_soak

    if args.soak < 1 or args.concurrency < 1:
        print("kvguard probe: error: --soak and --concurrency must be positive", file=sys.stderr)
        return 2
    cfg = SoakConfig(url=args.url, requests=args.soak, concurrency=args.concurrency, seed=args.seed,
                     max_new_tokens=args.max_tokens, limit=args.limit, nodes=tuple(args.node),
                     token_range=args.token_range, bound_s=max(args.timeout, 1.0))
    log = None if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    try:
        rep = run_soak(cfg, log=log, progress=not args.quiet and sys.stderr.isatty())
    except SoakError as exc:
        print(f"kvguard probe --soak: error: {exc}", file=sys.stderr)
        return 2
    print(render(rep))
    if args.json:
        payload = json.dumps(rep.as_dict(), indent=1, default=str)
        if args.json == "-":
            print(payload)
        else:
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(payload)
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
