"""The flags of ``splitstream rollout --judge`` and the :class:`JudgeConfig` they describe."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from splitstream.admin import constants

if TYPE_CHECKING:
    from splitstream.admin import judge


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def add_arguments(parser: Any) -> None:
    """The judge's group of flags on the rollout parser (an EnvArgumentParser: each reads an environment
    variable too)."""
    group = parser.add_argument_group(
        "canary judge (Kayenta's Mann-Whitney classification of each metric, scored 0-100; see docs/rollouts.md)"
    )
    group.add_argument(
        "--judge",
        action="store_true",
        help="judge each step by comparing control and new version over the step's check intervals: a score of "
        "at least --judge-pass goes on, below --judge-marginal rolls back, in between holds the step one more "
        "interval",
    )
    group.add_argument(
        "--judge-metric",
        action="append",
        default=None,
        metavar="NAME[=WEIGHT]",
        help=f"a metric the judge compares, one of {', '.join(constants.JUDGE_METRICS)} or the metric of a --guard "
        "(a quantile guard's: latency_p90, ttft_p99, ...), "
        "with its weight in percent (repeat; metrics without a weight share what is left of 100); default "
        f"{', '.join(constants.DEFAULT_METRICS)} and every --guard metric, equally weighted",
    )
    group.add_argument(
        "--judge-pass", type=_number, default=constants.DEFAULT_PASS, help="score at which a step passes (Kayenta: 95)"
    )
    group.add_argument(
        "--judge-marginal",
        type=_number,
        default=constants.DEFAULT_MARGINAL,
        help="score below which a step fails and rolls back (Kayenta: 75)",
    )
    group.add_argument(
        "--judge-confidence",
        type=_number,
        default=constants.DEFAULT_CONFIDENCE,
        help="confidence level of the Mann-Whitney interval of the shift (Kayenta: 0.98)",
    )
    group.add_argument(
        "--judge-tolerance",
        type=_number,
        default=constants.DEFAULT_TOLERANCE,
        help="a shift counts when its interval clears this fraction of its estimate (Kayenta: 0.25)",
    )


def config_from_args(args: argparse.Namespace) -> judge.JudgeConfig | None:
    """The judge the flags ask for (None without ``--judge``); ValueError naming the flag otherwise."""
    texts = args.judge_metric
    texts = [texts] if isinstance(texts, str) else list(texts or ())  # a str: from the environment
    tuned = (
        texts
        or args.judge_pass != constants.DEFAULT_PASS
        or args.judge_marginal != constants.DEFAULT_MARGINAL
        or args.judge_confidence != constants.DEFAULT_CONFIDENCE
        or args.judge_tolerance != constants.DEFAULT_TOLERANCE
    )
    if not args.judge:
        if tuned:
            raise ValueError("--judge-metric, --judge-pass, --judge-marginal, --judge-confidence and "
                             "--judge-tolerance go with --judge")  # fmt: skip
        return None
    from splitstream.admin import judge  # numpy and scipy: only a rollout with --judge computes with them

    chosen: list[judge.JudgeMetric] = []
    for text in texts:
        for part in text.split(","):
            if part.strip():
                try:
                    chosen.append(judge.JudgeMetric.parse(part))
                except ValueError as error:
                    raise ValueError(f"--judge-metric: {error}") from None
    return judge.JudgeConfig(
        metrics=tuple(chosen) or None,
        pass_score=args.judge_pass,
        marginal_score=args.judge_marginal,
        confidence=args.judge_confidence,
        tolerance=args.judge_tolerance,
    )
