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
import multiprocessing
import os
from typing import Callable, Dict

from .engine.targets import target

log = logging.getLogger("sglang_kvguard")

ADD_CLI_ARGS = target(
    "activation.server_args.add_cli_args",
    "sglang.srt.server_args:ServerArgs.add_cli_args",
    why="lists the --kvguard-* flags in SGLang's own parser",
)
RUN_SCHEDULER = target(
    "activation.scheduler.run_scheduler_process",
    "sglang.srt.managers.scheduler:run_scheduler_process",
    why="scheduler process entry: banner with the PD role",
)
RUN_DETOKENIZER = target(
    "activation.detokenizer.run_detokenizer_process",
    "sglang.srt.managers.detokenizer_manager:run_detokenizer_process",
    why="detokenizer process entry: banner",
)

_banner_done = {"done": False}


def spawned_child() -> bool:
    """True while (or after) this process was started by multiprocessing spawn."""
    cp = multiprocessing.current_process()
    return bool(getattr(cp, "_inheriting", False)) or multiprocessing.parent_process() is not None


def defer_banner() -> bool:
    return spawned_child()


def where(process: str = "", role: str = "") -> str:
    process = process or ("child" if spawned_child() else "main")
    role = role or os.environ.get("KVGUARD_ROLE", "")
    parts = [f"process={process}"]
    if role:
        parts.append(f"role={role}")
    return " ".join(parts)


def _log_banner(process: str, server_args) -> None:
    if _banner_done["done"]:
        return
    from .engine.runtime import installed_report

    report = installed_report()
    if report is None:
        return
    role = getattr(server_args, "disaggregation_mode", None) or "null"
    _banner_done["done"] = True
    log.info(report.banner(where(process, str(role))))


def _entry(process: str) -> Callable[[Callable], Callable]:
    def factory(original: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            server_args = args[0] if args else kwargs.get("server_args")
            _log_banner(process, server_args)
            return original(*args, **kwargs)

        return wrapper

    return factory


def _add_cli_args(original: Callable) -> Callable:
    def wrapper(parser, *args, **kwargs):
        result = original(parser, *args, **kwargs)
        from .config import add_to_parser

        add_to_parser(parser)
        return result

    return wrapper


TARGETS: Dict[str, Callable[[Callable], Callable]] = {
    ADD_CLI_ARGS.key: _add_cli_args,
    RUN_SCHEDULER.key: _entry("scheduler"),
    RUN_DETOKENIZER.key: _entry("detokenizer"),
}
