"""An aborted request's rid is free again once its client has the abort.

When the scheduler aborts a request that is still queued (its waiting or grammar
queue: a client's ``/abort_request``, a disconnect), it sends an ``AbortReq`` back to
the tokenizer manager. Up to 0.5.12.post1, ``TokenizerManager._handle_abort_req``
hands the client the abort but never deletes the request's ``rid_to_state`` entry
(0.5.13 added the ``del``). The entry stays for the life of the server:

* a retry with the same rid (sglang-router retries a failed PD request with its rid on
  the same or another pair) is refused at the door, "Duplicate request IDs detected",
  400; its other half, already sent to the other node, then waits for a peer that
  never comes: on decode until its waiting timeout, after which the router retries
  into the same refusal, until the client gives up. Seen in the chaos soak on 0.5.10
  (session 15, ``kvguard-soak-0-32``: no answer in 90 s);
* one ``ReqState`` (the prompt, the output so far) leaks per such abort.

kvguard deletes the entry after upstream's ``_handle_abort_req`` has handed the abort
to the client's waiter (which holds the state itself), if it is still the same,
finished state: what 0.5.13+ do. On 0.5.13+ upstream has already deleted it, and the
wrapper does nothing.
"""

from __future__ import annotations

from typing import Callable, Dict

from ..engine.guard import ACTIVE, Decision, Guard
from ..engine.targets import target

HANDLE_ABORT = target(
    "tokenizer_manager.TokenizerManager._handle_abort_req",
    "sglang.srt.managers.tokenizer_manager:TokenizerManager._handle_abort_req",
    why="the scheduler's abort of a queued request reaches the client: its rid state is released",
)


def _handle_abort_req(original: Callable) -> Callable:
    def _handle_abort_req(self, recv_obj, *args, **kwargs):
        rid = getattr(recv_obj, "rid", None)
        table = getattr(self, "rid_to_state", None)
        state = table.get(rid) if (table is not None and rid is not None) else None
        out = original(self, recv_obj, *args, **kwargs)
        if state is not None and getattr(state, "finished", False) and table.get(rid) is state:
            del table[rid]
            from ..engine import metrics

            metrics.count("abort_states_released")
        return out

    return _handle_abort_req


class AbortStateReleaseGuard(Guard):
    name = "abort_state_release"
    protects = "a request aborted in the scheduler's queue frees its rid (a retry with the rid is not refused)"
    targets = (HANDLE_ABORT,)

    def decide(self, ctx) -> Decision:
        ctx.require(HANDLE_ABORT.key)
        return Decision(ACTIVE, "rid state released after TokenizerManager._handle_abort_req",
                        patches=(HANDLE_ABORT.key,))

    def wrappers(self, ctx) -> Dict[str, Callable[[Callable], Callable]]:
        return {HANDLE_ABORT.key: _handle_abort_req}
