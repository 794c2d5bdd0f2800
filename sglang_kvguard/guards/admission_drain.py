"""Rejection draining at the PD admission doors.

Stops the incident's engine half: a request the scheduler already rejected (an
over-length prompt swapped for a one-token stub, or one aborted by its client before
bootstrap) must not enter bootstrap, get a KV sender/receiver, a metadata slot or a
KV page. It is withdrawn at ``PrefillBootstrapQueue.add`` / ``DecodePreallocQueue.add``
with its original message and HTTP status.

0.5.21+ ships the same doors (``is_unadmitted_reject``): the guard reports
``upstream`` after checking both doors are the reviewed code. Older releases get
kvguard's doors.
"""

from __future__ import annotations

import logging
from typing import Callable, Dict

from ..engine.guard import ACTIVE, UPSTREAM, Decision, Guard
from ..engine.targets import target
from . import _req

log = logging.getLogger("sglang_kvguard")

PREFILL_DOOR = target(
    "disagg.prefill.PrefillBootstrapQueue.add",
    "sglang.srt.disaggregation.prefill:PrefillBootstrapQueue.add",
    why="prefill admission door",
)
DECODE_DOOR = target(
    "disagg.decode.DecodePreallocQueue.add",
    "sglang.srt.disaggregation.decode:DecodePreallocQueue.add",
    why="decode admission door",
)
UPSTREAM_PREDICATE = target(
    "disagg.utils.is_unadmitted_reject",
    "sglang.srt.disaggregation.utils:is_unadmitted_reject",
    why="upstream's door predicate (0.5.21+)",
)
UPSTREAM_RETIRE = target(
    "scheduler.Scheduler.retire_unadmitted_request",
    "sglang.srt.managers.scheduler:Scheduler.retire_unadmitted_request",
    why="upstream's door retirement (0.5.21+)",
)
FINISH_STATE = target(
    "schedule_batch.Req.update_finish_state",
    "sglang.srt.managers.schedule_batch:Req.update_finish_state",
    "sglang.srt.managers.schedule_batch:Req.check_finished",
    why="turns to_finish into finished_reason before the abort is streamed",
)
STREAM_OUTPUT = target(
    "scheduler.stream_output",
    "sglang.srt.managers.scheduler_components.output_streamer:SchedulerOutputStreamer.stream_output",
    "sglang.srt.managers.scheduler_output_processor_mixin:SchedulerOutputProcessorMixin.stream_output",
    why="delivers the abort (message and status) to the tokenizer manager",
)


# Called with (queue, req) when kvguard's prefill door drains a request (e.g. the
# rejection notice to decode); each hook must not raise.
DOOR_DRAIN_HOOKS: list = []
# The same for kvguard's decode door, called with (prealloc queue, req) (e.g. the
# rejection notice to prefill).
DECODE_DRAIN_HOOKS: list = []


def _run_hooks(hooks, queue, req) -> None:
    for hook in list(hooks):
        try:
            hook(queue, req)
        except Exception as exc:  # noqa: BLE001
            log.warning("door hook %s failed: %s", getattr(hook, "__name__", hook), exc)


def retire(scheduler, req) -> None:
    """Deliver a door rejection to the client (kvguard's retire_unadmitted_request)."""
    if hasattr(req, "update_finish_state"):
        req.update_finish_state()
    else:
        req.check_finished()
    streamer = getattr(scheduler, "output_streamer", None)
    stream = streamer.stream_output if streamer is not None else scheduler.stream_output
    stream([req], req.return_logprob)


def _log_drain(door: str, req) -> None:
    reason = _req.abort_reason(req)
    msg = getattr(reason, "message", reason)
    log.warning("drained rejected request rid=%s at the %s door: %s", getattr(req, "rid", "?"), door, msg)
    from ..engine import metrics

    metrics.count("drained_rejections", door=door)


def _prefill_door(original: Callable) -> Callable:
    def add(self, req, *args, **kwargs):
        if _req.is_unadmitted_reject(req):
            _log_drain("prefill", req)
            _run_hooks(DOOR_DRAIN_HOOKS, self, req)
            retire(self.scheduler, req)
            return None
        return original(self, req, *args, **kwargs)

    return add


def _decode_door(original: Callable) -> Callable:
    def add(self, req, *args, **kwargs):
        is_retracted = kwargs.get("is_retracted", args[0] if args else False)
        is_rebootstrap = kwargs.get("is_rebootstrap", args[1] if len(args) > 1 else False)
        if not is_retracted and not is_rebootstrap and _req.is_unadmitted_reject(req):
            _log_drain("decode", req)
            _run_hooks(DECODE_DRAIN_HOOKS, self, req)
            retire(self.scheduler, req)
            return None
        return original(self, req, *args, **kwargs)

    return add


class AdmissionDrainGuard(Guard):
    name = "admission_drain"
    protects = "rejected or client-aborted requests never reach bootstrap, KV allocation or transfer"
    targets = (PREFILL_DOOR, DECODE_DOOR, UPSTREAM_PREDICATE, UPSTREAM_RETIRE, FINISH_STATE, STREAM_OUTPUT)

    def decide(self, ctx) -> Decision:
        ctx.require(PREFILL_DOOR.key)
        ctx.require(DECODE_DOOR.key)
        if ctx.has(UPSTREAM_PREDICATE.key):
            # The doors' fingerprints are the reviewed 0.5.21+ code, which checks
            # is_unadmitted_reject first; verify the predicate and retirement too.
            ctx.require(UPSTREAM_PREDICATE.key)
            ctx.require(UPSTREAM_RETIRE.key)
            return Decision(UPSTREAM, "SGLang drains unadmitted rejections at both doors (is_unadmitted_reject)")
        ctx.require(FINISH_STATE.key)
        ctx.require(STREAM_OUTPUT.key)
        return Decision(ACTIVE, "kvguard doors on PrefillBootstrapQueue.add and DecodePreallocQueue.add",
                        patches=(PREFILL_DOOR.key, DECODE_DOOR.key))

    def wrappers(self, ctx) -> Dict[str, Callable[[Callable], Callable]]:
        return {PREFILL_DOOR.key: _prefill_door, DECODE_DOOR.key: _decode_door}
