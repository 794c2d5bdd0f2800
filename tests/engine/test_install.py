"""Installing into real SGLang modules: wrappers, by-value aliases, pickling, idempotence."""

import pickle
import textwrap

from packaging.version import Version

from _engine_support import RELEASE, run_py

NEW = Version(RELEASE) >= Version("0.5.21")


# every guard that wraps the scheduler constructor, in wrapping order
SCHEDULER_INIT_GUARDS = tuple(sorted(
    ("activation", "decode_admission_fit", "hybrid_pool_check", "page_generation", "pool_capacity_check",
     "prefill_admission_fit",
     "prefill_source_hold") + (() if NEW else ("decode_destination_hold",))  # upstream's decode hold from 0.5.21
))


def test_install_uninstall_in_process():
    import sglang.srt.disaggregation.decode as decode
    import sglang.srt.disaggregation.prefill as prefill
    import sglang.srt.entrypoints.engine as engine
    import sglang.srt.managers.scheduler as scheduler

    import sglang_kvguard
    from sglang_kvguard.engine.patching import guards_on

    orig_entry = scheduler.run_scheduler_process
    orig_add = prefill.PrefillBootstrapQueue.add
    report = sglang_kvguard.install()
    try:
        assert sglang_kvguard.install() is report  # idempotent
        # the scheduler constructor carries the banner; the process entry function is
        # left alone (SGLang pickles it by reference for the spawn start method)
        assert guards_on(scheduler.Scheduler.__init__) == SCHEDULER_INIT_GUARDS
        assert scheduler.run_scheduler_process is orig_entry
        assert engine.run_scheduler_process is orig_entry
        assert pickle.loads(pickle.dumps(scheduler.run_scheduler_process)) is orig_entry
        if NEW:
            assert prefill.PrefillBootstrapQueue.add is orig_add  # upstream doors: untouched
        else:
            assert guards_on(prefill.PrefillBootstrapQueue.add) == ("admission_drain",)
            assert guards_on(decode.DecodePreallocQueue.add) == ("admission_drain",)
    finally:
        assert sglang_kvguard.uninstall() >= 1
    assert guards_on(scheduler.Scheduler.__init__) == ()
    assert prefill.PrefillBootstrapQueue.add is orig_add
    assert sglang_kvguard.uninstall() == 0  # idempotent
    # and again
    sglang_kvguard.install()
    assert guards_on(scheduler.Scheduler.__init__) == SCHEDULER_INIT_GUARDS
    sglang_kvguard.uninstall()
    assert guards_on(scheduler.Scheduler.__init__) == ()


def test_import_before_sglang_patches_on_import():
    """`import sglang_kvguard` first: targets are wrapped as their modules load."""
    code = textwrap.dedent(
        """
        import sglang_kvguard
        import sglang.srt.disaggregation.prefill as prefill
        import sglang.srt.managers.scheduler as scheduler
        from sglang_kvguard.engine.patching import guards_on
        print("entry", guards_on(scheduler.Scheduler.__init__))
        print("door", guards_on(prefill.PrefillBootstrapQueue.add))
        """
    )
    out = run_py(["-c", code])
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"entry {SCHEDULER_INIT_GUARDS}" in out.stdout
    assert ("door ()" if NEW else "door ('admission_drain',)") in out.stdout
    assert f"kvguard 0.1.0 sglang={RELEASE}" in out.stderr
    assert "admission_drain=" + ("upstream" if NEW else "active") in out.stderr


def test_refusal_raises_and_patches_nothing(tmp_path):
    import json, shutil
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    d = tmp_path / "patches"
    shutil.copytree(repo / "patches", d)
    p = d / f"sglang-{RELEASE}.json"
    data = json.loads(p.read_text())
    data["targets"]["activation.scheduler.Scheduler.__init__"]["fingerprint"] = "f" * 24
    data["targets"]["disagg.decode.DecodePreallocQueue.add"]["fingerprint"] = "f" * 24
    p.write_text(json.dumps(data))
    code = textwrap.dedent(
        """
        import sglang.srt.managers.scheduler as scheduler
        orig = scheduler.Scheduler.__init__
        try:
            import sglang_kvguard
        except BaseException as exc:  # a refusal is a SystemExit
            print("REFUSED", type(exc).__name__)
            print(exc)
        print("untouched", scheduler.Scheduler.__init__ is orig)
        """
    )
    out = run_py(["-c", code], KVGUARD_MANIFEST_DIR=str(d))
    assert "REFUSED KVGuardRefused" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "DecodePreallocQueue.add" in out.stdout
    assert "untouched True" in out.stdout


def test_plugin_entry_point_is_registered():
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "kvguard"]
    assert len(eps) == 1 and eps[0].value == "sglang_kvguard.plugin:load"


def test_launcher_help_lists_kvguard_flags():
    out = run_py(["-m", "sglang_kvguard.launch_server", "--help"], timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--kvguard-on-unknown" in out.stdout and "KVGUARD_ON_UNKNOWN" in out.stdout
    assert "--model-path" in out.stdout


def test_launcher_rejects_unknown_kvguard_flag():
    out = run_py(["-m", "sglang_kvguard.launch_server", "--kvguard-bogus", "1"])
    assert out.returncode == 2
    assert "unknown kvguard flag '--kvguard-bogus'" in out.stderr


def test_a_kvguard_flag_on_sglangs_own_command_line_reinstalls_with_it():
    """``--kvguard-*`` given to SGLang's own parser (the plugin path): the wrapped
    ``ServerArgs.from_cli_args`` exports it as ``KVGUARD_*`` for every spawned process and
    re-plans this one (the activation hook calls back into install)."""
    code = textwrap.dedent(
        """
        import argparse, os
        os.environ["KVGUARD_AUTO_INSTALL"] = "0"
        os.environ.pop("KVGUARD_DISABLE", None)
        import sglang_kvguard
        from sglang_kvguard.engine.runtime import installed_report
        states = lambda r: {g.name: g.state for g in r.guards}
        before = sglang_kvguard.install()
        print("before", states(before)["transfer_coverage"])
        from sglang.srt.server_args import ServerArgs
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        args = parser.parse_args(["--model-path", "/nonexistent", "--kvguard-disable", "transfer_coverage"])
        try:
            ServerArgs.from_cli_args(args)
        except Exception as exc:  # the model path does not exist; the flags were read first
            pass
        after = installed_report()
        print("env", os.environ.get("KVGUARD_DISABLE"))
        print("after", states(after)["transfer_coverage"], after is not before)
        """
    )
    out = run_py(["-c", code])
    assert "before active" in out.stdout, out.stdout + out.stderr[-3000:]
    assert "env transfer_coverage" in out.stdout, out.stdout + out.stderr[-3000:]
    assert "after off True" in out.stdout, out.stdout + out.stderr[-3000:]
