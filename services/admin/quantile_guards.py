"""Rollout guards on latency quantiles: ``--guard 'latency:p99:ratio<=1.10'``, judged statistically.

The router's p99 guard (``--max-p99-ratio``) compares two numbers read off histograms: at 10 % of the traffic a
few slow calls of one user move the new version's p99 past any bound, or hide a real slowdown. This guard
reads the analysis of the step's recorded calls instead (like the outcome guards, the current phase only):
the ratio of the new version's quantile to the control's, with the variance of its log from the delta method
for quantiles clustered by user (:mod:`splitstream.analysis.quantiles`). A rollout looks at it every few
seconds, so the interval is the always-valid (mSPRT) confidence sequence of the log-ratio, the same sequence
the outcome guards use, which holds at every look at once:

    METRIC:QUANTILE:ratio<=BOUND    METRIC latency or ttft, QUANTILE p50, p90 or p99, BOUND > 0

It trips (harm) when the sequence's lower end is past BOUND: the new version is significantly slower than
BOUND times the control at that quantile. It wins when the upper end is below 1 (significantly faster).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

from splitstream.admin.constants import QUANTILE_GUARD_SYNTAX as QUANTILE_GUARD_SYNTAX
from splitstream.analysis.model import PhaseResult
from splitstream.analysis.quantiles import QUANTILE_METRICS, QUANTILE_NAMES

_GUARD = re.compile(r"^(?P<metric>[a-z_]+):(?P<q>p\d+):ratio(?P<op>\W*)(?P<bound>.*)$", re.IGNORECASE)

QuantileState = Literal["harm", "win", "open", "not judged"]


def is_quantile_guard(text: str) -> bool:
    """Whether ``--guard`` names a quantile ratio (``...:ratio...``) rather than a lift."""
    return ":ratio" in text.replace(" ", "").lower()


@dataclass(frozen=True, kw_only=True)
class QuantileGuard:
    metric: Literal["latency", "ttft"]
    #: ``p50``, ``p90`` or ``p99``.
    quantile: str
    bound: float
    text: str
    #: Always ``<=``: a ratio above the bound is the harm (latency is better lower).
    op: Literal["<="] = "<="
    relative: bool = False

    @staticmethod
    def parse(text: str) -> QuantileGuard:
        """ValueError naming what is wrong, with the syntax."""
        match = _GUARD.match(text.strip().replace(" ", ""))
        if match is None:
            raise ValueError(f"--guard {text!r}: expected {QUANTILE_GUARD_SYNTAX}; e.g. latency:p99:ratio<=1.10")
        metric, q = match["metric"].lower(), match["q"].lower()
        if metric not in QUANTILE_METRICS:
            raise ValueError(f"--guard {text!r}: a ratio guard is on latency or ttft, not {match['metric']!r}")
        if q not in QUANTILE_NAMES:
            raise ValueError(f"--guard {text!r}: the quantile is p50, p90 or p99, not {match['q']!r}")
        if match["op"] != "<=":
            raise ValueError(
                f"--guard {text!r}: a latency ratio is bounded from above with ratio<=BOUND (slower is the harm)"
            )
        try:
            bound = float(match["bound"])
        except ValueError:
            raise ValueError(f"--guard {text!r}: the bound {match['bound']!r} is not a number") from None
        if not math.isfinite(bound) or bound <= 0:
            raise ValueError(f"--guard {text!r}: the bound must be a ratio above 0 (1.10: at most 10 % slower)")
        return QuantileGuard(
            metric="latency" if metric == "latency" else "ttft",
            quantile=q,
            bound=bound,
            text=f"{metric}:{q}:ratio<={match['bound']}",
        )

    @property
    def name(self) -> str:
        return f"{self.metric} {self.quantile}"

    @property
    def judge_metric(self) -> str:
        """The name ``rollout --judge`` compares it by (``latency_p99``, ``ttft_p90``): the quantile of each check
        interval's calls, per version, from the routers' histograms, which is what Kayenta compares."""
        return f"{self.metric}_{self.quantile}"

    #: What the reading's estimate is: a ratio to the control, not a lift.
    quantity = "ratio"

    def lift_text(self, value: float | None) -> str:
        return "n/a" if value is None else f"{value:.3f}x"

    def judge(
        self, result: PhaseResult, version: str
    ) -> tuple[QuantileState, float | None, float | None, float | None, str]:
        """(state, ratio, low, high, why not judged) from the phase's quantile comparison of ``version``."""
        comparison = next(
            (c for c in result.quantiles if c.metric == self.metric and c.name == self.quantile and c.arm == version),
            None,
        )
        if comparison is None:
            what = "calls with a first token" if self.metric == "ttft" else "calls"
            return "not judged", None, None, None, f"no {what} of both arms to compare"
        ci = comparison.sequential_ratio_ci
        if comparison.ratio is None or ci is None or ci.low is None or ci.high is None:
            return "not judged", None, None, None, f"too few calls past the {self.quantile} for an interval yet"
        harm, win = ci.low > self.bound, ci.high < 1.0
        state: QuantileState = "harm" if harm else "win" if win else "open"
        return state, comparison.ratio, ci.low, ci.high, ""
