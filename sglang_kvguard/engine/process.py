"""What kvguard knows about SGLang's processes: the upstream entry points every
process passes through (fingerprinted targets, wrapped by ``activation/hooks.py`` and
relied on by guards that act at scheduler start), and helpers that say which process
this is and its PD role. Knows no guard."""

from __future__ import annotations

import multiprocessing
import os

from .targets import target

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
