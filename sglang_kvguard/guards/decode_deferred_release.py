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

Upstream's hold ends after ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT``
(30 s) with "releasing anyway" (D5): the pages go back to the free list although a
prefill rank never confirmed its writes stopped (a frozen or partitioned prefill).
kvguard turns that into quarantine: ``_defer_release`` gets an infinite deadline, so
the request stays held until every rank's drain acknowledgement arrives; a hold
older than ``--kvguard-quarantine-after`` is reported quarantined (log line naming
room and pages, ``pages_quarantined{role="decode"}``, gauge
``kvguard_kv_quarantined_pages``) and is released, counted, if the drain is confirmed
later. Host-staged destinations (0.5.21+) are never timed out upstream either.

0.5.19-0.5.20 ship the same hold as an opt-in (off by default) that does not work
as shipped: nothing arms its drain-acknowledgement tracker
(``register_deferred_abort_room`` is never called), so every ack is dropped and every
hold ends in the timeout's blind release; and prefill does not ack a room it already
concluded while a chunk of it is still counted outstanding. Switched on with the
tracker armed by kvguard, holds were seen never to release under aborts on 0.5.19
(CI, tests/server/test_abort_phases.py). kvguard leaves these releases alone (state
``off``); its own decode hold for 0.5.10-0.5.20 is tracked in issue 3.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Dict, Optional, Tuple

