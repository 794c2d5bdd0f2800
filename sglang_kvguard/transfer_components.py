"""What a PD transfer moves on this node, read from what upstream registered with its
transfer backend, and which page guard covers each part.

Upstream builds one ``KVArgs`` per node when its PD queue creates the KV manager
(``PrefillBootstrapQueue._init_kv_manager`` / ``DecodePreallocQueue._init_kv_manager``)
and hands it to the backend (Mooncake registers every buffer in it):

* ``kv_data_ptrs``: the target pool's per-layer KV buffers, then the draft model's
  (speculative decoding; ``num_draft_entries`` of them from 0.5.19);
* ``state_data_ptrs`` with ``state_types`` (0.5.13+; 0.5.10-0.5.12: one ``state_type``
  string): every other component a transfer writes with its own indices: DSA/NSA
  indexer keys, the DSA compress tail, MXFP8 block scales, SWA, Mamba state...;
* ``aux_data_ptrs``: the metadata rows (first output token, logprobs, hidden states).

This module turns that into a list of :class:`Component` and says, per page guard,
whether the guard covers the component. It never guesses from attribute names what
is transferred: a buffer is matched to the pool only by its data pointer, and a
registered buffer that kvguard cannot place is reported as such (not covered).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

# guard -> the roles on which it protects transferred pages
CANARY, CHECKSUM = "destination_canary", "transfer_checksum"
SOURCE_HOLD, DEST_HOLD, GENERATION = "prefill_source_hold", "decode_destination_hold", "page_generation"
DEFERRED = "decode_deferred_release"
PAGE_GUARDS = {
    "prefill": (SOURCE_HOLD, CHECKSUM),
    "decode": (GENERATION, DEST_HOLD, DEFERRED, CANARY, CHECKSUM),
}

COVERED, NOT_COVERED = "covered", "not_covered"


@dataclass
class Component:
    name: str  # "kv", "draft_kv", "kv_unplaced", "kv_unregistered", "state:<type>", "aux"
    buffers: int
    # guard -> why it does not cover this component (absent: covered)
    gaps: Dict[str, str] = field(default_factory=dict)
    note: str = ""

    def state_for(self, guard: str) -> str:
        return NOT_COVERED if guard in self.gaps else COVERED


def _ptrs(seq) -> List[int]:
    out = []
    for p in seq or ():
        if isinstance(p, (list, tuple)):
            out.extend(int(x) for x in p)
        else:
            out.append(int(p))
    return out


def _buf_ptrs(buffers) -> List[int]:
    return [int(b.data_ptr()) for b in buffers or () if hasattr(b, "data_ptr")]


def _state_groups(kv_args) -> List[tuple]:
    """[(type name, [pointers])] of the state components in ``kv_args``."""
    ptrs = list(getattr(kv_args, "state_data_ptrs", None) or [])
    types = getattr(kv_args, "state_types", None)
    if types is not None:  # 0.5.13+: one list of pointers per component
        out = []
        for i, t in enumerate(types):
            name = str(getattr(t, "value", t))
            group = ptrs[i] if i < len(ptrs) else []
            out.append((name, _ptrs(group if isinstance(group, (list, tuple)) else [group])))
        return out
    if not ptrs:
        return []
    name = str(getattr(kv_args, "state_type", None) or "unnamed")  # 0.5.10-0.5.12: one flat list
    return [(name, _ptrs(ptrs))]


def describe(kv_args, kv_pool, draft_pool=None) -> List[Component]:
    """The components of this node's transfers and each page guard's coverage of them."""
    from .guards.destination_canary import kv_buffers

    registered = _ptrs(getattr(kv_args, "kv_data_ptrs", None))
    guarded = _buf_ptrs(kv_buffers(kv_pool) or [])
    draft = []
    if draft_pool is not None:
        infos = getattr(draft_pool, "get_contiguous_buf_infos", None)
        draft = _ptrs(infos()[0]) if infos is not None else _buf_ptrs(kv_buffers(draft_pool) or [])
    reg, grd, drf = set(registered), set(guarded), set(draft)
    comps: List[Component] = []

    target = [p for p in registered if p in grd]
    if target:
        comps.append(Component("kv", len(target)))
    drafted = [p for p in registered if p in drf and p not in grd]
    if drafted:
        why = "the draft model's KV pages are not stamped or digested (only the target pool's buffers are)"
        comps.append(Component("draft_kv", len(drafted), {CANARY: why, CHECKSUM: why},
                               note="same page ids as the target KV: held and generation-tagged"))
    unplaced = [p for p in registered if p not in grd and p not in drf]
    if unplaced:
        why = "registered KV buffers that are not the pool's per-layer page buffers kvguard stamps and digests"
        comps.append(Component("kv_unplaced", len(unplaced), {CANARY: why, CHECKSUM: why}))
    missing = [p for p in guarded if p not in reg]
    if missing:
        why = ("kvguard would stamp and digest per-layer buffers that the transfer does not carry "
               "(layer-split or other partial registration): every check would fail or raise")
        comps.append(Component("kv_unregistered", len(missing), {CANARY: why, CHECKSUM: why}))
    for name, ptrs in _state_groups(kv_args):
        why = (f"state component '{name}' is written with its own indices: its pages are neither held, "
               "generation-tagged, canary-stamped nor digested")
        comps.append(Component(f"state:{name}", len(ptrs),
                               {g: why for g in (SOURCE_HOLD, DEST_HOLD, DEFERRED, GENERATION, CANARY, CHECKSUM)}))
    aux = _ptrs(getattr(kv_args, "aux_data_ptrs", None))
    if aux:
        comps.append(Component("aux", len(aux), note="metadata rows: held with their pages; not digested"))
    return comps


def gaps_for(role: str, comps: Sequence[Component], active: Optional[set]) -> Dict[str, List[str]]:
    """guard -> [why] for the active page guards of ``role`` that miss a component."""
    out: Dict[str, List[str]] = {}
    for c in comps:
        for guard, why in c.gaps.items():
            if guard not in PAGE_GUARDS.get(role, ()):
                continue
            if active is not None and guard not in active:
                continue
            out.setdefault(guard, []).append(f"{c.name} ({c.buffers} buffer(s)): {why}")
    return out


def summary(role: str, comps: Sequence[Component], active: Optional[set]) -> str:
    """One line per component: which active page guards of ``role`` cover it."""
    parts = []
    for c in comps:
        guards = [g for g in PAGE_GUARDS.get(role, ()) if active is None or g in active]
        cov = [g for g in guards if c.state_for(g) == COVERED]
        text = f"{c.name} ({c.buffers} buffer(s))"
        if c.name == "aux":
            text += f": {c.note}"
        else:
            text += ": covered by " + (", ".join(cov) if cov else "no page guard")
            if c.note:
                text += f" ({c.note})"
        parts.append(text)
    return "; ".join(parts)


def record_metrics(role: str, comps: Sequence[Component], active: Optional[set]) -> None:
    """``kvguard_component_coverage{component,guard,state,role}`` = 1 for each pair."""
    try:
        from prometheus_client import Gauge
        import os

        from . import metrics as m

        if "coverage" not in m._metrics:
            kwargs = {"multiprocess_mode": "max"} if os.environ.get("PROMETHEUS_MULTIPROC_DIR") else {}
            m._metrics["coverage"] = Gauge(
                "kvguard_component_coverage",
                "1 for each transferred component, page guard and coverage state on this node",
                ["component", "guard", "state", "role"], **kwargs)
        g = m._metrics["coverage"]
        for c in comps:
            if c.name == "aux":
                continue
            for guard in PAGE_GUARDS.get(role, ()):
                if active is not None and guard not in active:
                    state = "off"
                else:
                    state = c.state_for(guard)
                g.labels(component=c.name, guard=guard, state=state, role=role).set(1)
    except Exception:  # noqa: BLE001 - metrics never stop a node
        pass
