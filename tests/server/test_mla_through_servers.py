"""The incident's attention class through real PD servers: a tiny DeepSeek-V2 (MLA)
model, prefill + decode + sglang-router on CPU, Mooncake over TCP.

SGLang serves MLA on CPU with ``--attention-backend torch_native`` once the test-only
plugin ``kvguard_test_mla_shim`` (tests/server/cpu_shim) routes DeepSeek attention
through SGLang's own absorbed-MLA method (why: see that file). Plugins load from
0.5.11; the DeepSeek attention registry it uses exists on the releases checked here
(0.5.19, 0.5.23), so the module skips where either is missing. The DSA indexer has no
CPU path in SGLang (``dsa_indexer.py``: "Indexer has no native (pure-torch) path"),
so DSA runs in the component tier and in scripts/gpu-check.sh; see docs/testing.md.

* unguarded 0.5.19: the over-capacity prompt is answered 200 over the MLA pool (the
  incident, on the incident's attention class);
* guarded: every PD node checks the latent KV it registered with Mooncake
  (``MLATokenToKVPool``, one buffer per layer) and calls it covered; fitting prompts
  of 1 to 13 pages pass coverage, canary, checksum and generation checks over real
  Mooncake (no false positive on MLA); the over-capacity prompt gets 400 naming the
  real limit.
"""
from __future__ import annotations

import importlib.util
import os
import re

import pytest

from server_tier import CPU_SHIM_PLUGIN, MLA_SHIM_PLUGIN, VOCAB, make_tiny_mla_model
from sglang_kvguard.demo.tinymodel import prompt_of_tokens

pytestmark = pytest.mark.server

OVER_TOKENS = 600  # > prefill limit (250), < decode limit, < context
NEW_TOKENS = 8
PLUGINS = [CPU_SHIM_PLUGIN, MLA_SHIM_PLUGIN]


@pytest.fixture(scope="module")
def mla_model(release, tmp_path_factory):
    if release.version_tuple != (0, 5, 19) and os.environ.get("KVGUARD_MLA_ALL") != "1":
        # CI time: the module's trios run on one release (0.5.23 measured: 6 passed, 2 skipped)
        pytest.skip("the MLA server tests run on 0.5.19 in CI (KVGUARD_MLA_ALL=1: every release from 0.5.11)")
    if release.version_tuple < (0, 5, 11):
        pytest.skip(f"SGLang {release.version} has no plugin system to load the MLA CPU shim (0.5.11+)")
    if importlib.util.find_spec("sglang.srt.models.deepseek_common.attention_backend_handler") is None:
        pytest.skip(f"SGLang {release.version} has no DeepSeek attention registry for the MLA CPU shim")
    return make_tiny_mla_model(tmp_path_factory.mktemp("tiny-mla") / "deepseek-v2")


@pytest.fixture(scope="module")
def guarded_mla(pd_factory, mla_model):
    # the incident's geometry (prefill pool < context) is what the pool check refuses by
    # default; 'warn' keeps it so that the over-capacity path is exercised
    args = ["--kvguard-pool-policy", "warn", "--enable-metrics"]
    return pd_factory("guarded-mla", launcher="sglang_kvguard.launch_server", model=mla_model,
                      sglang_plugins=PLUGINS, prefill_extra_args=args, decode_extra_args=args)


def test_unguarded_mla_answers_200_over_capacity(release, pd_factory, mla_model):
    """The incident on MLA: rejected inside prefill, answered 200 (0.5.19). Runs first,
    before the module's guarded trio exists (an idle trio spins two cores)."""
    if release.version_tuple > (0, 5, 19):
        pytest.skip(f"SGLang {release.version} does not answer 200 here (test_incident_red.py's docstring)")
    d = pd_factory("unguarded-mla", launcher="sglang.launch_server", model=mla_model, sglang_plugins=PLUGINS)
    r = d.generate(prompt_of_tokens(OVER_TOKENS, vocab=VOCAB, offset=11), max_new_tokens=NEW_TOKENS)
    assert r.status == 200, f"expected the vulnerable 200, got {r!r}"
    assert r.json["meta_info"]["prompt_tokens"] == OVER_TOKENS
    assert f"Input length ({OVER_TOKENS} tokens) exceeds the maximum allowed length" in d.log_text("prefill")
    assert "[kvguard-test-mla-shim]" in d.log_text("decode")


