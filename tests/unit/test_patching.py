import pickle
import sys
import types

import pytest

from sglang_kvguard.engine.patching import Patcher, PatchError, guards_on


@pytest.fixture
def fake_pkg():
    """A throwaway package (not SGLang) to exercise the patcher's mechanics."""
    src = types.ModuleType("kvg_fixture_pkg")
    src.__dict__["__name__"] = "kvg_fixture_pkg"
    exec(
        "def entry(x):\n    return x + 1\n"
        "class Q:\n    def add(self, v):\n        return ('orig', v)\n"
        "    @staticmethod\n    def s(v):\n        return v\n",
        src.__dict__,
    )
    user = types.ModuleType("kvg_fixture_pkg.user")
    user.entry = src.entry  # imported by value, like release_kv_cache upstream
    sys.modules["kvg_fixture_pkg"] = src
    sys.modules["kvg_fixture_pkg.user"] = user
    yield src, user
    del sys.modules["kvg_fixture_pkg"], sys.modules["kvg_fixture_pkg.user"]


def _twice(orig):
    def w(x):
        return orig(x) * 2
    return w


def test_wrap_replaces_by_value_imports_and_reverts(fake_pkg):
    src, user = fake_pkg
    original = src.entry
    p = Patcher(alias_prefixes=("kvg_fixture_pkg",))
    p.wrap("k", "g", "kvg_fixture_pkg", "entry", _twice)
    assert src.entry(1) == 4 and user.entry(1) == 4
    assert guards_on(src.entry) == ("g",)
    # idempotent: a second wrap of the same key by the same guard is a no-op
    p.wrap("k", "g", "kvg_fixture_pkg", "entry", _twice)
    assert src.entry(1) == 4
    # the wrapper keeps the original's identity for pickling by reference
    assert src.entry.__qualname__ == "entry" and src.entry.__module__ == "kvg_fixture_pkg"
    assert pickle.loads(pickle.dumps(src.entry)) is src.entry
    assert p.revert_all() == 1
    assert src.entry is original and user.entry is original
    assert p.revert_all() == 0


def test_wrap_method_and_staticmethod(fake_pkg):
    src, _ = fake_pkg
    p = Patcher(alias_prefixes=("kvg_fixture_pkg",))
    p.wrap("q", "g", "kvg_fixture_pkg", "Q.add", lambda o: (lambda self, v: ("guarded",) + o(self, v)))
    p.wrap("s", "g", "kvg_fixture_pkg", "Q.s", lambda o: (lambda v: o(v) + 100))
    assert src.Q().add(3) == ("guarded", "orig", 3)
    assert src.Q.s(1) == 101 and isinstance(src.Q.__dict__["s"], staticmethod)
    p.revert_all()
    assert src.Q().add(3) == ("orig", 3) and src.Q.s(1) == 1


def test_refuses_what_it_did_not_review(fake_pkg):
    src, _ = fake_pkg
    p = Patcher(alias_prefixes=("kvg_fixture_pkg",))
    with pytest.raises(PatchError, match="no attribute 'nope'"):
        p.wrap("n", "g", "kvg_fixture_pkg", "Q.nope", _twice)
    src.other = src.entry  # an alias defined under another name
    with pytest.raises(PatchError, match="not the reviewed definition"):
        p.wrap("o", "g", "kvg_fixture_pkg", "other", _twice)


def test_defaults_that_captured_the_original_are_replaced(fake_pkg):
    src, user = fake_pkg
    original = src.entry
    exec("def launch(func=entry):\n    return func(1)\n", user.__dict__ | {"entry": original}, ns := {})
    user.launch = ns["launch"]
    user.launch.__module__ = "kvg_fixture_pkg.user"
    p = Patcher(alias_prefixes=("kvg_fixture_pkg",))
    p.wrap("k", "g", "kvg_fixture_pkg", "entry", _twice)
    assert user.launch() == 4
    p.revert_all()
    assert user.launch() == 2