from ..lifetime import peer_liveness
from ..engine.config import Flag, register_flag
from ..engine.guard import ACTIVE, OFF, REFUSED, Decision, Guard
from ..engine.targets import target
from ._req import committed_len

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
    why="decode: upstream's hold of a failed transfer's pages (deadline made infinite: quarantine, not blind release)",
)
RESOLVE = target(
    "disagg.decode.DecodeTransferQueue.resolve_deferred_releases",
    "sglang.srt.disaggregation.decode:DecodeTransferQueue.resolve_deferred_releases",
    why="decode: upstream releases held pages once every prefill rank acked (kvguard reports quarantine after it)",
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


# ----------------------------------------------------------------------------- quarantine instead of a blind release

SINCE = "_kvguard_deferred_since"  # on the transfer queue: id(decode_req) -> [held since, decode_req, quarantined]
_pages_lock = threading.Lock()
_pages = {"held": None, "quarantined": 0}  # this process's figures (None: nothing tracked yet)
_announced = {"done": False}


def deferred_pages() -> Optional[Tuple[int, int]]:
    """(held, quarantined) decode pages of failed transfers in this process, or None."""
    with _pages_lock:
        if _pages["held"] is None:
            return None
        return int(_pages["held"]), int(_pages["quarantined"])


def _page_count(queue, decode_req) -> int:
    req = decode_req.req
    ps = getattr(getattr(queue, "scheduler", None), "page_size", None) or getattr(
        getattr(queue, "tree_cache", None), "page_size", 1) or 1
    n = committed_len(req)
    if n is None:
        n = len(getattr(req, "origin_input_ids", ()) or ())
    return -(-n // int(ps))


def prefill_ranks(decode_req) -> list:
    """``host:port`` of the prefill ranks that write this request (dummy ranks excluded)."""
    from .decode_destination_hold import rank_addresses

    infos = getattr(getattr(decode_req, "kv_receiver", None), "bootstrap_infos", None) or ()
    return [f"{ip}:{port}" for ip, port in rank_addresses(infos)]


_gone_lock = threading.Lock()
_gone: Dict[int, set] = {}  # id(decode_req) -> its prefill ranks confirmed gone (peer_liveness thread)


def _watch_ranks(rec: list, decode_req) -> None:
    """A prefill rank that is gone writes nothing more: once every rank of the hold is
    gone, the hold counts as drained (``_drop_gone_ranks`` before upstream's resolve)."""
    key = id(decode_req)
    for rank in prefill_ranks(decode_req):
        def gone(rank=rank):
            with _gone_lock:
                _gone.setdefault(key, set()).add(rank)

        room = getattr(decode_req.req, "bootstrap_room", "?")
        rec[3].append(peer_liveness.watch().watch([rank], gone, what=f"room {room}"))


def _drop_gone_ranks(queue) -> None:
    """Holds whose prefill ranks are all gone need no more acks (``required_acks`` 0)."""
    if not _gone:
        return
    entries = getattr(queue, "_deferred_releases", None)
    if not entries:
        return
    from ..engine import metrics

    for i, entry in enumerate(list(entries)):
        decode_req = entry[0]
        with _gone_lock:
            gone = set(_gone.get(id(decode_req), ()))
        if not gone:
            continue
        try:
            ranks = prefill_ranks(decode_req)
        except Exception as exc:  # noqa: BLE001 - this hold stays; the others are still checked
            log.warning("kvguard decode_deferred_release: reading the prefill ranks of room %s failed: %s",
                        getattr(decode_req.req, "bootstrap_room", "?"), exc)
            continue
        if not gone or not ranks or not set(ranks) <= gone or entry[-1] == 0:
            continue
        entries[i] = tuple(entry[:-1]) + (0,)
        metrics.count("drain_ranks_gone", n=len(ranks))
        log.warning("kvguard decode_deferred_release: prefill rank(s) %s of room %s are gone; they count as drained",
                    ", ".join(ranks), getattr(decode_req.req, "bootstrap_room", "?"))


def _defer_release(original: Callable) -> Callable:
    def _defer_release(self, decode_req, *args, **kwargs):
        if self.__dict__.get("deferred_kv_release_timeout") != float("inf"):
            if not _announced["done"]:
                _announced["done"] = True
                log.info("kvguard decode_deferred_release: upstream's %s s blind release of held decode pages is "
                         "replaced by quarantine (held until every prefill rank confirms its drain)",
                         self.__dict__.get("deferred_kv_release_timeout"))
            self.deferred_kv_release_timeout = float("inf")
        since = self.__dict__.setdefault(SINCE, {})
        rec = since[id(decode_req)] = [time.monotonic(), decode_req, False, []]
        out = original(self, decode_req, *args, **kwargs)
        try:
            _watch_ranks(rec, decode_req)
        except Exception as exc:  # noqa: BLE001 - the hold stays, only the gone-peer release is lost
            log.warning("kvguard decode_deferred_release: watching the prefill ranks of room %s failed: %s",
                        getattr(decode_req.req, "bootstrap_room", "?"), exc)
        return out

    return _defer_release


def sweep(queue, quarantine_after: float, now: Optional[float] = None) -> None:
    """Report holds past the bound as quarantined, and holds that ended."""
    since = queue.__dict__.get(SINCE)
    if since is None:
        return
    from ..engine import metrics

    now = time.monotonic() if now is None else now
    held_ids = {id(entry[0]) for entry in getattr(queue, "_deferred_releases", ())}
    held = quarantined = 0
    for key, rec in list(since.items()):
        t0, decode_req, was_quarantined = rec[:3]
        room = getattr(decode_req.req, "bootstrap_room", None)
        n = _page_count(queue, decode_req)
        if key not in held_ids:
            del since[key]
            _forget(key, rec)
            if was_quarantined:
                log.warning("kvguard decode_deferred_release: room %s drained after %.0f s; its %d quarantined "
                            "page(s) are released", room, now - t0, n)
                metrics.count("pages_released_from_quarantine", n=n, role="decode")
            continue
        held += n
        if not was_quarantined and now - t0 >= quarantine_after:
            rec[2] = was_quarantined = True
            log.error("kvguard decode_deferred_release: room %s (rid=%s) has waited %.0f s for its prefill ranks to "
                      "confirm that their writes stopped; its %d page(s) are quarantined (kept out of the free list, "
                      "never freed blind; released if the drain is confirmed later)",
                      room, getattr(decode_req.req, "rid", "?"), now - t0, n)
            metrics.count("pages_quarantined", n=n, role="decode")
        if was_quarantined:
            quarantined += n
    with _pages_lock:
        _pages["held"], _pages["quarantined"] = held, quarantined


def _forget(key: int, rec: list) -> None:
    for entry in rec[3] if len(rec) > 3 else ():
        peer_liveness.watch().cancel(entry)
    with _gone_lock:
        _gone.pop(key, None)


def _resolve(quarantine_after: float) -> Callable[[Callable], Callable]:
    def factory(original: Callable) -> Callable:
        def resolve_deferred_releases(self, *args, **kwargs):
            try:
                _drop_gone_ranks(self)
            except Exception as exc:  # noqa: BLE001
                log.warning("kvguard decode_deferred_release: checking for gone prefill ranks failed: %s", exc)
            out = original(self, *args, **kwargs)
            try:
                sweep(self, quarantine_after)
            except Exception as exc:  # noqa: BLE001 - reporting must not break the decode loop
                log.warning("kvguard decode_deferred_release: quarantine sweep failed: %s", exc)
            return out

        return resolve_deferred_releases

    return factory


class DecodeDeferredReleaseGuard(Guard):
    name = "decode_deferred_release"
    suspendable = True  # hybrid_pool_check may switch it off on a node it cannot cover (warn)
    protects = ("decode pages of a failed or aborted transfer stay held until every prefill rank has drained, "
                "quarantined instead of released blind (0.5.21+)")
    targets = (DEFER, RESOLVE)

    def decide(self, ctx) -> Decision:
        v = ctx.version
        if v is None or v.release[:3] < (0, 5, 21) or not ctx.has(DEFER.key):
            return Decision(
                OFF,
                "this release frees decode pages of a failed transfer at once (0.5.19-0.5.20 only with an "
                f"experimental {ENV}=1 that never counts prefill's acks); kvguard's own hold there is "
                "decode_destination_hold",
            )
        ctx.require(DEFER.key)
        ctx.require(RESOLVE.key)
        patches = (DEFER.key, RESOLVE.key)
        if upstream_setting(default=True):
            return Decision(ACTIVE, f"upstream's deferred decode KV release is on ({ENV}); its timeout release is "
                            "replaced by quarantine", patches=patches)
        policy = ctx.config.get("deferred_release")
        if policy == "enable":
            return Decision(ACTIVE, f"{ENV} was off: kvguard switches it back on; its timeout release is replaced "
                            "by quarantine", patches=patches, details={"enable": True})
        if policy == "refuse":
            return Decision(REFUSED, f"{ENV} is off: decode would free pages a prefill rank may still write")
        return Decision(OFF, f"{ENV} is off and --kvguard-deferred-release=allow leaves it off")

    def wrappers(self, ctx) -> Dict[str, Callable[[Callable], Callable]]:
        q = float(ctx.config.get("quarantine_after"))
        peer_liveness.configure(float(ctx.config.get("peer_probe_interval")))
        return {DEFER.key: _defer_release, RESOLVE.key: _resolve(q)}

    def on_installed(self, ctx) -> None:
        if self.decide(ctx).details.get("enable"):
            log.warning("kvguard decode_deferred_release: %s was off; switching it on", ENV)
            os.environ[ENV] = "1"
