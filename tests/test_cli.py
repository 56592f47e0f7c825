"""Flags from the environment, as containers set them."""

from __future__ import annotations

import argparse
import importlib

import pytest

from splitstream.common.cli import EnvArgumentParser


def parser() -> EnvArgumentParser:
    p = EnvArgumentParser(prog="svc", env_prefix="SPLITSTREAM_SVC_")
    p.add_argument("--port", type=int, default=1, help="port")
    group = p.add_argument_group("recording")
    group.add_argument("--batch-size", type=int, default=256, help="records per batch")
    group.add_argument("--verbose", action="store_true", help="say more")
    return p


def test_flags_in_groups_and_outside_read_their_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPLITSTREAM_SVC_PORT", "9")
    monkeypatch.setenv("SPLITSTREAM_SVC_BATCH_SIZE", "32")
    monkeypatch.setenv("SPLITSTREAM_SVC_VERBOSE", "true")
    args = parser().parse_args([])
    assert (args.port, args.batch_size, args.verbose) == (9, 32, True)


def test_the_command_line_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPLITSTREAM_SVC_BATCH_SIZE", "32")
    assert parser().parse_args(["--batch-size", "64"]).batch_size == 64


def test_a_bad_value_in_the_environment_exits_2_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SPLITSTREAM_SVC_BATCH_SIZE", "many")
    with pytest.raises(SystemExit) as exited:
        parser()
    assert exited.value.code == 2
    assert "SPLITSTREAM_SVC_BATCH_SIZE" in capsys.readouterr().err


def test_help_names_the_variable_of_every_flag() -> None:
    text = parser().format_help()
    for variable in ("SPLITSTREAM_SVC_PORT", "SPLITSTREAM_SVC_BATCH_SIZE", "SPLITSTREAM_SVC_VERBOSE"):
        assert variable in text


def test_a_secret_flag_s_help_says_its_variable_is_set_but_never_its_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPLITSTREAM_SVC_KEY", "hunter2-in-env")
    monkeypatch.setenv("SPLITSTREAM_SVC_URL", "redis://:pw-in-env@h:1/0")
    p = EnvArgumentParser(prog="svc", env_prefix="SPLITSTREAM_SVC_")
    p.add_argument("--key", default="", help="a key", secret=True)
    p.add_argument("--url", default="redis://127.0.0.1:6379/0", help="a URL", secret=True)
    args = p.parse_args([])
    assert (args.key, args.url) == ("hunter2-in-env", "redis://:pw-in-env@h:1/0")  # still read
    text = " ".join(p.format_help().split())
    assert "hunter2-in-env" not in text
    assert "pw-in-env" not in text
    assert "[env SPLITSTREAM_SVC_KEY set]" in text
    assert "[env SPLITSTREAM_SVC_URL set]" in text


def test_a_secret_flag_not_set_in_the_environment_shows_the_code_s_own_default() -> None:
    p = EnvArgumentParser(prog="svc", env_prefix="SPLITSTREAM_SVC_")
    group = p.add_argument_group("source")
    group.add_argument("--url", default="redis://127.0.0.1:6379/0", help="a URL", secret=True)
    text = " ".join(p.format_help().split())
    assert "[env SPLITSTREAM_SVC_URL] (default: redis://127.0.0.1:6379/0)" in text


def _append_actions(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.Action]]:
    """Every repeatable flag of ``parser`` and its subcommands, with the parser's name."""
    found: list[tuple[str, argparse.Action]] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found.extend(_append_actions(sub))
        elif isinstance(action, argparse._AppendAction):
            found.append((parser.prog, action))
    return found


def test_a_repeatable_flag_given_on_the_command_line_replaces_its_environment_list(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SPLITSTREAM_SVC_TAG", "a,b")
    p = EnvArgumentParser(prog="svc", env_prefix="SPLITSTREAM_SVC_")
    p.add_argument("--tag", action="append", default=[], help="a tag (repeat)")
    assert p.parse_args([]).tag == ["a", "b"]
    assert p.parse_args(["--tag", "c", "--tag", "d"]).tag == ["c", "d"]


def test_the_replayer_takes_model_from_the_command_line_when_its_variable_is_set_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from splitstream.replayer.main import parse_args

    monkeypatch.setenv("SPLITSTREAM_REPLAY_MODEL", "from-env")
    config = parse_args(["--model", "from-flag", "--since", "-1h", "--target", "127.0.0.1:1"])
    assert config.selection.models == ("from-flag",)
    monkeypatch.setenv("SPLITSTREAM_REPLAY_MODEL", "one,two")
    assert parse_args(["--since", "-1h", "--target", "127.0.0.1:1"]).selection.models == ("one", "two")


def test_the_rollout_s_metrics_flag_wins_over_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from splitstream.admin.main import build_parser as admin_parser

    monkeypatch.setenv("SPLITSTREAM_ADMIN_METRICS", "a:1,b:2")
    args = admin_parser().parse_args(["rollout", "m", "v2", "--metrics", "c:3"])
    assert args.metrics == ["c:3"]
    assert admin_parser().parse_args(["rollout", "m", "v2"]).metrics == ["a:1", "b:2"]


@pytest.mark.parametrize("command", ["replayer.main", "admin.main", "archiver.config"])
def test_every_repeatable_flag_of_every_command_survives_its_variable_being_set(
    command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = importlib.import_module(f"splitstream.{command}")
    parser: EnvArgumentParser = module.build_parser()
    flags = _append_actions(parser)
    assert flags
    for variable in [f"{parser.env_prefix}{a.option_strings[-1][2:].upper().replace('-', '_')}" for _, a in flags]:
        monkeypatch.setenv(variable, "x=1,y=2")
    for prog, action in _append_actions(module.build_parser()):
        namespace = argparse.Namespace(**{action.dest: action.default})
        action(parser, namespace, "z=3", action.option_strings[-1])
        assert getattr(namespace, action.dest) == ["z=3"], f"{prog} {action.option_strings[-1]}"
