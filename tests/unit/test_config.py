import argparse

import pytest

from sglang_kvguard.engine.config import FLAGS, Config, ConfigError, add_to_parser, split_argv


def test_split_argv_takes_kvguard_flags_out():
    env, rest = split_argv(["--model-path", "m", "--kvguard-on-unknown", "warn", "--kvguard-disable=admission_drain", "--port", "1"])
    assert env == {"KVGUARD_ON_UNKNOWN": "warn", "KVGUARD_DISABLE": "admission_drain"}
    assert rest == ["--model-path", "m", "--port", "1"]


def test_split_argv_rejects_unknown_and_bad_values():
    with pytest.raises(ConfigError, match="unknown kvguard flag '--kvguard-nope'"):
        split_argv(["--kvguard-nope", "1"])
    with pytest.raises(ConfigError, match="not one of refuse, warn"):
        split_argv(["--kvguard-on-unknown=maybe"])
    with pytest.raises(ConfigError, match="needs a value"):
        split_argv(["--kvguard-on-unknown"])


def test_env_is_read_and_validated():
    c = Config.from_env({"KVGUARD_ON_UNKNOWN": "warn", "KVGUARD_DISABLE": " a, b ,"})
    assert c.on_unknown == "warn"
    assert c.disabled == ["a", "b"]
    assert Config.from_env({}).on_unknown == "refuse"
    with pytest.raises(ConfigError, match="KVGUARD_ON_UNKNOWN='x'"):
        Config.from_env({"KVGUARD_ON_UNKNOWN": "x"})


def test_guard_flags_are_registered():
    env, rest = split_argv(["--kvguard-pool-policy", "clamp"])
    assert env == {"KVGUARD_POOL_POLICY": "clamp"} and rest == []
    assert Config.from_env({}).get("pool_policy") == "refuse"
    with pytest.raises(ConfigError, match="not one of refuse, clamp, warn"):
        split_argv(["--kvguard-pool-policy=maybe"])


def test_parser_gets_every_flag_once():
    p = argparse.ArgumentParser()
    add_to_parser(p)
    add_to_parser(p)  # idempotent
    help_text = p.format_help()
    for f in FLAGS:
        assert len([a for a in p._actions if f.option in a.option_strings]) == 1
        assert f.option in help_text
        assert f.env in help_text
    ns = p.parse_args(["--kvguard-on-unknown", "warn"])
    assert ns.kvguard_on_unknown == "warn"


def test_readme_documents_every_flag_and_every_guard():
    """The README's flag and guard tables are what operators read: a flag or guard
    added without a row there fails here."""
    from pathlib import Path

    from sglang_kvguard.engine.config import _load_all_flags
    from sglang_kvguard.guards import GUARDS

    _load_all_flags()
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert [f.option for f in FLAGS if f"| `{f.option}" not in readme] == []
    assert [g.name for g in GUARDS if f"| `{g.name}` |" not in readme] == []
