"""Injected faults over real Mooncake transfers, each caught before decode reads the KV.

The decode node runs with ``KVGUARD_FAULT_INJECTION=1`` (test hook,
``sglang_kvguard/guards/_faults.py``): a request whose rid names a fault has the KV
that Mooncake landed corrupted just before decode's commit-time checks. Each must be
failed closed with the right guard's message; a request without a fault name, on the
same servers, is answered normally.

The router runs with ``--disable-retries --disable-circuit-breaker``: by default it
retries a 500 (each retry is caught again) and, after a few, opens the prefill
worker's circuit, so the client gets the router's 503 instead of kvguard's message
(see docs/runbook.md).
"""
from __future__ import annotations

import pytest

from server_tier import DECODE_POOL, VOCAB
from sglang_kvguard.demo.tinymodel import prompt_of_tokens

pytestmark = pytest.mark.server

PROMPT = 100  # 7 pages of 16


@pytest.fixture(scope="module")
def faulty(pd_factory):
    return pd_factory("guarded-faults", launcher="sglang_kvguard.launch_server",
                      prefill_max_total_tokens=DECODE_POOL, env={"KVGUARD_FAULT_INJECTION": "1"},
                      router_extra_args=["--disable-retries", "--disable-circuit-breaker"])


@pytest.mark.parametrize("kind, expected", [
    ("bitflip", "KV checksum mismatch"),
    ("swap", "KV checksum mismatch"),
    ("unwritten", "1 of 7 KV pages reserved for this request were never written"),
])
def test_fault_is_caught(faulty, kind, expected):
    r = faulty.generate(prompt_of_tokens(PROMPT, vocab=VOCAB, offset=3), max_new_tokens=4,
                        timeout=60, rid=f"kvguard-fault-{kind}-1")
    assert r.status == 500, r
    assert expected in r.text, r.text
    log = faulty.log_text("decode")
    assert f"{kind} applied to rid=kvguard-fault-{kind}-1" in log


def test_same_request_without_a_fault_is_answered(faulty):
    r = faulty.generate(prompt_of_tokens(PROMPT, vocab=VOCAB, offset=3), max_new_tokens=4, timeout=60)
    assert r.status == 200, r
    assert r.json["meta_info"]["prompt_tokens"] == PROMPT
