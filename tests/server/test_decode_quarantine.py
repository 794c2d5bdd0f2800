"""Decode pages of an aborted transfer are quarantined, not released blind, while prefill is frozen.

0.5.10-0.5.20 decode frees a failed transfer's pages at once; kvguard's
decode_destination_hold keeps them until every prefill rank confirms the drain
(kvguard's own drain request and answer). 0.5.21+ decode holds them itself until every
prefill rank acknowledges that its writes stopped, but only for
``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT`` (30 s; 5 s here): then it
logs "releasing anyway" and frees them, although the writer may still be alive and
write later (docs/design/page-lifetime.md, D5); kvguard's decode_deferred_release
turns that into quarantine.

The writer is frozen for real: the prefill scheduler process gets SIGSTOP (its
Mooncake transfer and bootstrap threads stop with it). A request is sent through the
router; decode reserves its pages and waits for the transfer; decode then aborts it
(``/abort_request``) and holds the pages.

* Guarded: past ``--kvguard-quarantine-after`` (3 s) the pages are reported
  quarantined (log, ``kvguard_kv_quarantined_pages``), and 9 s later they are still
  held. After SIGCONT, prefill confirms the drain and decode releases the pages: the
  pool is back at its idle value.
* With the guard switched off on decode: the pages go back while the writer is still
  frozen (at once up to 0.5.20; "releasing anyway" after upstream's timeout on 0.5.21+).
"""
from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest

from server_tier import VOCAB
from sglang_kvguard.demo.deployment import http_request
from sglang_kvguard.demo.tinymodel import prompt_of_tokens
from test_admission_load import ARGS, _baseline, resources, settled

pytestmark = pytest.mark.server

