"""`kvguard doctor` against the real installed SGLang, and its refusal paths."""

import json
import shutil
from pathlib import Path

from packaging.version import Version

from _engine_support import RELEASE, run_py

REPO = Path(__file__).resolve().parents[2]
DOOR = "disagg.prefill.PrefillBootstrapQueue.add"


def doctor(*args, **env):
    return run_py(["-m", "sglang_kvguard.cli", "doctor", *args], **env)


def test_doctor_json_reports_every_guard_for_this_release():
    out = doctor("--json")
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.loads(out.stdout)
    assert data["sglang"] == RELEASE and data["ok"] is True
    assert "covered" in data["component_coverage"]["state:dsa / state:nsa"]  # the indexer is covered
    states = {g["name"]: g["state"] for g in data["guards"]}
    expected = "upstream" if Version(RELEASE) >= Version("0.5.21") else "active"
    assert states["admission_drain"] == expected
    assert states["pool_capacity_check"] == "active"
    assert states["mooncake_batch_bound"] == "active"
    assert states["rejection_notice"] == "active"
    assert set(data["activation"].values()) == {"active"}, data["activation"]
    assert data["manifest"].endswith(f"sglang-{RELEASE}.json")


def test_doctor_human_table():
    out = doctor()
    assert out.returncode == 0
    assert f"SGLang {RELEASE}" in out.stdout
    assert "admission_drain" in out.stdout


def _tampered_manifests(tmp_path, key=DOOR):
    d = tmp_path / "patches"
    shutil.copytree(REPO / "patches", d)
    p = d / f"sglang-{RELEASE}.json"
    data = json.loads(p.read_text())
    data["targets"][key]["fingerprint"] = "0" * 24
    p.write_text(json.dumps(data))
    return d


def test_tampered_fingerprint_refuses(tmp_path):
    d = _tampered_manifests(tmp_path)
    out = doctor("--json", KVGUARD_MANIFEST_DIR=str(d))
    assert out.returncode == 1
    data = json.loads(out.stdout)
    assert data["ok"] is False
    g = {g["name"]: g for g in data["guards"]}["admission_drain"]
    assert g["state"] == "refused"
    assert "sglang.srt.disaggregation.prefill:PrefillBootstrapQueue.add" in g["reason"]
    assert RELEASE in g["reason"]
    human = doctor(KVGUARD_MANIFEST_DIR=str(d))
    assert human.returncode == 1
    assert "--kvguard-on-unknown=warn" in human.stdout  # the way out is named


def test_tampered_fingerprint_with_warn_installs_and_warns(tmp_path):
    d = _tampered_manifests(tmp_path)
    out = doctor("--json", "--kvguard-on-unknown=warn", KVGUARD_MANIFEST_DIR=str(d))
    assert out.returncode == 0, out.stdout
    data = json.loads(out.stdout)
    assert any("PrefillBootstrapQueue.add" in w for w in data["warnings"])


def test_unknown_release_refuses_then_warn_uses_nearest(tmp_path):
    d = tmp_path / "patches"
    shutil.copytree(REPO / "patches", d)
    (d / f"sglang-{RELEASE}.json").unlink()
    out = doctor("--json", KVGUARD_MANIFEST_DIR=str(d))
    assert out.returncode == 1
    data = json.loads(out.stdout)
    assert {g["state"] for g in data["guards"]} == {"refused"}
    assert "not a release kvguard has reviewed" in data["guards"][0]["reason"]
    out = doctor("--json", KVGUARD_MANIFEST_DIR=str(d), KVGUARD_ON_UNKNOWN="warn")
    data = json.loads(out.stdout)
    assert any("is not a known release" in w for w in data["warnings"]), data


def test_batch_bound_zero_switches_it_off():
    out = doctor("--json", "--kvguard-max-transfer-batch=0")
    data = json.loads(out.stdout)
    g = {g["name"]: g for g in data["guards"]}["mooncake_batch_bound"]
    assert g["state"] == "off" and "max-transfer-batch=0" in g["reason"]
    bad = doctor("--kvguard-max-transfer-batch=-3")
    assert bad.returncode == 2 and "KVGUARD_MAX_TRANSFER_BATCH" in bad.stderr


def test_disable_switches_a_guard_off():
    out = doctor("--json", "--kvguard-disable", "admission_drain")
    data = json.loads(out.stdout)
    assert {g["name"]: g["state"] for g in data["guards"]}["admission_drain"] == "off"
    assert out.returncode == 0


DEFERRED = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"


def _deferred(*args, **env):
    code = (
        "import json, os, sglang_kvguard\n"
        "r = sglang_kvguard.install()\n"
        "g = [g for g in r.guards if g.name == 'decode_deferred_release'][0]\n"
        "from sglang.srt.environ import envs\n"
        f"v = envs.{DEFERRED}.get() if hasattr(envs, '{DEFERRED}') else None\n"
        "print(json.dumps({'state': g.state, 'reason': g.reason, 'upstream_reads': v}))\n"
    )
    out = run_py(["-c", code], **env)
    return out, (json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None)


def test_decode_deferred_release_per_release_and_policy():
    new = Version(RELEASE) >= Version("0.5.21")
    out, got = _deferred()
    assert out.returncode == 0, out.stderr[-3000:]
    if not new:
        assert got["state"] == "off" and "decode_destination_hold" in got["reason"], got
        return
    # upstream's hold is on by default on 0.5.21+; kvguard wraps it to quarantine instead of its 30 s
    # blind release
    assert got == {"state": "active", "reason": got["reason"], "upstream_reads": True}, got
    assert "quarantine" in got["reason"], got

    # switched off by the operator: kvguard switches it back on, upstream then reads True
    out, got = _deferred(**{DEFERRED: "0"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert got["state"] == "active" and got["upstream_reads"] is True, got

    out, got = _deferred(**{DEFERRED: "false", "KVGUARD_DEFERRED_RELEASE": "allow"})
    assert got["state"] == "off" and got["upstream_reads"] is False, got

    out, _ = _deferred(**{DEFERRED: "0", "KVGUARD_DEFERRED_RELEASE": "refuse"})
    assert out.returncode != 0  # fail closed: refused guard, --kvguard-on-unknown=refuse
    assert "decode_deferred_release" in out.stderr and DEFERRED in out.stderr, out.stderr[-3000:]
