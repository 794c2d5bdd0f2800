"""kvguard's settings: one table of flags, each also readable from ``KVGUARD_*``.

The same table feeds three places: SGLang's own argument parser (so that
``--help`` lists the ``--kvguard-*`` flags), the launchers (which take the flags off
the command line and export them as environment variables, so that every process
SGLang spawns sees the same settings), and :func:`Config.from_env`.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

ON_UNKNOWN_CHOICES = ("refuse", "warn")


@dataclass(frozen=True)
class Flag:
    name: str  # attribute name, e.g. "on_unknown"
    default: str
    help: str
    choices: Optional[Tuple[str, ...]] = None
    validate: Optional[Callable[[str], object]] = None

    @property
    def option(self) -> str:
        return "--kvguard-" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return "KVGUARD_" + self.name.upper()

    @property
    def dest(self) -> str:
        return "kvguard_" + self.name


def _positive_int(value: str) -> int:
    n = int(value)
    if n < 0:
        raise ValueError("must be >= 0")
    return n


def non_negative_seconds(value: str) -> float:
    v = float(value)
    if v < 0:
        raise ValueError("must be >= 0")
    return v


FLAGS: List[Flag] = [
    Flag(
        "on_unknown",
        "refuse",
        "What to do when the running SGLang release is not one kvguard knows, or one of "
        "its patch targets differs from the reviewed code: 'refuse' (default) stops the "
        "process; 'warn' installs what it can and logs loudly (for experiments only).",
        choices=ON_UNKNOWN_CHOICES,
    ),
    Flag(
        "disable",
        "",
        "Comma-separated guard names to switch off (see 'kvguard doctor'). A switched-off "
        "guard is reported as 'off' in the banner and metrics.",
    ),
    Flag(
        "accounting",
        "off",
        "Guard cost accounting: 'on' times every kvguard wrapper (upstream calls excluded) "
        "and the scheduler's busy time, exported as kvguard_guard_seconds_total{guard,phase} and "
        "kvguard_scheduler_busy_seconds_total; 'off' (default) adds nothing.",
        choices=("off", "on"),
    ),
    Flag(
        "log_level",
        "INFO",
        "Log level of kvguard's own logger.",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
    ),
]


# Callables that import the modules declaring flags (the guards register their own
# flags when their modules are imported). The engine knows no guard: the package's
# ``__init__`` adds the loader of the guard registry here.
FLAG_SOURCES: List[Callable[[], None]] = []


def _load_all_flags() -> None:
    for load in FLAG_SOURCES:
        load()


def register_flag(flag: Flag) -> None:
    """Add a guard's own flag to the table (called at guard-module import)."""
    if any(f.name == flag.name for f in FLAGS):
        return
    FLAGS.append(flag)


class ConfigError(ValueError):
    pass


@dataclass
class Config:
    values: Dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "Config":
        environ = os.environ if environ is None else environ
        _load_all_flags()
        values = {}
        for flag in FLAGS:
            raw = environ.get(flag.env, flag.default)
            if flag.choices and raw not in flag.choices:
                raise ConfigError(
                    f"{flag.env}={raw!r} is not one of {', '.join(flag.choices)}"
                )
            if flag.validate is not None:
                try:
                    flag.validate(raw)
                except Exception as exc:  # noqa: BLE001 - reported with the flag name
                    raise ConfigError(f"{flag.env}={raw!r}: {exc}") from None
            values[flag.name] = raw
        return cls(values)

    def get(self, name: str) -> str:
        return self.values[name]

    def get_int(self, name: str) -> int:
        return int(self.values[name])

    @property
    def on_unknown(self) -> str:
        return self.values["on_unknown"]

    @property
    def disabled(self) -> List[str]:
        return [g.strip() for g in self.values["disable"].split(",") if g.strip()]


def add_to_parser(parser: argparse.ArgumentParser) -> None:
    """Add every ``--kvguard-*`` flag to ``parser`` (idempotent)."""
    _load_all_flags()
    existing = {a for action in parser._actions for a in action.option_strings}
    if FLAGS[0].option in existing:
        return
    group = parser.add_argument_group(
        "kvguard", "sglang-kvguard: fail-closed KV-cache guards (each flag also reads KVGUARD_<NAME>)"
    )
    for flag in FLAGS:
        kwargs = dict(
            dest=flag.dest,
            default=os.environ.get(flag.env, flag.default),
            help=f"{flag.help} [env {flag.env}; default {flag.default!r}]",
        )
        if flag.choices:
            kwargs["choices"] = flag.choices
        group.add_argument(flag.option, **kwargs)


def split_argv(argv: Sequence[str]) -> Tuple[Dict[str, str], List[str]]:
    """Take ``--kvguard-*`` flags out of ``argv``.

    Returns the environment updates (``KVGUARD_*``) and the rest of the argument list.
    Accepts both ``--kvguard-x value`` and ``--kvguard-x=value``.
    """
    _load_all_flags()
    by_option = {f.option: f for f in FLAGS}
    env: Dict[str, str] = {}
    rest: List[str] = []
    i = 0
    argv = list(argv)
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in by_option:
            flag = by_option[name]
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"{name} needs a value")
                value = argv[i + 1]
                i += 1
            if flag.choices and value not in flag.choices:
                raise ConfigError(f"{name}={value!r} is not one of {', '.join(flag.choices)}")
            env[flag.env] = value
        elif arg.startswith("--kvguard-"):
            known = ", ".join(sorted(by_option))
            raise ConfigError(f"unknown kvguard flag {name!r}; known flags: {known}")
        else:
            rest.append(arg)
        i += 1
    return env, rest


def iter_flags() -> Iterable[Flag]:
    return iter(FLAGS)
