"""Entry point for SGLang's plugin loader (group ``sglang.srt.plugins``).

Releases that load general plugins call :func:`load` in each process they start;
installing is idempotent, so a process that already imported ``sglang_kvguard``
is unaffected.
"""

from __future__ import annotations


def load(*_args, **_kwargs):
    from .engine.runtime import install

    install()