def test_mla_nodes_check_the_latent_kv_they_transfer(guarded_mla):
    for role in ("prefill", "decode"):
        log = guarded_mla.log_text(role)
        assert "[kvguard-test-mla-shim]" in log, role
        m = re.search(rf"kvguard hybrid pool check: the {role} node's pool \((\w+) over (\w+), \w+\) is one the "
                      r"page guards cover; transferred: kv \((\d+) buffer\(s\)\): covered by ([\w, ]+)", log)
        assert m, f"{role} did not log its covered MLA pool:\n" + "\n".join(
            ln for ln in log.splitlines() if "hybrid pool check" in ln)
        assert m.group(2) == "MLATokenToKVPool" and m.group(3) == "2", m.groups()  # one latent buffer per layer
        guards = set(m.group(4).replace(" ", "").split(","))
        want = {"prefill_source_hold", "transfer_checksum"} if role == "prefill" else {
            "page_generation", "destination_canary", "transfer_checksum"}
        assert want <= guards, (role, guards)


def test_mla_component_coverage_is_exported(guarded_mla):
    from sglang_kvguard.demo.deployment import http_request

    for role, url in (("prefill", guarded_mla.prefill_url), ("decode", guarded_mla.decode_url)):
        r = http_request(url + "/metrics", timeout=30)
        assert r.status == 200, r
        rows = [ln for ln in r.text.splitlines() if ln.startswith("kvguard_component_coverage{")]
        guard = "transfer_checksum"
        hit = [ln for ln in rows if 'component="kv"' in ln and f'guard="{guard}"' in ln and f'role="{role}"' in ln]
        assert hit and 'state="covered"' in hit[0] and hit[0].endswith(" 1.0"), (role, rows)


@pytest.mark.parametrize("tokens", [5, 40, 200])
def test_fitting_mla_prompts_pass_every_check_over_real_mooncake(guarded_mla, tokens):
    r = guarded_mla.generate(prompt_of_tokens(tokens, vocab=VOCAB, offset=tokens % 7), max_new_tokens=NEW_TOKENS)
    assert r.status == 200, r
    assert r.json["meta_info"]["prompt_tokens"] == tokens
    assert len(r.json["output_ids"]) == NEW_TOKENS
    decode_log = guarded_mla.log_text("decode")
    assert "failed closed" not in decode_log, [ln for ln in decode_log.splitlines() if "failed closed" in ln]


def test_over_capacity_mla_prompt_gets_400_with_the_real_limit(guarded_mla):
    r = guarded_mla.generate(prompt_of_tokens(OVER_TOKENS, vocab=VOCAB, offset=13), max_new_tokens=NEW_TOKENS,
                             timeout=60)
    assert r.status == 400, r
    m = re.search(r"maximum allowed length \((\d+) tokens\)", r.text)
    assert m, r.text
    limit = int(m.group(1))
    ok = guarded_mla.generate(prompt_of_tokens(limit, vocab=VOCAB, offset=5), max_new_tokens=2, timeout=60)
    assert ok.status == 200, (limit, ok)


# ----------------------------------------------------------------------------- late write on MLA


@pytest.fixture(scope="module")
def weighted_mla_model(mla_model, tmp_path_factory):
    """The tiny MLA model with seeded random weights (transformers' own DeepseekV2ForCausalLM):
    its output depends on the latent KV it attends to."""
    return make_tiny_mla_model(tmp_path_factory.mktemp("tiny-mla-w") / "deepseek-v2", weights_seed=0)


def _late_write_releases(release):
    # The late-write pair decodes 2 x 1000 tokens per trio; with KVGUARD_MLA_ALL=1 it still
    # runs on 0.5.19 only unless KVGUARD_MLA_LATE_WRITE_ALL=1.
    if release.version_tuple != (0, 5, 19) and os.environ.get("KVGUARD_MLA_LATE_WRITE_ALL") != "1":
        pytest.skip("the MLA late-write pair runs on 0.5.19 (KVGUARD_MLA_LATE_WRITE_ALL=1: every release)")


def test_late_write_lands_in_reused_mla_pages_without_the_guard(pd_factory, weighted_mla_model, release, tmp_path):
    """test_late_write.py's scenario on the MLA latent pool: a failed Mooncake send whose
    write lands later changes another request's output when decode gives the pages back."""
    _late_write_releases(release)
    from test_late_write import unguarded_case

    unguarded_case(pd_factory, weighted_mla_model, release, tmp_path, "late-write-mla-unguarded",
                   sglang_plugins=PLUGINS)


def test_guard_keeps_late_written_mla_pages_out_of_circulation(pd_factory, weighted_mla_model, release, tmp_path):
    _late_write_releases(release)
    from test_late_write import guarded_case

    guarded_case(pd_factory, weighted_mla_model, release, tmp_path, "late-write-mla-guarded", sglang_plugins=PLUGINS)
