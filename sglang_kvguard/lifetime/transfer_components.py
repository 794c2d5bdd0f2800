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

# State components that upstream sends at the KV page ids: the DSA/NSA indexer's keys
# (``StateType.DSA`` from 0.5.13, ``state_type = "nsa"`` on 0.5.10-0.5.12) and MXFP8
# block scales of the full KV (``StateType.BLOCK_SCALE``).
PAGE_STATE_TYPES = ("dsa", "nsa", "block_scale")


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


def _ints(seq) -> List[int]:
    """Integers of a numpy array, tensor, list or nested list (page or slot indices)."""
    if seq is None:
        return []
    if hasattr(seq, "tolist"):
        seq = seq.tolist()
    if not isinstance(seq, (list, tuple)):
        return [int(seq)]
    out: List[int] = []
    for x in seq:
        if isinstance(x, (list, tuple)) or hasattr(x, "tolist"):
            out.extend(_ints(x))
        else:
            out.append(int(x))
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


def kv_buffers(pool) -> Optional[List]:
    """Every per-layer page buffer of an MHA or MLA token pool (token rows), or None."""
    bufs = []
    for attr in ("k_buffer", "v_buffer", "kv_buffer"):
        value = getattr(pool, attr, None)
        if isinstance(value, (list, tuple)):
            bufs.extend(value)
    if not bufs or not all(hasattr(b, "data_ptr") for b in bufs):
        return None
    return bufs


def _empty(buf) -> bool:
    return getattr(buf, "numel", lambda: 1)() == 0


def indexer_buffers(pool) -> Optional[List]:
    """The DSA/NSA indexer's per-layer key buffers (``index_k_with_scale_buffer``: one
    row of key and scale bytes per KV page, indexed by the KV page id), without the
    0-row placeholders of layers that write no index keys; None if the pool has no
    indexer or lays it out otherwise (pooled or sharded index pages, which kvguard
    does not cover)."""
    bufs = getattr(pool, "index_k_with_scale_buffer", None)
    if not isinstance(bufs, (list, tuple)) or not bufs or not all(hasattr(b, "data_ptr") for b in bufs):
        return None
    ps = int(getattr(pool, "page_size", 0) or 0)
    if ps <= 0 or int(getattr(pool, "index_kpool", 1) or 1) != 1:
        return None
    if int(getattr(pool, "index_page_size", ps) or ps) != ps:
        return None
    rows = [b for b in bufs if not _empty(b)]
    size = int(getattr(pool, "size", 0) or 0)
    if not rows or any(b.dim() != 2 or b.shape[0] * ps < size for b in rows):
        return None
    return rows


def scale_buffers(pool) -> Optional[List]:
    """The MXFP8 block-scale buffers (``k_scale_buffer`` then ``v_scale_buffer``) as one
    row per KV page (upstream's interleaved layout already is; the flat per-slot layout
    is viewed page by page), or None if the pool has none or kvguard cannot read them
    page by page as 32-bit words."""
    ks, vs = getattr(pool, "k_scale_buffer", None), getattr(pool, "v_scale_buffer", None)
    if not isinstance(ks, (list, tuple)) or not isinstance(vs, (list, tuple)) or not ks:
        return None
    ps = int(getattr(pool, "page_size", 0) or 0)
    if ps <= 0:
        return None
    import torch

    out = []
    for t in list(ks) + list(vs):
        if not hasattr(t, "data_ptr") or not t.is_contiguous() or t.dim() < 1:
            return None
        if _empty(t):
            continue
        rows = t.shape[0] if getattr(pool, "mxfp8_sf_interleaved", False) else t.shape[0] // ps
        if rows <= 0 or (not getattr(pool, "mxfp8_sf_interleaved", False) and t.shape[0] % ps):
            return None
        page = t.view(torch.uint8).reshape(rows, -1)
        if page.shape[1] % 4:
            return None
        out.append(page)
    return out or None


@dataclass
class PageGroup:
    """Buffers that a transfer writes at the KV page ids: ``rows_per_page`` rows per page."""

    component: str  # "kv", "draft_kv", "indexer", "block_scale"
    buffers: list
    rows_per_page: int


