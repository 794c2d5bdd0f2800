"""``kvguard probe`` against real PD deployments through sglang-router.

* Unguarded 0.5.19 (the incident's geometry, see test_incident_red.py): the probe
  reports over_capacity FAIL with the incident's reason (HTTP 200 for prompts the
  prefill pool cannot hold) and cross_tenant FAIL (the over-limit prompt's output
  changes with other tenants' traffic: decode attended over their KV), and exits 1.
  The trios serve the tiny model with seeded random weights; with dummy weights no
  output depends on its context and cross_tenant could not fail. Unguarded 0.5.20+: over_capacity FAILs too,
  for the other reason (no answer within the timeout).
* Guarded, pool policy ``warn`` (as in test_rejection_notice.py): over_capacity,
  prompt_tokens and cross_tenant PASS, exit 0.

What the router accepts (sglang-router 0.3.2, PD mode): ``/v1/completions`` with a
token-id ``prompt`` is refused with 422 ("data did not match any variant of untagged
enum StringOrArray"), so the probe falls back to ``/generate`` with ``input_ids``; the
router hides the workers' limits (``/get_server_info`` has none, ``/v1/models`` no
``max_model_len``) but lists the workers under ``/workers``, where the probe reads
prefill's ``max_req_input_len`` (250 -> limit 249).

limit_edges: with a 256-token prefill pool and page 16, upstream's prefill scheduler
admits a prompt only if ``len + 1 + 16 < 256`` (0.5.11+), so unguarded prompts of
239..249 tokens pass every length check and then wait forever. kvguard's
prefill_admission_fit lowers the prefill's accepted length to 239 there, which the
probe reads (limit 238), so limit_edges passes on the guarded trio too; on 0.5.10 (no
page in the estimate) the limit stays 249 and is served.
"""
from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys

import pytest

from server_tier import REPO, rotating_module

pytestmark = pytest.mark.server
pytest_plugins = ["pytester"]

VULNERABLE_UP_TO = (0, 5, 19)  # as in test_incident_red.py
RELAX = ["--kvguard-pool-policy", "warn"]
INCIDENT = "answered a prompt the deployment cannot hold: the incident"
# prefill: upstream max_req_input_len = min(1024 - 1, 256 - 1) - 5 = 250 (admits len < 250);
# kvguard lowers it to 256 - 1 - 16 = 239 where the admission estimate adds a page (0.5.11+)
UPSTREAM_LIMIT = 249
GUARDED_LIMIT = 238


def _limit(release) -> int:
    """The limit the probe reads from the guarded trio."""
    return GUARDED_LIMIT if release.version_tuple >= (0, 5, 11) else UPSTREAM_LIMIT


def _probe(url, *args, timeout=240):
    env = dict(os.environ, KVGUARD_AUTO_INSTALL="0", PYTHONPATH=str(REPO))
    cp = subprocess.run([sys.executable, "-m", "sglang_kvguard.cli", "probe", url, "-q", "--json", "-", *args],
                        capture_output=True, text=True, timeout=timeout, cwd=str(REPO), env=env)
    print(cp.stderr)  # the human summary (stdout holds the JSON)
    assert cp.stdout.strip(), cp.stderr
    return cp.returncode, json.loads(cp.stdout), cp.stderr


def _checks(rep):
    return {c["name"]: c for c in rep["checks"]}


@pytest.fixture(scope="module")
def start(pd_factory, weighted_tiny_model, release):
    """Every trio here serves the tiny model with seeded random weights: with SGLang's
    dummy weights every logit is ~0 and no output depends on its context, so the
    probe's cross_tenant check could not fail whatever decode attended to.

    The probe talks HTTP only; what it meets differs by release mainly in the
    unguarded answer, so in CI this module rotates over the three server releases."""
    rotating_module(release, "the live probe module")
    def go(name, **kw):
        return pd_factory(name, model=weighted_tiny_model, load_format="auto", **kw)
    return go


