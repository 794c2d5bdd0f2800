"""Server tier: real SGLang prefill + decode servers and the PD router on loopback (CPU).

Run with the python of a test bed (scripts/testbed.sh), e.g.::

    VENV=$(scripts/testbed.sh 0.5.19 | tail -n1)
    "$VENV/bin/python" -m pytest tests/server -v

Logs: every process writes its own file under ``$KVGUARD_TEST_LOGDIR/<module>/<name>/``
(default: pytest's tmp dir, printed in the summary). When a test fails, the tail of
each log is attached to the failure report. ``stats.json`` beside the logs holds
start-up time and peak RSS; the terminal summary prints them.

The unguarded servers run with ``SGLANG_PLUGINS=kvguard_test_cpu_shim`` (SGLang's
plugin allow-list) and ``KVGUARD_AUTO_INSTALL=0``: kvguard is installed (editable)
in the test bed and registers an entry-point plugin, which would otherwise guard
the "unguarded" baseline too.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Dict, List

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_tier import (  # noqa: E402
    CONTEXT_LENGTH,
    CPU_SHIM_DIR,
    CPU_SHIM_PLUGIN,
    DECODE_POOL,
    HERE,
    PREFILL_POOL,
    STUBS_DIR,
    VOCAB,
)

# The test runner itself needs no guards; keep `import sglang_kvguard` from installing
# them in this process (servers are separate processes with their own env).
_prev = os.environ.get("KVGUARD_AUTO_INSTALL")
os.environ["KVGUARD_AUTO_INSTALL"] = "0"
try:
    from sglang_kvguard.demo.deployment import DeploymentError, PDDeployment, probe_release
    from sglang_kvguard.demo.tinymodel import make_tiny_model
finally:
    if _prev is None:
        os.environ.pop("KVGUARD_AUTO_INSTALL", None)
    else:
        os.environ["KVGUARD_AUTO_INSTALL"] = _prev

# module nodeid -> live deployments (for failure reports)
_ACTIVE: Dict[str, List[PDDeployment]] = {}
_STATS: List[dict] = []
_STUCK: List[str] = []  # deployments that did not come up and were started again


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.server)


@pytest.fixture(scope="session")
def release():
    """What the SGLang installed for this python supports; skips without a test bed."""
    try:
        info = probe_release(sys.executable)
    except DeploymentError as e:
        pytest.skip(f"server tier needs a test bed with SGLang installed (scripts/testbed.sh): {e}")
    if not info.has_router:
        pytest.skip("server tier needs sglang-router in this environment (scripts/testbed.sh)")
    return info


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model") / "llama", context_length=CONTEXT_LENGTH, vocab=VOCAB)


@pytest.fixture(scope="session")
def weighted_tiny_model(tmp_path_factory):
    """The same tiny Llama with seeded random weights (start with ``load_format="auto"``):
    its output depends on the context it attends to."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model-w") / "llama", context_length=CONTEXT_LENGTH,
                           vocab=VOCAB, weights_seed=0)


def _log_root(tmp_path_factory) -> Path:
    env = os.environ.get("KVGUARD_TEST_LOGDIR")
    if env:
        p = Path(env)
        p.mkdir(parents=True, exist_ok=True)
        return p
    return tmp_path_factory.getbasetemp() / "server-logs"


def _server_pythonpath() -> List[Path]:
    paths = [CPU_SHIM_DIR]
    # The test bed puts tests/stubs on sys.path through a .pth file; add it anyway
    # for hand-made environments (it is harmless twice).
    if STUBS_DIR.is_dir():
        paths.append(STUBS_DIR)
    return paths