def page_groups(pool, draft_pool=None) -> Optional[List[PageGroup]]:
    """Every buffer indexed by the KV page ids that the canary and the checksum stamp
    and digest: the target pool's KV, the draft model's KV (speculative decoding: same
    page ids), the DSA/NSA indexer keys (one row per page), MXFP8 block scales (one
    row per page). None without KV buffers."""
    kv = kv_buffers(pool) if pool is not None else None
    if kv is None:
        return None
    ps = int(pool.page_size)
    # 0-row placeholders (layers this rank does not hold: layer-split pools) hold no page
    groups = [PageGroup("kv", [b for b in kv if not _empty(b)], ps)]
    if draft_pool is not None:
        draft = kv_buffers(draft_pool)
        if draft is not None and int(getattr(draft_pool, "page_size", ps) or ps) == ps:
            groups.append(PageGroup("draft_kv", [b for b in draft if not _empty(b)], ps))
    idx = indexer_buffers(pool)
    if idx is not None:
        groups.append(PageGroup("indexer", idx, 1))
    scales = scale_buffers(pool)
    if scales is not None:
        groups.append(PageGroup("block_scale", scales, 1))
    return [g for g in groups if g.buffers]


def group_ptrs(groups: Optional[Sequence[PageGroup]], component: str) -> List[int]:
    for g in groups or ():
        if g.component == component:
            return _buf_ptrs(g.buffers)
    return []


def stamp_canary(groups: Sequence[PageGroup], pages: Sequence[int], room: int) -> None:
    """Stamp every listed page in every group with its canary (see ``kernels.stamp_canary``)."""
    from .. import kernels

    for g in groups:
        kernels.stamp_canary(g.buffers, pages, g.rows_per_page, room)


def unwritten(groups: Sequence[PageGroup], pages: Sequence[int], room: int) -> Dict[str, List[int]]:
    """component -> the listed pages that still hold their canary in every word of that
    component (never written since stamping); components with none are left out."""
    from .. import kernels

    out: Dict[str, List[int]] = {}
    for g in groups:
        counts = kernels.canary_counts(g.buffers, pages, g.rows_per_page, room).tolist()
        full = kernels.canary_full_count(g.buffers, g.rows_per_page)
        bad = [p for p, c in zip(pages, counts) if c == full]
        if bad:
            out[g.component] = bad
    return out


def digest(groups: Sequence[PageGroup], pages: Sequence[int], room: int) -> int:
    """64-bit digest of the listed pages over every group, bound to ``room`` and each
    page's position (``kernels.page_sums`` per group, one ``bind_digest``). With the
    KV group alone it equals ``kernels.digest_pages`` over the KV buffers."""
    import torch

    from .. import kernels

    sums = [kernels.page_sums(g.buffers, pages, g.rows_per_page) for g in groups]
    if not sums:  # nothing this rank holds at those page ids (see kv_layer_split): nothing to bind
        return 0
    sums = sums[0] if len(sums) == 1 else torch.cat([x.to(sums[0].device) for x in sums], dim=0)
    _, total = kernels.bind_digest(sums, int(room), pages)
    return int(total)


ALL_PAGE_GUARDS = (SOURCE_HOLD, DEST_HOLD, DEFERRED, GENERATION, CANARY, CHECKSUM)


