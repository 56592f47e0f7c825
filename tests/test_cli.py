"""Flags from the environment, as containers set them."""

from __future__ import annotations

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
