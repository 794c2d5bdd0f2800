"""Start-up check that the page guards cover this node's KV pool; fail closed if not.

kvguard's page guards understand one kind of pool: an MHA or MLA token pool with
per-layer page buffers, handed out by SGLang's plain token or paged allocator, with
no per-request state beside the KV pages. Hybrid models get other pools, each with
its own free paths and transferred state:

* SWA models (``SWATokenToKVPoolAllocator`` and its unified / pure variants): two
  page spaces, and window pages freed mid-request (``free_swa``);
* Mamba / linear-attention models (``HybridReqToTokenPool``): a state slot per
  request that the transfer also writes;
* hisparse, page-interleave, DeepSeek-V4 and other allocators with their own sinks;
* page layouts across ranks that kvguard has not verified (``layout_gaps``: decode
  context parallelism, KV cache sharding, context-parallel transfers), for the guards
  that read or count page contents (``LAYOUT_GUARDS``).

kvguard does not tag, hold or stamp those. Serving such a model with the guards
"active" would claim a protection the node does not have, so after each PD
scheduler has built its pools kvguard compares them with what the active page
guards cover:

* ``refuse`` (default): the scheduler stops with a message naming the pool, each
  guard that would not cover it and why, and the two ways to go on;
* ``warn``: log the same and serve with those guards suspended in this scheduler
  process (engine/suspension.py: their wrappers pass straight through to SGLang; a
  guard aimed at a pool it does not cover could otherwise write into it).

Switching the named guards off (``--kvguard-disable``) also lets the node start; the
banner and metrics then say ``off`` for them. Non-PD nodes are not checked (the page
guards act on PD transfers only).
"""

from __future__ import annotations

import logging
from typing import Callable, Dict, List, Optional, Tuple

from ..engine.process import SCHEDULER_INIT, pd_role
from ..lifetime.transfer_components import is_mooncake_manager
from ..engine.config import Flag, register_flag
from ..engine.guard import ACTIVE, Decision, Guard

log = logging.getLogger("sglang_kvguard")

POLICIES = ("refuse", "warn")
register_flag(
    Flag(
        "hybrid_pool",
        "refuse",
        "What a prefill/decode node does when its KV pool is one kvguard's page guards do not "
        "cover (hybrid SWA / Mamba / hisparse / interleaved pools): 'refuse' (default) stops the "
        "node, 'warn' logs and serves with those guards suspended on this node (not run at all).",
        choices=POLICIES,
    )
)

PLAIN_ALLOCATORS = ("TokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator")

# gap -> the page guards it defeats, per role
ALLOCATOR, STATE, BUFFERS = "allocator", "state", "buffers"
AFFECTED: Dict[str, Dict[str, Tuple[str, ...]]] = {
    # a non-plain allocator also maps the page ids a transfer carries onto rows its own
    # way (page interleave, HiSparse): the canary and the checksum would read other rows
    "prefill": {
        ALLOCATOR: ("prefill_source_hold", "transfer_checksum"),
        STATE: ("prefill_source_hold",),
        BUFFERS: ("transfer_checksum",),
    },
    "decode": {
        ALLOCATOR: ("page_generation", "decode_destination_hold", "destination_canary", "transfer_checksum"),
        STATE: ("decode_destination_hold",),
        BUFFERS: ("destination_canary", "transfer_checksum"),
    },
}


# The guards that read or count a transferred page's content, per role: these assume
# that a page goes whole from one prefill rank to the matching decode rank (layout_gaps).
# Holds, generation tags and deferred release act on page ids and are layout-free.
LAYOUT_GUARDS: Dict[str, Tuple[str, ...]] = {
    "prefill": ("transfer_checksum",),
    "decode": ("destination_canary", "transfer_checksum", "transfer_coverage"),
}


class HybridPoolUnguarded(RuntimeError):
    """Raised from the scheduler's constructor (like pool_capacity_check's refusal:
    SGLang's scheduler entry logs it and the launcher sees the node die)."""


