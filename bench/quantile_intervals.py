"""The two ways to put a user-clustered interval on a latency quantile, measured: speed and A/A accuracy.

- delta method for quantiles (Deng, Knoblich & Lu 2018), what ``splitstream analyze`` runs
  (:mod:`splitstream.analysis.quantiles`);
- a cluster bootstrap over users, vectorised as well as numpy allows: each resample draws a Poisson(1) weight
  per user (the Poisson bootstrap, the usual large-n stand-in for multinomial counts), and the weighted
  quantile of every resample comes from one sparse (resamples x users) @ (users x latency buckets) product,
  a cumulative sum over the buckets and an argmax, on the same 2 % latency buckets the analysis keeps.

Data: users with geometric call counts (mean 8) and a random effect of their own on log latency (sd 0.5,
within-user sd 0.5), like tests/test_analysis_quantiles.py. Timings: one comparison of two arms at p50, p90
and p99 over ``--users`` users per arm. A/A: ``--simulations`` experiments of 300 users per arm, the share
whose 95 % interval of the p90 ratio excludes 1 by each method.

    .venv/bin/python bench/quantile_intervals.py [--users 6250] [--resamples 2000] [--simulations 200]
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import numpy.typing as npt
from scipy import sparse

from splitstream.analysis import quantiles as qt
from splitstream.analysis.loading import LATENCY_BUCKETS, LATENCY_GROWTH, bucket_middle_ms
from splitstream.analysis.unit_buckets import UnitBuckets

Calls = tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]


def arm(rng: np.random.Generator, users: int) -> Calls:
    """Each call's user and latency bucket (2 %)."""
    counts = rng.geometric(1 / 8, users)
    effect = rng.normal(0, 0.5, users)
    unit = np.repeat(np.arange(users), counts)
    latency = np.exp(3 + effect[unit] + rng.normal(0, 0.5, len(unit)))
    buckets = (np.log(latency / 1e-3) / np.log(1.02)).astype(np.int64)
    return unit, buckets


def pairs(unit: npt.NDArray[np.int64], buckets: npt.NDArray[np.int64]) -> qt.CallValues:
    kept = UnitBuckets()
    kept.add(unit, buckets, np.zeros(len(unit), np.int64))
    merged = kept.result()
    return qt.CallValues.of(bucket_middle_ms(merged.buckets), merged.rows, merged.counts)


def delta_log_ratios(control: qt.CallValues, treatment: qt.CallValues) -> list[tuple[float, float]]:
    """Ratio intervals per quantile as the analysis computes them; (0, inf) where there is none."""
    out = []
    for q in qt.QUANTILES:
        effect = qt.compare(control, treatment, q, resolution=LATENCY_GROWTH)
        assert effect is not None
        out.append(effect.ratio_ci or (0.0, math.inf))
    return out


def bootstrap_quantiles(
    rng: np.random.Generator, unit: npt.NDArray[np.int64], buckets: npt.NDArray[np.int64], resamples: int
) -> npt.NDArray[np.float64]:
    """(resamples, quantiles): each resample's pooled quantiles, users weighted Poisson(1)."""
    users = int(unit.max()) + 1
    # (buckets x users) sparse @ (users x resamples) dense: each resample's calls per bucket in one product.
    counts = sparse.coo_matrix((np.ones(len(unit)), (buckets, unit)), shape=(LATENCY_BUCKETS, users)).tocsr()
    weights = rng.poisson(1.0, (users, resamples)).astype(np.float64)
    cumulative = np.cumsum(np.asarray(counts @ weights).T, axis=1)
    total = cumulative[:, -1:]
    middles = bucket_middle_ms(np.arange(LATENCY_BUCKETS))
    return np.stack([middles[np.argmax(cumulative >= q * total, axis=1)] for q in qt.QUANTILES], axis=1)


def bootstrap_ratio_cis(
    rng: np.random.Generator, control: Calls, treatment: Calls, resamples: int
) -> list[tuple[float, float]]:
    """Percentile intervals of the ratio per quantile."""
    ratios = bootstrap_quantiles(rng, treatment[0], treatment[1], resamples) / bootstrap_quantiles(
        rng, control[0], control[1], resamples
    )
    low, high = np.quantile(ratios, [0.025, 0.975], axis=0)
    return list(zip(low.tolist(), high.tolist(), strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=6250, help="users per arm for the timings (~8 calls each)")
    parser.add_argument("--resamples", type=int, default=2000)
    parser.add_argument("--simulations", type=int, default=200)
    args = parser.parse_args()
    rng = np.random.default_rng(1)
    control, treatment = arm(rng, args.users), arm(rng, args.users)
    calls = len(control[0]) + len(treatment[0])
    c, t = pairs(*control), pairs(*treatment)
    started = time.perf_counter()
    delta_log_ratios(c, t)
    delta_s = time.perf_counter() - started
    started = time.perf_counter()
    bootstrap_ratio_cis(rng, control, treatment, args.resamples)
    bootstrap_s = time.perf_counter() - started
    print(f"{calls:,} calls, {2 * args.users:,} users, p50/p90/p99 ratio intervals:")
    print(f"  delta method         {delta_s * 1000:8.1f} ms")
    print(f"  cluster bootstrap    {bootstrap_s * 1000:8.1f} ms ({args.resamples} resamples)")
    rejected = {"delta": np.zeros(3), "bootstrap": np.zeros(3)}
    for _ in range(args.simulations):
        control, treatment = arm(rng, 300), arm(rng, 300)
        for name, cis in (
            ("delta", delta_log_ratios(pairs(*control), pairs(*treatment))),
            ("bootstrap", bootstrap_ratio_cis(rng, control, treatment, 1000)),
        ):
            rejected[name] += [not (low <= 1.0 <= high) for low, high in cis]
    print(f"A/A, {args.simulations} experiments of 300 users per arm, share of 95 % ratio intervals excluding 1:")
    for name, counts in rejected.items():
        rates = ", ".join(
            f"{qt.quantile_name(q)} {r * 100:.1f} %"
            for q, r in zip(qt.QUANTILES, counts / args.simulations, strict=True)
        )
        print(f"  {name:<20} {rates}")


if __name__ == "__main__":
    main()
