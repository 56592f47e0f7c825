"""The flags of ``splitstream bandit``, apart from the bandit: the admin CLI builds every command's parser
at each start, and the bandit imports the whole analysis (see :mod:`splitstream.analysis.flags`)."""

from __future__ import annotations

from typing import Any

from splitstream.admin.arguments import duration_s, fraction, metric
from splitstream.admin.constants import DEFAULT_DRAWS
from splitstream.common.redis_settings import add_redis_security_arguments


def add_parser(commands: Any, env_prefix: str) -> None:
    """Register ``bandit`` on the admin CLI's subcommands."""
    bandit = commands.add_parser(
        "bandit",
        env_prefix=env_prefix,
        help="move a model's weights each interval by Thompson sampling on a feedback metric",
        description=(
            "Each interval, read the metric per arm over the bandit's phases, draw from each arm's posterior and set "
            "each arm's weight to its probability of being best, after a holdout split evenly over the arms. "
            "Reverts to the starting weights on a sample ratio mismatch, an error rate over --max-error-rate or "
            "an interrupt; --max-steps or --duration end it leaving the last weights. See docs/bandits.md."
        ),
    )
    bandit.add_argument("model")
    bandit.add_argument(
        "--metric",
        type=metric,
        required=True,
        help="NAME:KIND[:DIRECTION], e.g. click:conversion or wait_s:mean:lower",
    )
    bandit.add_argument("--interval", type=duration_s, default=60.0, help="time between weight changes, e.g. 60s")
    bandit.add_argument("--holdout", type=fraction, default=0.20, help="share split evenly over the arms, e.g. 20%%")
    bandit.add_argument(
        "--min-weight", type=fraction, default=0.05, help="no arm below this, a whole percent, e.g. 5%%"
    )
    bandit.add_argument(
        "--max-steps", type=int, default=None, help="end after this many intervals, keeping the weights"
    )
    bandit.add_argument("--duration", type=duration_s, default=None, help="end after this long, keeping the weights")
    bandit.add_argument("--max-error-rate", type=fraction, default=0.01, help="an arm failing more in a phase reverts")
    bandit.add_argument("--min-calls", type=int, default=20, help="calls of an arm before its error rate is judged")
    bandit.add_argument("--draws", type=int, default=DEFAULT_DRAWS, help="posterior draws per interval")
    bandit.add_argument("--alpha", type=float, default=0.05, help="1 - confidence of the read-out's interval")
    bandit.add_argument("--seed", type=int, default=None, help="seed of the posterior draws (default: fresh)")
    bandit.add_argument(
        "--redis-url", default=None, secret=True, help="the recorder's Redis, where calls and feedback are read"
    )
    add_redis_security_arguments(bandit)
