"""Shared machinery for the test-bed stand-ins in this directory.

This directory is put on ``sys.path`` (after site-packages) by a ``.pth`` file that
``scripts/testbed.sh`` writes into the test-bed virtualenv, so every Python process
started from that venv -- including SGLang's server subprocesses -- can import the
stand-ins. They exist ONLY for native packages that have no CPU build on the package
index (see the docstring of each stand-in package). They never replace SGLang's own
Python code.

Contract of every stand-in:
* importing it (and any submodule it creates on demand) succeeds;
* touching attributes is allowed, so SGLang's module-level ``from X import name``
  statements and attribute chains such as ``InterpolationMode.BICUBIC`` work;
* CALLING anything fails loudly: it raises ``StubCalledError`` AND appends a line to
  the file named by ``$KVGUARD_STUB_CALL_LOG`` (when set). The log matters because
  SGLang sometimes wraps optional native calls in ``try/except Exception``; the
  component/server test fixtures assert that the log stays empty.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import threading
import traceback
import types

STUB_VERSION = "0.0.0+kvguard.stub"
CALL_LOG_ENV = "KVGUARD_STUB_CALL_LOG"

_log_lock = threading.Lock()


class StubCalledError(RuntimeError):
    """Raised when code calls into a test-bed stand-in for a native package."""


def record_call(qualname: str) -> None:
    """Append one line describing a stand-in call to $KVGUARD_STUB_CALL_LOG."""
    path = os.environ.get(CALL_LOG_ENV)
    if not path:
        return
    # drop record_call, fail_call and the StubAttr dunder frame: show the caller
    frames = traceback.extract_stack(limit=12)[:-3]
    where = " <- ".join(f"{f.filename}:{f.lineno}" for f in reversed(frames[-3:]))
    line = f"pid={os.getpid()} called={qualname} at={where}\n"
    try:
        with _log_lock, open(path, "a", encoding="utf-8") as fh:
            fh.write(line)
    except OSError:
        pass  # the raise below still makes the call fail loudly


def fail_call(qualname: str, why: str):
    record_call(qualname)
    raise StubCalledError(
        f"{qualname} was called, but it belongs to a kvguard TEST-BED STAND-IN "
        f"(tests/stubs): {why} The real native package is not installed; this code "
        f"path cannot run on the CPU test bed."
    )


class StubAttr:
    """Placeholder for any attribute of a stand-in module.

    Attribute access chains (returning more placeholders); calling, iterating or
    using it as a number raises.
    """

    __slots__ = ("_kv_name", "_kv_why")

    def __init__(self, name: str, why: str):
        object.__setattr__(self, "_kv_name", name)
        object.__setattr__(self, "_kv_why", why)

    def __getattr__(self, item: str):
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        return StubAttr(f"{self._kv_name}.{item}", self._kv_why)

    def __call__(self, *args, **kwargs):
        fail_call(self._kv_name, self._kv_why)

    def __iter__(self):
        fail_call(f"iter({self._kv_name})", self._kv_why)

    def __bool__(self):
        # Truthiness checks such as `if some_kernel:` are treated as a use.
        fail_call(f"bool({self._kv_name})", self._kv_why)

    def __repr__(self):
        return f"<kvguard test-bed stand-in {self._kv_name}>"

    def __mro_entries__(self, bases):
        fail_call(f"subclassing {self._kv_name}", self._kv_why)


class StubModule(types.ModuleType):
    """A module whose unknown attributes are StubAttr placeholders."""

    def __init__(self, name: str, why: str):
        super().__init__(name)
        self.__dict__["_kv_why"] = why
        self.__dict__["__version__"] = STUB_VERSION
        self.__dict__["__kvguard_stub__"] = True

    def __getattr__(self, item: str):
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        return StubAttr(f"{self.__name__}.{item}", self.__dict__["_kv_why"])


class _StubLoader(importlib.abc.Loader):
    def __init__(self, why: str):
        self._why = why

    def create_module(self, spec):
        mod = StubModule(spec.name, self._why)
        mod.__path__ = []  # every stand-in module can have submodules
        return mod

    def exec_module(self, module):
        pass


class StubFinder(importlib.abc.MetaPathFinder):
    """Creates ``<root>.<anything>`` submodules on demand, except ``blocked`` ones."""

    def __init__(self, root: str, why: str, blocked: tuple[str, ...] = ()):
        self.root = root
        self.why = why
        self.blocked = blocked

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(self.root + "."):
            return None
        for b in self.blocked:
            if fullname == b or fullname.startswith(b + "."):
                return None  # -> ModuleNotFoundError, as if the package lacked it
        return importlib.machinery.ModuleSpec(
            fullname, _StubLoader(self.why), is_package=True
        )


def install_package_stub(package_module, why: str, blocked: tuple[str, ...] = ()):
    """Turn an already-imported stand-in package into a StubModule-like package."""
    root = package_module.__name__
    for finder in sys.meta_path:
        if isinstance(finder, StubFinder) and finder.root == root:
            break
    else:
        sys.meta_path.append(StubFinder(root, why, blocked))
    package_module.__class__ = StubModule
    package_module.__dict__["_kv_why"] = why
    package_module.__dict__["__version__"] = STUB_VERSION
    package_module.__dict__["__kvguard_stub__"] = True
