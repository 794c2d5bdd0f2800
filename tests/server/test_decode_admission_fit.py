"""A prompt the decode node can never reserve pages for (issue: admission guards).

Geometry: context 1024 on both nodes, decode pool 1024 (a correctly sized node:
pool = context, so the pool check passes), prefill pool 2048. Upstream's decode accepts
prompts up to 1017 tokens, but ``DecodePreallocQueue`` reserves a request only when
``len + num_reserved_decode_tokens (512) <= free tokens``, so prompts of 513..1017
tokens are accepted and then never reserved.

* unguarded (0.5.19): a 600-token prompt gets no answer within 30 s; a short prompt
  sent after it is still served;
* guarded (every server-tier release): kvguard's decode_admission_fit lowers decode's
  accepted length to 513, so 512 tokens get 200 and 513 / 600 tokens get upstream's
  400 with the original message; decode answers at once and keeps nothing, and its
  decode_rejection_notice tells prefill, so the client of sglang-router gets that 400
  within seconds. Without the notice prefill would wait for the decode half until
  ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` (300 s, the default kept here).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from server_tier import VOCAB
from sglang_kvguard.demo.tinymodel import prompt_of_tokens

pytestmark = pytest.mark.server

GEOMETRY = dict(prefill_max_total_tokens=2048, decode_max_total_tokens=1024, context_length=1024)
RESERVED = 512  # SGLang's default num_reserved_decode_tokens
FIT = 1024 - RESERVED  # longest prompt decode can reserve


def test_unguarded_decode_never_reserves_a_long_prompt(release, pd_factory):
    if release.version_tuple != (0, 5, 19):
        pytest.skip("shown on 0.5.19 only (one unguarded trio is enough; the rule is the same on every release)")
    d = pd_factory("unguarded", launcher="sglang.launch_server", **GEOMETRY)
    try:
        assert d.server_info("decode").json["max_req_input_len"] == 1018
        r = d.generate(prompt_of_tokens(600, vocab=VOCAB, offset=2), max_new_tokens=2, timeout=30)
        assert r.status == 0 and r.elapsed >= 29, f"expected no answer within 30 s, got {r!r}"
        ok = d.generate(prompt_of_tokens(40, vocab=VOCAB, offset=3), max_new_tokens=2, timeout=60)
        assert ok.status == 200, ok
    finally:
        d.stop()  # free the cores for the guarded trio


@pytest.fixture(scope="module")
def guarded(pd_factory):
    return pd_factory("guarded", launcher="sglang_kvguard.launch_server", **GEOMETRY)


def test_guarded_decode_accepts_only_what_it_can_reserve(guarded):
    assert guarded.server_info("decode").json["max_req_input_len"] == FIT + 1
    assert "kvguard decode_admission_fit: this decode node reserves a request only if" in guarded.log_text("decode")
    ok = guarded.generate(prompt_of_tokens(FIT, vocab=VOCAB, offset=4), max_new_tokens=2, timeout=60)
    assert ok.status == 200, ok
    assert ok.json["meta_info"]["prompt_tokens"] == FIT
    over = (FIT + 1, 600)
    with ThreadPoolExecutor(len(over)) as pool:
        results = list(pool.map(
            lambda n: guarded.generate(prompt_of_tokens(n, vocab=VOCAB, offset=n % 5), max_new_tokens=2, timeout=120),
            over))
    for n, r in zip(over, results):
        assert r.status == 400, (n, r)
        assert f"Input length ({n} tokens) exceeds the maximum allowed length ({FIT} tokens)" in r.text, r.text
        # decode refuses at once and tells prefill, which fails the request at once
        assert r.elapsed < 10, r
    decode_log = guarded.log_text("decode")  # rejected by decode itself (its door: kvguard's or 0.5.21+ upstream's)
    for n in over:
        assert f"Input length ({n} tokens) exceeds the maximum allowed length ({FIT} tokens)" in decode_log, n
    prefill_log = guarded.log_text("prefill")
    assert prefill_log.count("was rejected by decode") >= len(over), prefill_log[-3000:]
    assert guarded.log_text("decode").count("that decode rejected room") >= len(over)
    after = guarded.generate(prompt_of_tokens(40, vocab=VOCAB, offset=6), max_new_tokens=2, timeout=60)
    assert after.status == 200, after
