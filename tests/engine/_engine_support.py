"""Helpers shared by the engine-tier tests (a unique module name: several conftest.py exist)."""

import importlib.metadata
import os
import subprocess
import sys

try:
    RELEASE = importlib.metadata.version("sglang")
except importlib.metadata.PackageNotFoundError:  # pragma: no cover
    RELEASE = None


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGUARD_")}
    env.update(extra)
    return env


def run_py(args, timeout=300, **env):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=clean_env(**env))
