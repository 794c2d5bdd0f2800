"""No false positives: 200 normal requests through real PD servers and Mooncake, with
every integrity check on (transfer coverage, destination canaries, KV checksums).

Mixed prompt lengths (1 token to several pages, page boundaries on both sides),
chunked prefill on (``--chunked-prefill-size 64``: long prompts go out in several
chunks), prefill prefix-cache hits (half the prompts share a 96-token prefix), and,
where the release has it, decode's radix cache
(``--disaggregation-decode-enable-radix-cache``: decode already holds a prefix and
prefill sends only the rest, so the checks cover exactly the transferred range).
Every request must get 200 with its own prompt_tokens, and the decode log must not
contain a single kvguard failure.
"""
from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from server_tier import DECODE_POOL, VOCAB
from sglang_kvguard.demo.deployment import http_request

pytestmark = pytest.mark.server

LENGTHS = [1, 7, 15, 16, 17, 31, 33, 64, 65, 100, 129, 200, 300]
SHARED = 96


PREFIX = [(5 * k + 1) % (VOCAB - 4) + 2 for k in range(SHARED)]


def _ids(n: int, i: int, shared: bool):
    tail = [(7 * k + 3 * i) % (VOCAB - 4) + 2 for k in range(n)]
    return PREFIX + tail if shared else tail


@pytest.fixture(scope="module")
def guarded(pd_factory, release):
    decode_args = ["--enable-metrics"]
    if release.version_tuple >= (0, 5, 19):
        decode_args.append("--disaggregation-decode-enable-radix-cache")
    return pd_factory("guarded-integrity", launcher="sglang_kvguard.launch_server",
                      prefill_max_total_tokens=DECODE_POOL,
                      prefill_extra_args=["--chunked-prefill-size", "64", "--enable-metrics"],
                      decode_extra_args=decode_args)


def test_200_normal_requests_pass_every_check(guarded):
    jobs = []
    for i in range(200):
        n = LENGTHS[i % len(LENGTHS)]
        jobs.append((i, _ids(n, i // 3, shared=(i % 2 == 0))))

    def run(job):
        i, ids = job
        return ids, guarded.generate(input_ids=ids, max_new_tokens=3, timeout=120)

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(run, jobs))
    bad = [(len(ids), r) for ids, r in results
           if r.status != 200 or r.json["meta_info"]["prompt_tokens"] != len(ids)]
    assert not bad, f"{len(bad)} of 200 failed: {bad[:3]}"

    log = guarded.log_text("decode")
    assert "failed closed" not in log, [l for l in log.splitlines() if "failed closed" in l][:3]
    # page_generation checked every batch (radix cache on from 0.5.19: rows it rewrites are recorded again)
    assert "decode pages carry generation tags" in log
    if guarded.release.version_tuple >= (0, 5, 19):
        assert "are recorded again" in log
    for bad in ("kept out of the radix cache", "check failed", "check before the radix insert failed",
                "recording rows after the radix insert failed", "NOT active"):
        assert bad not in log, [l for l in log.splitlines() if bad in l][:3]
    assert "could not checksum" not in guarded.log_text("prefill")
    metrics = http_request(guarded.decode_url + "/metrics", timeout=30).text
    m = re.search(r'^kvguard_events_total\{event="coverage_verified"[^}]*\} ([0-9.e+]+)$', metrics, re.M)
    assert m and float(m.group(1)) >= 200, metrics[-2000:]
