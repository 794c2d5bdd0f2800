"""Bad input and load through sglang-router on a guarded PD trio (issue: admission guards).

* 50 concurrent over-capacity prompts mixed with 20 normal ones: every over-capacity
  prompt gets 400 with the original text, every normal one 200 with its own
  prompt_tokens, and afterwards free KV tokens (free + evictable), and free metadata
  slots, on both nodes are back at their starting counts (read from kvguard's own
  resource gauges on SGLang's /metrics, ``--enable-metrics``);
* prompts one below, at and past the prefill limit; an empty prompt.

The prefill node is the incident's mis-sized one (pool 256 < context 1024), so the
pool check is relaxed to ``warn``.
"""
from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from server_tier import PREFILL_POOL, VOCAB
from sglang_kvguard.demo.deployment import http_request
from sglang_kvguard.demo.tinymodel import prompt_of_tokens

pytestmark = pytest.mark.server

OVER = 600
PAGE = 16  # PDDeployment default page size
ARGS = ["--kvguard-pool-policy", "warn", "--enable-metrics"]
GAUGES = ("kvguard_kv_free_tokens", "kvguard_kv_evictable_tokens", "kvguard_metadata_free_slots")


@pytest.fixture(scope="module")
def guarded(pd_factory):
    return pd_factory("guarded-load", launcher="sglang_kvguard.launch_server",
                      prefill_extra_args=ARGS, decode_extra_args=ARGS)


def resources(d, role: str) -> dict:
    url = d.prefill_url if role == "prefill" else d.decode_url
    r = http_request(url + "/metrics", timeout=30)
    assert r.status == 200, r
    out = {}
    for name in GAUGES:
        m = re.search(rf"^{name}\{{[^}}]*\}} ([0-9.e+]+)$", r.text, re.M)
        assert m, f"{name} missing from {role} /metrics"
        out[name] = float(m.group(1))
    return out


