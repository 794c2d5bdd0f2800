"""Bounded Mooncake transfer batches.

One Mooncake ``batch_transfer_sync`` call covering thousands of blocks holds every
block's pages on both sides for as long as the slowest block takes, and a failure
anywhere fails (and may half-write) the whole batch: the post-mortem recommends
bounded batches for every PD deployment. kvguard splits every batch that
``MooncakeKVManager`` hands to its engine (``_transfer_data``, the one sink of all
KV, state and auxiliary transfers in every release) into batches of at most
``--kvguard-max-transfer-batch`` blocks (default 1024), stopping at the first
failure. On 0.5.20+ it also turns on upstream's own knob
(``SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES``, 0 = off upstream) with the same
bound, unless the operator set a non-zero value.
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Dict

from ..engine.config import Flag, register_flag
from ..engine.guard import ACTIVE, OFF, Decision, Guard
from ..engine.targets import target

log = logging.getLogger("sglang_kvguard")

UPSTREAM_ENV = "SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES"


def _non_negative(value: str) -> int:
    n = int(value)
    if n < 0:
        raise ValueError("must be >= 0")
    return n


register_flag(
    Flag(
        "max_transfer_batch",
        "1024",
        "Most blocks one Mooncake batch transfer may carry (0 switches the bound off).",
        validate=_non_negative,
    )
)

TRANSFER_DATA = target(
    "mooncake.MooncakeKVManager._transfer_data",
    "sglang.srt.disaggregation.mooncake.conn:MooncakeKVManager._transfer_data",
    why="the single call into Mooncake's batch transfer",
)


def _bounded(limit: int) -> Callable[[Callable], Callable]:
    def factory(original: Callable) -> Callable:
        def _transfer_data(self, mooncake_session_id, transfer_blocks, *args, **kwargs):
            if not transfer_blocks or len(transfer_blocks) <= limit:
                return original(self, mooncake_session_id, transfer_blocks, *args, **kwargs)
            from ..engine import metrics

            blocks = list(transfer_blocks)
            metrics.count("split_batches")
            for start in range(0, len(blocks), limit):
                ret = original(self, mooncake_session_id, blocks[start : start + limit], *args, **kwargs)
                if ret != 0:
                    return ret
            return 0

        return _transfer_data

    return factory


class MooncakeBatchBoundGuard(Guard):
    name = "mooncake_batch_bound"
    suspendable = True  # hybrid_pool_check switches it off on a non-Mooncake transfer backend (warn)
    protects = "no Mooncake batch transfer carries more than N blocks"
    targets = (TRANSFER_DATA,)

    def decide(self, ctx) -> Decision:
        limit = int(ctx.config.get("max_transfer_batch"))
        if limit == 0:
            return Decision(OFF, "switched off by --kvguard-max-transfer-batch=0")
        ctx.require(TRANSFER_DATA.key)
        return Decision(ACTIVE, f"at most {limit} blocks per Mooncake batch", patches=(TRANSFER_DATA.key,))

    def wrappers(self, ctx) -> Dict[str, Callable[[Callable], Callable]]:
        return {TRANSFER_DATA.key: _bounded(int(ctx.config.get("max_transfer_batch")))}

    def on_installed(self, ctx) -> None:
        v = ctx.version
        if v is None or (v.major, v.minor, v.micro) < (0, 5, 20):
            return
        limit = ctx.config.get("max_transfer_batch")
        current = os.environ.get(UPSTREAM_ENV, "").strip()
        if current in ("", "0"):
            if current == "0":
                log.warning("%s=0 switches upstream's batch bound off; kvguard sets it to %s", UPSTREAM_ENV, limit)
            os.environ[UPSTREAM_ENV] = limit  # read when each MooncakeKVManager is created
