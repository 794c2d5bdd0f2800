"""Fixtures for the component tier: real SGLang classes on CPU.

Run with a test-bed interpreter (SGLang, torch CPU and the stand-ins installed):

    VENV=$(scripts/testbed.sh 0.5.23 | tail -n1)
    "$VENV/bin/python" -m pytest tests/component

Outside a test bed (no ``sglang`` importable) every test here is skipped.
"""

from __future__ import annotations

import contextlib
import inspect
import importlib.util
import sys
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None and (
    importlib.util.find_spec("torch") is not None
)
_SKIP_REASON = (
    "component tests need a test-bed venv with real SGLang: "
    "VENV=$(scripts/testbed.sh VERSION | tail -n1); $VENV/bin/python -m pytest tests/component"
)


def pytest_collection_modifyitems(config, items):
    if HAVE_SGLANG:
        return
    skip = pytest.mark.skip(reason=_SKIP_REASON)
    for item in items:
        if str(item.fspath).startswith(str(_HERE)):
            item.add_marker(skip)


def pytest_report_header(config):
    if not HAVE_SGLANG:
        return ["component tier: no sglang importable -> skipped"]
    import importlib.metadata as md

    return [
        f"component tier: sglang {md.version('sglang')}, torch {md.version('torch')}"
    ]


# ---------------------------------------------------------------------------------
# stand-in guard
# ---------------------------------------------------------------------------------
STUB_LOG_ENV = "KVGUARD_STUB_CALL_LOG"


@pytest.fixture(autouse=True)
def stub_call_log(tmp_path, monkeypatch):
    """Point $KVGUARD_STUB_CALL_LOG at a fresh file for this test (inherited by any
    subprocess it starts) and FAIL the test if any stand-in in tests/stubs
    (torchvision, sgl_kernel) was called -- even if SGLang swallowed the
    StubCalledError."""
    log = tmp_path / "kvguard-stub-calls.log"
    monkeypatch.setenv(STUB_LOG_ENV, str(log))
    yield log
    if log.exists() and log.read_text().strip():
        pytest.fail(
            "a test-bed stand-in for a native package was called; this path cannot "
            "run on the CPU test bed:\n" + log.read_text(),
            pytrace=False,
        )


# ---------------------------------------------------------------------------------
# SGLang helpers
# ---------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _fresh_metadata_row_pins():
    """Metadata-row pins and suspended guards are per process (one scheduler each); here
    every test starts with none, so a row a test left pinned never holds another test's
    free."""
    yield
    try:
        from sglang_kvguard.engine import suspension
        from sglang_kvguard.lifetime.page_hold import ROWS
    except ImportError:
        return
    ROWS.reset()
    suspension.reset()  # a warn-policy check in one test never switches guards off in the next


@pytest.fixture(scope="session")
def sgl():
    """The helper module (``tests/component/_sglang_components.py``)."""
    if not HAVE_SGLANG:
        pytest.skip(_SKIP_REASON)
    import _sglang_components

    return _sglang_components


@pytest.fixture(scope="session")
def sglang_version(sgl):
    """``packaging.version.Version`` of the installed SGLang."""
    return sgl.SGLANG_VERSION


@pytest.fixture
def torch_alloc_kernels(sgl):
    """For releases <= 0.5.21, whose ``PagedTokenToKVPoolAllocator.alloc_extend`` /
    ``alloc_decode`` always launch Triton kernels (which fail on CPU with
    "0 active drivers"), replace exactly those two launches with a pure-torch
    equivalent (test-side shim, see ``_sglang_components._torch_alloc_extend``; its
    equivalence with the real kernels is checked under ``TRITON_INTERPRET=1`` in
    test_components_smoke.py). Yields ``{name: shim}`` or ``None`` on releases that
    already fall back to torch on CPU."""
    with sgl.torch_alloc_kernels() as shims:
        yield shims


@pytest.fixture
def make_side(sgl, torch_alloc_kernels):
    """Factory: ``with make_side("prefill" | "decode", **kw) as side:`` publishes a
    configuration for that PD role (page size 16, fake transfer backend) and builds
    real pools, allocator, radix cache, metadata buffers and queues on CPU.

    Only one role's configuration can be published at a time (0.5.18+ keep it in a
    process-global context), so use one ``with`` block per role."""

    @contextlib.contextmanager
    def factory(mode: str, *, page_size: int = 16, config: dict | None = None, **kw):
        fields = dict(
            disaggregation_mode=mode,
            disaggregation_transfer_backend="fake",
            page_size=page_size,
        )
        fields.update(config or {})
        with sgl.sglang_config(**fields) as server_args:
            side = sgl.make_pd_side(mode, server_args=server_args, page_size=page_size, **kw)
            side.kernel_shims = torch_alloc_kernels
            yield side

    return factory


@pytest.fixture
def fake_manager_keeps_kv_args(monkeypatch):
    """0.5.10-0.5.11's fake transfer backend drops the ``KVArgs`` its queue built and
    handed it (Mooncake's manager keeps them on every release): keep them, so tests read
    the same real ``KVArgs`` upstream gives Mooncake."""
    try:
        from sglang.srt.disaggregation.fake.conn import FakeKVManager
    except ImportError:
        return
    if "self.kv_args = args" in inspect.getsource(FakeKVManager.__init__):
        return
    original = FakeKVManager.__init__

    def __init__(self, args, *a, **kw):
        original(self, args, *a, **kw)
        self.kv_args = args

    monkeypatch.setattr(FakeKVManager, "__init__", __init__)


@pytest.fixture
def prefill_side(make_side):
    with make_side("prefill") as side:
        yield side


@pytest.fixture
def decode_side(make_side):
    with make_side("decode") as side:
        yield side


@pytest.fixture
def kvguard():
    """kvguard installed on the real SGLang classes for one test (yields the report)."""
    import sglang_kvguard

    report = sglang_kvguard.install()
    try:
        yield report
    finally:
        sglang_kvguard.uninstall()


@pytest.fixture
def install_kvguard(monkeypatch):
    """``install(**env)``: install kvguard with those ``KVGUARD_*`` variables set for this
    test (returns the report); uninstalled, and the page holds forgotten, at test end."""
    import sglang_kvguard

    def install(**env):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        return sglang_kvguard.install()

    try:
        yield install
    finally:
        sglang_kvguard.uninstall()
        from sglang_kvguard.lifetime.page_hold import HOLDS

        HOLDS.clear()


@pytest.fixture
def bootstrap_server(sgl):
    """SGLang's real ``CommonKVBootstrapServer`` on a free loopback port; yields the port."""
    server, port = sgl.start_bootstrap_server()
    try:
        yield port
    finally:
        server.close()
