"""Reject at validation a prompt that the decode node could never reserve pages for.

``DecodePreallocQueue.pop_preallocated`` reserves a request's pages only while

    len(prompt) + num_reserved_decode_tokens  <=  allocatable tokens

(``num_reserved_decode_tokens``: ``SGLANG_NUM_RESERVED_DECODE_TOKENS`` / server args,
512 by default; allocatable tokens are at most the pool, on an idle node). Every
release validates prompts only against ``max_req_input_len`` (``min(context - 1,
pool - 1) - 5``), so on a decode pool of P tokens a prompt longer than P - 512 passes
validation and then waits in the prealloc queue forever. Measured on 0.5.19, decode
pool 1024 = context 1024 (a correctly sized node): a 600-token prompt gets no answer
within 30 s, while prefill has long finished it.

kvguard lowers the decode scheduler's ``max_req_input_len`` at start-up to
``pool - num_reserved_decode_tokens + 1``: upstream's own validation then answers
longer prompts with its 400 ("Input length (N tokens) exceeds the maximum allowed
length (M tokens)"), drained at the decode door, which the router passes to the
client. The bound is a necessary condition of reservation on every release, so a
prompt an idle node could reserve is never refused (0.5.13+ round the prompt up to a
page on some paths; with a page-aligned pool and reserve that changes nothing).
"""

from __future__ import annotations

import logging
from typing import Callable, Dict, Optional

from ..engine.process import SCHEDULER_INIT, pd_role
from ..engine.guard import ACTIVE, Decision, Guard
from ..engine.targets import target

log = logging.getLogger("sglang_kvguard")

POP_PREALLOCATED = target(
    "disagg.decode.DecodePreallocQueue.pop_preallocated",
    "sglang.srt.disaggregation.decode:DecodePreallocQueue.pop_preallocated",
    why="the reservation test the bound mirrors (checked, not patched)",
)


def longest_reservable(pool_tokens: int, reserved_decode_tokens: int) -> int:
    """The ``max_req_input_len`` (upstream rejects ``len >=`` it) under which every
    accepted prompt can be reserved on an idle node: ``len + reserved <= pool``."""
    return pool_tokens - reserved_decode_tokens + 1


def fit_scheduler(scheduler) -> Optional[int]:
    """Lower a decode scheduler's ``max_req_input_len``; returns the new value if lowered."""
    from ..engine import metrics

    if pd_role(scheduler) != "decode":
        return None
    if getattr(scheduler, "enable_hisparse", False):
        log.info("kvguard decode_admission_fit: HiSparse decode admits from host memory; bound not applied")
        return None
    queue = getattr(scheduler, "disagg_decode_prealloc_queue", None)
    reserved = getattr(queue, "num_reserved_decode_tokens", None)
    if reserved is None:
        log.warning("kvguard decode_admission_fit: no prealloc queue reserve found; bound not applied")
        return None
    pool = int(scheduler.max_total_num_tokens)
    fit = longest_reservable(pool, int(reserved))
    current = int(scheduler.max_req_input_len)
    if current <= fit:
        log.info(
            "kvguard decode_admission_fit: prompts up to %d tokens are accepted and every one can be "
            "reserved on this decode pool (%d tokens, %d reserved for decoding)", current - 1, pool, reserved,
        )
        return None
    if fit < 2:
        log.error(
            "kvguard decode_admission_fit: this decode node can never reserve a request: its pool (%d "
            "tokens) is not larger than the %d tokens it reserves for decoding each request; every "
            "prompt will be rejected. Give it a larger pool or lower SGLANG_NUM_RESERVED_DECODE_TOKENS.",
            pool, reserved,
        )
        fit = 1
    else:
        log.warning(
            "kvguard decode_admission_fit: this decode node reserves a request only if its prompt plus %d "
            "tokens for decoding fit its pool (%d tokens), so it can take prompts of at most %d tokens, "
            "but upstream would accept up to %d and leave the ones in between waiting forever; lowering "
            "the accepted prompt length to %d tokens so they get a 400 instead",
            reserved, pool, fit - 1, current - 1, fit - 1,
        )
    scheduler.max_req_input_len = fit
    metrics.count("decode_limit_lowered", by=current - fit)
    return fit


def _scheduler_init(original: Callable) -> Callable:
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        fit_scheduler(self)

    return __init__


class DecodeAdmissionFitGuard(Guard):
    name = "decode_admission_fit"
    protects = "a prompt the decode node can never reserve pages for gets 400 at validation instead of waiting forever"
    targets = (SCHEDULER_INIT, POP_PREALLOCATED)

    def decide(self, ctx) -> Decision:
        ctx.require(SCHEDULER_INIT.key)
        ctx.require(POP_PREALLOCATED.key)  # a changed reservation test must be reviewed first
        return Decision(ACTIVE, "bound: pool - num_reserved_decode_tokens", patches=(SCHEDULER_INIT.key,))

    def wrappers(self, ctx) -> Dict[str, Callable[[Callable], Callable]]:
        return {SCHEDULER_INIT.key: _scheduler_init}
