"""Being present, and saying so, in every SGLang process.

Three upstream entry points are wrapped (each fingerprinted like a guard target):

* ``ServerArgs.add_cli_args``: adds the ``--kvguard-*`` flags to SGLang's own parser,
  so that ``--help`` lists them and SGLang accepts them on its command line.
* ``run_scheduler_process`` and ``run_detokenizer_process``: the entry functions of
  the processes SGLang spawns. In a spawned child kvguard is installed while
  multiprocessing re-imports the parent's main module (the kvguard launcher, or the
  operator's script that imported ``sglang_kvguard``), or by SGLang's plugin loader;
  the child's banner waits for its entry function so that it can name the process
  and its PD role.
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Dict

from ..engine.process import ADD_CLI_ARGS, DETOKENIZER_INIT, FROM_CLI_ARGS, SCHEDULER_INIT, pd_role, where

log = logging.getLogger("sglang_kvguard")

_banner_done = {"done": False}
# Called when SGLang's own command line changed a --kvguard-* flag (set by install.py,
# which installs these hooks; the hooks do not import it back).
ON_CONFIG_CHANGE: list = []


def log_banner(process: str, server_args) -> None:
    if _banner_done["done"]:
        return
    from ..engine.runtime import installed_report

    report = installed_report()
    if report is None:
        return
    _banner_done["done"] = True
    log.info(report.banner(where(process, pd_role(server_args) or "null")))


def _constructor(process: str) -> Callable[[Callable], Callable]:
    def factory(original: Callable) -> Callable:
        def __init__(self, *args, **kwargs):
            server_args = args[0] if args else kwargs.get("server_args")
            log_banner(process, server_args)
            ret = original(self, *args, **kwargs)
            if process == "scheduler":
                from ..observe import resources

                try:
                    resources.start(self)
                except Exception as exc:  # noqa: BLE001 - observability only
                    log.warning("kvguard resource gauges not started: %s", exc)
            return ret

        return __init__

    return factory


def _add_cli_args(original: Callable) -> Callable:
    def add_cli_args(parser, *args, **kwargs):
        result = original(parser, *args, **kwargs)
        from ..engine.config import add_to_parser

        add_to_parser(parser)
        return result

    return add_cli_args


def _from_cli_args(original: Callable) -> Callable:
    def from_cli_args(cls, args, *rest, **kwargs):
        from ..engine.config import FLAGS

        changed = False
        for flag in FLAGS:
            value = getattr(args, flag.dest, None)
            if value is not None and os.environ.get(flag.env, flag.default) != str(value):
                os.environ[flag.env] = str(value)  # inherited by every spawned process
                changed = True
        if changed:
            for callback in ON_CONFIG_CHANGE:  # install.reinstall_if_config_changed
                callback()
        return original(cls, args, *rest, **kwargs)

    return from_cli_args


TARGETS: Dict[str, Callable[[Callable], Callable]] = {
    ADD_CLI_ARGS.key: _add_cli_args,
    FROM_CLI_ARGS.key: _from_cli_args,
    SCHEDULER_INIT.key: _constructor("scheduler"),
    DETOKENIZER_INIT.key: _constructor("detokenizer"),
}
