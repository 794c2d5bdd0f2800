"""Entry point for SGLang's plugin loader (group ``sglang.srt.plugins``).

Releases that load general plugins call :func:`load` in each process they start;
installing is idempotent, so a process that already imported ``sglang_kvguard``
is unaffected. ``KVGUARD_AUTO_INSTALL=0`` turns this path off, as it does for
``import sglang_kvguard``; upstream's allow-list ``SGLANG_PLUGINS`` works too.
"""

from __future__ import annotations


def load(*_args, **_kwargs):
    import os

    if os.environ.get("KVGUARD_AUTO_INSTALL", "1") in ("0", "false", "no"):
        return  # the operator chose explicit installation only
    from .activation.install import install

    install()