def settled(d, role: str, want: dict, timeout: float = 30.0) -> dict:
    """Resources of ``role`` once they equal ``want`` (or the last sample at timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        got = resources(d, role)
        usable = got["kvguard_kv_free_tokens"] + got["kvguard_kv_evictable_tokens"]
        if (usable, got["kvguard_metadata_free_slots"]) == want or time.monotonic() > deadline:
            return {"usable_tokens": usable, "metadata_free_slots": got["kvguard_metadata_free_slots"]}
        time.sleep(0.5)


def _baseline(d, role):
    time.sleep(2.5)  # the sampler runs once a second
    got = resources(d, role)
    return (got["kvguard_kv_free_tokens"] + got["kvguard_kv_evictable_tokens"], got["kvguard_metadata_free_slots"])


def test_metrics_show_guard_states_and_resources(guarded):
    for role in ("prefill", "decode"):
        url = guarded.prefill_url if role == "prefill" else guarded.decode_url
        text = http_request(url + "/metrics", timeout=30).text
        assert re.search(r'^kvguard_guard_state\{[^}]*guard="transfer_coverage"[^}]*state="active"[^}]*\} 1\.0$', text, re.M) or \
            re.search(r'^kvguard_guard_state\{[^}]*state="active"[^}]*guard="transfer_coverage"[^}]*\} 1\.0$', text, re.M), text[-3000:]
        res = resources(guarded, role)
        assert res["kvguard_kv_free_tokens"] > 0 and res["kvguard_metadata_free_slots"] > 0


def test_storm_of_over_capacity_prompts_mixed_with_normal_ones(guarded):
    before = {role: _baseline(guarded, role) for role in ("prefill", "decode")}

    jobs = [("over", i) for i in range(50)] + [("ok", i) for i in range(20)]
    jobs.sort(key=lambda j: (j[1] * 7 + (j[0] == "ok")) % 11)  # interleave

    def run(job):
        kind, i = job
        n = OVER + i if kind == "over" else 20 + i
        r = guarded.generate(prompt_of_tokens(n, vocab=VOCAB, offset=i), max_new_tokens=4, timeout=120)
        return kind, n, r

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=70) as pool:
        results = list(pool.map(run, jobs))
    elapsed = time.monotonic() - t0

    bad = []
    for kind, n, r in results:
        if kind == "over":
            if r.status != 400 or f"Input length ({n} tokens) exceeds the maximum allowed length" not in r.text:
                bad.append((kind, n, r))
        elif r.status != 200 or r.json["meta_info"]["prompt_tokens"] != n:
            bad.append((kind, n, r))
    assert not bad, f"{len(bad)} of {len(results)} wrong (storm took {elapsed:.1f}s): {bad[:5]}"

    for role in ("prefill", "decode"):
        want = before[role]
        after = settled(guarded, role, want)
        assert (after["usable_tokens"], after["metadata_free_slots"]) == want, (role, want, after)


def _limit(guarded) -> int:
    r = guarded.generate(prompt_of_tokens(OVER, vocab=VOCAB, offset=3), max_new_tokens=2, timeout=60)
    assert r.status == 400, r
    m = re.search(r"maximum allowed length \((\d+) tokens\)", r.text)
    assert m, r.text
    return int(m.group(1))


def test_prompts_at_and_past_the_limit(guarded):
    limit = _limit(guarded)  # the longest prompt the deployment accepts (input_limit_message)
    ok = guarded.generate(prompt_of_tokens(limit, vocab=VOCAB, offset=2), max_new_tokens=2, timeout=60)
    assert ok.status == 200, ok  # the number in the message is accepted: it is the real limit
    for n in (limit + 1, limit + 2):
        r = guarded.generate(prompt_of_tokens(n, vocab=VOCAB, offset=2), max_new_tokens=2, timeout=60)
        assert r.status == 400, r
        assert f"Input length ({n} tokens) exceeds the maximum allowed length ({limit} tokens)" in r.text, r.text
        assert r.elapsed < 10, r


def test_longest_accepted_prompt_is_answered(guarded, release):
    """Upstream's prefill scheduler admits a prompt only while len + 1 + page (16) <
    pool (256), so prompts of 239-249 tokens would be accepted and then wait forever
    (see test_incident_red). kvguard's prefill_admission_fit lowers the accepted length
    to what an idle pool admits, and input_limit_message names the longest accepted
    prompt (max_req_input_len - 1), so the number in the 400 is itself answered."""
    limit = _limit(guarded)
    page_overhead = release.version_tuple >= (0, 5, 11)  # 0.5.10 adds no page
    if page_overhead:
        assert limit == PREFILL_POOL - 2 - PAGE, limit  # 238: len + 1 + 16 < 256
    else:
        assert limit == PREFILL_POOL - 7, limit  # upstream's own 250 (len < 250) already fits
    for n in (limit, limit - 1, limit - PAGE):
        ok = guarded.generate(prompt_of_tokens(n, vocab=VOCAB, offset=n % 7), max_new_tokens=2, timeout=30)
        assert ok.status == 200, (n, ok)
        assert ok.json["meta_info"]["prompt_tokens"] == n
    fit_log = "admits only prompts of at most" if page_overhead else "every one fits this prefill pool"
    assert "kvguard prefill_admission_fit: " in guarded.log_text("prefill")
    assert fit_log in guarded.log_text("prefill")


def test_empty_prompt_is_a_client_error(guarded):
    """0.5.23 unguarded lets ``text=""`` through as a zero-token request, which kills
    the prefill scheduler; kvguard's empty_prompt guard answers 400 up front."""
    for kw in ({"text": ""}, {"input_ids": []}):
        r = guarded.generate(max_new_tokens=2, timeout=60, **kw)
        assert r.status == 400, (kw, r)
        assert "empty" in r.text, r.text
    ok = guarded.generate(prompt_of_tokens(5, vocab=VOCAB), max_new_tokens=2, timeout=60)
    assert ok.status == 200, ok  # the node survived


def test_prefill_source_hold_is_active_and_holds_nothing_when_idle(guarded):
    """prefill_source_hold wraps the transfer workers and the allocator on the prefill
    node; after the traffic above nothing stays held or quarantined."""
    assert "kvguard prefill_source_hold: source pages of Mooncake transfers stay allocated" in guarded.log_text("prefill")
    r = guarded.generate(prompt_of_tokens(30, vocab=VOCAB, offset=9), max_new_tokens=2, timeout=60)
    assert r.status == 200, r
    time.sleep(2.5)  # one sampler period and more
    text = http_request(guarded.prefill_url + "/metrics", timeout=30).text
    for name in ("kvguard_kv_held_pages", "kvguard_kv_quarantined_pages"):
        m = re.search(rf"^{name}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
        assert m, f"{name} missing from prefill /metrics"
        assert float(m.group(1)) == 0, (name, m.group(0))