def describe(kv_args, kv_pool, draft_pool=None) -> List[Component]:
    """The components of this node's transfers and each page guard's coverage of them."""
    registered = _ptrs(getattr(kv_args, "kv_data_ptrs", None))
    groups = page_groups(kv_pool, draft_pool) or []
    guarded = group_ptrs(groups, "kv")
    draft = []
    if draft_pool is not None:
        infos = getattr(draft_pool, "get_contiguous_buf_infos", None)
        draft = _ptrs(infos()[0]) if infos is not None else _buf_ptrs(kv_buffers(draft_pool) or [])
    stamped_draft = set(group_ptrs(groups, "draft_kv"))
    reg, grd, drf = set(registered), set(guarded), set(draft)
    comps: List[Component] = []

    target = [p for p in registered if p in grd]
    if target:
        short = _pages_not_token_rows(kv_pool)
        if short:
            why = (f"the pool's KV buffers hold {short} (e.g. ROCm's vectorized_5d layout), not one row per token "
                   "slot: kvguard addresses page p as rows p*page_size.. and would stamp and digest other pages")
            comps.append(Component("kv", len(target), {CANARY: why, CHECKSUM: why}))
        else:
            comps.append(Component("kv", len(target)))
    drafted = [p for p in registered if p in drf and p not in grd]
    if drafted:
        if all(p in stamped_draft for p in drafted):
            comps.append(Component("draft_kv", len(drafted),
                                   note="the target KV's page ids: stamped, digested, held and generation-tagged"))
        else:
            why = "the draft model's KV buffers are not per-layer page buffers kvguard stamps and digests"
            comps.append(Component("draft_kv", len(drafted), {CANARY: why, CHECKSUM: why}))
    unplaced = [p for p in registered if p not in grd and p not in drf]
    if unplaced:
        why = "registered KV buffers that are not the pool's per-layer page buffers kvguard stamps and digests"
        comps.append(Component("kv_unplaced", len(unplaced), {CANARY: why, CHECKSUM: why}))
    placeholders_kv = [b for b in kv_buffers(kv_pool) or () if _empty(b)]
    if placeholders_kv:
        why = (f"a layer-split pool ({type(kv_pool).__name__}): this rank holds {len(placeholders_kv)} layer(s) "
               "only as 0-row placeholders, so the KV prefill digests and the layers decode stamps are per rank "
               "and need not match; kvguard does not stamp or digest layer-split KV")
        comps.append(Component("kv_layer_split", len(placeholders_kv), {CANARY: why, CHECKSUM: why}))
    missing = [p for p in guarded + sorted(stamped_draft) if p not in reg]
    if missing:
        why = ("kvguard would stamp and digest per-layer buffers that the transfer does not carry "
               "(layer-split or other partial registration): every check would fail or raise")
        comps.append(Component("kv_unregistered", len(missing), {CANARY: why, CHECKSUM: why}))
    placeholders = {int(b.data_ptr()) for attr in ("index_k_with_scale_buffer", "k_scale_buffer", "v_scale_buffer")
                    for b in getattr(kv_pool, attr, None) or () if hasattr(b, "data_ptr") and _empty(b)}
    page_state = {"dsa": ("indexer", "the indexer's keys"), "nsa": ("indexer", "the indexer's keys"),
                  "block_scale": ("block_scale", "the KV's MXFP8 block scales")}
    # No registered KV buffer is the pool's own: the KV goes to another pool (HiSparse's
    # host pool on decode), so the page ids a reservation carries are that pool's.
    kv_elsewhere = bool(unplaced) and not target
    for name, ptrs in _state_groups(kv_args):
        live = [p for p in ptrs if p not in placeholders]
        group, what = page_state.get(name, (None, None))
        mine = group_ptrs(groups, group) if group else []
        if mine and set(live) == set(mine) and kv_elsewhere:
            why = (f"the KV this node transfers is registered from another pool ({len(unplaced)} buffer(s), e.g. "
                   f"HiSparse's host pool), so the page ids its transfers carry are that pool's: kvguard would "
                   f"stamp, digest, tag and hold {what} at ids that are not the rows written")
            # the deferred release holds the whole request, whose own pages carry these rows
            comps.append(Component(f"state:{name}", len(live), {g: why for g in ALL_PAGE_GUARDS if g != DEFERRED}))
            continue
        if mine and set(live) == set(mine):
            comps.append(Component(f"state:{name}", len(live),
                                   note=f"{what} at the KV page ids: stamped, digested, held at both ends and "
                                        "generation-tagged"))
            continue
        if group:
            why = (f"state component '{name}' is not laid out as one row per KV page that kvguard reads on every "
                   "registered buffer (pooled, sharded, partly registered or unreadable): its pages are neither "
                   "held, generation-tagged, canary-stamped nor digested")
        else:
            why = (f"state component '{name}' is written with its own indices: its pages are neither held, "
                   "generation-tagged, canary-stamped nor digested")
        comps.append(Component(f"state:{name}", len(ptrs), {g: why for g in ALL_PAGE_GUARDS}))
    sent = reg | {p for _, ptrs in _state_groups(kv_args) for p in ptrs}
    unsent = [name for name, b in _scale_tensors(kv_pool) if int(b.data_ptr()) not in sent]
    if unsent:
        why = (f"the pool keeps per-page KV scales ({', '.join(sorted(set(unsent)))}) that this node does not "
               "register with its transfer backend: a transfer moves the quantized KV without them, so decode "
               "reads scales it never received, and a canary or digest over them cannot match what was sent")
        comps.append(Component("scales_not_transferred", len(unsent), {CANARY: why, CHECKSUM: why}))
    wrong = misaddressed(kv_args, kv_pool, groups)
    if wrong:
        ptr, reg_len, page_len = wrong[0]
        why = (f"upstream registers {len(wrong)} buffer(s) with a transfer item length that is not one page of "
               f"the pool's layout (e.g. {reg_len} bytes registered where a page is {page_len} bytes): the "
               f"backend moves page p at byte p*item_length, so every transfer reads and writes outside the pages "
               f"the request owns, into pages of other requests that no page guard watches (seen on SGLang "
               f"0.5.13-0.5.15 with SGLANG_AITER_KV_CACHE_LAYOUT=vectorized_5d; way out: the nhd layout or "
               f"SGLang 0.5.16+)")
        comps.append(Component("kv_item_len", len(wrong), {g: why for g in ALL_PAGE_GUARDS}))
    aux = _ptrs(getattr(kv_args, "aux_data_ptrs", None))
    if aux:
        comps.append(Component("aux", len(aux), note="metadata rows: held with their pages; bound to the request by upstream's bootstrap_room check "
                                                   "(every release); other fields not digested"))
    return comps


