"""Refuse an empty prompt at the front door with 400, on every release.

0.5.23's tokenizer manager no longer rejects ``text=""`` (it only rejects ``None`` or an
empty list), so an empty text becomes a zero-token request. On the PD prefill node
that request reaches the model forward and the scheduler dies ("cannot reshape tensor
of 0 elements"), taking the whole node and every request on it down (server test,
0.5.23, CPU). Earlier releases answer 400 ("texts cannot be empty ...").

kvguard checks the tokenized prompt in ``TokenizerManager._validate_one_request``
(the front door of every request, single or batch, in every release) and raises
``ValueError``, which SGLang answers with HTTP 400 before anything is scheduled.
Multimodal requests are checked after their placeholders are expanded, so an
image-only prompt is not empty. Upstream's health checks send ``input_ids=[0]``.
"""

from __future__ import annotations

from typing import Callable, Dict

from ..engine.guard import ACTIVE, Decision, Guard
from .pool_capacity import TOKENIZER_VALIDATE

MESSAGE = "The prompt is empty (0 tokens): send at least one token."


def _validate(original: Callable) -> Callable:
    def _validate_one_request(self, obj, input_ids, *args, **kwargs):
        if input_ids is not None and len(input_ids) == 0:
            from ..engine import metrics

            metrics.count("empty_prompts_refused")
            raise ValueError(MESSAGE)
        return original(self, obj, input_ids, *args, **kwargs)

    return _validate_one_request


class EmptyPromptGuard(Guard):
    name = "empty_prompt"
    protects = "a zero-token prompt gets 400 at the front door instead of reaching the scheduler"
    targets = (TOKENIZER_VALIDATE,)

    def decide(self, ctx) -> Decision:
        ctx.require(TOKENIZER_VALIDATE.key)
        return Decision(ACTIVE, "checked in TokenizerManager._validate_one_request", patches=(TOKENIZER_VALIDATE.key,))

    def wrappers(self, ctx) -> Dict[str, Callable[[Callable], Callable]]:
        return {TOKENIZER_VALIDATE.key: _validate}
