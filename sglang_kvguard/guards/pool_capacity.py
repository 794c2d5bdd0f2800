"""Pool-vs-context check at start-up, on every prefill and decode node.

Stops the incident's configuration half: SGLang sizes the KV pool from the memory
left after loading weights and never compares it with the context it advertises;
prompts between the two are rejected inside the scheduler (the path that, in PD
mode, turned into other tenants' text). After each scheduler has sized its pool,
kvguard compares the tokens the pool holds with the context length:

* ``refuse`` (default): the scheduler exits with a message naming both numbers and
  the fix, so the node never serves;
* ``clamp``: the node's front door (the tokenizer manager) lowers the context it
  enforces to the longest prompt the pool admits, so a too-long prompt gets a 400
  before it reaches the scheduler;
* ``warn``: log only.

Non-PD nodes are only warned about (a plain node answers those prompts with an
error). A prefill pool under twice its context gets the post-mortem's advice as a
note. Upstream 0.5.23 logs a warning at start-up; nothing refuses.
"""

from __future__ import annotations

import logging
from typing import Callable, Dict

from ..engine.process import SCHEDULER_INIT, pd_role
from ..engine.config import Flag, register_flag
from ..engine.guard import ACTIVE, Decision, Guard
from ..engine.targets import target

log = logging.getLogger("sglang_kvguard")

POLICIES = ("refuse", "clamp", "warn")
register_flag(
    Flag(
        "pool_policy",
        "refuse",
        "What a prefill/decode node does when its KV pool holds fewer tokens than its context "
        "length: 'refuse' (default) stops the node, 'clamp' lowers the context its front door "
        "enforces so too-long prompts get a 400, 'warn' logs.",
        choices=POLICIES,
    )
)

TOKENIZER_VALIDATE = target(
    "tokenizer_manager.TokenizerManager._validate_one_request",
    "sglang.srt.managers.tokenizer_manager:TokenizerManager._validate_one_request",
    why="front-door length check (clamp policy)",
)

# SGLang: max_req_input_len = min(context_len - 1, pool - 1) - 5
_HEADROOM = 6


class PoolTooSmall(RuntimeError):
    """Raised from the scheduler's constructor.

    An ``Exception`` on purpose: SGLang's scheduler entry catches it, logs it and
    signals its launcher, which then takes the whole node down (exit non-zero). A
    ``SystemExit`` would end the scheduler silently and leave the launcher waiting.
    """


def _role(scheduler) -> str:
    return pd_role(scheduler) or "null"


def check_scheduler(scheduler, policy: str) -> str:
    """Compare the pool with the context; returns the outcome (ok/note/refuse/clamp/warn)."""
    from ..engine import metrics

    pool = int(scheduler.max_total_num_tokens)
    ctx = int(scheduler.model_config.context_len)
    limit = scheduler.max_req_input_len
    role = _role(scheduler)
    if pool < ctx:
        msg = (
            f"kvguard pool check: the {role} node's KV pool holds {pool} tokens, fewer than its "
            f"context length of {ctx} tokens (longest prompt it can admit: {limit} tokens). "
            f"Prompts between the two are rejected inside the scheduler, the path behind the "
            f"PD cross-request KV exposure. Fix: give the pool at least {ctx} tokens "
            f"(--mem-fraction-static, --max-total-tokens, fewer weights per GPU) or lower "
            f"--context-length to {limit}; --kvguard-pool-policy=clamp makes the node reject "
            f"longer prompts at its front door instead."
        )
        outcome = policy if role in ("prefill", "decode") else "warn"
        metrics.count("pool_check", outcome=outcome, role=role)
        metrics.set_pool_check(role, pool, ctx, outcome)
        if outcome == "refuse":
            log.error(msg)
            raise PoolTooSmall(msg)
        log.warning(msg + (f" Clamping the enforced context to {limit} tokens." if outcome == "clamp" else ""))
        return outcome
    metrics.set_pool_check(role, pool, ctx, "ok")
    if role == "prefill" and pool < 2 * ctx:
        log.info(
            "kvguard pool check: note: the prefill pool (%d tokens) is under twice the context (%d); "
            "the post-mortem sized prefill pools at about 2x the context so valid requests never "
            "come near the rejection path.", pool, ctx,
        )
        return "note"
    return "ok"


def _scheduler_init(policy: str) -> Callable[[Callable], Callable]:
    def factory(original: Callable) -> Callable:
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            check_scheduler(self, policy)

        return __init__

    return factory


def _clamp(original: Callable) -> Callable:
    def _validate_one_request(self, *args, **kwargs):
        if not getattr(self, "_kvguard_pool_clamped", False):
            limit = getattr(self, "max_req_input_len", None)
            if limit is not None:
                if limit < self.context_len - _HEADROOM:  # the pool, not the context, binds
                    log.warning(
                        "kvguard pool check (clamp): this node enforces a context of %d tokens "
                        "instead of %d: its KV pool admits prompts of at most that length",
                        limit, self.context_len,
                    )
                    self.context_len = limit
                self._kvguard_pool_clamped = True
        return original(self, *args, **kwargs)

    return _validate_one_request


class PoolCapacityGuard(Guard):
    name = "pool_capacity_check"
    protects = "a node whose KV pool is smaller than its context never serves (or enforces the smaller limit up front)"
    targets = (SCHEDULER_INIT, TOKENIZER_VALIDATE)

    def decide(self, ctx) -> Decision:
        policy = ctx.config.get("pool_policy")
        ctx.require(SCHEDULER_INIT.key)
        patches = [SCHEDULER_INIT.key]
        if policy == "clamp":
            ctx.require(TOKENIZER_VALIDATE.key)
            patches.append(TOKENIZER_VALIDATE.key)
        return Decision(ACTIVE, f"policy {policy}", patches=tuple(patches))

    def wrappers(self, ctx) -> Dict[str, Callable[[Callable], Callable]]:
        policy = ctx.config.get("pool_policy")
        return {SCHEDULER_INIT.key: _scheduler_init(policy), TOKENIZER_VALIDATE.key: _clamp}
