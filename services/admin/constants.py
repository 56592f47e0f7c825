"""The admin CLI's exit codes, and the defaults and syntaxes its flags show, apart from the modules that use them.

Every command's parser is built at each start: read from the rollout, the judge, the guards or the bandit's
sampler, these values cost numpy, scipy and the analysis's models in every command, ``experiment get`` and a
usage error included."""

from __future__ import annotations

# Exit codes (the admin CLI's module docstring says what each means).
PROMOTED = 0
FAILED = 1
USAGE = 2
ROLLED_BACK = 3

GUARD_SYNTAX = (
    "NAME[:KIND][:cap=CAP]:lift>=BOUND (higher is better) or NAME[:KIND][:cap=CAP]:lift<=BOUND (lower is better), "
    "BOUND relative (-1%) or absolute (-0.002)"
)
QUANTILE_GUARD_SYNTAX = "METRIC:QUANTILE:ratio<=BOUND, METRIC latency or ttft, QUANTILE p50, p90 or p99"

#: What the judge can read per interval from the routers' counters: name -> what it is.
JUDGE_METRICS: dict[str, str] = {
    "latency_p50": "median latency of the interval's calls, s",
    "latency_p99": "p99 latency of the interval's calls, s",
    "error_rate": "failed calls / calls in the interval",
}
DEFAULT_METRICS = ("latency_p50", "latency_p99", "error_rate")
#: Kayenta's defaults: NetflixACAJudge's confidence level and tolerance, and the canary config's score
#: thresholds (pass 95, marginal 75).
DEFAULT_CONFIDENCE = 0.98
DEFAULT_TOLERANCE = 0.25
DEFAULT_PASS = 95.0
DEFAULT_MARGINAL = 75.0

#: The bandit's draws from the posteriors per interval: the probability of being best is known to about ±0.5 %
#: at 10,000.
DEFAULT_DRAWS = 10_000
