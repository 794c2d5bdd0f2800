"""A transfer that covers less than decode reserved, through real servers and Mooncake.

The prefill node runs with ``--allow-auto-truncate`` and a shorter context (320)
than the decode node (1024), both with pools that hold their context: SGLang cuts a
600-token prompt to prefill's limit, computes and sends KV for the cut prompt, and
reports success. The decode node accepted and reserved all 600 tokens. Upstream (0.5.19 and 0.5.23 alike) commits the transfer and
decodes over the pages prefill never wrote: the client gets HTTP 200. With kvguard,
decode compares what prefill published with what it reserved and fails the request
closed with 500 and both numbers, before it can join a decode batch.
"""
from __future__ import annotations

import pytest

from server_tier import DECODE_POOL, VOCAB
from sglang_kvguard.demo.tinymodel import prompt_of_tokens

pytestmark = pytest.mark.server

OVER = 600
PREFILL_ARGS = ["--allow-auto-truncate", "--context-length", "320"]


def _start(pd_factory, name, **kw):
    return pd_factory(name, prefill_extra_args=PREFILL_ARGS, prefill_max_total_tokens=DECODE_POOL, **kw)


def test_unguarded_decode_answers_200_over_unwritten_pages(pd_factory):
    d = _start(pd_factory, "unguarded-truncate")
    r = d.generate(prompt_of_tokens(OVER, vocab=VOCAB), max_new_tokens=8, timeout=60)
    assert r.status == 200, r
    # decode believes it holds KV for the whole prompt; prefill sent far less
    assert r.json["meta_info"]["prompt_tokens"] == OVER
    assert "Truncated" in d.log_text("prefill")


def test_guarded_decode_fails_the_short_transfer_closed(pd_factory):
    d = _start(pd_factory, "guarded-truncate", launcher="sglang_kvguard.launch_server")
    r = d.generate(prompt_of_tokens(OVER, vocab=VOCAB, offset=5), max_new_tokens=8, timeout=60)
    assert r.status == 500, r
    assert "does not cover the reservation" in r.text, r.text
    assert f"decode reserved {OVER}" in r.text, r.text
    assert r.elapsed < 20, r
    log = d.log_text("decode")
    assert "failed closed" in log
    # prompts that fit are transferred, verified and answered
    for n in (1, 40, 200):
        ok = d.generate(prompt_of_tokens(n, vocab=VOCAB, offset=n), max_new_tokens=4, timeout=60)
        assert ok.status == 200, ok
        assert ok.json["meta_info"]["prompt_tokens"] == n
