"""Engine tier: kvguard's patch engine against a real SGLang release (test bed venv)."""

import os
import sys
from pathlib import Path

import pytest

# Tests in this process install and uninstall explicitly.
os.environ["KVGUARD_AUTO_INSTALL"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _engine_support import RELEASE  # noqa: E402

if RELEASE is None:
    pytest.skip("engine tier needs a test-bed venv with real SGLang (scripts/testbed.sh)", allow_module_level=True)


@pytest.fixture
def release():
    return RELEASE