def pool_gaps(allocator, req_to_token_pool) -> List[Tuple[str, str]]:
    """``(gap, why)`` for each part of this node's pools the page guards do not cover."""
    from .destination_canary import kv_buffers

    gaps = []
    name = type(allocator).__name__
    if name not in PLAIN_ALLOCATORS:
        gaps.append((ALLOCATOR, f"its allocator {name} is not SGLang's plain token or paged allocator: its own "
                                "alloc/free paths are neither tagged nor held"))
    mros = {c.__name__ for c in type(req_to_token_pool).__mro__}
    if "HybridReqToTokenPool" in mros or getattr(req_to_token_pool, "mamba_pool", None) is not None:
        gaps.append((STATE, f"its request pool {type(req_to_token_pool).__name__} carries per-request state "
                            "slots (Mamba / linear attention) that a transfer writes and kvguard does not hold"))
    kv = allocator.get_kvcache() if hasattr(allocator, "get_kvcache") else None
    if kv is None or kv_buffers(kv) is None:
        gaps.append((BUFFERS, f"its KV pool {type(kv).__name__} has no per-layer page buffers kvguard can "
                              "stamp or checksum"))
    return gaps


# Releases whose deferred release of a failed decode transfer keeps a HiSparse
# request's host pages (the KV destination) until the deferral ends: there
# DecodeTransferQueue._release_request, which the deferred path calls, frees them
# (hisparse_coordinator.request_finished). Read in the wheels: 0.5.21 and 0.5.22 free
# them in pop_transferred's failure branch BEFORE deciding to defer, so the hold keeps
# the logical pages while a late prefill write lands in host pages already free. A
# release not listed here (older or newer) is not trusted with it.
HISPARSE_HOST_PAGES_DEFERRED = ("0.5.23",)


def is_hisparse(allocator) -> bool:
    return "HiSparse" in type(allocator).__name__ or hasattr(allocator, "hisparse_attn_allocator")


def hisparse_gaps(role: str, comps, release: Optional[str]):
    """What a HiSparse allocator takes from the page guards' coverage, beyond its own
    allocator gap:

    * every KV component: HiSparse maps the logical page ids a transfer carries onto
      device slots (``full_to_hisparse_device_index_mapping``), so stamping or digesting
      the pool at those ids reads other rows (upstream runs HiSparse on decode only, but
      does not stop a prefill started with it);
    * decode: the host pool's KV (``kv_unplaced``) is not kept by decode_deferred_release
      unless the release's deferral keeps the host pages (HISPARSE_HOST_PAGES_DEFERRED).
    """
    from ..lifetime.transfer_components import CANARY, CHECKSUM, DEFERRED

    mapped = ("HiSparse maps the logical page ids a transfer carries onto device slots, so the pool's rows at "
              "those ids are not the ones written or sent")
    deferred = (f"HiSparse decode: SGLang {release or '?'} frees a failed transfer's host pages (where the KV "
                "lands) before its deferred release starts (DecodeTransferQueue.pop_transferred), so holding the "
                "request does not keep them")
    for c in comps:
        if c.name in ("kv", "draft_kv"):
            c.gaps.setdefault(CANARY, mapped)
            c.gaps.setdefault(CHECKSUM, mapped)
        if role == "decode" and c.name == "kv_unplaced" and release not in HISPARSE_HOST_PAGES_DEFERRED:
            c.gaps.setdefault(DEFERRED, deferred)
    return comps


def active_guards() -> Optional[set]:
    """Names of the installed guards that are active; None before kvguard is installed."""
    from ..engine.runtime import installed_report
    from .decode_destination_hold import SEND_METADATA

    report = installed_report()
    if report is None:
        return None
    from ..engine import suspension

    out = set()
    for g in report.guards:
        if g.state != ACTIVE or suspension.is_suspended(g.name):
            continue
        if g.name == "decode_destination_hold" and SEND_METADATA.key not in g.patches:
            continue  # 0.5.21+: it only answers drain requests on prefill; decode's hold is upstream's
        out.add(g.name)
    return out


_NO_KV_ARGS = object()


