"""Engine tier: kvguard's patch engine against a real SGLang release (test bed venv)."""

import importlib.metadata
import os
import subprocess
import sys

import pytest

# Tests in this process install and uninstall explicitly.
os.environ["KVGUARD_AUTO_INSTALL"] = "0"

try:
    RELEASE = importlib.metadata.version("sglang")
except importlib.metadata.PackageNotFoundError:  # pragma: no cover
    RELEASE = None

if RELEASE is None:
    pytest.skip("engine tier needs a test-bed venv with real SGLang (scripts/testbed.sh)", allow_module_level=True)


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGUARD_")}
    env.update(extra)
    return env


def run_py(args, timeout=300, **env):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=clean_env(**env))


@pytest.fixture
def release():
    return RELEASE
