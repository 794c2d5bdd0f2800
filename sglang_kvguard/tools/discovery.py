"""Discovering a PD deployment behind a router: its nodes, their roles, the model and the
prompt limit. Shared by the live probe (``probe.py``) and the chaos soak (``soak.py``).

``discover(client, cfg)`` reads the router's ``/v1/models``, its worker list, and each
node's ``/server_info``; ``cfg`` is a :class:`DiscoveryConfig` or anything with its
fields (the probe passes its ``ProbeConfig``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

from .http import HttpClient, Reply


class ProbeError(Exception):
    """Usage error or unreachable endpoint (exit status 2)."""


@dataclass
class DiscoveryConfig:
    url: str
    model: Optional[str] = None
    limit: Optional[int] = None
    nodes: Sequence[str] = ()
    discover_workers: bool = True
    max_tokens: int = 8
    page: Optional[int] = None


class Client:
    """One endpoint (the router, or a node by ``base``), on kvguard's one HTTP client."""

    def __init__(self, url: str, timeout: float, api_key: Optional[str] = None):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.api_key = api_key
        self.http = HttpClient(timeout, api_key=api_key)

    def request(self, path: str, payload: Any = None, *, base: Optional[str] = None,
                timeout: Optional[float] = None) -> Reply:
        url = (base or self.url).rstrip("/") + path
        return self.http.request("POST" if payload is not None else "GET", url, payload,
                                 timeout=self.timeout if timeout is None else timeout)


@dataclass
class NodeInfo:
    url: str
    role: Optional[str] = None
    context_length: Optional[int] = None
    max_req_input_len: Optional[int] = None
    max_total_num_tokens: Optional[int] = None
    page_size: Optional[int] = None
    version: Optional[str] = None
    error: Optional[str] = None


@dataclass
class Discovery:
    url: str
    model: Optional[str] = None
    model_source: Optional[str] = None
    nodes: List[NodeInfo] = field(default_factory=list)
    limit: Optional[int] = None
    limit_source: Optional[str] = None
    pool_tokens: Optional[int] = None  # largest pool seen (what traffic must fill)
    page: int = 64
    api: Optional[str] = None
    api_note: Optional[str] = None


def _int(v) -> Optional[int]:
    try:
        return int(v) if v is not None and not isinstance(v, bool) else None
    except (TypeError, ValueError):
        return None


def _first_key(obj: Any, key: str) -> Any:
    """First value of ``key`` in a nested dict/list (server_info nests per-DP states)."""
    if isinstance(obj, dict):
        if obj.get(key) is not None:
            return obj[key]
        for v in obj.values():
            r = _first_key(v, key)
            if r is not None:
                return r
    elif isinstance(obj, list):
        for v in obj:
            r = _first_key(v, key)
            if r is not None:
                return r
    return None


def read_node(client: Client, url: str, role: Optional[str] = None) -> Tuple[NodeInfo, Optional[str], Optional[int]]:
    """A node's limits; returns (info, model id from /v1/models, max_model_len)."""
    node = NodeInfo(url=url.rstrip("/"), role=role)
    model_id, max_model_len = None, None
    r = client.request("/v1/models", base=url, timeout=min(client.timeout, 15))
    if r.status == 200 and isinstance(r.json, dict):
        data = r.json.get("data") or []
        if data and isinstance(data[0], dict):
            model_id = data[0].get("id")
            max_model_len = _int(data[0].get("max_model_len"))
    elif r.status == 0:
        node.error = f"GET /v1/models: {r.error}"
        return node, None, None  # unreachable: do not wait on its other endpoints
    info = None
    for path in ("/server_info", "/get_server_info"):
        ri = client.request(path, base=url, timeout=min(client.timeout, 15))
        if ri.status == 200 and isinstance(ri.json, dict):
            info = ri.json
            break
        if ri.status == 0:
            break
    if info is not None:
        node.context_length = _int(_first_key(info, "context_length"))
        node.max_req_input_len = _int(_first_key(info, "max_req_input_len"))
        node.max_total_num_tokens = _int(_first_key(info, "max_total_num_tokens"))
        node.page_size = _int(_first_key(info, "page_size"))
        node.version = _first_key(info, "version")
        mode = _first_key(info, "disaggregation_mode")
        if node.role is None and mode is not None:
            node.role = str(mode)
    if max_model_len is not None:
        node.context_length = max_model_len if node.context_length is None else min(node.context_length, max_model_len)
    return node, model_id, max_model_len


def discover(client: Client, cfg: "DiscoveryConfig") -> Discovery:
    disc = Discovery(url=client.url)
    root, model_id, _ = read_node(client, client.url)
    health = None
    if root.error:
        health = client.request("/health", timeout=min(client.timeout, 15))
        if health.status == 0:
            raise ProbeError(f"endpoint unreachable: {client.url}: {root.error}")
    disc.nodes.append(root)
    if cfg.model:
        disc.model, disc.model_source = cfg.model, "--model"
    elif model_id:
        disc.model, disc.model_source = model_id, "/v1/models"
    extra: List[Tuple[str, Optional[str]]] = [(u, None) for u in cfg.nodes]
    if cfg.discover_workers:
        w = client.request("/workers", timeout=min(client.timeout, 15))
        if w.status == 200 and isinstance(w.json, dict) and isinstance(w.json.get("workers"), list):
            for wk in w.json["workers"]:
                if isinstance(wk, dict) and wk.get("url"):
                    extra.append((str(wk["url"]), wk.get("worker_type")))
    seen = {root.url}
    for u, role in extra:
        if u.rstrip("/") in seen:
            continue
        seen.add(u.rstrip("/"))
        node, mid, _ = read_node(client, u, role)
        disc.nodes.append(node)
        if disc.model is None and mid:
            disc.model, disc.model_source = mid, f"/v1/models of {u}"
    # the limit
    cands: List[Tuple[int, str]] = []
    for n in disc.nodes:
        where = n.url + (f" ({n.role})" if n.role else "")
        if n.max_req_input_len is not None:
            cands.append((n.max_req_input_len - 1, f"max_req_input_len {n.max_req_input_len} - 1 at {where}"))
        if n.context_length is not None:
            if _strict_total(n.version):  # 0.5.10 rejects len + max_new_tokens >= context
                cands.append((n.context_length - cfg.max_tokens - 1,
                              f"context {n.context_length} - max_tokens {cfg.max_tokens} - 1 at {where}"))
            else:
                cands.append((n.context_length - cfg.max_tokens,
                              f"context {n.context_length} - max_tokens {cfg.max_tokens} at {where}"))
    if cfg.limit is not None:
        disc.limit, disc.limit_source = cfg.limit, "--limit"
    elif cands:
        disc.limit, disc.limit_source = min(cands)
    pools = [n.max_total_num_tokens for n in disc.nodes if n.max_total_num_tokens]
    disc.pool_tokens = max(pools) if pools else None
    pages = [n.page_size for n in disc.nodes if n.page_size]
    disc.page = cfg.page or (max(pages) if pages else 64)
    return disc


def _strict_total(version: Optional[str]) -> bool:
    """SGLang up to 0.5.10 rejects ``len + max_new_tokens >= context``; 0.5.11+ only ``>``."""
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", str(version or ""))
    return bool(m) and tuple(int(x) for x in m.groups()) <= (0, 5, 10)


