"""The SPIN model of PD KV transfer ownership (models/pd_transfer.pml).

Two kinds of test:

* cheap, always: the hook names the model's actions carry (``@Name``) are the real
  targets kvguard patches, as listed in ``patches/sglang-0.5.19.json`` and
  ``patches/sglang-0.5.23.json``; the check script keeps to exhaustive search;
* the model check itself: ``scripts/check-model.sh`` (about 2 minutes on 2 cores).
  Skipped when ``spin`` or ``gcc`` is not on PATH, unless ``KVGUARD_REQUIRE_SPIN=1``,
  which turns the missing tool into a failure.

See docs/design/formal-model.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "models" / "pd_transfer.pml"
SCRIPT = REPO / "scripts" / "check-model.sh"
FAMILIES = ("0.5.19", "0.5.23")
HOOK = re.compile(r"@([A-Za-z_][A-Za-z0-9_]*)")
STATE_MACHINE = REPO / "tests" / "component" / "test_page_ownership_model.py"
# steps of the hypothesis state machine that the SPIN model has no hook name for, and why
NOT_MODEL_ACTIONS = {
    "RadixCache_match_prefix": "prefix sharing is left out of the SPIN model (formal-model.md, abstractions)",
    "quarantine_bound_passes": "the hold's clock, not an upstream call; the model's quarantine step has no hook name",
}


def _targets() -> dict:
    """qualname with dots written as underscores -> releases whose manifest lists it."""
    names: dict = {}
    for release in FAMILIES:
        data = json.loads((REPO / "patches" / f"sglang-{release}.json").read_text())
        for entry in data["targets"].values():
            if entry:
                names.setdefault(entry["qualname"].replace(".", "_"), set()).add(release)
    return names


def _model_hooks() -> set:
    return set(HOOK.findall(MODEL.read_text()))


# ----------------------------------------------------------------------------- cheap


def test_every_hook_name_in_the_model_is_a_patched_target():
    hooks = _model_hooks()
    known = _targets()
    unknown = sorted(h for h in hooks if h not in known)
    assert not unknown, (
        f"models/pd_transfer.pml names {unknown}, which no target in patches/sglang-0.5.19.json or "
        f"patches/sglang-0.5.23.json has as its qualname (dots as underscores); rename the model's action "
        f"or add the target")


def test_the_model_names_the_hook_points_of_each_phase():
    hooks = _model_hooks()
    for name in (
        "validate_input_length",                         # the rejection and its stub
        "PrefillBootstrapQueue_add",                     # prefill door
        "PrefillBootstrapQueue_pop_bootstrapped",        # bootstrap
        "SchedulerDisaggregationPrefillMixin_send_kv_chunk",
        "MooncakeKVManager_add_transfer_request",
        "MooncakeKVManager_transfer_worker",             # the transfer engine
        "MooncakeKVManager__transfer_data",
        "DecodePreallocQueue_add",                       # decode door
        "DecodePreallocQueue__pre_alloc",                # destination reservation
        "MooncakeKVReceiver_send_metadata",
        "DecodeTransferQueue_pop_transferred",
        "DecodeTransferQueue__commit_transfer_to_req",   # verification
        "DecodeTransferQueue__defer_release",            # 0.5.23's deferred release
        "DecodeTransferQueue_resolve_deferred_releases",
        "Scheduler_update_running_batch",                # decode reads
        "PagedTokenToKVPoolAllocator_alloc",             # the pools
        "PagedTokenToKVPoolAllocator_free",
        "prepare_abort",
        "Scheduler_flush_cache",
        "TokenizerManager_abort_request",                # client aborts
    ):
        assert name in hooks, f"the model has no action named @{name}"


def _state_machine_rules() -> list:
    """Names of the methods decorated with hypothesis' ``@rule`` in the state machine."""
    import ast

    names = []
    for node in ast.walk(ast.parse(STATE_MACHINE.read_text())):
        if isinstance(node, ast.FunctionDef):
            for dec in node.decorator_list:
                fn = dec.func if isinstance(dec, ast.Call) else dec
                if isinstance(fn, ast.Name) and fn.id == "rule":
                    names.append(node.name)
    return names


def test_the_hypothesis_state_machine_uses_the_models_action_names():
    rules = _state_machine_rules()
    assert len(rules) >= 6, rules
    hooks = _model_hooks()
    strays = [r for r in rules if r not in hooks and r not in NOT_MODEL_ACTIONS]
    assert not strays, (f"{STATE_MACHINE.name} has steps {strays} that are neither an action of "
                        f"models/pd_transfer.pml (@Name) nor listed in NOT_MODEL_ACTIONS with a reason")
    assert [r for r in rules if r in hooks], "no step of the state machine is named after a model action"
    assert not set(NOT_MODEL_ACTIONS) & hooks, "NOT_MODEL_ACTIONS lists a name the model does use"


