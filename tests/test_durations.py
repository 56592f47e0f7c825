"""One duration grammar for every command line: the admin CLI's ``--interval`` and the replayer's
``--max-lateness``/``--clock-skew``/relative ``--since`` read the same forms and refuse the same junk."""

from __future__ import annotations

import argparse
from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from splitstream.admin.main import build_parser as admin_parser
from splitstream.admin.main import duration_s
from splitstream.common.durations import UNITS_NS, BadDuration, parse_duration_ns, parse_duration_s
from splitstream.replayer.main import parse_args as replay_args

NS = 10**9


@pytest.mark.parametrize(
    ("text", "expected_ns"),
    [
        ("0", 0),
        ("0s", 0),
        ("60", 60 * NS),
        ("1.5", 1_500_000_000),
        (".5", 500_000_000),
        ("2.", 2 * NS),
        ("250ms", 250_000_000),
        ("90s", 90 * NS),
        ("15m", 15 * 60 * NS),
        ("2h", 2 * 3600 * NS),
        ("1d", 86400 * NS),
        (" 0.1s ", 100_000_000),  # exact: a float product would give 99,999,999
        ("1.5 h", 5400 * NS),
    ],
)
def test_every_documented_form_is_read_exactly(text: str, expected_ns: int) -> None:
    assert parse_duration_ns(text) == expected_ns


@pytest.mark.parametrize(
    "text",
    ["", " ", "nan", "NaN", "inf", "-inf", "infs", "-1s", "-5", "+5s", "1e3", "1e3s", "1.2.3", "1..", "s", "5x",
     "5 sec", "5min", "1h30m", "0x10", "\u0661s", "five"],
)  # fmt: skip
def test_negative_non_finite_empty_and_garbage_durations_are_refused_with_the_accepted_forms(text: str) -> None:
    with pytest.raises(BadDuration, match=r"bad duration .*expected .*250ms, 90s, 15m, 2h, 1d"):
        parse_duration_ns(text)


def test_a_bare_number_is_refused_where_a_unit_is_required_but_zero_is_zero() -> None:
    with pytest.raises(BadDuration, match="a number and a unit"):
        parse_duration_ns("10", unit_required=True)
    assert parse_duration_ns("0", unit_required=True) == 0
    assert parse_duration_ns("10s", unit_required=True) == 10 * NS


@given(
    number=st.decimals(min_value=0, max_value=10**6, places=3, allow_nan=False, allow_infinity=False),
    unit=st.sampled_from(list(UNITS_NS)),
)
def test_any_non_negative_decimal_with_any_unit_reads_as_that_many_units(number: Decimal, unit: str) -> None:
    text = f"{number:f}{unit}"
    expected = int(number * UNITS_NS[unit])  # Decimal * int: exact at these sizes
    assert parse_duration_ns(text) == expected
    assert parse_duration_s(text) == pytest.approx(expected / NS)


def test_the_admin_cli_and_the_replayer_read_the_same_forms() -> None:
    for text, seconds in (("90", 90.0), ("1d", 86400.0), ("250ms", 0.25), ("2.5m", 150.0)):
        rollout = admin_parser().parse_args(["--registry", "file:r.yaml", "rollout", "m", "v2", "--interval", text])
        assert rollout.interval == seconds
        replay = replay_args(
            ["--model", "m", "--since", "-1h", "--target", "h:1", "--max-lateness", text, "--clock-skew", text]
        )
        assert replay.selection.max_lateness_ns == replay.selection.clock_skew_ns == int(seconds * NS)


def test_the_admin_cli_names_a_bad_duration_in_its_usage_error() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="bad duration 'nan'"):
        duration_s("nan")
