"""kvguard must import, plan and report cleanly where SGLang is absent."""
import importlib.util
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed here")


def test_doctor_reports_off_without_sglang():
    out = subprocess.run([sys.executable, "-m", "sglang_kvguard.cli", "doctor", "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["sglang"] is None
    assert {g["state"] for g in data["guards"]} == {"off"}


def test_import_installs_as_noop_and_logs_banner():
    out = subprocess.run([sys.executable, "-c", "import sglang_kvguard"], capture_output=True, text=True)
    assert out.returncode == 0
    assert "kvguard 0.1.0 sglang=absent" in out.stderr and "admission_drain=off" in out.stderr