def test_probe_fails_the_unguarded_deployment_with_the_incident(release, start, tmp_path):
    if release.version_tuple > VULNERABLE_UP_TO:
        pytest.skip(f"SGLang {release.version} does not answer 200 here (see test_incident_red.py); "
                    "the probe would report a timeout / 5xx instead")
    d = start("unguarded", launcher="sglang.launch_server")
    try:
        junit = tmp_path / "probe.xml"
        rc, rep, summary = _probe(d.router_url, "--timeout", "20", "--junit", str(junit))
    finally:
        d.stop()  # free the cores and memory for the guarded trio
    checks = _checks(rep)
    assert rc == 1, summary
    assert rep["discovery"]["limit"] == UPSTREAM_LIMIT, summary
    assert rep["discovery"]["api"] == "generate", summary
    oc = checks["over_capacity"]
    assert oc["status"] == "FAIL" and INCIDENT in oc["reason"], summary
    for r in oc["measurements"]["requests"]:
        assert r["status"] == 200 and r["prompt_tokens"] == r["tokens"] > UPSTREAM_LIMIT, r
    assert checks["prompt_tokens"]["status"] == "PASS", summary
    # the incident's data leak itself: the over-limit prompt's answer is computed over
    # decode pages that still hold other tenants' KV, so it changes with their traffic
    ct = checks["cross_tenant"]
    assert ct["status"] == "FAIL", summary
    assert "output depends on other tenants' traffic: the over-limit victim" in ct["reason"], summary
    assert "the incident" in junit.read_text()


def test_probe_fails_the_unguarded_deployment_after_0_5_19(release, start):
    """0.5.20+ unguarded: no 200, but the client gets nothing until decode's transfer
    timeout (300 s), then a 500 (test_incident_red.py's docstring): still a FAIL."""
    if release.version_tuple <= VULNERABLE_UP_TO:
        pytest.skip("covered by the test above on releases that answer 200")
    d = start("unguarded-late", launcher="sglang.launch_server")
    try:
        rc, rep, summary = _probe(d.router_url, "--timeout", "10", "--only", "over_capacity")
    finally:
        d.stop()
    oc = _checks(rep)["over_capacity"]
    assert rc == 1 and oc["status"] == "FAIL", summary
    assert INCIDENT not in oc["reason"], summary
    assert "no answer within 10 s" in oc["reason"] or "not reach the client as a client error" in oc["reason"], summary


@pytest.fixture(scope="module")
def guarded(start):
    return start("guarded", launcher="sglang_kvguard.launch_server",
                      prefill_extra_args=RELAX, decode_extra_args=RELAX)


def test_probe_passes_the_guarded_deployment(guarded, release):
    rc, rep, summary = _probe(guarded.router_url, "--timeout", "30",
                              "--only", "over_capacity,prompt_tokens,cross_tenant,prefill_speed")
    checks = _checks(rep)
    assert rc == 0, summary
    assert rep["discovery"]["limit"] == _limit(release), summary
    for name in ("over_capacity", "prompt_tokens", "cross_tenant"):
        assert checks[name]["status"] == "PASS", summary
    for r in checks["over_capacity"]["measurements"]["requests"]:
        assert r["status"] == 400 and r["latency_s"] < 10, r
    assert "exceeds the maximum allowed length" in checks["over_capacity"]["measurements"]["requests"][0]["body"]
    assert checks["prefill_speed"]["status"] != "FAIL"


def test_pytest_plugin_against_the_guarded_deployment(guarded, pytester):
    """The probe's checks as pytest tests; with prefill_admission_fit the at-limit
    prompt is served, so both pass."""
    args = [f"--kvguard-url={guarded.router_url}", "--kvguard-timeout=10", "-k", "over_capacity or limit_edges",
            "-p", "kvguard_pytest"]
    if any(ep.value == "kvguard_pytest" for ep in md.entry_points(group="pytest11")):
        args = args[:-2]  # the installed distribution registers it already
    res = pytester.runpytest_inprocess(*args)
    res.assert_outcomes(passed=2, deselected=3)


def test_probe_passes_every_check_on_a_correctly_sized_guarded_deployment(start, guarded):
    """Pools that hold the context (2048 >= 1024): every check passes, exit 0,
    including the prompts at and one past the limit."""
    guarded.stop()  # free the cores for this trio (the guarded trio's tests ran above)
    d = start("guarded-sized", launcher="sglang_kvguard.launch_server", prefill_max_total_tokens=2048)
    rc, rep, summary = _probe(d.router_url, "--timeout", "60")
    checks = _checks(rep)
    assert rc == 0, summary
    assert [c["status"] for c in checks.values()].count("FAIL") == 0, summary
    for name in ("over_capacity", "limit_edges", "prompt_tokens", "cross_tenant"):
        assert checks[name]["status"] == "PASS", summary
