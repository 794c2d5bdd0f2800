"""kvguard is active, and says so, in every SGLang process of a real PD deployment.

Two ways in, each on real prefill + decode servers behind sglang-router:
* ``kvguard launch`` (here as ``python -m sglang_kvguard.cli launch``; every release):
  the launcher installs kvguard, and every process SGLang spawns re-imports the
  launcher as its main module and installs too (``python -m
  sglang_kvguard.launch_server`` is used by the pool-check tests and the demo);
* SGLang's own plugin loader (entry point group ``sglang.srt.plugins``, 0.5.11+),
  with the plain ``python -m sglang.launch_server``.
The banner of each scheduler process names its PD role and every guard's state.
"""
from __future__ import annotations

import re

import pytest
from packaging.version import Version

from server_tier import CPU_SHIM_PLUGIN, DECODE_POOL, VOCAB
from sglang_kvguard.demo.tinymodel import prompt_of_tokens

pytestmark = pytest.mark.server

BANNER = re.compile(r"kvguard \d+\.\d+\.\d+ sglang=(\S+) pid=(\d+) process=(\S+)(?: role=(\S+))? guards: (.*)")


def _banners(text):
    return [m.groups() for m in BANNER.finditer(text)]


def _expected_state(release):
    return "upstream" if Version(release.version) >= Version("0.5.21") else "active"


def _check(d, release):
    found = {}
    for role in ("prefill", "decode"):
        banners = _banners(d.log_text(role))
        sched = [b for b in banners if b[2] == "scheduler"]
        assert sched, f"no scheduler banner in the {role} log:\n" + d.log_tail(role, 40)
        for version, pid, _, brole, guards in sched:
            assert version == release.version
            assert brole == role, (role, brole)
            assert f"admission_drain={_expected_state(release)}" in guards
            assert "pool_capacity_check=active" in guards
            assert "hybrid_pool_check=active" in guards
        # each scheduler compared its real pools with the page guards and found them covered
        assert f"kvguard hybrid pool check: the {role} node's pool (" in d.log_text(role)
        assert "is one the page guards cover" in d.log_text(role)
        # ... read from what upstream registered with Mooncake: K and V of 2 layers, and the metadata rows
        assert "; transferred: kv (4 buffer(s)): covered by " in d.log_text(role), d.log_tail(role, 40)
        assert "aux (" in d.log_text(role) and "state:" not in d.log_text(role)
        found[role] = banners
    r = d.generate(prompt_of_tokens(40, vocab=VOCAB, offset=3), max_new_tokens=4)
    assert r.status == 200, r
    assert r.json["meta_info"]["prompt_tokens"] == 40
    return found


def test_banner_in_every_scheduler_via_kvguard_launcher(pd_factory, release):
    # pools that hold the context: the pool check (default policy refuse) lets them start
    d = pd_factory("kvguard-launch", launcher="sglang_kvguard.cli launch", prefill_max_total_tokens=DECODE_POOL)
    found = _check(d, release)
    for role, banners in found.items():
        # the launcher process itself logs one banner too, and each process only one
        pids = [b[1] for b in banners]
        assert len(pids) == len(set(pids)), banners
        assert any(b[2] == "main" for b in banners), (role, banners)


def test_banner_in_every_scheduler_via_plugin_entry_point(pd_factory, release):
    if Version(release.version) < Version("0.5.11"):
        pytest.skip(f"SGLang {release.version} has no plugin loader (sglang.srt.plugins appears in 0.5.11)")
    d = pd_factory(
        "plugin",
        launcher="sglang.launch_server",
        sglang_plugins=[CPU_SHIM_PLUGIN, "kvguard"],
        prefill_max_total_tokens=DECODE_POOL,
        env={"KVGUARD_AUTO_INSTALL": "1"},
    )
    _check(d, release)
