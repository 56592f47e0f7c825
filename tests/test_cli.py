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
