"""The flags of ``splitstream analyze``, apart from the analysis itself.

The admin CLI builds every command's parser at each start, so this module imports only what parsing needs:
the analysis (its engines, pyarrow, duckdb, sqlglot) is imported by :mod:`splitstream.analysis.cli` when the
command runs. A usage error, and every other command, starts without it.
"""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING, Any

from splitstream.analysis import defaults
from splitstream.analysis.sql import DIALECTS
from splitstream.common.redis_settings import add_redis_security_arguments

if TYPE_CHECKING:
    from splitstream.analysis.model import MetricSpec

#: Flags whose value may be a relative time such as ``-2h`` (see :func:`join_relative_times`).
TIME_FLAGS = ("--since", "--until", "--cuped-pre-since", "--cuped-pre-until")


def metric_list(text: str) -> list[MetricSpec]:
    """``click:rate`` or ``click:rate,revenue:sum``; ValueError naming the bad one."""
    from splitstream.analysis.model import MetricSpec  # numpy and pydantic: only once a --metric is given

    return [MetricSpec.parse(part) for part in text.split(",") if part.strip()]


class _AppendMetrics(argparse.Action):
    """``--metric`` (repeatable, or comma-separated): flags given replace the environment's list rather than
    extend it (argparse's ``append`` would try to append to the variable's string)."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: str | None = None
    ) -> None:
        current = getattr(namespace, self.dest, None)
        items = list(current) if isinstance(current, list) else []
        try:
            items.extend(metric_list(str(values)))
        except ValueError as error:
            parser.error(str(error))
        setattr(namespace, self.dest, items)


class AppendPrices(argparse.Action):
    """``--price`` (repeatable): flags given replace the environment's value rather than extend it."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: str | None = None
    ) -> None:
        current = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, [*(current if isinstance(current, list) else []), str(values)])


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def _alpha(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"alpha must be between 0 and 1, got {text!r}")
    return value


#: The most units a sizing flag takes: far past any experiment, short of a float's exact integers.
MAX_UNITS = 10**12