def layout_gaps(server_args, kv_manager) -> List[str]:
    """Why this node's KV pages are laid out across ranks in a way kvguard has not
    verified its page guards on (one reason per layout; empty for the plain one).

    kvguard stamps, digests, tags and holds whole pages at the page ids a transfer
    carries, with each prefill rank's page going whole to the matching decode rank.
    These layouts break that assumption and have never run under kvguard (they need
    several GPUs), so the node refuses rather than calling them covered:

    * decode context parallelism (``--dcp-size`` / ``--decode-context-parallel-size``,
      0.5.16+; the transfer backend relayouts a DCP-1 prefill's MLA pages token by
      token across the decode's DCP ranks from 0.5.17);
    * KV cache sharding (``--enable-kv-cache-sharding``, 0.5.23: no rank holds a whole
      page, every rank sends its share);
    * a context-parallel prefill whose every CP rank sends its shard of the KV
      (``enable_all_cp_ranks_for_transfer`` with ``attn_cp_size`` > 1)."""
    whys = []
    dcp = max(int(getattr(server_args, "dcp_size", 1) or 1), int(getattr(kv_manager, "dcp_size", 1) or 1))
    if dcp > 1:
        whys.append(f"decode context parallelism (DCP size {dcp}) spreads each page's tokens over {dcp} ranks, "
                    "and the transfer relayouts a DCP-1 prefill's pages token by token: kvguard has not verified "
                    "its per-page stamps, digests, tags and holds on that layout")
    shard = int(getattr(kv_manager, "kv_shard_size", 1) or 1)
    if shard > 1 or getattr(server_args, "enable_kv_cache_sharding", False):
        whys.append(f"KV cache sharding (shard size {shard if shard > 1 else '>1'}): no rank holds a whole page and "
                    "every rank sends its share; kvguard has not verified its page guards on that layout")
    cp = int(getattr(kv_manager, "attn_cp_size", 1) or 1)
    if cp > 1 and getattr(kv_manager, "enable_all_cp_ranks_for_transfer", False):
        whys.append(f"context-parallel transfer (attention CP size {cp}, every CP rank sends its shard of the KV): "
                    "kvguard has not verified its page guards on that layout")
    return whys


# Guards whose protection of a role's transfers rests on Mooncake's own transfer path
# (its transfer worker, bootstrap thread, receiver and aux messages), or has only ever
# been verified on it: on any other transfer backend (NIXL, Ascend, Mori) they
# would report active over transfers they do not see (backend_gaps). SGLang's ``fake``
# test backend moves nothing and is not a gap.
MOONCAKE_GUARDS: Dict[str, Tuple[str, ...]] = {
    "prefill": ("prefill_source_hold", "transfer_checksum", "rejection_notice", "decode_rejection_notice",
                "mooncake_batch_bound"),
    "decode": ("page_generation", "decode_destination_hold", "decode_deferred_release", "destination_canary",
               "transfer_checksum", "transfer_coverage", "rejection_notice", "decode_rejection_notice"),
}


def backend_gaps(server_args, kv_manager) -> List[str]:
    """Why this node's transfer backend is not one kvguard's transfer-path guards run on
    (empty for Mooncake, or when the node has no PD transfer manager to read). SGLang's
    ``fake`` backend (a test backend) transfers nothing, so no transfer-path guard has
    a transfer to miss; the content guards hook its receiver explicitly."""
    if kv_manager is None or is_mooncake_manager(kv_manager):
        return []
    if any(c.__name__ == "FakeKVManager" for c in type(kv_manager).__mro__):
        return []
    backend = getattr(server_args, "disaggregation_transfer_backend", None) or "?"
    return [f"the transfer backend is {backend} ({type(kv_manager).__name__}): kvguard's transfer-path guards "
            "patch and have been verified on Mooncake's transfer path only, so on this backend they would not see "
            "the transfers they report protecting"]


def scheduler_backend_gaps(scheduler) -> List[str]:
    return backend_gaps(getattr(scheduler, "server_args", None), getattr(_pd_queue(scheduler), "kv_manager", None))


def _pd_queue(scheduler):
    queue = None
    for attr in ("disagg_prefill_bootstrap_queue", "disagg_decode_prealloc_queue"):  # one exists per PD role
        queue = queue or getattr(scheduler, attr, None)
    return queue


def transfer_kv_args(scheduler):
    """(KVArgs, draft pool) that this PD scheduler's queue registered with its transfer backend."""
    queue = _pd_queue(scheduler)
    kv_args = getattr(getattr(queue, "kv_manager", None), "kv_args", None)
    return kv_args, getattr(queue, "draft_token_to_kv_pool", None)


def scheduler_layout_gaps(scheduler) -> List[str]:
    return layout_gaps(getattr(scheduler, "server_args", None), getattr(_pd_queue(scheduler), "kv_manager", None))


