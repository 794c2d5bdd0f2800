"""The incident, red half: an UNGUARDED SGLang PD deployment answers HTTP 200 to a
prompt that its prefill pool cannot hold.

Geometry (the incident scaled down): context 1024 tokens, prefill pool 256 tokens
(prefill's max_req_input_len = min(context-1, pool-1) - 5 = 250), decode pool 2048
(decode's limit is 1018). A 600-token prompt passes the tokenizer's context check,
is rejected inside prefill's scheduler (``validate_input_length`` -> ``set_finish_with_abort``,
prompt replaced by a one-token stub), yet in PD mode it still bootstraps, transfers
one page and decode runs over the full 600-token reservation: the client gets
200 with ``prompt_tokens == 600``, fast, instead of 400.

Releases (measured with this module and test_pd_smoke.py on this CPU set-up):
* 0.5.19: HTTP 200 in ~0.1 s, ``prompt_tokens == 600`` -> reproduced (asserted below).
* 0.5.20: NOT the 200: prefill retires the aborted request before its KV send and
  answers 400 to the router, but decode (which admitted the 600 tokens) waits for a
  transfer that never comes; the client gets nothing for
  SGLANG_DISAGGREGATION_WAITING_TIMEOUT (300 s) per router attempt, then 500
  ("KVTransferError ... timed out in KVPoll.WaitingForInput"), and the router's
  circuit breaker then answers 503 to valid prompts for a while.
* 0.5.23 (measured; 0.5.21 and 0.5.22 not run): same as 0.5.20. The admission-door reject fires
  on prefill only; decode's door admits because decode's own limit is larger.
So this module is skipped after 0.5.19 (VULNERABLE_UP_TO).
"""
from __future__ import annotations

import json
import re

import pytest

from server_tier import CONTEXT_LENGTH, DECODE_POOL, PREFILL_POOL, VOCAB
from sglang_kvguard.demo.tinymodel import prompt_of_tokens

pytestmark = pytest.mark.server

# Last release on which the unguarded engine answers 200 to an over-capacity
# prompt in PD mode (measured with this module; see the module docstring).
VULNERABLE_UP_TO = (0, 5, 19)

FIT_TOKENS = 40  # well inside every limit
OVER_TOKENS = 600  # > prefill limit (250), < decode limit (1018), < context (1024)
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def unguarded(release, pd_factory):
    if release.version_tuple > VULNERABLE_UP_TO:
        pytest.skip(
            f"SGLang {release.version} does not answer 200 here: from 0.5.20 prefill drops the "
            "rejected request before its KV send (0.5.21+ at the PD admission door), and the "
            "client waits for decode's transfer timeout, then gets 500 (see module docstring)"
        )
    return pd_factory(
        "unguarded",
        launcher="sglang.launch_server",
        prefill_max_total_tokens=PREFILL_POOL,
        decode_max_total_tokens=DECODE_POOL,
        context_length=CONTEXT_LENGTH,
    )


def _limits(d, role):
    r = d.server_info(role)
    assert r.status == 200, r
    return r.json["max_total_num_tokens"], r.json["max_req_input_len"], r.json["context_length"]


def test_servers_are_unguarded(unguarded, release):
    # The test bed has kvguard installed, which registers an SGLang entry-point
    # plugin; SGLANG_PLUGINS (the allow-list) must have kept it out. The CPU shim,
    # loaded through the same mechanism, proves plugins were read at all (0.5.11+;
    # 0.5.10 has no plugin system, so neither plugin can load there).
    for role in ("prefill", "decode"):
        log = unguarded.log_text(role)
        if release.version_tuple >= (0, 5, 11):
            assert "[kvguard-test-cpu-shim]" in log, role
        assert not re.search(r"\bkvguard \d+\.\d+|sglang_kvguard[./]", log), f"kvguard active on {role}"


def test_geometry_matches_the_incident(unguarded):
    p_pool, p_limit, p_ctx = _limits(unguarded, "prefill")
    d_pool, d_limit, d_ctx = _limits(unguarded, "decode")
    assert (p_pool, d_pool) == (PREFILL_POOL, DECODE_POOL)
    assert p_ctx == d_ctx == CONTEXT_LENGTH
    # prefill cannot hold the prompt, decode can, the tokenizer lets it through
    assert p_limit < OVER_TOKENS <= d_limit < CONTEXT_LENGTH, (p_limit, d_limit)


def test_fitting_prompt_returns_200(unguarded):
    r = unguarded.generate(prompt_of_tokens(FIT_TOKENS, vocab=VOCAB), max_new_tokens=NEW_TOKENS)
    assert r.status == 200, r
    meta = r.json["meta_info"]
    assert meta["prompt_tokens"] == FIT_TOKENS
    assert meta["completion_tokens"] == NEW_TOKENS


