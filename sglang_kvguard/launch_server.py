"""``python -m sglang_kvguard.launch_server [SGLang flags] [--kvguard-* flags]``.

Takes the ``--kvguard-*`` flags (exported as ``KVGUARD_*`` so every process SGLang
spawns sees them), installs kvguard, then runs ``sglang.launch_server`` as the main
program in this same process. Spawned SGLang processes re-import this module as
their main module and so install kvguard too.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import List, Optional


def _peek(argv: List[str], option: str) -> Optional[str]:
    for i, arg in enumerate(argv):
        if arg == option and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(option + "="):
            return arg.split("=", 1)[1]
    return None


def main(argv: Optional[List[str]] = None, prog: str = "sglang_kvguard.launch_server") -> int:
    from .engine.config import ConfigError, split_argv

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        env, rest = split_argv(argv)
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    os.environ.update(env)
    role = _peek(rest, "--disaggregation-mode")
    if role:
        os.environ["KVGUARD_ROLE"] = role

    from .engine.process import ADD_CLI_ARGS
    from .engine.runtime import KVGuardRefused
    from .activation.install import install

    try:
        report = install()
    except KVGuardRefused as exc:
        print(str(exc), file=sys.stderr)
        return 2
    # SGLang's parser knows the --kvguard-* flags once its add_cli_args is wrapped.
    keep = report.activation.get(ADD_CLI_ARGS.key) == "active"
    sys.argv = [sys.argv[0]] + (argv if keep else rest)
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
elif __name__ == "__mp_main__":
    # A process SGLang spawned from this launcher: install before it runs its target.
    from .activation.install import install as _install

    _install()