def check_pools(role: str, allocator, req_to_token_pool, policy: str, active: Optional[set] = None,
                kv_args=_NO_KV_ARGS, draft_pool=None, layout: Tuple[str, ...] = (),
                backend: Tuple[str, ...] = ()) -> str:
    """Compare the node's pools, and every component its transfers move (``kv_args``: what
    upstream registered with the transfer backend), with the active page guards;
    returns ok/refuse/warn."""
    from ..engine import metrics
    from ..lifetime import transfer_components

    if role not in AFFECTED:
        return "ok"
    active = active_guards() if active is None else active
    hit: Dict[str, List[str]] = {}

    def gap(why: str, guards) -> None:  # each active guard of ``guards`` misses ``why``
        for guard in guards:
            if active is None or guard in active:
                hit.setdefault(guard, []).append(why)

    for kind, why in pool_gaps(allocator, req_to_token_pool):
        gap(why, AFFECTED[role][kind])
    for why in layout:
        gap(why, LAYOUT_GUARDS[role])
    for why in backend:
        gap(why, MOONCAKE_GUARDS[role])
    kv = allocator.get_kvcache() if hasattr(allocator, "get_kvcache") else None
    comps = []
    if kv_args is None:  # a PD node whose transfer registration cannot be read: nothing can be called covered
        gap("what this node registered with its transfer backend (the KV manager's KVArgs) could not be read",
            transfer_components.PAGE_GUARDS[role])
    elif kv_args is not _NO_KV_ARGS:
        comps = transfer_components.describe(kv_args, kv, draft_pool)
        if is_hisparse(allocator):
            from ..engine.runtime import sglang_release

            comps = hisparse_gaps(role, comps, sglang_release())
        for guard, whys in transfer_components.gaps_for(role, comps, active).items():
            hit.setdefault(guard, []).extend(whys)
        transfer_components.record_metrics(role, comps, active)
    moved = f"; transferred: {transfer_components.summary(role, comps, active)}" if comps else ""
    if not hit:
        metrics.count("hybrid_pool_check", outcome="ok", role=role)
        log.info("kvguard hybrid pool check: the %s node's pool (%s over %s, %s) is one the page guards cover%s",
                 role, type(allocator).__name__, type(kv).__name__, type(req_to_token_pool).__name__, moved)
        return "ok"
    names = sorted(hit)
    lines = [f"  - {g}: " + "; ".join(hit[g]) for g in names]
    msg = (
        f"kvguard hybrid pool check: the {role} node's KV pool ({type(kv).__name__}) or a component its PD "
        f"transfers move is not one kvguard's page guards cover, so these active guards would not protect "
        f"it:\n" + "\n".join(lines) + "\n"
        f"kvguard covers the per-layer KV pages of MHA/MLA pools with SGLang's plain token or paged allocator"
        f"{moved}. To serve this model anyway, switch those guards off (--kvguard-disable {','.join(names)}; "
        f"reported 'off') or accept the gap with --kvguard-hybrid-pool=warn (they are then suspended on this node)."
    )
    outcome = "refuse" if policy == "refuse" else "warn"
    metrics.count("hybrid_pool_check", outcome=outcome, role=role)
    if outcome == "refuse":
        log.error(msg)
        raise HybridPoolUnguarded(msg)
    log.warning(msg)
    # Accepted with warn: the named guards do not run on this node at all (aimed at a pool
    # they do not cover, their wrappers could write into it, e.g. canaries stamped at
    # HiSparse host page ids into the device pool).
    from ..engine import suspension

    for guard in sorted(suspension.suspend(names)):
        metrics.count("guard_suspended", guard=guard, role=role)
        metrics.set_guard_state(guard, "off")  # kvguard_guard_state says what runs here
    log.warning("kvguard hybrid pool check: suspended on this %s node (each call goes straight to SGLang): %s",
                role, ", ".join(names))
    return outcome


def _scheduler_init(policy: str) -> Callable[[Callable], Callable]:
    def factory(original: Callable) -> Callable:
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            role = pd_role(self)
            if role not in AFFECTED:
                return
            kv_args, draft = transfer_kv_args(self)
            check_pools(role, self.token_to_kv_pool_allocator, self.req_to_token_pool, policy,
                        kv_args=kv_args, draft_pool=draft, layout=tuple(scheduler_layout_gaps(self)),
                        backend=tuple(scheduler_backend_gaps(self)))

        return __init__

    return factory


class HybridPoolCheckGuard(Guard):
    name = "hybrid_pool_check"
    protects = "a node whose KV pool the page guards do not cover (hybrid SWA / Mamba / hisparse) never serves as if guarded"
    targets = (SCHEDULER_INIT,)

    def decide(self, ctx) -> Decision:
        ctx.require(SCHEDULER_INIT.key)
        return Decision(ACTIVE, f"policy {ctx.config.get('hybrid_pool')}", patches=(SCHEDULER_INIT.key,))

    def wrappers(self, ctx) -> Dict[str, Callable[[Callable], Callable]]:
        return {SCHEDULER_INIT.key: _scheduler_init(ctx.config.get("hybrid_pool"))}
