"""The 400 for an over-long prompt names the longest prompt the node accepts.

Every release rejects a prompt of ``len >= max_req_input_len`` with "Input length
(N tokens) exceeds the maximum allowed length (max_req_input_len tokens)": the
number it names is one more than the longest prompt it accepts. A 495-token prompt
on a node that accepts at most 494 is told that 495 is allowed, and a client that
trims to the number it was given is refused again. (kvguard's admission-fit guards
lower ``max_req_input_len`` on PD nodes, which makes the wrong number easy to meet.)

kvguard rewrites that one number in upstream's message (``validate_input_length``,
the scheduler's check) to ``max_req_input_len - 1``; the rest of the text, the status
(400) and the decision are upstream's.
"""

from __future__ import annotations

from typing import Callable, Dict

from ..engine.guard import ACTIVE, Decision, Guard
from ..engine.targets import target

VALIDATE_INPUT_LENGTH = target(
    "managers.utils.validate_input_length",
    "sglang.srt.managers.utils:validate_input_length",
    why="the scheduler's prompt length check and its 400 message",
)


def corrected(message, max_req_input_len) -> str:
    if not isinstance(message, str):
        return message
    try:
        limit = int(max_req_input_len)
    except (TypeError, ValueError):
        return message
    wrong = f"the maximum allowed length ({limit} tokens)"
    if wrong not in message:
        return message
    return message.replace(wrong, f"the maximum allowed length ({max(limit - 1, 0)} tokens)", 1)


def _validate(original: Callable) -> Callable:
    def validate_input_length(req, max_req_input_len, *args, **kwargs):
        return corrected(original(req, max_req_input_len, *args, **kwargs), max_req_input_len)

    return validate_input_length


class InputLimitMessageGuard(Guard):
    name = "input_limit_message"
    protects = "the 400 for an over-long prompt names the longest prompt the node accepts, not one more"
    targets = (VALIDATE_INPUT_LENGTH,)

    def decide(self, ctx) -> Decision:
        ctx.require(VALIDATE_INPUT_LENGTH.key)
        return Decision(ACTIVE, "limit in the message: max_req_input_len - 1", patches=(VALIDATE_INPUT_LENGTH.key,))

    def wrappers(self, ctx) -> Dict[str, Callable[[Callable], Callable]]:
        return {VALIDATE_INPUT_LENGTH.key: _validate}