TIMEOUT_ENV = {"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "5"}
PROMPT = 200


def _decode_hold_guard(release) -> str:
    return "decode_deferred_release" if release.version_tuple >= (0, 5, 21) else "decode_destination_hold"


def _scheduler_pid(d, role: str) -> int:
    m = re.findall(r"pid=(\d+) process=scheduler", d.log_text(role))
    assert m, f"no scheduler pid in the {role} log"
    return int(m[-1])


def decode_reserved(d, before: int, timeout: float = 30) -> bool:
    """Wait until decode's usable tokens drop below ``before``: it reserved the pages of a
    request that now waits for the (frozen) prefill."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = resources(d, "decode")
        if got["kvguard_kv_free_tokens"] + got["kvguard_kv_evictable_tokens"] < before:
            return True
        time.sleep(0.3)
    return False


def _abort_on_decode_while_prefill_is_frozen(d, rid: str):
    """SIGSTOP prefill's scheduler, send a request, abort it on decode once decode holds
    its pages. Returns (prefill scheduler pid, client thread, baseline usable tokens)."""
    before = _baseline(d, "decode")
    pid = _scheduler_pid(d, "prefill")
    os.kill(pid, signal.SIGSTOP)
    box = {}
    t = threading.Thread(target=lambda: box.update(r=d.generate(
        prompt_of_tokens(PROMPT, vocab=VOCAB, offset=3), max_new_tokens=4, timeout=30, rid=rid)))
    t.start()
    if not decode_reserved(d, before[0]):
        os.kill(pid, signal.SIGCONT)
        pytest.fail("decode never reserved pages for the request")
    http_request(d.decode_url + "/abort_request", {"rid": rid}, timeout=30)
    return pid, t, before


def _once_per_decode_hold(release):
    # 0.5.10-0.5.20 share decode_destination_hold (CI: 0.5.19), 0.5.21+ decode_deferred_release
    # (CI: 0.5.23); KVGUARD_QUARANTINE_ALL=1: every release
    if release.version_tuple < (0, 5, 19) and os.environ.get("KVGUARD_QUARANTINE_ALL") != "1":
        pytest.skip("decode_destination_hold's quarantine runs on 0.5.19 in CI (KVGUARD_QUARANTINE_ALL=1: here too)")


def test_frozen_prefill_quarantines_decode_pages_until_it_drains(pd_factory, release):
    _once_per_decode_hold(release)
    d = pd_factory("guarded-quarantine", launcher="sglang_kvguard.launch_server",
                   prefill_extra_args=ARGS, decode_extra_args=ARGS + ["--kvguard-quarantine-after", "3"],
                   env=dict(TIMEOUT_ENV, KVGUARD_PEER_PROBE_INTERVAL="1"), router_extra_args=["--disable-retries", "--disable-circuit-breaker"])
    rid = "kvguard-frozen-1"
    pid, t, before = _abort_on_decode_while_prefill_is_frozen(d, rid)
    try:
        time.sleep(9)  # past the quarantine bound (3 s) and upstream's timeout (5 s)
        log = d.log_text("decode")
        assert "releasing anyway" not in log, log[-3000:]
        assert re.search(r"room \d+ \(rid=kvguard-frozen-1\) has waited \d+ s .* quarantined", log), log[-3000:]
        time.sleep(1.5)  # one more sample of the gauges
        got = resources(d, "decode")
        assert got["kvguard_kv_free_tokens"] + got["kvguard_kv_evictable_tokens"] < before[0], "pages released blind"
        text = http_request(d.decode_url + "/metrics", timeout=30).text
        m = re.search(r"^kvguard_kv_quarantined_pages\{[^}]*\} ([0-9.e+]+)$", text, re.M)
        assert m and float(m.group(1)) >= PROMPT // 16, m and m.group(0)
        # No request is left on decode, but its held pages may still be written: a flush
        # must not reset the allocator now (flush_barrier). Upstream answers a busy
        # flush with 400.
        flush = http_request(d.decode_url + "/flush_cache", method="POST", timeout=30)
        assert flush.status == 400, flush
        assert "kvguard flush_barrier: cache not flushed" in d.log_text("decode")
    finally:
        os.kill(pid, signal.SIGCONT)
    after = settled(d, "decode", before, timeout=60)
    assert (after["usable_tokens"], after["metadata_free_slots"]) == before, (before, after)
    # drained: the flush goes through, and the pool is still whole afterwards
    flush = http_request(d.decode_url + "/flush_cache", method="POST", timeout=30)
    assert flush.status == 200, flush
    after = settled(d, "decode", before, timeout=30)
    assert (after["usable_tokens"], after["metadata_free_slots"]) == before, (before, after)
    log = d.log_text("decode")
    assert re.search(r"room \d+ drained after \d+ s; its \d+ quarantined page\(s\) are released", log), log[-3000:]
    t.join(60)
    assert not t.is_alive()
    ok = d.generate(prompt_of_tokens(40, vocab=VOCAB, offset=1), max_new_tokens=4, timeout=60)
    assert ok.status == 200, ok
    assert "Traceback" not in log
    if release.version_tuple < (0, 5, 21):  # kvguard's own drain request and answer
        assert "left the transfer queue unfinished" in log
        assert "has drained on this prefill rank" in d.log_text("prefill")
    assert "count as drained" not in log and "counts as drained" not in log, \
        "a frozen prefill (probed every second) was called gone"
    # A prefill that is gone (its rank socket refuses connections) writes nothing more:
    # it counts as having answered, and decode releases the pages.
    _pid, t2, before2 = _abort_on_decode_while_prefill_is_frozen(d, "kvguard-frozen-3")
    os.killpg(d.procs["prefill"].pgid, signal.SIGKILL)
    after = settled(d, "decode", before2, timeout=60)
    assert (after["usable_tokens"], after["metadata_free_slots"]) == before2, (before2, after)
    log = d.log_text("decode")
    assert re.search(r"prefill rank\S* \S+ of room \d+ (is|are) gone; (it counts|they count) as drained", log), \
        log[-3000:]
    assert "releasing anyway" not in log
    t2.join(60)


def test_without_the_guard_upstream_releases_while_prefill_is_frozen(pd_factory, release):
    _once_per_decode_hold(release)
    guard = _decode_hold_guard(release)
    d = pd_factory("unguarded-quarantine", launcher="sglang_kvguard.launch_server",
                   prefill_extra_args=ARGS, decode_extra_args=ARGS + [f"--kvguard-disable={guard}"],
                   env=TIMEOUT_ENV, router_extra_args=["--disable-retries", "--disable-circuit-breaker"])
    pid, t, before = _abort_on_decode_while_prefill_is_frozen(d, "kvguard-frozen-2")
    try:
        # held, then "releasing anyway" after upstream's timeout
        after = settled(d, "decode", before, timeout=30)
        assert (after["usable_tokens"], after["metadata_free_slots"]) == before, \
            "upstream gave the pages back while the writer was still frozen"
        if release.version_tuple >= (0, 5, 21):
            assert "releasing anyway" in d.log_text("decode")
    finally:
        os.kill(pid, signal.SIGCONT)
    t.join(60)
