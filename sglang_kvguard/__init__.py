"""sglang-kvguard: fail-closed KV-cache ownership guards for SGLang PD serving.

``import sglang_kvguard`` before SGLang starts installs every guard in this process
(and, through multiprocessing's re-import of the main module, in the processes SGLang
spawns). Set ``KVGUARD_AUTO_INSTALL=0`` to import without installing, then call
:func:`install` yourself. The ``kvguard`` command and ``python -m
sglang_kvguard.launch_server`` install explicitly, at the right moment.
"""

from __future__ import annotations

import os
import sys

from .engine import config as _config
from .engine.version import __version__

__all__ = ["install", "uninstall", "plan", "KVGuardRefused", "__version__"]


def _load_guard_flags() -> None:
    from . import guards  # noqa: F401 - each guard registers its own flags at import


_config.FLAG_SOURCES.append(_load_guard_flags)


def install(config=None):
    """Install every guard that applies to the running SGLang (idempotent)."""
    from .activation.install import install as _install

    return _install(config)


def uninstall() -> int:
    from .activation.install import uninstall as _uninstall

    return _uninstall()


def plan(config=None):
    from .activation.install import plan as _plan

    return _plan(config)[0]


def __getattr__(name):
    if name == "KVGuardRefused":
        from .engine.runtime import KVGuardRefused

        return KVGuardRefused
    raise AttributeError(name)


def _started_by_kvguard_command() -> bool:
    """The kvguard CLI and launcher install explicitly; do not auto-install for them."""
    import multiprocessing

    if getattr(multiprocessing.current_process(), "_inheriting", False):
        return False  # a spawned child re-importing its parent's main: install here
    if multiprocessing.parent_process() is not None:
        return False
    argv = list(getattr(sys, "orig_argv", sys.argv))
    if "-m" in argv:
        i = argv.index("-m")
        if i + 1 < len(argv) and argv[i + 1].split(".")[0] == "sglang_kvguard":
            return True
    return os.path.basename(sys.argv[0] if sys.argv else "") == "kvguard"


if os.environ.get("KVGUARD_AUTO_INSTALL", "1") not in ("0", "false", "no") and not _started_by_kvguard_command():
    install()
