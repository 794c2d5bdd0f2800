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
import contextlib
import hashlib
import io
import json
import os
import tempfile
import threading
import tokenize
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

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


def _fingerprint_tree(tree: ast.Module, lines: List[str], qualname: str) -> Optional[str]:
    node = find_definition(tree, qualname)
    if node is None:
        return None
    code = _segment(lines, node)
    digest = hashlib.sha256(normalise(code).encode("utf-8")).hexdigest()
    return digest[:24]


def fingerprint_source(source: str, qualname: str) -> Optional[str]:
    """Fingerprint of ``qualname`` in a module's source, or None if absent."""
    return _fingerprint_tree(ast.parse(source), source.splitlines(keepends=True), qualname)


# Installing kvguard fingerprints about 50 targets in about 16 upstream files, in every
# SGLang process; parsing those files is most of what that costs. Two caches, both keyed
# by sha256 of the scheme and the file's exact bytes (an edited file is a new key, so
# neither can vouch for code other than the bytes it was computed from):
#
# * in this process, one parse per file while a plan runs (``release_parse_cache``
#   drops the trees afterwards);
# * on disk, the fingerprints found in each file (a few hundred bytes per file), so
#   the next process (each scheduler, the next start) skips parsing: directory
#   ``$KVGUARD_FINGERPRINT_CACHE`` (``off`` disables it), else
#   ``$XDG_CACHE_HOME/sglang-kvguard/fingerprints`` (``~/.cache/...``). A cache that
#   cannot be read or written is ignored (the fingerprint is computed).
_PARSED: "OrderedDict[str, Tuple[ast.Module, List[str]]]" = OrderedDict()
_PARSED_MAX = 32
_FOUND: Dict[str, Dict[str, Optional[str]]] = {}  # content key -> qualname -> fingerprint
_lock = threading.Lock()


def cache_dir() -> Optional[str]:
    """The on-disk fingerprint cache directory, or None when switched off."""
    env = os.environ.get("KVGUARD_FINGERPRINT_CACHE", "").strip()
    if env.lower() in ("off", "0", "false", "no", "none"):
        return None
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "sglang-kvguard", "fingerprints")


def _disk_load(key: str) -> Dict[str, Optional[str]]:
    d = cache_dir()
    if d is None:
        return {}
    try:
        with open(os.path.join(d, key + ".json"), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("scheme") != FINGERPRINT_SCHEME:
        return {}
    found = data.get("fingerprints")
    if not isinstance(found, dict):
        return {}
    return {str(q): (fp if isinstance(fp, str) else None) for q, fp in found.items()}


def _disk_store(key: str, found: Dict[str, Optional[str]]) -> None:
    d = cache_dir()
    if d is None:
        return
    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"scheme": FINGERPRINT_SCHEME, "fingerprints": found}, f, sort_keys=True)
            os.replace(tmp, os.path.join(d, key + ".json"))  # atomic: readers see old or new
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError:
        pass


def _parsed(key: str, raw: bytes) -> Tuple[ast.Module, List[str]]:
    with _lock:
        hit = _PARSED.get(key)
        if hit is not None:
            _PARSED.move_to_end(key)
            return hit
    source = raw.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")  # as open() in text mode
    hit = (ast.parse(source), source.splitlines(keepends=True))
    with _lock:
        _PARSED[key] = hit
        while len(_PARSED) > _PARSED_MAX:
            _PARSED.popitem(last=False)
    return hit


def release_parse_cache() -> None:
    """Drop the parsed trees (tens of MB); the fingerprints found stay memoised."""
    with _lock:
        _PARSED.clear()


def fingerprint_file(path: str, qualname: str) -> Optional[str]:
    """``fingerprint_source`` of the file's text, through the caches above."""
    with open(path, "rb") as f:
        raw = f.read()
    key = hashlib.sha256(FINGERPRINT_SCHEME.encode() + b"\0" + raw).hexdigest()
    with _lock:
        found = _FOUND.get(key)
    if found is None:  # first time this process sees these bytes: start from the disk cache
        disk = _disk_load(key)
        with _lock:
            found = _FOUND.setdefault(key, disk)
    with _lock:
        if qualname in found:
            return found[qualname]
    tree, lines = _parsed(key, raw)
    fp = _fingerprint_tree(tree, lines, qualname)
    with _lock:
        found[qualname] = fp
        snapshot = dict(found)
    _disk_store(key, snapshot)
    return fp