def _page_bytes(groups: Sequence[PageGroup], kv_pool) -> Dict[int, int]:
    """data pointer -> bytes of one page in that buffer, as the pool lays it out (token
    rows: ``page_size`` rows; a buffer with fewer rows than slots: one row per page)."""
    size = int(getattr(kv_pool, "size", 0) or 0)
    out: Dict[int, int] = {}
    for g in groups:
        for b in g.buffers:
            if _empty(b) or not hasattr(b, "shape") or not b.dim():
                continue
            row = int(b[0].nbytes)
            rows = g.rows_per_page
            if g.component in ("kv", "draft_kv") and size and int(b.shape[0]) < size:
                rows = 1  # rows are pages (ROCm's vectorized_5d)
            out.setdefault(int(b.data_ptr()), row * rows)
    return out


def _registered_item_lens(kv_args) -> List[tuple]:
    """[(pointer, item length)] that upstream registered for what it sends at the KV page
    ids: the KV (target and draft) and the state components sent at KV page ids."""
    out = []
    ptrs, lens = _ptrs(getattr(kv_args, "kv_data_ptrs", None)), _ints(getattr(kv_args, "kv_item_lens", None))
    if len(ptrs) == len(lens):
        out += list(zip(ptrs, lens))
    sptrs = list(getattr(kv_args, "state_data_ptrs", None) or [])
    slens = list(getattr(kv_args, "state_item_lens", None) or [])
    types = getattr(kv_args, "state_types", None)
    if types is not None:  # 0.5.13+: one list per component
        for i, t in enumerate(types):
            if str(getattr(t, "value", t)) in PAGE_STATE_TYPES and i < len(sptrs) and i < len(slens):
                p, n = _ptrs(sptrs[i] if isinstance(sptrs[i], (list, tuple)) else [sptrs[i]]), _ints(slens[i])
                if len(p) == len(n):
                    out += list(zip(p, n))
    elif str(getattr(kv_args, "state_type", None) or "none") in PAGE_STATE_TYPES:
        p, n = _ptrs(sptrs), _ints(slens)
        if len(p) == len(n):
            out += list(zip(p, n))
    return out


def misaddressed(kv_args, kv_pool, groups: Sequence[PageGroup]) -> List[tuple]:
    """[(pointer, registered item length, page bytes)] of every buffer kvguard places in
    the pool whose registered transfer item length is not one page of its layout."""
    registered = _registered_item_lens(kv_args)
    if not registered:
        return []
    page = _page_bytes(groups, kv_pool)
    return [(p, n, page[p]) for p, n in registered if p in page and n and n != page[p]]


SCALE_ATTRS = ("k_scale_buffer", "v_scale_buffer", "kv_scale_buffer")


