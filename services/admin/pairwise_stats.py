"""Win/tie/loss of two versions judged pair by pair, with an interval that treats a user as one unit.

Each pair scores the version ``a`` (the first of the two a run compares) +1 when the judge preferred its
answer, 0 for a tie, -1 when it preferred the other's. A user's calls share their prompts' style and
difficulty, so their pairs are not independent: the interval of the mean score is the cluster-robust one
(Liang-Zeger, clusters = users; a call without a user is its own cluster), with the small-sample factor
G/(G-1) that statsmodels' ``OLS(...).fit(cov_type="cluster")`` applies to a mean (its (N-1)/(N-K) is 1 for
one regressor), and Student's t with G-1 degrees of freedom for the critical value (statsmodels' ``use_t``,
Stata's default): with few users the normal's would reject a true null too often (docs/replay.md has
the A/A rates). The preference ``(wins + ties/2) / pairs`` is ``(1 + mean score) / 2``: its interval is the
score's, halved and shifted, and excluding 0.5 means the judge preferred one version.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import scipy


@dataclass(frozen=True, slots=True)
class Judged:
    """One decided pair: the score of version ``a`` (+1, 0, -1), its user, and where ``a`` was shown."""

    score: int
    cluster: str
    a_first: bool


def clustered_mean(scores: Sequence[float], clusters: Sequence[str]) -> tuple[float, float]:
    """The mean and its cluster-robust standard error (NaN with fewer than two clusters: no interval then)."""
    n = len(scores)
    if n == 0:
        return 0.0, math.nan
    mean = sum(scores) / n
    sums: dict[str, float] = defaultdict(float)
    for score, cluster in zip(scores, clusters, strict=True):
        sums[cluster] += score - mean
    groups = len(sums)
    if groups < 2:
        return mean, math.nan
    variance = groups / (groups - 1) * sum(total * total for total in sums.values()) / (n * n)
    return mean, variance**0.5


def version_summary(judged: Sequence[Judged], *, sign: int, alpha: float) -> dict[str, object]:
    """Win/tie/loss rates of one side (``sign`` +1: version a, -1: version b) and its preference's interval."""
    n = len(judged)
    scores = [sign * item.score for item in judged]
    wins = sum(1 for score in scores if score > 0)
    losses = sum(1 for score in scores if score < 0)
    ties = n - wins - losses
    mean, se = clustered_mean(scores, [item.cluster for item in judged])
    users = len({item.cluster for item in judged})
    z = float(scipy.stats.t.ppf(1 - alpha / 2, users - 1)) if users > 1 else math.nan
    preference = (1 + mean) / 2 if n else None
    interval = (
        [max(0.0, (1 + mean - z * se) / 2), min(1.0, (1 + mean + z * se) / 2)] if n and math.isfinite(se) else None
    )
    return {
        "pairs": n,
        "wins": wins,
        "ties": ties,
        "losses": losses,
        "win_rate": wins / n if n else None,
        "tie_rate": ties / n if n else None,
        "loss_rate": losses / n if n else None,
        "preference": preference,
        "preference_interval": interval,
        "users": users,
    }


def position_summary(judged: Sequence[Judged]) -> dict[str, object]:
    """How often the answer shown first won, among pairs the judge decided: near 0.5 for an unbiased judge
    whatever the versions (the order is random), far from it for one that prefers a position."""
    decided = [item for item in judged if item.score != 0]
    first_won = sum(1 for item in decided if (item.score > 0) == item.a_first)
    return {
        "decided": len(decided),
        "first_won": first_won,
        "first_win_rate": first_won / len(decided) if decided else None,
        "a_shown_first": sum(1 for item in judged if item.a_first),
    }