def _units(text: str) -> int:
    try:
        value = int(text.replace(",", "").replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number of units: {text!r}") from None
    if not 2 <= value <= MAX_UNITS:
        raise argparse.ArgumentTypeError(f"must be between 2 and {MAX_UNITS:,} units, got {text!r}")
    return value


def add_command(commands: Any, env_prefix: str) -> None:
    """Add ``analyze`` to the admin CLI's subcommands (``commands`` is argparse's subparsers action)."""
    parser = commands.add_parser(
        "analyze",
        env_prefix=env_prefix,
        help="A/B verdicts per metric from recorded calls and feedback (needs Redis, not the registry)",
        description=(
            "Compare the arms of a model's experiment, phase by phase, on business metrics from feedback, with "
            "latency and errors from the call records. Only randomized calls (hash, random) are compared; pins, "
            "spills and retries are shown apart. Writes analysis.json and analysis.html to --output-dir."
        ),
    )
    parser.add_argument("model")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="the recorder's Redis", secret=True)
    add_redis_security_arguments(parser.add_argument_group("Redis TLS and ACL user (see docs/security.md)"))
    parser.set_defaults(redis_env_prefix=env_prefix)
    parser.add_argument(
        "--source",
        default="redis",
        help="where calls and feedback are read: redis (older parts of the window from --archive, if set), or "
        "archive:URL (only the archive written by splitstream-archive: a directory, s3://bucket/prefix, ...)",
    )
    parser.add_argument(
        "--archive",
        default="",
        help="the archive behind Redis: what is older than a stream's oldest entry is read from it, the rest "
        "from Redis (each entry once)",
    )
    parser.add_argument(
        "--s3-endpoint", default="", help="endpoint of an S3-compatible archive store: http://host:port"
    )
    parser.add_argument(
        "--archive-engine",
        default="python",
        help="how --source archive: is aggregated: python (read in pages like Redis) or duckdb (SQL over the "
        "Parquet, the same answers; --segment falls back to python; docs/analysis.md says why not yet the default)",
    )
    parser.add_argument(
        "--print-sql",
        action="store_true",
        help="print the per-unit aggregation query for the archive's tables in --dialect and exit (docs/analysis.md)",
    )
    parser.add_argument("--dialect", default="duckdb", help=f"the SQL dialect of --print-sql: {', '.join(DIALECTS)}")
    parser.add_argument(
        "--aggregates",
        default="",
        metavar="FILE",
        help="run the statistics on per-unit aggregates the --print-sql query produced elsewhere (Parquet or CSV) "
        "instead of reading Redis or the archive",
    )
    parser.add_argument(
        "--segment",
        choices=defaults.SEGMENT_FIELDS,
        default=None,
        help="also compare the arms per value of this call field (principal: the authenticated caller)",
    )
    parser.add_argument(
        "--since",
        required=True,
        help="window start, by router receive time (events by their time): ISO-8601 with timezone, -2h, epoch s",
    )
    parser.add_argument("--until", default="now", help="window end (exclusive), same forms as --since")
    parser.add_argument(
        "--metric",
        action=_AppendMetrics,
        required=True,
        help="NAME:KIND[:DIRECTION][:cap=CAP], KIND conversion (units with an event > 0, per unit), rate (calls with "
        "an event > 0, per call; proportion is its old name), mean (per event) or sum (per unit), DIRECTION higher "
        "(the default) or lower: which way is better (repeat, or comma-separate), e.g. buy:conversion, click:rate, "
        "latency_ms:mean:lower; mean and sum take a last :cap=P99 (a percentile of the units pooled over the arms) "
        "or :cap=250 (a value) capping each unit's value",
    )
    parser.add_argument(
        "--price",
        action=AppendPrices,
        default=None,
        help="a version's price per million tokens in and out, VERSION=IN/1M-in,OUT/1M-out (repeat per version, "
        "or comma-join them): each call's cost, per arm and as metric cost; a version without one has no cost",
    )
    parser.add_argument(
        "--unit",
        choices=("user", "call"),
        default="user",
        help="unit of analysis: user (routing-key HMAC; the call when a call has no key) or call",
    )
    parser.add_argument("--alpha", type=_alpha, default=0.05, help="significance level (1 - confidence)")
    parser.add_argument(
        "--sequential",
        action="store_true",
        help="always-valid p-values and confidence sequences (mSPRT): safe to check as often as you like",
    )
    parser.add_argument(
        "--sequential-tuning",
        type=_units,
        default=defaults.DEFAULT_TUNING_UNITS,
        metavar="N",
        help="units in both arms together at which the confidence sequence is narrowest (GrowthBook's default, "
        "5,000); set it near the size the experiment will reach",
    )
    parser.add_argument(
        "--correction",
        choices=("none", "holm", "bh"),
        default="none",
        help="adjust p-values and intervals over every comparison (metrics x arms x phases, and segments): holm "
        "(any false positive at most alpha) or bh (Benjamini-Hochberg: false discoveries at most alpha of those "
        "declared)",
    )
    parser.add_argument(
        "--non-inferiority",
        default=None,
        metavar="MARGIN",
        help="also test every metric one-sided against a margin on its bad side: relative to the control with %% "
        "(1%%) or absolute in the metric's unit (0.002); says non-inferior, inferior or not shown non-inferior",
    )
    parser.add_argument(
        "--novelty-bucket",
        default="1d",
        metavar="DURATION",
        help="the comparison again per bucket of time since each unit's first exposure, this wide (1d, 6h, 2s): "
        "over the units active in the bucket, on their calls and events of it, to see an effect that fades; off: not",
    )
    parser.add_argument(
        "--planned-units",
        type=_units,
        default=None,
        metavar="N",
        help="units the experiment is planned to reach in total: the minimum detectable effect is also given at "
        "that size, split as now",
    )
    parser.add_argument(
        "--engine",
        choices=defaults.ENGINES,
        default="frequentist",
        help="how verdicts are read: frequentist (p-values and confidence intervals) or bayes (GrowthBook's "
        "Gaussian effect model: chance to beat control, expected loss, credible interval of the lift)",
    )
    parser.add_argument(
        "--prior-mean",
        type=_finite,
        default=0.0,
        help="with --engine bayes and --prior-sd: the prior's mean relative lift (0.05: five percent up)",
    )
    parser.add_argument(
        "--prior-sd",
        type=_finite,
        default=None,
        help="with --engine bayes: a proper normal prior on the relative lift with this standard deviation (0.3: "
        "GrowthBook's suggestion); default a flat prior",
    )
    parser.add_argument(
        "--bayes-threshold",
        type=_finite,
        default=defaults.DEFAULT_THRESHOLD,
        help="with --engine bayes: the chance to beat control at which an arm is better (at 1 - it, worse); "
        "GrowthBook's default 0.95",
    )
    parser.add_argument("--cuped-pre-since", default=None, help="CUPED pre-period start (same forms as --since)")
    parser.add_argument("--cuped-pre-until", default=None, help="CUPED pre-period end (exclusive)")
    parser.add_argument(
        "--max-lateness",
        default="1h",
        help="how long after the window a call's record or an event may reach Redis (spooled in an outage)",
    )
    parser.add_argument(
        "--attribution-window",
        default=None,
        help="how long after --until, and after its call, an event naming a call of the window still counts for "
        "that call (a click an hour after the answer); default: --max-lateness (and never shorter than it, after "
        "the call). Events naming only a user are counted inside the window",
    )
    parser.add_argument("--output-dir", default="analysis-out", help="where analysis.json and analysis.html go")
    parser.add_argument("--connect-timeout-s", type=float, default=5.0, help="Redis connect timeout")
