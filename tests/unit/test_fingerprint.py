from sglang_kvguard.engine.fingerprint import find_definition, fingerprint_source, normalise
import ast

SRC = '''
import os

class Queue:
    """doc"""

    def add(self, req, n):
        # a comment
        if req:
            return n + 1
        return n

    @staticmethod
    def helper(x):
        return x


def top(a, b=2):
    return a * b
'''


def test_finds_methods_and_functions():
    tree = ast.parse(SRC)
    assert find_definition(tree, "Queue.add").name == "add"
    assert find_definition(tree, "top").name == "top"
    assert find_definition(tree, "Queue.missing") is None
    assert find_definition(tree, "missing") is None


def test_layout_and_comments_do_not_count():
    reformatted = SRC.replace("        # a comment\n", "").replace("return n + 1", "return n  +  1  # x")
    reformatted = reformatted.replace("\n\ndef top", "\n\n\n\ndef top")
    for q in ("Queue.add", "top", "Queue.helper"):
        assert fingerprint_source(SRC, q) == fingerprint_source(reformatted, q)


def test_code_changes_do_count():
    changed = SRC.replace("return n + 1", "return n + 2")
    assert fingerprint_source(SRC, "Queue.add") != fingerprint_source(changed, "Queue.add")
    assert fingerprint_source(SRC, "top") == fingerprint_source(changed, "top")


def test_decorator_counts():
    changed = SRC.replace("@staticmethod", "@classmethod")
    assert fingerprint_source(SRC, "Queue.helper") != fingerprint_source(changed, "Queue.helper")


def test_same_code_at_other_indent_has_same_fingerprint():
    nested = "class Outer:\n" + "".join("    " + l + "\n" if l else "\n" for l in SRC.splitlines())
    assert fingerprint_source(nested, "Outer.Queue.add") == fingerprint_source(SRC, "Queue.add")


def test_ambiguous_definition_is_missing():
    src = "if X:\n    def f():\n        return 1\n" + "def g():\n    pass\n" * 2
    assert fingerprint_source(src, "g") is None  # defined twice: ambiguous
    assert normalise("x = 1\n") == "x\x1f=\x1f1\x1f<NL>"


def _forget(fp_mod):
    fp_mod._FOUND.clear()
    fp_mod.release_parse_cache()


def test_file_fingerprints_are_cached_on_disk_by_content(tmp_path, monkeypatch):
    """The on-disk cache spares the next process the parse, and never vouches for other bytes."""
    import sglang_kvguard.engine.fingerprint as fp_mod

    cache = tmp_path / "cache"
    monkeypatch.setenv("KVGUARD_FINGERPRINT_CACHE", str(cache))
    src = tmp_path / "mod.py"
    src.write_text(SRC)
    _forget(fp_mod)
    first = fp_mod.fingerprint_file(str(src), "Queue.add")
    assert first == fingerprint_source(SRC, "Queue.add")
    assert fp_mod.fingerprint_file(str(src), "nope") is None
    assert len(list(cache.glob("*.json"))) == 1

    _forget(fp_mod)  # a new process: nothing in memory, the parse must not run
    monkeypatch.setattr(fp_mod.ast, "parse", lambda *a, **k: (_ for _ in ()).throw(AssertionError("parsed")))
    assert fp_mod.fingerprint_file(str(src), "Queue.add") == first
    assert fp_mod.fingerprint_file(str(src), "nope") is None
    monkeypatch.undo()
    monkeypatch.setenv("KVGUARD_FINGERPRINT_CACHE", str(cache))

    changed = SRC.replace("return n + 1", "return n + 2")
    assert changed != SRC
    src.write_text(changed)  # edited in site-packages: a new key, computed afresh
    assert fp_mod.fingerprint_file(str(src), "Queue.add") == fingerprint_source(changed, "Queue.add")
    assert len(list(cache.glob("*.json"))) == 2
    _forget(fp_mod)


def test_a_corrupt_or_foreign_cache_entry_is_ignored_and_off_writes_nothing(tmp_path, monkeypatch):
    import sglang_kvguard.engine.fingerprint as fp_mod

    cache = tmp_path / "cache"
    monkeypatch.setenv("KVGUARD_FINGERPRINT_CACHE", str(cache))
    src = tmp_path / "mod.py"
    src.write_text(SRC)
    _forget(fp_mod)
    want = fp_mod.fingerprint_file(str(src), "Queue.add")
    (entry,) = cache.glob("*.json")
    for bad in ("{not json", '{"scheme": "other-scheme", "fingerprints": {"Queue.add": "forged"}}', "[]"):
        entry.write_text(bad)
        _forget(fp_mod)
        assert fp_mod.fingerprint_file(str(src), "Queue.add") == want

    off = tmp_path / "off"
    monkeypatch.setenv("KVGUARD_FINGERPRINT_CACHE", "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(off))
    _forget(fp_mod)
    assert fp_mod.cache_dir() is None
    assert fp_mod.fingerprint_file(str(src), "Queue.add") == want
    assert not off.exists()
    _forget(fp_mod)
