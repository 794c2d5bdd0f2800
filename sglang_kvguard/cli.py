"""The ``kvguard`` command."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

USAGE = """kvguard <command> [args]

commands:
  doctor [--json]      state of every guard for the installed SGLang (no server started);
                       exits 1 if any guard would refuse
  launch ARGS...       sglang.launch_server ARGS with kvguard installed in every process;
                       accepts every SGLang flag plus the --kvguard-* flags
  preflight URL...     read each node's pool, limits and context; flag pools smaller than the
                       context and decode accepting longer prompts than prefill (--json)
  probe URL            send a live deployment (router, server, OpenAI-compatible endpoint) the
                       requests that would have caught the incident; PASS/FAIL per check
                       (--json FILE|-, --junit FILE, --only, --limit N); exits 1 on a FAIL
  demo                 the incident's request on a local CPU PD deployment, without and with kvguard
  version              kvguard and SGLang versions
"""


def _doctor(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(prog="kvguard doctor", description="State of every kvguard guard for the installed SGLang.")
    ap.add_argument("--json", action="store_true", help="print JSON")
    from .engine.config import ConfigError, split_argv, Config

    try:
        env, rest = split_argv(argv)
        args = ap.parse_args(rest)
        environ = dict(os.environ)
        environ.update(env)
        config = Config.from_env(environ)
    except ConfigError as exc:
        print(f"kvguard doctor: error: {exc}", file=sys.stderr)
        return 2
    from .activation.install import plan

    from .lifetime.transfer_components import COVERAGE_RULES

    report, _, _ = plan(config)
    if args.json:
        data = report.as_dict()
        data["component_coverage"] = dict(COVERAGE_RULES)
        print(json.dumps(data, indent=2))
    else:
        print(f"kvguard {report.kvguard}  SGLang {report.release or 'not installed'}  "
              f"manifest {report.manifest or '-'}  on-unknown={report.on_unknown}")
        width = max([len(g.name) for g in report.guards] + [5])
        print(f"{'guard':<{width}}  {'state':<8}  reason")
        for g in report.guards:
            print(f"{g.name:<{width}}  {g.state:<8}  {g.reason}")
        for key, state in report.activation.items():
            print(f"  activation {key}: {state}")
        print("transferred components (each PD node decides at start-up from what it registers with its "
              "transfer backend, logs it and exports kvguard_component_coverage):")
        for name, rule in COVERAGE_RULES:
            print(f"  {name}: {rule}")
        for w in report.warnings:
            print(f"warning: {w}")
        if report.refused:
            print(report.refusal_message())
    return 1 if report.refused else 0


def _version(_argv: List[str]) -> int:
    from .engine.version import __version__
    from .engine.runtime import sglang_release

    print(f"sglang-kvguard {__version__}; sglang {sglang_release() or 'not installed'}")
    return 0


def _probe(argv: List[str]) -> int:
    from .tools.probe import main as probe

    return probe(argv)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "doctor":
        return _doctor(rest)
    if cmd == "launch":
        from .launch_server import main as launch

        return launch(rest, prog="kvguard launch")
    if cmd == "version":
        return _version(rest)
    if cmd == "preflight":
        from .tools.preflight import main as preflight

        return preflight(rest)
    if cmd == "probe":
        return _probe(rest)
    if cmd == "demo":
        from .demo.cli import main as demo

        return demo(rest)
    print(f"kvguard: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2


def _install_in_spawned_child() -> None:
    """`kvguard launch`'s children re-run the console script as ``__mp_main__``."""
    main_mod = sys.modules.get("__mp_main__")
    if main_mod is None or not getattr(main_mod, "__file__", None):
        return
    from .engine.process import preparing_spawned_child

    if preparing_spawned_child():
        from .activation.install import install

        install()


if __name__ == "__main__":
    sys.exit(main())
else:
    _install_in_spawned_child()
