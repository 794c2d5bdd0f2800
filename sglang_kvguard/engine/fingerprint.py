"""Fingerprints of upstream functions, computed from their source text.

A fingerprint identifies *the code we reviewed*. It is computed the same way from a
released wheel (by ``scripts/gen_manifests.py``) and from the SGLang installed in the
running environment, so a target that upstream changed, or a file that someone
edited in site-packages, no longer matches its manifest and the guard that wraps it
refuses to install.

The text is normalised through :mod:`tokenize`: comments, blank lines and the exact
amount of indentation do not count; every other token does (including docstrings and
decorators). This keeps the fingerprint stable across Python versions, unlike
``ast.dump``.
"""

from __future__ import annotations

import ast
import hashlib
import io
import tokenize
from typing import Optional

FINGERPRINT_SCHEME = "tok-sha256-v1"

_SKIP = {
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.ENCODING,
    tokenize.ENDMARKER,
}
_MARK = {tokenize.NEWLINE: "<NL>", tokenize.INDENT: "<IN>", tokenize.DEDENT: "<DE>"}


def find_definition(tree: ast.Module, qualname: str) -> Optional[ast.AST]:
    """Return the def/class node for ``qualname`` ("Class.method") in ``tree``.

    Only the top-level statement list and class bodies are searched, following
    the qualified name; a name defined twice (e.g. under ``if``/``else``) is
    ambiguous and reported as missing, because we could not tell which one runs.
    """
    body = tree.body
    node: Optional[ast.AST] = None
    for part in qualname.split("."):
        matches = [
            n
            for n in body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and n.name == part
        ]
        if len(matches) != 1:
            return None
        node = matches[0]
        body = node.body if isinstance(node, ast.ClassDef) else []
    return node


def _segment(source_lines: list[str], node: ast.AST) -> str:
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    end = node.end_lineno
    return "".join(source_lines[start - 1 : end])


def normalise(code: str) -> str:
    """Token stream of ``code`` without comments or layout, as one string."""
    lines = code.splitlines(keepends=True)
    # Re-indent: a method body is indented; tokenize wants column 0 first.
    indent = len(lines[0]) - len(lines[0].lstrip()) if lines else 0
    dedented = "".join(l[indent:] if l[:indent].strip() == "" else l for l in lines)
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(dedented).readline):
        if tok.type in _SKIP:
            continue
        out.append(_MARK.get(tok.type, tok.string))
    return "\x1f".join(out)


def fingerprint_source(source: str, qualname: str) -> Optional[str]:
    """Fingerprint of ``qualname`` in a module's source, or None if absent."""
    tree = ast.parse(source)
    node = find_definition(tree, qualname)
    if node is None:
        return None
    code = _segment(source.splitlines(keepends=True), node)
    digest = hashlib.sha256(normalise(code).encode("utf-8")).hexdigest()
    return digest[:24]


def fingerprint_file(path: str, qualname: str) -> Optional[str]:
    with open(path, encoding="utf-8") as f:
        return fingerprint_source(f.read(), qualname)
