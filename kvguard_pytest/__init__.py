"""pytest plugin: ``kvguard probe`` checks as tests.

::

    pytest --kvguard-url=http://router:8000 [--kvguard-model M] [--kvguard-limit N]
           [--kvguard-timeout S] [--kvguard-node URL] [--kvguard-api-key KEY]

adds one test per probe check (``kvguard-probe::over_capacity`` ...), each failing
with the probe's reason; ``-k`` selects among them (``-k kvguard`` selects all of
them and nothing else), and the probe runs only the selected checks, once, at the
first of them. WARN passes with a :class:`KVGuardProbeWarning`; SKIP skips.

Registered as the ``pytest11`` entry point ``kvguard`` (module ``kvguard_pytest``), so
pytest loads it in every run where sglang-kvguard is installed. Without ``--kvguard-url`` it only registers
its options: no items, no requests. It imports nothing beyond pytest until then
(the probe itself is standard library only and never imports SGLang).
"""

from __future__ import annotations

import json
import warnings
from typing import Any, Optional

import pytest

__all__ = ["KVGuardProbeWarning", "ProbeItem"]

# This module lives outside the ``sglang_kvguard`` package on purpose: pytest loads
# it in every run where sglang-kvguard is installed, and importing ``sglang_kvguard``
# installs the guards (and refuses on an SGLang release it does not know). The probe
# is imported only when ``--kvguard-url`` is given, and then with auto-install off.
def _quiet_import() -> None:
    import os
    import sys

    if "sglang_kvguard" in sys.modules or "KVGUARD_AUTO_INSTALL" in os.environ:
        return
    os.environ["KVGUARD_AUTO_INSTALL"] = "0"
    try:
        import sglang_kvguard.tools.probe  # noqa: F401  (stdlib only; never imports SGLang)
    finally:
        del os.environ["KVGUARD_AUTO_INSTALL"]


class KVGuardProbeWarning(UserWarning):
    """A probe check reported WARN (heuristic finding; the test passes)."""


class ProbeFailure(Exception):
    def __init__(self, text: str):
        super().__init__(text)
        self.text = text


_REPORT = pytest.StashKey[Any]()


def pytest_addoption(parser):
    g = parser.getgroup("kvguard", "kvguard live probe of a serving deployment (kvguard probe)")
    g.addoption("--kvguard-url", default=None, metavar="URL",
                help="router / server / OpenAI-compatible endpoint to probe; adds one test per probe check")
    g.addoption("--kvguard-model", default=None, help="model name (default: first of /v1/models)")
    g.addoption("--kvguard-limit", type=int, default=None, metavar="N",
                help="longest prompt the deployment should accept, in tokens (default: discovered)")
    g.addoption("--kvguard-timeout", type=float, default=60.0, metavar="S", help="seconds per request (default 60)")
    g.addoption("--kvguard-node", action="append", default=[], metavar="URL",
                help="also read this node's limits; repeatable")
    g.addoption("--kvguard-api-key", default=None, help="sent as 'Authorization: Bearer KEY'")


@pytest.hookimpl(tryfirst=True)  # before -k / -m deselection, so they apply to these items
def pytest_collection_modifyitems(session, config, items):
    if not config.getoption("kvguard_url", None):
        return
    _quiet_import()
    from sglang_kvguard.tools.probe import CHECKS

    parent = ProbeCollector.from_parent(session, name="kvguard-probe", nodeid="kvguard-probe")
    new = [ProbeItem.from_parent(parent, name=name) for name in CHECKS]
    items.extend(new)
    # count them as collected (terminal summary, junitxml), as if a collector had returned them
    config.hook.pytest_collectreport(report=pytest.CollectReport(parent.nodeid, "passed", None, new))


class ProbeCollector(pytest.Collector):
    def collect(self):  # items are created by pytest_collection_modifyitems
        return []

    def reportinfo(self):
        return self.path, None, "kvguard-probe"


class ProbeItem(pytest.Item):
    def reportinfo(self):
        return self.path, None, f"kvguard-probe::{self.name}"

    def _report(self):
        config = self.config
        rep = config.stash.get(_REPORT, None)
        if rep is None:
            _quiet_import()
            from sglang_kvguard.tools.probe import ProbeConfig, ProbeError, Report, run_probe

            selected = [i.name for i in self.session.items if isinstance(i, ProbeItem)] or [self.name]
            url = config.getoption("kvguard_url")
            try:
                cfg = ProbeConfig(url=url, model=config.getoption("kvguard_model"),
                                  limit=config.getoption("kvguard_limit"),
                                  timeout=config.getoption("kvguard_timeout"),
                                  only=selected, api_key=config.getoption("kvguard_api_key"),
                                  nodes=tuple(config.getoption("kvguard_node") or ()))
                rep = run_probe(cfg)
            except ProbeError as exc:
                rep = Report(url, None, [], error=str(exc))
            config.stash[_REPORT] = rep
        return rep

    def runtest(self):
        rep = self._report()
        if rep.error:
            raise ProbeFailure(f"kvguard probe could not run against {rep.url}: {rep.error}")
        res = next((c for c in rep.checks if c.name == self.name), None)
        if res is None:
            pytest.skip(f"check {self.name} was not run")
        self.user_properties.append(("kvguard_status", res.status))
        self.user_properties.append(("kvguard_reason", res.reason))
        self.user_properties.append(("kvguard_measurements", json.dumps(res.measurements, default=str)))
        if res.status == "FAIL":
            raise ProbeFailure(f"{res.name}: {res.reason}\n\nmeasurements:\n"
                               + json.dumps(res.measurements, indent=1, default=str))
        if res.status == "SKIP":
            pytest.skip(f"{res.name}: {res.reason}")
        if res.status == "WARN":
            warnings.warn(KVGuardProbeWarning(f"{res.name}: {res.reason}"))

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, ProbeFailure):
            return excinfo.value.text
        return super().repr_failure(excinfo, style=style)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    rep: Optional[Any] = config.stash.get(_REPORT, None)
    if rep is None:
        return
    _quiet_import()
    from sglang_kvguard.tools.probe import render

    terminalreporter.section("kvguard probe")
    for line in render(rep).splitlines():
        terminalreporter.write_line(line)
