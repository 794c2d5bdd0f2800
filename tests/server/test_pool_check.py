"""pool_capacity_check on real servers: a node whose KV pool is smaller than its
context refuses to serve (default), or enforces the smaller limit at its front door.

Geometry of the incident (tests/server/server_tier.py): prefill pool 256 tokens,
context 1024, decode pool 2048.
"""
from __future__ import annotations

import pytest

from server_tier import CONTEXT_LENGTH, PREFILL_POOL, VOCAB
from sglang_kvguard.demo.deployment import DeploymentError
from sglang_kvguard.demo.tinymodel import prompt_of_tokens

pytestmark = pytest.mark.server

GUARDED = "sglang_kvguard.launch_server"


def test_refuse_stops_a_node_whose_pool_is_below_its_context(pd_factory):
    with pytest.raises(DeploymentError) as info:
        pd_factory("refuse", launcher=GUARDED)
    text = str(info.value)
    assert f"KV pool holds {PREFILL_POOL} tokens, fewer than its context length of {CONTEXT_LENGTH}" in text, text[-4000:]
    assert "--kvguard-pool-policy=clamp" in text


def test_clamp_turns_the_too_long_prompt_into_a_400_at_the_front_door(pd_factory):
    d = pd_factory(
        "clamp",
        launcher=GUARDED,
        prefill_extra_args=["--kvguard-pool-policy", "clamp"],
    )
    assert "Clamping the enforced context" in d.log_text("prefill")
    # the prefill node's own front door: 400 before the scheduler, in well under a second
    r = d.generate(prompt_of_tokens(600, vocab=VOCAB, offset=17), max_new_tokens=4, url=d.prefill_url, timeout=30)
    assert r.status == 400, r
    assert "600 tokens" in r.text and "context length" in r.text, r.text
    assert r.elapsed < 5
    # a prompt that fits still works end to end
    ok = d.generate(prompt_of_tokens(40, vocab=VOCAB), max_new_tokens=4)
    assert ok.status == 200, ok