@pytest.fixture(scope="module")
def pd_factory(request, release, tiny_model, tmp_path_factory):
    """Return ``start(name, **PDDeployment kwargs)``; everything started is torn down
    when the module ends, whatever happened."""
    module_id = request.node.nodeid
    started: List[PDDeployment] = []
    _ACTIVE[module_id] = started
    stack = contextlib.ExitStack()

    def start(name: str, **kw) -> PDDeployment:
        log_dir = _log_root(tmp_path_factory) / Path(module_id).stem / name
        if log_dir.exists():
            shutil.rmtree(log_dir)
        env = {"KVGUARD_AUTO_INSTALL": "0", "KVGUARD_TEST_STACK_DUMPS": "1"}
        env.update(kw.pop("env", {}))
        kw.setdefault("prefill_max_total_tokens", PREFILL_POOL)
        kw.setdefault("decode_max_total_tokens", DECODE_POOL)
        kw.setdefault("context_length", CONTEXT_LENGTH)
        kw.setdefault("sglang_plugins", [CPU_SHIM_PLUGIN])
        kw.setdefault("extra_pythonpath", _server_pythonpath())
        model = kw.pop("model", tiny_model)
        for attempt in (1, 2):
            d = PDDeployment(model, log_dir=log_dir, python=sys.executable, env=env, **kw)
            started.append(d)
            try:
                d.start()  # on failure: DeploymentError carrying the log tails (and stacks)
                stack.callback(_finish, d, module_id, name)
                return d
            except DeploymentError as e:
                if attempt == 2 or "to become healthy" not in str(e):
                    stack.callback(_finish, d, module_id, name)
                    d.stop()
                    raise
                started.remove(d)
                d.stop()
                # A server that never answered /health (seen once in ~300 starts, 0.5.23
                # decode, CI): keep its logs and stack dumps, say so, start once more.
                kept = log_dir.with_name(log_dir.name + ".stuck-start")
                shutil.rmtree(kept, ignore_errors=True)
                log_dir.rename(kept)
                _STUCK.append(f"{module_id}::{name}: {str(e).splitlines()[0]} (logs and stacks: {kept})")
            except BaseException:
                stack.callback(_finish, d, module_id, name)
                d.stop()
                raise
        raise AssertionError("unreachable")

    try:
        yield start
    finally:
        stack.close()
        _ACTIVE.pop(module_id, None)


@pytest.fixture(autouse=True)
def _stop_trios_the_test_started(request):
    """A trio started in a test's body is stopped when the test ends, not at module end.

    An idle SGLang scheduler on CPU spins (measured here: each of an idle trio's two
    schedulers used one full core), so a trio left up slows every later start and test
    of the module on a 2-core machine. Trios that module fixtures started (they are set
    up before this fixture) stay until the module ends; the failure report has already
    taken the logs when this runs."""
    module_id = request.node.nodeid.split("::")[0]
    before = {id(d) for d in _ACTIVE.get(module_id, ())}
    yield
    for d in [d for d in _ACTIVE.get(module_id, ()) if id(d) not in before]:
        try:
            d.stop()
        except Exception:  # noqa: BLE001 - stopped again (and reported) at module end
            pass


def _finish(d: PDDeployment, module_id: str, name: str) -> None:
    try:
        d.stop()
    finally:
        st = dict(d.stats(), module=module_id, name=name, log_dir=str(d.log_dir))
        _STATS.append(st)
        try:
            (Path(d.log_dir) / "stats.json").write_text(json.dumps(st, indent=2))
        except OSError:
            pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.failed and rep.when in ("setup", "call"):
        mod = item.module.__name__ if item.module else None
        for module_id, deps in list(_ACTIVE.items()):
            if mod and Path(module_id).stem != mod.rsplit(".", 1)[-1]:
                continue
            for d in deps:
                rep.sections.append((f"PD deployment logs ({d.log_dir})", d.describe(lines=60)))


def pytest_terminal_summary(terminalreporter):
    tr = terminalreporter
    if _STUCK:
        tr.section("kvguard server tier: deployments started twice (first start never became healthy)")
        for line in _STUCK:
            tr.write_line(line)
    if not _STATS:
        return
    tr.section("kvguard server tier: deployments")
    for st in _STATS:
        up = st.get("startup_seconds")
        tr.write_line(
            f"{st['module']}::{st['name']} sglang {st['sglang']} launcher={st['launcher']} "
            f"healthy_in={up:.1f}s peak_rss_total={st['peak_rss_total_mib']}MiB {st['peak_rss_mib']}"
            if up is not None
            else f"{st['module']}::{st['name']} did not come up; logs: {st['log_dir']}"
        )
        tr.write_line(f"    logs: {st['log_dir']}")
