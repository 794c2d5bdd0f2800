"""Decode destination pages are not freed while a prefill rank may still write them (0.5.21+).

When a decode request fails or is aborted mid-transfer, upstream up to 0.5.20 frees its
destination pages at once, while prefill ranks may still be writing into them
(docs/design/page-lifetime.md, hazards D1-D4): the late write lands in pages now owned
by another request. 0.5.21 made upstream's deferred release the default
(``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE``): the failed request keeps its
pages, request slot and metadata row until every prefill rank has acknowledged that
its transfer drained.

On 0.5.21+ kvguard checks that the mechanism is the reviewed code
(``DecodeTransferQueue._defer_release`` / ``resolve_deferred_releases``) and that it is
on. If an operator switched it off, ``--kvguard-deferred-release`` decides:

* ``enable`` (default): switch it back on in this process and its children (before any
  KV manager or transfer queue reads it);
* ``refuse``: the guard refuses (kvguard's ``--kvguard-on-unknown`` policy applies);
* ``allow``: leave it off, log a warning.

It must be on on prefill as well: the prefill's own setting decides whether its ABORT
acknowledgement waits for the drain (D6), so kvguard sets it on every node.

Not covered here: upstream's hold still ends after
``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT`` (30 s) with "releasing
anyway" (D5), and releases up to 0.5.20 have no usable hold; kvguard's own decode
hold is tracked in issue 3.
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Dict

from ..config import Flag, register_flag
from ..engine.guard import ACTIVE, OFF, REFUSED, UPSTREAM, Decision, Guard
from ..engine.targets import target

log = logging.getLogger("sglang_kvguard")

ENV = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"
POLICIES = ("enable", "refuse", "allow")

register_flag(
    Flag(
        "deferred_release",
        "enable",
        "SGLang 0.5.21+ when its deferred decode KV release has been switched off: 'enable' "
        "(default) switches it back on, 'refuse' refuses the guard, 'allow' leaves it off.",
        choices=POLICIES,
    )
)

DEFER = target(
    "disagg.decode.DecodeTransferQueue._defer_release",
    "sglang.srt.disaggregation.decode:DecodeTransferQueue._defer_release",
    why="decode: upstream's hold of a failed transfer's pages (checked, not patched)",
)
RESOLVE = target(
    "disagg.decode.DecodeTransferQueue.resolve_deferred_releases",
    "sglang.srt.disaggregation.decode:DecodeTransferQueue.resolve_deferred_releases",
    why="decode: upstream releases held pages once every prefill rank acked (checked, not patched)",
)

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def upstream_setting(default: bool) -> bool:
    """What upstream's ``EnvBool`` will read for the switch."""
    raw = os.environ.get(ENV)
    if raw is None or raw.strip() == "":
        return default
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    return default


class DecodeDeferredReleaseGuard(Guard):
    name = "decode_deferred_release"
    protects = "decode pages of a failed or aborted transfer stay held until every prefill rank has drained (0.5.21+)"
    targets = (DEFER, RESOLVE)

    def decide(self, ctx) -> Decision:
        v = ctx.version
        if v is None or v.release[:3] < (0, 5, 21) or not ctx.has(DEFER.key):
            return Decision(
                OFF,
                "this release frees decode pages of a failed transfer at once (0.5.19-0.5.20 only with the "
                f"experimental {ENV}=1); kvguard's own decode hold is not built yet",
            )
        ctx.require(DEFER.key)
        ctx.require(RESOLVE.key)
        if upstream_setting(default=True):
            return Decision(UPSTREAM, f"upstream's deferred decode KV release is on ({ENV})")
        policy = ctx.config.get("deferred_release")
        if policy == "enable":
            return Decision(ACTIVE, f"{ENV} was off: kvguard switches it back on", details={"enable": True})
        if policy == "refuse":
            return Decision(REFUSED, f"{ENV} is off: decode would free pages a prefill rank may still write")
        return Decision(OFF, f"{ENV} is off and --kvguard-deferred-release=allow leaves it off")

    def wrappers(self, ctx) -> Dict[str, Callable[[Callable], Callable]]:
        return {}

    def on_installed(self, ctx) -> None:
        if self.decide(ctx).details.get("enable"):
            log.warning("kvguard decode_deferred_release: %s was off; switching it on", ENV)
            os.environ[ENV] = "1"
