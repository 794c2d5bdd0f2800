"""An abort that overtakes its request still aborts it.

A gateway aborts a request on both PD nodes at once (``/abort_request`` with its rid)
while the router is still forwarding the request itself. Upstream's tokenizer manager
loses such an abort on every release (0.5.10-0.5.23):

* the rid is not known yet: ``abort_request`` returns without a word (one tokenizer
  worker, the default);
* the rid is known but the request is still being tokenized: the ``AbortReq`` is sent
  to the scheduler *ahead of* the request, and the scheduler, which finds no such
  request, drops it.

The request then arrives and runs. On a prefill node it waits in the bootstrap queue
for a decode that has already given the request up, until the bootstrap timeout
(300 s): the client behind the router waits that long for nothing (seen on 0.5.21 in
``test_abort_phases``: decode logged the handshake aborted, prefill answered the
abort with 200, never logged the rid and kept ``#bootstrap-req: 1``).

kvguard remembers, for 120 s, each abort whose request the scheduler has not been
sent yet. When a request with that rid is then sent to the scheduler
(``_send_one_request`` / ``_send_batch_request``), kvguard sends upstream's own
``AbortReq`` right behind it, once: the scheduler aborts it through upstream's paths
and the client gets upstream's abort answer at once. A later request reusing the rid
(a router retry) is not touched.

An abort for a rid that this node has already sent to its scheduler (within the same
120 s) and that is no longer known is *not* remembered: the request it names has
already ended here, and remembering it would abort the router's retry of that request
on this node alone (seen in CI on 0.5.19, ``test_abort_phases``: prefill ended the
first attempt, decode answered 500, the gateway's abort reached decode after that, and
decode aborted the retry while prefill kept its half in the bootstrap queue).
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections import OrderedDict
from typing import Callable, Dict

from ..engine.guard import ACTIVE, Decision, Guard
from ..engine.targets import target

log = logging.getLogger("sglang_kvguard")

ABORT_REQUEST = target(
    "tokenizer_manager.TokenizerManager.abort_request",
    "sglang.srt.managers.tokenizer_manager:TokenizerManager.abort_request",
    why="front door of /abort_request: an abort for a request not yet sent to the scheduler is remembered",
)
SEND_ONE = target(
    "tokenizer_manager.TokenizerManager._send_one_request",
    "sglang.srt.managers.tokenizer_manager:TokenizerManager._send_one_request",
    why="a request reaches the scheduler: a remembered abort follows it",
)
SEND_BATCH = target(
    "tokenizer_manager.TokenizerManager._send_batch_request",
    "sglang.srt.managers.tokenizer_manager:TokenizerManager._send_batch_request",
    why="a batch reaches the scheduler: remembered aborts follow it",
)

REMEMBER_FOR = 120.0  # seconds an early abort waits for its request
MAX_REMEMBERED = 10000
DISPATCHED = "_kvguard_dispatched"  # set on upstream's ReqState once its request was sent to the scheduler

_lock = threading.Lock()
_early: "OrderedDict[str, float]" = OrderedDict()  # rid -> monotonic time of the abort
_sent: "OrderedDict[str, float]" = OrderedDict()  # rid -> monotonic time it was sent to the scheduler


def remember(rid: str, now: float = None) -> None:
    now = time.monotonic() if now is None else now
    with _lock:
        _early.pop(rid, None)
        _early[rid] = now
        _expire(_early, now)


def take(rid: str, now: float = None):
    """The time of a remembered abort of ``rid`` (forgotten now), or None."""
    now = time.monotonic() if now is None else now
    with _lock:
        t = _early.pop(rid, None)
    if t is None or now - t > REMEMBER_FOR:
        return None
    return t


def _expire(table: "OrderedDict[str, float]", now: float) -> None:
    while table and (len(table) > MAX_REMEMBERED or now - next(iter(table.values())) > REMEMBER_FOR):
        table.popitem(last=False)


def sent(rid: str, now: float = None) -> None:
    """``rid`` was sent to this node's scheduler."""
    now = time.monotonic() if now is None else now
    with _lock:
        _sent.pop(rid, None)
        _sent[rid] = now
        _expire(_sent, now)


def ran_here(rid: str, now: float = None) -> bool:
    """Whether a request ``rid`` was sent to this node's scheduler within the window."""
    now = time.monotonic() if now is None else now
    with _lock:
        t = _sent.get(rid)
    return t is not None and now - t <= REMEMBER_FOR


def remembered() -> int:
    with _lock:
        return len(_early)


def reset() -> None:
    with _lock:
        _early.clear()
        _sent.clear()


def _abort_request(original: Callable) -> Callable:
    def abort_request(self, rid: str = "", abort_all: bool = False, *args, **kwargs):
        if rid and not abort_all:
            state = getattr(self, "rid_to_state", {}).get(rid)
            if state is None and ran_here(rid):
                log.info("kvguard abort_before_arrival: abort of rid=%s, a request that already ended on this "
                         "node; not remembered (a retry with that rid is not aborted here)", rid)
            elif state is None or not getattr(state, DISPATCHED, False):
                remember(rid)
        return original(self, rid, abort_all, *args, **kwargs)

    return abort_request


def _after_dispatch(tm, rids) -> None:
    for rid in rids:
        if rid is None:
            continue
        state = tm.rid_to_state.get(rid)
        if state is not None:
            setattr(state, DISPATCHED, True)
        sent(rid)
        t = take(rid)
        if t is None:
            continue
        from ..engine import metrics

        metrics.count("early_aborts_applied")
        log.warning("kvguard abort_before_arrival: request rid=%s reached the scheduler %.0f ms after its abort; "
                    "aborting it now", rid, (time.monotonic() - t) * 1000)
        if state is not None and getattr(state, "abort_sent", False):
            state.abort_sent = False  # 0.5.21+: upstream sent its abort ahead of the request, where it was lost
        tm.abort_request(rid)


def _rids(objs):
    return [getattr(o, "rid", None) for o in objs]


def _send(original: Callable, batch: bool) -> Callable:
    if inspect.iscoroutinefunction(original):  # 0.5.21+
        async def send(self, objs, *args, **kwargs):
            out = await original(self, objs, *args, **kwargs)
            _after_dispatch(self, _rids(objs if batch else [objs]))
            return out
    else:
        def send(self, objs, *args, **kwargs):
            out = original(self, objs, *args, **kwargs)
            _after_dispatch(self, _rids(objs if batch else [objs]))
            return out
    return send


class AbortBeforeArrivalGuard(Guard):
    name = "abort_before_arrival"
    protects = "an abort that arrives before its request is sent to the scheduler still aborts it"
    targets = (ABORT_REQUEST, SEND_ONE, SEND_BATCH)

    def decide(self, ctx) -> Decision:
        for t in self.targets:
            ctx.require(t.key)
        return Decision(ACTIVE, f"early aborts remembered for {REMEMBER_FOR:.0f} s",
                        patches=tuple(t.key for t in self.targets))

    def wrappers(self, ctx) -> Dict[str, Callable[[Callable], Callable]]:
        return {
            ABORT_REQUEST.key: _abort_request,
            SEND_ONE.key: lambda original: _send(original, batch=False),
            SEND_BATCH.key: lambda original: _send(original, batch=True),
        }
