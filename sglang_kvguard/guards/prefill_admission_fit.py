"""Reject at validation a prompt that the prefill scheduler could never admit.

Every release validates a prompt against ``max_req_input_len`` (``min(context - 1,
pool - 1) - 5``), but the PD prefill scheduler's ``PrefillAdder.add_one_req`` admits a
request only while

    len(prompt) + 1 (prefill's max_new_tokens) + overhead  <  free + evictable tokens

where ``overhead`` is one page from 0.5.11 on (0.5.21+: ``per_req_token_overhead``, a
page per KV shard). A prompt between the two passes validation and then waits in the
prefill queue forever, even on an idle pool: the client never gets an answer, and
behind a router the decode half holds its reservation until its timeout. Measured on
0.5.19 and 0.5.23 (256-token pool, page 16): prompts of 239-249 tokens hang.

kvguard lowers the prefill scheduler's ``max_req_input_len`` at start-up to the
longest prompt an idle pool admits, ``pool - 1 - overhead``. Upstream's own
validation then answers such prompts with its usual 400 ("Input length (N tokens)
exceeds the maximum allowed length (M tokens)") at the prefill door, which the
``admission_drain`` and ``rejection_notice`` guards carry to the client. A prompt the
pool can hold is never refused: the bound is a necessary condition of admission on
every release, whatever else (Mamba or SWA state) the release adds to it.
"""

from __future__ import annotations

import logging
from typing import Callable, Dict, Optional

from ..engine.process import SCHEDULER_INIT, pd_role
from ..engine.guard import ACTIVE, Decision, Guard
from ..engine.targets import target

log = logging.getLogger("sglang_kvguard")

ADD_ONE_REQ = target(
    "schedule_policy.PrefillAdder.add_one_req",
    "sglang.srt.managers.schedule_policy:PrefillAdder.add_one_req",
    why="the admission formula the bound mirrors (checked, not patched)",
)


def admission_overhead(scheduler, page_overhead: bool) -> int:
    """Tokens ``add_one_req`` adds to a request's prompt beyond its one output token."""
    if not page_overhead:
        return 0
    page = int(getattr(scheduler, "page_size", 1) or 1)
    shards = 1
    try:  # 0.5.21+: one page per KV shard class
        from sglang.srt.managers import schedule_policy

        fn = getattr(schedule_policy, "page_interleave_shard_size", None)
        if fn is not None:
            shards = max(1, int(fn(scheduler.token_to_kv_pool_allocator)))
    except Exception as exc:  # noqa: BLE001 - fall back to one page: never over-reject
        log.debug("kvguard: page_interleave_shard_size unavailable: %s", exc)
    return page * shards


def longest_admissible(pool_tokens: int, overhead: int) -> int:
    """The ``max_req_input_len`` under which every accepted prompt fits an idle pool.

    Upstream rejects ``len >= max_req_input_len``; a prompt of ``len`` is admitted iff
    ``len + 1 + overhead < pool``, i.e. ``len <= pool - 2 - overhead``.
    """
    return pool_tokens - 1 - overhead


def fit_scheduler(scheduler, page_overhead: bool) -> Optional[int]:
    """Lower a prefill scheduler's ``max_req_input_len``; returns the new value if lowered."""
    from ..engine import metrics

    if pd_role(scheduler) != "prefill":
        return None
    pool = int(scheduler.max_total_num_tokens)
    overhead = admission_overhead(scheduler, page_overhead)
    fit = longest_admissible(pool, overhead)
    current = int(scheduler.max_req_input_len)
    if current <= fit:
        log.info(
            "kvguard prefill_admission_fit: prompts up to %d tokens are accepted and every one "
            "fits this prefill pool (%d tokens, %d overhead)", current - 1, pool, overhead,
        )
        return None
    log.warning(
        "kvguard prefill_admission_fit: this prefill scheduler admits only prompts of at most %d "
        "tokens (pool %d tokens - 1 output token - %d tokens of page overhead), but upstream would "
        "accept up to %d and leave the ones in between waiting forever; lowering the accepted "
        "prompt length to %d tokens so they get a 400 instead",
        fit - 1, pool, overhead, current - 1, fit - 1,
    )
    scheduler.max_req_input_len = fit
    metrics.count("prefill_limit_lowered", by=current - fit)
    return fit


def _scheduler_init(page_overhead: bool) -> Callable[[Callable], Callable]:
    def factory(original: Callable) -> Callable:
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            fit_scheduler(self, page_overhead)

        return __init__

    return factory


def _page_overhead(ctx) -> bool:
    """0.5.10 adds no page to the admission estimate; 0.5.11 and later do."""
    v = ctx.version
    return v is None or v.release[:3] >= (0, 5, 11)


class PrefillAdmissionFitGuard(Guard):
    name = "prefill_admission_fit"
    protects = "a prompt the prefill pool can never admit gets 400 at validation instead of waiting forever"
    targets = (SCHEDULER_INIT, ADD_ONE_REQ)

    def decide(self, ctx) -> Decision:
        ctx.require(SCHEDULER_INIT.key)
        ctx.require(ADD_ONE_REQ.key)  # a changed admission formula must be reviewed first
        page = _page_overhead(ctx)
        how = "bound: pool - 1 - page overhead" if page else "bound: pool - 1 (0.5.10 adds no page overhead)"
        return Decision(ACTIVE, how, patches=(SCHEDULER_INIT.key,), details={"page_overhead": page})

    def wrappers(self, ctx) -> Dict[str, Callable[[Callable], Callable]]:
        return {SCHEDULER_INIT.key: _scheduler_init(_page_overhead(ctx))}
