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
FROM_CLI_ARGS = target(
    "activation.server_args.from_cli_args",
    "sglang.srt.server_args:ServerArgs.from_cli_args",
    why="exports --kvguard-* flags given on SGLang's own command line as KVGUARD_* env",
)
SCHEDULER_INIT = target(
    "activation.scheduler.Scheduler.__init__",
    "sglang.srt.managers.scheduler:Scheduler.__init__",
    why="scheduler process start: banner with the PD role",
)
DETOKENIZER_INIT = target(
    "activation.detokenizer.DetokenizerManager.__init__",
    "sglang.srt.managers.detokenizer_manager:DetokenizerManager.__init__",
    why="detokenizer process start: banner",
)

# The process entry functions (run_scheduler_process, ...) are deliberately not
# wrapped: SGLang passes them to multiprocessing by reference and keeps copies in
# default arguments and class attributes; the constructors they call are enough.

_banner_done = {"done": False}


def spawned_child() -> bool:
    """True while (or after) this process was started by multiprocessing spawn."""
    return preparing_spawned_child() or multiprocessing.parent_process() is not None


def preparing_spawned_child() -> bool:
    """True while multiprocessing prepares a spawned child (re-importing its main)."""
    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


def defer_banner() -> bool:
    """In a spawned child, the banner waits for the scheduler/detokenizer to start."""
    return spawned_child()


def _role(server_args) -> str:
    mode = getattr(server_args, "disaggregation_mode", None)
    mode = getattr(mode, "value", mode)
    return str(mode) if mode is not None else ""


def pd_role(scheduler_or_args) -> str:
    """The PD role of a scheduler (or its server args): "prefill", "decode", "null" or ""."""
    return _role(scheduler_or_args)


def where(process: str = "", role: str = "") -> str:
    if not process:
        process = multiprocessing.current_process().name if spawned_child() else "main"
    role = role or os.environ.get("KVGUARD_ROLE", "")
    parts = [f"process={process}"]
    if role:
        parts.append(f"role={role}")
    return " ".join(parts)


def log_banner(process: str, server_args) -> None:
    if _banner_done["done"]:
        return
    from .engine.runtime import installed_report

    report = installed_report()
    if report is None:
        return
    _banner_done["done"] = True
    log.info(report.banner(where(process, _role(server_args) or "null")))


def _constructor(process: str) -> Callable[[Callable], Callable]:
    def factory(original: Callable) -> Callable:
        def __init__(self, *args, **kwargs):
            server_args = args[0] if args else kwargs.get("server_args")
            log_banner(process, server_args)
            ret = original(self, *args, **kwargs)
            if process == "scheduler":
                from . import resources

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
        from .config import add_to_parser

        add_to_parser(parser)
        return result

    return add_cli_args


def _from_cli_args(original: Callable) -> Callable:
    def from_cli_args(cls, args, *rest, **kwargs):
        from .config import FLAGS
        from .engine.runtime import reinstall_if_config_changed

        changed = False
        for flag in FLAGS:
            value = getattr(args, flag.dest, None)
            if value is not None and os.environ.get(flag.env, flag.default) != str(value):
                os.environ[flag.env] = str(value)  # inherited by every spawned process
                changed = True
        if changed:
            reinstall_if_config_changed()
        return original(cls, args, *rest, **kwargs)

    return from_cli_args


TARGETS: Dict[str, Callable[[Callable], Callable]] = {
    ADD_CLI_ARGS.key: _add_cli_args,
    FROM_CLI_ARGS.key: _from_cli_args,
    SCHEDULER_INIT.key: _constructor("scheduler"),
    DETOKENIZER_INIT.key: _constructor("detokenizer"),
}