def test_the_check_script_keeps_to_an_exhaustive_search():
    text = SCRIPT.read_text()
    assert "set -euo pipefail" in text
    for shortcut in ("BITSTATE", "-DHC", "-DMA=", "-DSPACE"):
        assert shortcut not in text, f"check-model.sh must not use {shortcut} (the CI run is exhaustive)"


# ----------------------------------------------------------------------------- the check


@pytest.fixture(scope="module")
def model_check(tmp_path_factory):
    missing = [tool for tool in ("spin", "gcc") if shutil.which(tool) is None]
    if missing:
        msg = f"{' and '.join(missing)} not on PATH (Debian: apt-get install -y spin gcc)"
        if os.environ.get("KVGUARD_REQUIRE_SPIN") == "1":
            pytest.fail(f"KVGUARD_REQUIRE_SPIN=1 but {msg}")
        pytest.skip(f"{msg}; KVGUARD_REQUIRE_SPIN=1 makes this a failure")
    out = tmp_path_factory.mktemp("kvguard-model")
    env = dict(os.environ, KVGUARD_MODEL_OUT=str(out))
    cp = subprocess.run(["bash", str(SCRIPT)], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    return cp, out


def test_every_run_ends_as_expected(model_check):
    cp, _ = model_check
    assert cp.returncode == 0, cp.stdout[-6000:] + cp.stderr[-3000:]
    assert "check-model: every run ended as expected" in cp.stdout
    assert "unexpected: 0" in cp.stdout


def test_guarded_searches_are_complete_with_no_errors(model_check):
    out = model_check[0].stdout
    for fam in FAMILIES:
        short = fam[-2:]
        for run in (f"g{short}-safety", f"g{short}-progress", f"g{short}-clients-wait", f"g{short}-frozen-peer",
                    f"g{short}-dead-peer", f"g{short}-dead-frozen-peer", f"g{short}-dead-peer-ends",
                    f"g{short}-router-retry", f"g{short}-progress-retry"):
            assert f"RESULT {run} {fam} guarded: complete search, errors: 0" in out, run
    # pan's own summary of a complete search
    assert re.search(r"pan: State-vector \d+ byte, depth reached \d+, errors: 0", out)
    assert re.search(r"pan: \d+ states, stored", out)
    assert "max search depth too small" not in out


def test_unguarded_releases_show_their_named_violations(model_check):
    out = model_check[0].stdout
    for line in (
        # 0.5.19: the incident (one page sent, all read, HTTP 200) and the late write
        "RESULT u19-incident 0.5.19 unguarded: violation: isolation",
        "RESULT u19-incident-200 0.5.19 unguarded: violation: error fidelity (never 200)",
        "RESULT u19-late-write 0.5.19 unguarded: violation: no late write into a reused page",
        # 0.5.23: source pages reused under a transfer, and the 500 after decode's wait
        "RESULT u23-source-reuse 0.5.23 unguarded: violation: no reuse under a transfer (prefill source page)",
        "RESULT u23-500 0.5.23 unguarded: violation: error fidelity (its own 400)",
    ):
        assert line in out, line


def test_each_guard_is_necessary_or_explained(model_check):
    out = model_check[0].stdout
    table = out[out.index("================ necessity"):out.index("================ all runs")]
    guards = ("ADMISSION_DRAIN", "REJECTION_NOTICE", "COVERAGE", "SOURCE_HOLD", "DEST_HOLD", "QUARANTINE",
              "GENERATION", "CHECKSUM", "CANARY", "POOL_CHECK", "FLUSH_BARRIER", "PEER_LIVENESS")
    for fam in FAMILIES:
        for g in guards:
            rows = [r for r in table.splitlines() if r.startswith(fam) and f" {g} " in r]
            assert rows, f"{fam} {g}: no necessity row"
            for r in rows:
                assert ("violated, cex" in r or "defence in depth" in r or "upstream" in r), r


def test_counterexample_trails_read_as_hook_calls(model_check):
    _, out = model_check
    incident = (out / "u19-incident.trail.txt").read_text()
    for step in ("@validate_input_length", "@DecodePreallocQueue__pre_alloc", "@SchedulerDisaggregationPrefillMixin_send_kv_chunk",
                 "@MooncakeKVManager__transfer_data", "@DecodeTransferQueue__commit_transfer_to_req",
                 "@Scheduler_update_running_batch", "HTTP 200"):
        assert step in incident, step
    late = (out / "u19-late-write.trail.txt").read_text()
    assert "returns -1" in late and "still lands" in late
    assert (out / "u23-source-reuse.trail.txt").read_text().count("@PagedTokenToKVPoolAllocator_alloc prefill page 0") == 2
    assert (out / "summary.txt").exists()
