"""Shared constants of the server tier (imported by conftest.py and the test modules;
a uniquely named module, since several conftest.py files exist in this repo)."""
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CPU_SHIM_DIR = HERE / "cpu_shim"  # test-only SGLang plugin, see cpu_shim/kvguard_test_cpu_shim.py
CPU_SHIM_PLUGIN = "kvguard_test_cpu_shim"
STUBS_DIR = REPO / "tests" / "stubs"  # stand-ins for torchvision / sgl_kernel (no CPU wheels)

# The incident geometry, scaled down: prefill's pool is smaller than the advertised
# context; decode's pool holds the whole context.
CONTEXT_LENGTH = 1024
PREFILL_POOL = 256
DECODE_POOL = 2048
VOCAB = 256
