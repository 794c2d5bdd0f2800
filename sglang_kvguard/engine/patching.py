"""Replacing upstream functions with guarded wrappers, reversibly.

Wrappers are plain functions (``functools.wraps``), not proxy objects: SGLang pickles
some module-level functions by reference (e.g. the scheduler process entry passed to
``multiprocessing.Process`` under the spawn start method); a plain function with the
original ``__module__``/``__qualname__`` that is also the module's attribute pickles
exactly like the original.

A module-level function that upstream imported *by value* into other modules
(``from sglang.srt.mem_cache.common import release_kv_cache``) is replaced in every
loaded ``sglang.*`` module that holds the original object, too.
"""

from __future__ import annotations

import functools
import importlib
import sys
import threading
import types
from dataclasses import dataclass, field
from typing import Any, Callable, List, Tuple

MARK = "__kvguard_wrapped__"
ORIGINAL = "__kvguard_original__"


class PatchError(RuntimeError):
    pass


@dataclass
class Applied:
    key: str
    guard: str
    owner: Any
    attr: str
    original_raw: Any  # what was in owner.__dict__ (function, staticmethod, classmethod)
    wrapped_raw: Any
    aliases: List[Tuple[Any, str]] = field(default_factory=list)


def resolve_owner(module_name: str, qualname: str) -> Tuple[Any, str]:
    module = sys.modules.get(module_name) or importlib.import_module(module_name)
    parts = qualname.split(".")
    owner: Any = module
    for part in parts[:-1]:
        owner = getattr(owner, part)
    return owner, parts[-1]


def _unwrap_raw(raw: Any) -> Tuple[Callable, Callable[[Callable], Any]]:
    """Return (function, rewrap) for a class-dict entry or a module function."""
    if isinstance(raw, staticmethod):
        return raw.__func__, staticmethod
    if isinstance(raw, classmethod):
        return raw.__func__, classmethod
    return raw, lambda f: f


class Patcher:
    """Applies and reverts wrappers; thread-safe and idempotent per target."""

    def __init__(self, alias_prefixes: Tuple[str, ...] = ("sglang",)) -> None:
        self._lock = threading.RLock()
        self.applied: List[Applied] = []
        self.alias_prefixes = alias_prefixes

    def is_applied(self, key: str, guard: str) -> bool:
        return any(a.key == key and a.guard == guard for a in self.applied)

    def wrap(
        self,
        key: str,
        guard: str,
        module_name: str,
        qualname: str,
        factory: Callable[[Callable], Callable],
    ) -> Applied:
        """Replace ``module:qualname`` with ``factory(original)``."""
        with self._lock:
            for a in self.applied:
                if a.key == key and a.guard == guard:
                    return a
            owner, attr = resolve_owner(module_name, qualname)
            raw = owner.__dict__.get(attr)
            if raw is None:
                raise PatchError(
                    f"{module_name}:{qualname}: no attribute {attr!r} defined on "
                    f"{getattr(owner, '__name__', owner)!r}"
                )
            func, rewrap = _unwrap_raw(raw)
            if not callable(func):
                raise PatchError(f"{module_name}:{qualname} is not callable")
            base = func
            while getattr(base, ORIGINAL, None) is not None:
                base = getattr(base, ORIGINAL)
            if getattr(base, "__qualname__", None) != qualname or getattr(base, "__module__", None) != module_name:
                raise PatchError(
                    f"{module_name}:{qualname} resolves to "
                    f"{getattr(base, '__module__', '?')}:{getattr(base, '__qualname__', '?')}, "
                    "not the reviewed definition"
                )
            wrapper = factory(func)
            functools.update_wrapper(wrapper, func)
            setattr(wrapper, ORIGINAL, func)
            marks = set(getattr(func, MARK, ()))
            marks.add(guard)
            setattr(wrapper, MARK, tuple(sorted(marks)))
            new_raw = rewrap(wrapper)
            setattr(owner, attr, new_raw)
            applied = Applied(key, guard, owner, attr, raw, new_raw)
            if "." not in qualname:
                applied.aliases = _replace_aliases(func, wrapper, owner, self.alias_prefixes)
            self.applied.append(applied)
            return applied

    def revert_all(self) -> int:
        with self._lock:
            n = 0
            for a in reversed(self.applied):
                if a.owner.__dict__.get(a.attr) is a.wrapped_raw:
                    setattr(a.owner, a.attr, a.original_raw)
                    n += 1
                func, _ = _unwrap_raw(a.wrapped_raw)
                orig, _ = _unwrap_raw(a.original_raw)
                if isinstance(a.owner, types.ModuleType):
                    for mod, name in a.aliases:
                        if getattr(mod, name, None) is func:
                            setattr(mod, name, orig)
                    # Late by-value importers picked up the wrapper; put the original back.
                    _replace_aliases(func, orig, a.owner, self.alias_prefixes)
            self.applied.clear()
            return n


def _replace_aliases(old: Callable, new: Callable, skip: Any, prefixes: Tuple[str, ...]) -> List[Tuple[Any, str]]:
    replaced = []
    for name, mod in list(sys.modules.items()):
        if mod is None or mod is skip:
            continue
        if not any(name == p or name.startswith(p + ".") for p in prefixes):
            continue
        d = getattr(mod, "__dict__", None)
        if not d:
            continue
        for attr, value in list(d.items()):  # a snapshot: imports may run meanwhile
            if value is old:
                setattr(mod, attr, new)
                replaced.append((mod, attr))
            elif getattr(value, "__module__", None) == name:
                # Default arguments captured the original by value, e.g.
                # ``def launch(..., run_scheduler_process_func=run_scheduler_process)``.
                funcs = [value]
                if isinstance(value, type):
                    funcs = [getattr(v, "__func__", v) for v in list(vars(value).values())]
                for f in funcs:
                    try:
                        _replace_in_defaults(f, old, new)
                    except (AttributeError, TypeError):
                        pass  # not a plain function after all
    return replaced


def _replace_in_defaults(func: Any, old: Callable, new: Callable) -> None:
    if not isinstance(func, types.FunctionType):
        return
    defaults = getattr(func, "__defaults__", None)
    if defaults and any(d is old for d in defaults):
        func.__defaults__ = tuple(new if d is old else d for d in defaults)
    kwdefaults = getattr(func, "__kwdefaults__", None)
    if kwdefaults and any(v is old for v in kwdefaults.values()):
        func.__kwdefaults__ = {k: (new if v is old else v) for k, v in kwdefaults.items()}


def guards_on(func: Any) -> Tuple[str, ...]:
    func, _ = _unwrap_raw(func)
    return tuple(getattr(func, MARK, ()))
