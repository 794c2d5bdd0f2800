"""The incident's request through sglang-router, guarded: the client gets prefill's
own 400 with the original message within seconds (not 200, not a 500 after decode's
transfer timeout), and normal prompts keep working.

The pool check is relaxed to ``warn`` so that the mis-sized prefill node starts at
all (its default, ``refuse``, is tested in test_pool_check.py).
"""
from __future__ import annotations

import pytest

from server_tier import VOCAB
from sglang_kvguard.demo.tinymodel import prompt_of_tokens

pytestmark = pytest.mark.server

OVER = 600
RELAX = ["--kvguard-pool-policy", "warn"]


@pytest.fixture(scope="module")
def guarded(pd_factory):
    return pd_factory("guarded", launcher="sglang_kvguard.launch_server",
                      prefill_extra_args=RELAX, decode_extra_args=RELAX)


def test_over_capacity_prompt_gets_the_original_400_through_the_router(guarded):
    for offset in (17, 33):  # twice: nothing leaks or sticks between requests
        r = guarded.generate(prompt_of_tokens(OVER, vocab=VOCAB, offset=offset), max_new_tokens=8, timeout=60)
        assert r.status == 400, r
        assert f"Input length ({OVER} tokens) exceeds the maximum allowed length" in r.text, r.text
        assert r.elapsed < 10, r
    log = guarded.log_text("decode")
    assert "was rejected by prefill" in log


def test_fitting_prompts_still_work(guarded):
    r = guarded.generate(prompt_of_tokens(40, vocab=VOCAB), max_new_tokens=4)
    assert r.status == 200, r
    assert r.json["meta_info"]["prompt_tokens"] == 40
