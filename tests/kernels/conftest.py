"""Kernel tier: Triton kernels vs the pure-torch reference, bit for bit.

Without a CUDA device the Triton kernels run under the interpreter
(``TRITON_INTERPRET=1``, set here before the kernels module is imported; Triton reads
the variable when a kernel is defined).  With a CUDA device the same tests launch the
real kernels on it.  Every module starts with ``pytest.importorskip`` of torch and
Triton, so the directory is skipped cleanly where they are not installed.
"""

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("KVGUARD_AUTO_INSTALL", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))

try:
    import torch
except Exception:  # pragma: no cover - depends on the environment
    torch = None

HAS_CUDA = bool(torch is not None and torch.cuda.is_available())
if torch is not None and not HAS_CUDA:
    if "sglang_kvguard.kernels.triton_kernels" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("kvguard's Triton kernels were defined before TRITON_INTERPRET=1 was set", allow_module_level=True)
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = "cuda" if HAS_CUDA else "cpu"


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def force_triton(monkeypatch):
    monkeypatch.setenv("KVGUARD_KERNELS", "triton")


@pytest.fixture
def force_torch(monkeypatch):
    monkeypatch.setenv("KVGUARD_KERNELS", "torch")
