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
