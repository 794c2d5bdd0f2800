"""``kvguard preflight URL ...``: measure the pools, do not trust HTTP 200.

Reads each running SGLang node's own report (``/server_info``, falling back to
``/get_server_info``; ``/v1/models`` for the context length the node advertises)
and checks the incident's configuration:

* a node whose KV pool holds fewer tokens than its context: prompts in between are
  rejected inside the scheduler (the path that turned into other tenants' text);
* decode accepting longer prompts than prefill can hold (the incident's asymmetry);
* a prefill pool under twice its context (the post-mortem's advice; a note only).

Exit status: 0 all checks pass, 1 a check failed, 2 a node could not be read.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from typing import List, Optional

from . import http
from .http import Reply


@dataclass
class Node:
    url: str
    release: Optional[str] = None
    mode: Optional[str] = None
    pool_tokens: Optional[int] = None
    max_req_input_len: Optional[int] = None
    context_length: Optional[int] = None
    page_size: Optional[int] = None
    error: Optional[str] = None


@dataclass
class Finding:
    level: str  # FAIL or NOTE
    node: str
    message: str


@dataclass
class Result:
    nodes: List[Node]
    findings: List[Finding] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        if any(n.error for n in self.nodes):
            return 2
        return 1 if any(f.level == "FAIL" for f in self.findings) else 0


def _get(url: str, timeout: float) -> Reply:
    return http.request("GET", url, timeout=timeout)


def _first(d: dict, *keys):
    for k in keys:
        v = d.get(k)
        if v is not None:
            return v
    return None


def read_node(url: str, timeout: float = 10.0) -> Node:
    url = url.rstrip("/")
    node = Node(url)
    info = None
    for path in ("/server_info", "/get_server_info"):
        r = _get(url + path, timeout)
        if r.status == 404:
            continue
        if r.status == 0:
            node.error = f"GET {path}: {r.error}"
            return node
        if not r.ok:
            node.error = f"GET {path}: HTTP {r.status}"
            return node
        if not isinstance(r.body, dict):
            node.error = f"GET {path}: the answer is not a JSON object: {r.text[:200]!r}"
            return node
        info = r.body
        break
    if info is None:
        node.error = "no /server_info or /get_server_info (is this an SGLang server, not a router?)"
        return node
    states = info.get("internal_states") or [{}]
    first_state = states[0] if isinstance(states, list) and states else {}
    node.release = _first(info, "version")
    mode = _first(info, "disaggregation_mode")
    node.mode = str(mode) if mode is not None else "null"
    node.pool_tokens = _first(info, "max_total_num_tokens") or _first(first_state, "max_total_num_tokens")
    node.max_req_input_len = _first(info, "max_req_input_len") or _first(first_state, "max_req_input_len")
    node.page_size = _first(info, "page_size")
    ctx = None
    models = _get(url + "/v1/models", timeout).body
    data = (models.get("data") if isinstance(models, dict) else None) or []
    if data and isinstance(data[0], dict):
        ctx = data[0].get("max_model_len")
    node.context_length = ctx if ctx is not None else _first(info, "context_length")
    return node


def check(nodes: List[Node]) -> Result:
    res = Result(nodes)
    for n in nodes:
        if n.error:
            continue
        if n.pool_tokens is not None and n.context_length is not None:
            if n.pool_tokens < n.context_length:
                res.findings.append(Finding(
                    "FAIL", n.url,
                    f"{n.mode} node's KV pool holds {n.pool_tokens} tokens but it advertises a context of "
                    f"{n.context_length}: prompts of {n.max_req_input_len}..{n.context_length} tokens are rejected "
                    "inside the scheduler (the incident's configuration). Raise the pool "
                    "(--mem-fraction-static / --max-total-tokens) or lower --context-length.",
                ))
            elif n.mode == "prefill" and n.pool_tokens < 2 * n.context_length:
                res.findings.append(Finding(
                    "NOTE", n.url,
                    f"prefill pool {n.pool_tokens} tokens is under twice the context ({n.context_length}); "
                    "the post-mortem's remediation sized prefill pools at about 2x the context.",
                ))
    prefill = [n for n in nodes if not n.error and n.mode == "prefill" and n.max_req_input_len is not None]
    decode = [n for n in nodes if not n.error and n.mode == "decode" and n.max_req_input_len is not None]
    if prefill and decode:
        p = min(prefill, key=lambda n: n.max_req_input_len)
        d = max(decode, key=lambda n: n.max_req_input_len)
        if d.max_req_input_len > p.max_req_input_len:
            res.findings.append(Finding(
                "FAIL", d.url,
                f"decode accepts prompts up to {d.max_req_input_len} tokens but prefill {p.url} holds only "
                f"{p.max_req_input_len}: longer prompts pass decode's admission while prefill rejects them "
                "(the incident's asymmetry).",
            ))
    return res


def render(res: Result) -> str:
    cols = ("url", "release", "mode", "pool_tokens", "max_req_input_len", "context_length", "page_size")
    rows = [cols] + [tuple("-" if getattr(n, c) is None else str(getattr(n, c)) for c in cols) for n in res.nodes]
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    for n in res.nodes:
        if n.error:
            lines.append(f"ERROR {n.url}: {n.error}")
    for f in res.findings:
        lines.append(f"{f.level} {f.node}: {f.message}")
    verdict = {0: "PASS", 1: "FAIL", 2: "ERROR"}[res.exit_code]
    lines.append(f"preflight: {verdict}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="kvguard preflight", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("urls", nargs="+", help="base URL of each prefill / decode / plain SGLang node")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--timeout", type=float, default=10.0)
    args = ap.parse_args(argv)
    res = check([read_node(u, args.timeout) for u in args.urls])
    if args.json:
        print(json.dumps({"ok": res.exit_code == 0, "exit_code": res.exit_code,
                          "nodes": [asdict(n) for n in res.nodes],
                          "findings": [asdict(f) for f in res.findings]}, indent=2))
    else:
        print(render(res))
    return res.exit_code


if __name__ == "__main__":
    sys.exit(main())
