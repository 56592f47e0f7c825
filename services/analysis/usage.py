"""Tokens, time to first token and cost per call: the metrics the analysis takes from the calls themselves.

Feedback metrics are reported by someone; these four are measured on every call the router recorded (the
readable fields ``prompt_tokens``, ``completion_tokens`` and ``ttft_ms`` of each call entry, and a price per
version), so an arm's cost or TTFT is compared with the same statistics as clicks, per unit:

- ``tokens_in``: prompt tokens per call (calls whose prompt tokens are known);
- ``tokens_out``: completion tokens per call;
- ``ttft_ms``: time to first token per call, in ms (calls that got a token);
- ``cost``: ``tokens_in * price in + tokens_out * price out`` per call, from ``--price`` (calls of a priced
  arm whose tokens are both known).

Kind ``mean`` is per call (the sum over the unit's calls over their number, delta method), ``sum`` per unit
(a user's total); ``rate`` and ``conversion`` mean nothing for them and are refused. A feedback metric of one
of these names is not read: the name is the calls'.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

#: Metric name → (what it is, the direction that is better when ``--metric`` gives none).
CALL_METRICS: dict[str, tuple[str, Literal["higher", "lower"]]] = {
    "tokens_in": ("prompt tokens per call", "higher"),
    "tokens_out": ("completion tokens per call", "higher"),
    "ttft_ms": ("time to first token per call, ms", "lower"),
    "cost": ("cost per call, from --price", "lower"),
}
PRICE_SYNTAX = "VERSION=IN/1M-in,OUT/1M-out (per million tokens; 1K also taken), e.g. v1=0.15/1M-in,0.60/1M-out"
_COMPONENT = re.compile(r"^(?P<amount>[0-9]+(\.[0-9]*)?|\.[0-9]+)(e[-+]?[0-9]+)?/(?P<per>1m|1k)-(?P<side>in|out)$")
_PER = {"1m": 1_000_000, "1k": 1_000}


def is_call_metric(name: str) -> bool:
    return name in CALL_METRICS


@dataclass(frozen=True, slots=True)
class Price:
    """A version's price per token, in and out (the unit of the amounts given: dollars, euros, credits)."""

    version: str
    per_token_in: float
    per_token_out: float
    text: str

    def cost(self, tokens_in: float, tokens_out: float) -> float:
        return tokens_in * self.per_token_in + tokens_out * self.per_token_out


def parse_prices(texts: Iterable[str]) -> dict[str, Price]:
    """``--price`` values (repeated, or several versions comma-joined in one) → a price per version.

    ValueError naming the bad part: a component that is not ``AMOUNT/1M-in`` or ``AMOUNT/1M-out``, a version
    without both, a version priced twice, a negative or non-finite amount."""
    prices: dict[str, Price] = {}
    for text in texts:
        parts = [part.strip() for part in text.split(",")]
        groups: list[tuple[str, list[str]]] = []
        for part in parts:
            if not part:
                raise ValueError(f"bad --price {text!r}: an empty part (expected {PRICE_SYNTAX})")
            version, sep, component = part.partition("=")
            if sep:
                if not version.strip():
                    raise ValueError(f"bad --price {text!r}: no version before '=' (expected {PRICE_SYNTAX})")
                groups.append((version.strip(), [component.strip()]))
            elif not groups:
                raise ValueError(f"bad --price {text!r}: it starts without VERSION= (expected {PRICE_SYNTAX})")
            else:
                groups[-1][1].append(part)
        for version, components in groups:
            price = _price(text, version, components)
            if version in prices:
                raise ValueError(f"bad --price {text!r}: version {version!r} is priced twice")
            prices[version] = price
    return prices


def _price(text: str, version: str, components: list[str]) -> Price:
    sides: dict[str, float] = {}
    for component in components:
        match = _COMPONENT.match(component.replace(" ", "").lower())
        if match is None:
            raise ValueError(f"bad --price {text!r}: {component!r} is not AMOUNT/1M-in or AMOUNT/1M-out")
        amount = float(component.replace(" ", "").lower().partition("/")[0])
        if not math.isfinite(amount):
            raise ValueError(f"bad --price {text!r}: {component!r} is past any number")
        side = match["side"]
        if side in sides:
            raise ValueError(f"bad --price {text!r}: {version} has two '{side}' prices")
        sides[side] = amount / _PER[match["per"]]
    missing = [side for side in ("in", "out") if side not in sides]
    if missing:
        raise ValueError(
            f"bad --price {text!r}: {version} has no '{missing[0]}' price (give both, 0/1M-{missing[0]} for free)"
        )
    return Price(version, sides["in"], sides["out"], f"{version}={','.join(components)}")