def _scale_tensors(pool) -> List[tuple]:
    """(attribute, tensor) of every non-empty per-layer KV scale buffer of ``pool``
    (MXFP8 / FP4 block scales of MHA, FP4 scales of MLA)."""
    out = []
    for attr in SCALE_ATTRS:
        value = getattr(pool, attr, None)
        if isinstance(value, (list, tuple)):
            out.extend((attr, b) for b in value if hasattr(b, "data_ptr") and not _empty(b))
    return out


def _pages_not_token_rows(pool) -> Optional[str]:
    """Why the pool's KV buffers are not one row per token slot (what kvguard's page
    addressing assumes), or None: a buffer with fewer rows than the pool has slots."""
    size = int(getattr(pool, "size", 0) or 0)
    for b in kv_buffers(pool) or ():
        if _empty(b) or not hasattr(b, "shape"):
            continue
        if size and int(b.shape[0]) < size:
            return f"{int(b.shape[0])} leading rows for {size} token slots"
    return None


def page_state_positions(kv_args) -> Optional[List[int]]:
    """Positions, in a chunk's ``state_indices``, of the components sent at KV page ids
    (the indexer's keys): a list of positions (0.5.13+: one index list per component),
    [-1] when the whole flat list is one such component (0.5.10-0.5.12), [] if none."""
    types = getattr(kv_args, "state_types", None)
    if types is not None:
        return [i for i, t in enumerate(types) if str(getattr(t, "value", t)) in PAGE_STATE_TYPES]
    name = str(getattr(kv_args, "state_type", None) or "none")
    return [-1] if name in PAGE_STATE_TYPES else []


def state_pages(state_indices, positions: Sequence[int]) -> List[int]:
    """KV page ids a chunk's state components read or write, from its ``state_indices``."""
    if state_indices is None or not positions:
        return []
    if list(positions) == [-1]:
        return _ints(state_indices)
    out: List[int] = []
    for i in positions:
        if i < len(state_indices) and state_indices[i] is not None:
            out.extend(_ints(state_indices[i]))
    return out


# What kvguard does with each kind of transferred component (``kvguard doctor``); the
# decision for a node is taken at its start-up from what it registered (describe()).
COVERAGE_RULES = (
    ("kv", "covered: the target pool's per-layer page buffers (MHA K/V, MLA latent KV)"),
    ("draft_kv", "covered: the draft model's per-layer page buffers (EAGLE / MTP), at the target KV's page ids"),
    ("state:dsa / state:nsa", "covered when the registered buffers are exactly the pool's DSA/NSA indexer rows, "
                              "one per KV page; otherwise (pooled or sharded index keys) refused by name"),
    ("state:block_scale", "covered when the registered buffers are exactly the pool's MXFP8 k/v scale buffers, "
                          "read one row per KV page; otherwise refused by name"),
    ("state:<other>", "refused by name (Mamba, SWA, SWA ring, SWA block scales, DSA tail, MiniMax index, "
                      "DeepSeek-V4 request state, ...): written at their own indices"),
    ("kv_layer_split", "refused for destination_canary and transfer_checksum (layer-split DSA pools)"),
    ("kv_unplaced / kv_unregistered", "refused for destination_canary and transfer_checksum: registered buffers "
                                      "kvguard does not stamp, or stamped buffers never registered"),
    ("scales_not_transferred", "refused for destination_canary and transfer_checksum: per-page KV scales (FP4 "
                               "MLA kv_scale_buffer, FP4 MHA k/v_scale_buffer) the node does not register"),
    ("kv_item_len", "refused for every page guard: a registered buffer whose transfer item length is not one "
                    "page of the pool's layout (the backend would move bytes outside the reserved pages; SGLang "
                    "0.5.13-0.5.15 vectorized_5d)"),
    ("aux", "metadata rows: held with their pages (prefill_source_hold, decode hold); bound to the request by "
            "upstream's bootstrap_room check (decode fails a row whose room is not the request's); other fields "
            "not digested"),
)


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

        from ..engine import metrics as m

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


def is_mooncake_manager(kv_manager) -> bool:
    """SGLang's own Mooncake manager (``mooncake`` and ``mooncake_tcp``), the transfer
    path kvguard's transfer guards hook; a subclass from another backend (Ascend's
    ``AscendKVManager``) replaces that path."""
    cls = type(kv_manager)
    return (any(c.__name__ == "MooncakeKVManager" for c in cls.__mro__)
            and cls.__module__.startswith("sglang.srt.disaggregation.mooncake"))