def test_over_context_prompt_is_rejected_by_the_tokenizer(unguarded):
    # Control: the only length check before the scheduler is against the context.
    r = unguarded.generate(prompt_of_tokens(CONTEXT_LENGTH + 50, vocab=VOCAB), max_new_tokens=NEW_TOKENS)
    assert r.status == 400, r


def test_over_capacity_prompt_returns_200_unguarded(unguarded, record_property):
    """THE BUG: rejected inside prefill, yet HTTP 200 with a full-length prompt count."""
    prompt = prompt_of_tokens(OVER_TOKENS, vocab=VOCAB, offset=11)
    fit = unguarded.generate(prompt_of_tokens(FIT_TOKENS, vocab=VOCAB, offset=3), max_new_tokens=NEW_TOKENS)
    r = unguarded.generate(prompt, max_new_tokens=NEW_TOKENS)
    observed = {
        "status": r.status,
        "latency_s": round(r.elapsed, 3),
        "fit_latency_s": round(fit.elapsed, 3),
        "prompt_tokens": (r.json or {}).get("meta_info", {}).get("prompt_tokens"),
        "output_ids": (r.json or {}).get("output_ids"),
        "text": (r.json or {}).get("text"),
        "finish_reason": (r.json or {}).get("meta_info", {}).get("finish_reason"),
    }
    record_property("over_capacity_generate", json.dumps(observed))
    print("over-capacity /generate on the unguarded engine:", json.dumps(observed))

    assert r.status == 200, f"expected the vulnerable 200, got {r!r}"
    assert observed["prompt_tokens"] == OVER_TOKENS
    assert len(observed["output_ids"]) == NEW_TOKENS
    # ... although prefill's scheduler rejected the request:
    prefill_log = unguarded.log_text("prefill")
    assert f"Input length ({OVER_TOKENS} tokens) exceeds the maximum allowed length" in prefill_log


def test_over_capacity_openai_completion_returns_200_unguarded(unguarded, record_property):
    r = unguarded.completions(prompt_of_tokens(OVER_TOKENS, vocab=VOCAB, offset=29), max_tokens=NEW_TOKENS)
    body = r.json or {}
    observed = {
        "status": r.status,
        "latency_s": round(r.elapsed, 3),
        "usage": body.get("usage"),
        "text": (body.get("choices") or [{}])[0].get("text"),
    }
    record_property("over_capacity_completions", json.dumps(observed))
    print("over-capacity /v1/completions on the unguarded engine:", json.dumps(observed))
    assert r.status == 200, r
    assert body["usage"]["prompt_tokens"] == OVER_TOKENS
    assert body["usage"]["completion_tokens"] == NEW_TOKENS


def test_fitting_prompt_still_works_afterwards(unguarded):
    r = unguarded.completions(prompt_of_tokens(FIT_TOKENS, vocab=VOCAB), max_tokens=NEW_TOKENS)
    assert r.status == 200, r
    assert r.json["usage"]["prompt_tokens"] == FIT_TOKENS


def test_prompt_the_prefill_pool_never_admits_hangs_unguarded(unguarded, release):
    """Upstream's second gap (kvguard's prefill_admission_fit closes it): a prompt of
    max_req_input_len - 2 tokens passes validation, but the prefill scheduler admits a
    request only while len + 1 + page_size < free tokens, which an idle 256-token pool
    never satisfies: no answer. Runs last in this module: the stuck request never
    leaves the prefill queue (a fitting prompt sent after it was still answered)."""
    _, p_limit, _ = _limits(unguarded, "prefill")
    stuck = p_limit - 2  # 248: accepted, never admitted (needs 248 + 1 + 16 < 256)
    if release.version_tuple < (0, 5, 11):
        # 0.5.10 adds no page to its admission estimate (248 + 1 < 256): no gap
        r = unguarded.generate(prompt_of_tokens(stuck, vocab=VOCAB, offset=5), max_new_tokens=2, timeout=60)
        assert r.status == 200, r
        return
    r = unguarded.generate(prompt_of_tokens(stuck, vocab=VOCAB, offset=5), max_new_tokens=2, timeout=20)
    assert r.status == 0 and r.elapsed >= 19, f"expected no answer within 20 s, got {r!r}"
    behind = unguarded.generate(prompt_of_tokens(FIT_TOKENS, vocab=VOCAB, offset=6), max_new_tokens=2, timeout=60)
    assert behind.status == 200, behind  # the node still serves; only the stuck prompt waits
