"""``splitstream analyze`` end to end: a real redis-server holding calls and feedback written the way the
recorder writes them, read back by the analysis library and by the CLI as a user runs it.

One shop experiment (50/50, v2 planted with a higher click rate) carries everything the analysis must
get right at once: keyless calls (their own units), users seen in both arms, pinned and spilled calls,
call entries and events stored twice, events for request ids no call has, user-level events.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
from redis.asyncio import Redis
from scipy import stats
from statsmodels.stats.multitest import multipletests

from splitstream.analysis.analyze import Query, analyze
from splitstream.analysis.loading import Window, read_pages
from splitstream.analysis.model import PER_CALL_LABEL, Analysis, MetricComparison, MetricSpec, PhaseResult
from splitstream.analysis.report import render_table
from splitstream.common.records import stream_key
from tests import launcher
from tests.experiments import Call, Event, phase, write_arrivals, write_calls, write_feedback
from tests.experiments import analyze_cli as cli
from tests.harness import ROOT, free_port
from tests.redis_server import RedisServer

HOUR_NS = 3_600 * 10**9
#: The experiment ran an hour, starting three hours ago (so "now" is well past any lateness).
T0 = (time.time_ns() // 10**9 - 3 * 3_600) * 10**9
WINDOW = Window(T0, T0 + HOUR_NS)
SHOP = "shop"
METRICS = (
    MetricSpec.parse("click:proportion"),
    MetricSpec.parse("satisfaction:mean"),
    MetricSpec.parse("revenue:sum"),
)
USERS = 3_000
CROSSOVER_USERS = 20
KEYLESS_CALLS = 200
PINNED = 50
SPILLED = 30
DUPLICATE_CALLS = 100
DUPLICATE_CLICKS = 200
UNKNOWN_EVENTS = 25


def user_unit(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


@dataclass
class Shop:
    redis: RedisServer
    distinct_clicks: dict[str, int]
    pinned_click_events: int
    crossover_events: int
    #: Events naming a user, not a call.
    revenue_events: int
    #: Per arm, the units (users, or a keyless call) with a click on a randomized call, and the units there are.
    converted: dict[str, set[str]]
    units: dict[str, set[str]]


@pytest.fixture(scope="module")
def shop(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shop]:
    rng = np.random.default_rng(12)
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    client = server.client()
    shop_phase = phase({"v1": 50, "v2": 50}, "v1")
    calls: list[Call] = []
    events: list[Event] = []
    clicks = {"v1": 0, "v2": 0}
    converted: dict[str, set[str]] = {"v1": set(), "v2": set()}
    units: dict[str, set[str]] = {"v1": set(), "v2": set()}

    def call_events(call: Call, click_rate: float) -> None:
        units[call.arm].add(call.unit or call.request_id)
        if rng.random() < click_rate:
            events.append(Event("click", 1.0, call.time_ns + 10**9, request_id=call.request_id,
                                idempotency_key=f"click-{call.request_id}"))  # fmt: skip
            if call.assignment in ("hash", "random") and call.time_ns + 10**9 < WINDOW.until_ns:
                clicks[call.arm] += 1
                converted[call.arm].add(call.unit or call.request_id)
        if rng.random() < 0.5:
            events.append(Event("satisfaction", float(rng.normal(4, 1)), call.time_ns + 2 * 10**9,
                                request_id=call.request_id, idempotency_key=f"sat-{call.request_id}"))  # fmt: skip

    rates = {"v1": 0.10, "v2": 0.15}
    for i in range(USERS):
        arm = "v1" if i % 2 == 0 else "v2"
        unit = user_unit(f"user-{i}")
        times = np.sort(rng.integers(T0, T0 + HOUR_NS - 10 * 10**9, 1 + rng.poisson(1.5)))
        for j, t in enumerate(times):
            call = Call(f"u{i}-{j}", int(t), arm, unit=unit)
            calls.append(call)
            call_events(call, rates[arm])
        if rng.random() < 0.3:
            events.append(Event("revenue", float(rng.exponential(20)), int(times[0]) + 10 * 10**9, unit=unit,
                                idempotency_key=f"rev-{i}"))  # fmt: skip
    for i in range(KEYLESS_CALLS):
        arm = "v1" if i % 2 == 0 else "v2"
        call = Call(f"anon-{i}", int(T0 + rng.integers(0, HOUR_NS - 10 * 10**9)), arm, assignment="random")
        calls.append(call)
        call_events(call, rates[arm])
    crossover_events = 0
    for i in range(CROSSOVER_USERS):
        unit = user_unit(f"crossed-{i}")
        for arm in ("v1", "v2"):
            calls.append(Call(f"x{i}-{arm}", T0 + 60 * 10**9 * (i + 1), arm, unit=unit))
            events.append(Event("click", 1.0, T0 + 60 * 10**9 * (i + 1) + 10**9, request_id=f"x{i}-{arm}",
                                idempotency_key=f"click-x{i}-{arm}"))  # fmt: skip
            crossover_events += 1
    for i in range(PINNED):
        calls.append(Call(f"pin-{i}", T0 + 10**9 * (i + 5), "v2", unit=user_unit(f"user-{i}"), assignment="pin"))
        events.append(
            Event("click", 1.0, T0 + 10**9 * (i + 6), request_id=f"pin-{i}", idempotency_key=f"click-pin-{i}")
        )
    for i in range(SPILLED):
        calls.append(
            Call(f"spill-{i}", T0 + 10**9 * (i + 5), "v2", version="v1", unit=user_unit(f"user-{i + 1}"),
                 assignment="spill", status_code=14 if i % 3 == 0 else 0, latency_ms=40.0)
        )  # fmt: skip
    for i in range(UNKNOWN_EVENTS):
        events.append(Event("click", 1.0, T0 + 10**9 * (i + 100), request_id=f"ghost-{i}", idempotency_key=f"g{i}"))
    write_calls(client, SHOP, calls, shop_phase)
    # The recorder's at-least-once delivery: copies arrive later (a router's spool drained after an outage).
    late_ns = WINDOW.until_ns + 10 * 60 * 10**9
    write_calls(client, SHOP, calls[:DUPLICATE_CALLS], shop_phase, written_at_ns=late_ns)
    write_feedback(client, SHOP, events)
    clicks_written = [e for e in events if e.metric == "click" and e.request_id.startswith("u")]
    write_feedback(client, SHOP, clicks_written[:DUPLICATE_CLICKS], written_at_ns=late_ns)
    client.close()
    try:
        yield Shop(
            server, clicks, PINNED, crossover_events, sum(e.metric == "revenue" for e in events), converted, units
        )
    finally:
        server.stop()


def run_analysis(server: RedisServer, query: Query) -> Analysis:
    async def go() -> Analysis:
        redis = Redis.from_url(server.url)
        try:
            return await analyze(redis, query)
        finally:
            await redis.aclose()

    return asyncio.run(go())


def comparison(phase_result: PhaseResult, metric: str) -> MetricComparison:
    return next(c for c in phase_result.comparisons if c.metric == metric)


@pytest.fixture(scope="module")
def shop_analysis(shop: Shop) -> Analysis:
    return run_analysis(shop.redis, Query(model=SHOP, window=WINDOW, metrics=METRICS))


def test_a_planted_click_lift_is_found_with_its_interval_and_verdict(shop_analysis: Analysis) -> None:
    [result] = shop_analysis.phases
    click = comparison(result, "click")
    assert click.arm == "v2"
    assert click.control == "v1"
    assert click.verdict == "better"
    assert click.p_value is not None
    assert click.p_value < 0.001
    assert click.relative_ci.low is not None
    assert click.relative_ci.high is not None
    assert click.relative_ci.low < 0.5 < click.relative_ci.high  # planted: 15 % against 10 %
    assert re.fullmatch(
        r"v2 vs v1: click \+\d+\.\d % \(95 % CI \+\d+\.\d \.\. \+\d+\.\d %\), p < 0\.001: v2 better",
        click.verdict_line,
    ), click.verdict_line
    assert click.verdict_line in shop_analysis.verdicts


def test_a_reader_without_quantiles_gets_the_same_comparisons_and_no_quantiles(
    shop: Shop, shop_analysis: Analysis
) -> None:
    """``Query(quantiles=False)`` (a rollout with no quantile guard) skips keeping each unit's calls per latency
    bucket: no quantile comparisons, every other figure as before."""
    assert shop_analysis.phases[0].quantiles  # compared by default
    plain = run_analysis(shop.redis, Query(model=SHOP, window=WINDOW, metrics=METRICS, quantiles=False))
    assert [p.quantiles for p in plain.phases] == [[] for _ in shop_analysis.phases]
    assert [p.comparisons for p in plain.phases] == [p.comparisons for p in shop_analysis.phases]
    assert plain.verdicts == shop_analysis.verdicts


def test_a_lower_is_better_metric_calls_a_rise_worse(shop: Shop, shop_analysis: Analysis) -> None:
    # The same clicks, read as something to keep low (say, complaints): v2's planted rise is now its harm.
    complaints = MetricSpec.parse("click:proportion:lower")
    assert complaints.direction == "lower"
    analysis = run_analysis(shop.redis, Query(model=SHOP, window=WINDOW, metrics=(complaints,)))
    [result] = analysis.phases
    click = comparison(result, "click")
    assert click.direction == "lower"
    assert click.verdict == "worse"
    assert click.verdict_line.endswith(": v2 worse"), click.verdict_line
    # The lift itself is arm minus control whatever the direction: the same number as read higher-is-better.
    assert click.absolute_lift == comparison(shop_analysis.phases[0], "click").absolute_lift
    assert analysis.metrics == ["click:rate:lower"]  # proportion, the old name, reads as rate


def test_metrics_without_a_difference_are_inconclusive_with_a_sample_size_estimate(shop_analysis: Analysis) -> None:
    [result] = shop_analysis.phases
    for metric in ("satisfaction", "revenue"):
        verdict = comparison(result, metric)
        assert verdict.verdict == "inconclusive", verdict.verdict_line
        assert verdict.more_units_needed is not None
        assert (
            f"about {verdict.more_units_needed:,} more users in total are needed at the current split"
            in verdict.verdict_line
        )
        # Not significant means the lift is inside ±1.96 standard errors, so below what 80 % power detects.
        assert verdict.minimum_detectable_effect is not None
        assert verdict.absolute_lift is not None
        assert abs(verdict.absolute_lift) < verdict.minimum_detectable_effect
    assert comparison(result, "revenue").test == "welch"
    assert comparison(result, "satisfaction").test == "z"


def test_events_naming_a_user_join_the_arm_that_user_was_randomized_into(shop: Shop, shop_analysis: Analysis) -> None:
    [result] = shop_analysis.phases
    assert sum(arm.metrics["revenue"].events for arm in result.arms) == shop.revenue_events
    revenue = {arm.arm: arm.metrics["revenue"] for arm in result.arms}
    assert revenue["v1"].events > 0
    assert revenue["v2"].events > 0


def test_each_arm_has_units_calls_metric_values_latency_and_error_rate(shop_analysis: Analysis) -> None:
    [result] = shop_analysis.phases
    arms = {arm.arm: arm for arm in result.arms}
    assert set(arms) == {"v1", "v2"}
    # Every user is a unit, and every keyless call is one too.
    assert arms["v1"].units == USERS // 2 + KEYLESS_CALLS // 2
    assert arms["v2"].units == USERS // 2 + KEYLESS_CALLS // 2
    assert arms["v1"].latency_p50_ms == pytest.approx(5.0, rel=0.02)
    assert arms["v1"].error_rate == 0
    click_v1, click_v2 = arms["v1"].metrics["click"], arms["v2"].metrics["click"]
    assert click_v1.value is not None
    assert click_v2.value is not None
    assert 0.08 < click_v1.value < 0.12 < 0.13 < click_v2.value < 0.17
    assert click_v1.ci.low is not None
    assert click_v1.ci.low < click_v1.value


def test_an_honest_split_raises_no_sample_ratio_mismatch(shop_analysis: Analysis) -> None:
    [result] = shop_analysis.phases
    assert result.srm is not None
    assert not result.srm.flagged
    assert result.srm.observed == {"v1": 1_600, "v2": 1_600}
    assert result.srm.expected == {"v1": 1_600, "v2": 1_600}


def test_units_seen_in_two_arms_are_counted_and_left_out(shop: Shop, shop_analysis: Analysis) -> None:
    [result] = shop_analysis.phases
    assert result.crossover_units == CROSSOVER_USERS
    assert sum(arm.units for arm in result.arms) == USERS + KEYLESS_CALLS
    assert shop_analysis.feedback.crossover == shop.crossover_events


def test_pinned_and_spilled_calls_are_shown_apart_and_never_compared(shop: Shop, shop_analysis: Analysis) -> None:
    rows = {(r.assignment, r.arm): r for r in shop_analysis.non_randomized}
    assert rows[("pin", "v2")].calls == PINNED
    spill = rows[("spill", "v2")]
    assert spill.calls == SPILLED
    assert spill.errors == SPILLED // 3
    assert spill.latency_p50_ms == pytest.approx(40.0, rel=0.02)
    assert shop_analysis.feedback.not_randomized == shop.pinned_click_events
    assert shop_analysis.calls.not_randomized == PINNED + SPILLED
    [result] = shop_analysis.phases
    arms = {arm.arm: arm for arm in result.arms}
    assert arms["v2"].latency_p99_ms == pytest.approx(5.0, rel=0.02)  # the spills' 40 ms are not in it


def test_duplicate_calls_and_events_count_once_and_unknown_request_ids_are_counted(
    shop: Shop, shop_analysis: Analysis
) -> None:
    assert shop_analysis.calls.duplicates == DUPLICATE_CALLS
    assert shop_analysis.feedback.duplicates == DUPLICATE_CLICKS
    assert shop_analysis.feedback.unknown == UNKNOWN_EVENTS
    [result] = shop_analysis.phases
    arms = {arm.arm: arm for arm in result.arms}
    assert arms["v1"].metrics["click"].events == shop.distinct_clicks["v1"]
    assert arms["v2"].metrics["click"].events == shop.distinct_clicks["v2"]
    calls = USERS + KEYLESS_CALLS  # at least one call each
    assert arms["v1"].calls + arms["v2"].calls > calls


def test_the_analysis_is_the_same_whatever_the_page_size(shop: Shop, shop_analysis: Analysis) -> None:
    # Pages are read one ahead of the one being converted: small pages, and a last page exactly full (the
    # read after it comes back empty), must give every entry once, in order, like one page per stream.
    client = shop.redis.client()
    calls_entries = client.xlen(stream_key(SHOP))
    client.close()
    for page_size in (97, calls_entries):
        paged = run_analysis(shop.redis, Query(model=SHOP, window=WINDOW, metrics=METRICS, page_size=page_size))
        assert paged.model_dump() == shop_analysis.model_dump(), page_size


def test_a_reader_that_stops_early_leaves_no_read_in_flight_and_the_client_usable(shop: Shop) -> None:
    async def go() -> None:
        redis = Redis.from_url(shop.redis.url)
        try:
            pages = read_pages(redis, stream_key(SHOP), start="-", end="+", page_size=100)
            first = await anext(pages)  # the second page is asked for by now
            await pages.aclose()
            await asyncio.sleep(0)
            assert asyncio.all_tasks() == {asyncio.current_task()}  # the page in flight was cancelled
            # No connection of the client holds the reply nobody read: each command gets its own answer.
            for _ in range(3):
                again = cast(list[tuple[bytes, Any]], await redis.xrange(stream_key(SHOP), count=100))
                assert [entry_id for entry_id, _ in again] == [entry_id for entry_id, _ in first]
                assert await redis.xlen(stream_key(SHOP)) > 100
        finally:
            await redis.aclose()

    asyncio.run(go())


def test_the_lift_over_time_ends_at_the_final_comparison(shop_analysis: Analysis) -> None:
    click = comparison(shop_analysis.phases[0], "click")
    assert len(click.timeline) >= 15
    assert click.timeline[-1].absolute == pytest.approx(click.absolute_lift)
    assert click.timeline[-1].until_ns == WINDOW.until_ns
    units = [p.units_arm for p in click.timeline]
    assert units == sorted(units)


def test_sequential_analysis_gives_always_valid_p_values_wider_than_fixed_intervals(shop: Shop) -> None:
    result = run_analysis(shop.redis, Query(model=SHOP, window=WINDOW, metrics=METRICS, sequential=True))
    click = comparison(result.phases[0], "click")
    assert click.sequential_p_value is not None
    assert click.sequential_ci is not None
    assert click.sequential_ci.low is not None
    assert click.absolute_ci.low is not None
    assert click.sequential_ci.low < click.absolute_ci.low
    assert click.sequential_p_value >= click.p_value  # type: ignore[operator]
    assert click.verdict == "better"
    assert "always-valid 95 % CI" in click.verdict_line


def test_the_sequential_verdict_shows_the_relative_lifts_own_sequence(shop: Shop) -> None:
    result = run_analysis(shop.redis, Query(model=SHOP, window=WINDOW, metrics=METRICS, sequential=True))
    click = comparison(result.phases[0], "click")
    relative = click.sequential_relative_ci
    assert relative is not None
    assert relative.low is not None
    assert relative.high is not None
    assert click.relative_ci.low is not None
    assert relative.low < click.relative_ci.low  # wider than the fixed interval: looks may be taken any time
    shown = f"always-valid 95 % CI {relative.low * 100:+.1f} .. {relative.high * 100:+.1f} %"
    assert shown in click.verdict_line, click.verdict_line
    assert result.phases[0].comparisons[0].timeline[-1].sequential_relative_ci == relative


def test_a_later_tuning_narrows_the_sequence_later(shop: Shop) -> None:
    """The sequence is tightest near its tuning: at this window's ~3,000 users the default (5,000 in total) fits,
    and tuning for a million users leaves it wider now."""
    early = run_analysis(shop.redis, Query(model=SHOP, window=WINDOW, metrics=METRICS, sequential=True))
    late = run_analysis(
        shop.redis, Query(model=SHOP, window=WINDOW, metrics=METRICS, sequential=True, tuning_units=1_000_000)
    )
    fitted, far = comparison(early.phases[0], "click").sequential_ci, comparison(late.phases[0], "click").sequential_ci
    assert fitted is not None
    assert far is not None
    assert fitted.low is not None
    assert far.low is not None
    assert fitted.high is not None
    assert far.high is not None
    assert far.high - far.low > fitted.high - fitted.low


def test_the_detectable_effect_is_given_now_and_at_the_planned_size(shop: Shop) -> None:
    result = run_analysis(shop.redis, Query(model=SHOP, window=WINDOW, metrics=METRICS, planned_units=100_000))
    [phase_result] = result.phases
    users = sum(arm.units for arm in phase_result.arms)
    for c in phase_result.comparisons:
        assert c.minimum_detectable_effect is not None
        assert c.planned_minimum_detectable_effect is not None
        # The same split, more units: the effect shrinks with the square root of the size.
        ratio = c.planned_minimum_detectable_effect / c.minimum_detectable_effect
        assert ratio == pytest.approx((users / 100_000) ** 0.5, rel=1e-9)
        assert c.control_value
        assert c.minimum_detectable_relative_effect == pytest.approx(c.minimum_detectable_effect / c.control_value)


def test_a_conversion_is_the_share_of_units_with_a_positive_event_and_a_rate_is_per_call(
    shop: Shop, shop_analysis: Analysis
) -> None:
    result = run_analysis(shop.redis, Query(model=SHOP, window=WINDOW, metrics=(MetricSpec.parse("click:conversion"),)))
    conversion = comparison(result.phases[0], "click")
    assert conversion.kind == "conversion"
    assert conversion.test == "welch"
    converted = {
        arm: np.array([1.0 if unit in shop.converted[arm] else 0.0 for unit in sorted(shop.units[arm])])
        for arm in ("v1", "v2")
    }
    assert conversion.control_value == pytest.approx(converted["v1"].mean(), rel=1e-12)
    assert conversion.arm_value == pytest.approx(converted["v2"].mean(), rel=1e-12)
    reference = stats.ttest_ind(converted["v2"], converted["v1"], equal_var=False)
    assert conversion.p_value == pytest.approx(reference.pvalue, rel=1e-9)
    # Per call, the same clicks read differently: users make 2.5 calls on average.
    rate = comparison(shop_analysis.phases[0], "click")
    assert rate.kind == "rate"
    assert rate.control_value is not None
    assert conversion.control_value > rate.control_value * 1.5


def test_holm_adjusts_every_metric_and_arm_as_one_family(shop: Shop, shop_analysis: Analysis) -> None:
    result = run_analysis(shop.redis, Query(model=SHOP, window=WINDOW, metrics=METRICS, correction="holm"))
    # The latency quantiles (p50, p90, p99 of v2 against v1) are hypotheses of the analysis too: in the family.
    plain_quantiles = [q for q in shop_analysis.phases[0].quantiles if q.p_value is not None]
    assert len(plain_quantiles) == 3
    assert (result.correction, result.family_size, result.quantiles_in_family) == ("holm", 6, 3)
    plain = {c.metric: c for c in shop_analysis.phases[0].comparisons}
    adjusted = {c.metric: c for c in result.phases[0].comparisons}
    names = sorted(plain)
    family = [plain[n].p_value for n in names] + [q.p_value for q in plain_quantiles]
    expected = multipletests(family, method="holm")[1]
    for q, before, reference in zip(result.phases[0].quantiles, plain_quantiles, expected[3:], strict=True):
        assert (q.metric, q.name, q.correction) == (before.metric, before.name, "holm")
        assert q.adjusted_p_value == pytest.approx(reference, rel=1e-12)
        assert q.p_value == before.p_value  # the unadjusted one stays beside it
        # Bonferroni's level for the ratio's interval too: alpha / 6, on the log scale.
        assert q.adjusted_ratio_ci is not None
        assert q.adjusted_ratio_ci.low is not None
        assert q.adjusted_ratio_ci.high is not None
        assert before.ratio_ci.low is not None
        assert before.ratio_ci.high is not None
        widened = math.log(q.adjusted_ratio_ci.high / q.adjusted_ratio_ci.low) / math.log(
            before.ratio_ci.high / before.ratio_ci.low
        )
        assert widened == pytest.approx(stats.norm.ppf(1 - 0.05 / 12) / stats.norm.ppf(0.975), rel=1e-9)
    for name, reference in zip(names, expected[:3], strict=True):
        c = adjusted[name]
        assert c.correction == "holm"
        assert c.adjusted_p_value == pytest.approx(reference, rel=1e-12)
        assert c.p_value == plain[name].p_value  # the unadjusted one stays beside it
        assert "Holm-adjusted 95 % CI" in c.verdict_line
        assert ", adjusted p" in c.verdict_line
    # Bonferroni's level for the intervals: alpha / 6, so the click (a z-test) interval widens by the z ratio.
    click, before = adjusted["click"], plain["click"]
    assert click.adjusted_ci is not None
    assert click.adjusted_ci.low is not None
    assert click.adjusted_ci.high is not None
    assert before.absolute_ci.low is not None
    assert before.absolute_ci.high is not None
    widened = (click.adjusted_ci.high - click.adjusted_ci.low) / (before.absolute_ci.high - before.absolute_ci.low)
    assert widened == pytest.approx(stats.norm.ppf(1 - 0.05 / 12) / stats.norm.ppf(0.975), rel=1e-9)
    assert click.verdict == "better"  # a planted 50 % lift survives six tests
    assert result.verdicts == [c.verdict_line for c in result.phases[0].comparisons]
    table = render_table(result)
    assert "Verdicts adjusted by Holm (family-wise) over 6 comparisons" in table
    assert "3 of them latency and TTFT quantiles" in table
    assert "HOLM-ADJ. RATIO CI" in table


def test_bh_counts_the_segments_in_its_family_and_marks_each_line(shop: Shop) -> None:
    query = Query(model=SHOP, window=WINDOW, metrics=METRICS, correction="bh", segment="principal")
    result = run_analysis(shop.redis, query)
    per_segment = sum(len(p.comparisons) for s in result.segments for p in s.phases)
    assert per_segment > 0
    # The latency quantiles with an interval, overall and per segment, are in the family too.
    quantiles = [q for q in result.every_quantile() if q.p_value is not None]
    assert result.quantiles_in_family == len(quantiles) > 0
    assert result.family_size == len(result.phases[0].comparisons) + per_segment + len(quantiles)
    assert all(q.correction == "bh" and q.adjusted_p_value is not None for q in quantiles)
    lines = result.verdicts + [line for s in result.segments for line in s.verdicts]
    assert lines
    assert all("BH-adjusted" in line for line in lines)


def test_per_call_analysis_uses_the_two_proportion_test_and_its_always_valid_form(shop: Shop) -> None:
    result = run_analysis(shop.redis, Query(model=SHOP, window=WINDOW, metrics=METRICS, unit="call", sequential=True))
    [phase_result] = result.phases
    click = comparison(phase_result, "click")
    assert click.test == "two-proportion z"
    assert click.verdict == "better"
    assert click.sequential_p_value is not None
    assert click.sequential_p_value < 0.05
    assert phase_result.crossover_units == 0  # a call is in one arm
    assert sum(arm.units for arm in phase_result.arms) == sum(arm.calls for arm in phase_result.arms)
    # User-level events name no call: unknown when the unit is the call.
    assert result.feedback.unknown > UNKNOWN_EVENTS
    # The router split these calls by user: calls of one user are not independent, and the result says so.
    keyed = result.calls.randomized - KEYLESS_CALLS
    assert result.unit_warning is not None
    assert f"{keyed:,} of {result.calls.randomized:,} randomized calls were split by their routing key" in (
        result.unit_warning
    )
    assert all(line.endswith(PER_CALL_LABEL) for line in result.verdicts)
    assert result.verdicts
    assert run_analysis(shop.redis, Query(model=SHOP, window=WINDOW, metrics=METRICS)).unit_warning is None


def test_per_call_analysis_of_calls_sent_without_a_routing_key_carries_no_warning(tmp_path: Path) -> None:
    calls = [Call(f"k{i}", T0 + i * 10**8, "v2" if i % 2 else "v1", assignment="random") for i in range(200)]
    events = [Event("click", 1.0, c.time_ns + 10**9, request_id=c.request_id) for c in calls[::3]]
    with RedisServer(tmp_path / "redis") as server:
        client = server.client()
        write_calls(client, "keyless", calls, phase({"v1": 50, "v2": 50}, "v1"))
        write_feedback(client, "keyless", events)
        client.close()
        metrics = (MetricSpec.parse("click:rate"),)
        result = run_analysis(server, Query(model="keyless", window=WINDOW, metrics=metrics, unit="call"))
    assert result.calls.randomized == 200
    assert result.unit_warning is None
    assert not any(line.endswith(PER_CALL_LABEL) for line in result.verdicts)


def test_a_52_48_split_of_a_50_50_experiment_is_flagged_with_expected_and_observed(tmp_path: Path) -> None:
    skewed = phase({"v1": 50, "v2": 50}, "v1", salt="skewed")
    calls = [Call(f"s{i}", T0 + i * 10**6, "v1" if i < 5_200 else "v2", unit=user_unit(f"s{i}")) for i in range(10_000)]
    with RedisServer(tmp_path / "redis") as server:
        client = server.client()
        write_calls(client, "skewed", calls, skewed)
        client.close()
        result = run_analysis(server, Query(model="skewed", window=WINDOW, metrics=(METRICS[0],)))
    srm = result.phases[0].srm
    assert srm is not None
    assert srm.flagged
    assert srm.observed == {"v1": 5_200, "v2": 4_800}
    assert srm.expected == {"v1": 5_000, "v2": 5_000}
    assert srm.p_value < 0.001


def test_cuped_with_a_pre_period_narrows_the_interval(tmp_path: Path) -> None:
    rng = np.random.default_rng(13)
    pre_window = Window(T0 - 2 * HOUR_NS, T0 - HOUR_NS)
    cuped_phase = phase({"v1": 50, "v2": 50}, "v1", salt="cuped")
    calls: list[Call] = []
    events: list[Event] = []
    for i in range(2_000):
        unit, arm = user_unit(f"c{i}"), "v1" if i % 2 else "v2"
        spend = rng.gamma(2.0, 10.0)  # how much this user tends to spend, in both periods
        for period, start in (("pre", pre_window.since_ns), ("in", T0)):
            t = int(start + rng.integers(0, HOUR_NS // 2))
            calls.append(Call(f"{period}-{i}", t, arm, unit=unit))
            amount = spend * rng.lognormal(0, 0.25) + (1.0 if period == "in" and arm == "v2" else 0.0)
            events.append(Event("revenue", float(amount), t + 10**9, request_id=f"{period}-{i}"))
    with RedisServer(tmp_path / "redis") as server:
        client = server.client()
        write_calls(client, "cuped", calls, cuped_phase)
        write_feedback(client, "cuped", events)
        client.close()
        metrics = (MetricSpec.parse("revenue:sum"),)
        result = run_analysis(server, Query(model="cuped", window=WINDOW, metrics=metrics, pre_window=pre_window))
    revenue = comparison(result.phases[0], "revenue")
    assert revenue.cuped_theta is not None
    assert revenue.cuped_theta > 0.5
    assert revenue.unadjusted_ci is not None
    width = revenue.absolute_ci.high - revenue.absolute_ci.low  # type: ignore[operator]
    unadjusted = revenue.unadjusted_ci.high - revenue.unadjusted_ci.low  # type: ignore[operator]
    assert width < 0.6 * unadjusted
    assert revenue.absolute_ci.low < 1.0 < revenue.absolute_ci.high  # type: ignore[operator]


def test_cuped_with_a_pre_period_that_holds_no_call_adjusts_nothing(tmp_path: Path) -> None:
    """A pre-period no unit called in (a new model, or a window before the recording began) is a covariate of
    zeros: the analysis gives the unadjusted comparison. It raised IndexError reading a row of the empty
    pre-period for every unit, since a unit absent from it pointed at row 0."""
    rng = np.random.default_rng(17)
    cuped_phase = phase({"v1": 50, "v2": 50}, "v1", salt="cuped-empty")
    calls, events = [], []
    for i in range(400):
        arm, t = "v1" if i % 2 else "v2", int(T0 + rng.integers(0, HOUR_NS // 2))
        calls.append(Call(f"in-{i}", t, arm, unit=user_unit(f"e{i}")))
        events.append(Event("revenue", float(rng.gamma(2.0, 10.0)), t + 10**9, request_id=f"in-{i}"))
        events.append(Event("score", float(rng.integers(1, 6)), t + 10**9, request_id=f"in-{i}"))
    metrics = (MetricSpec.parse("revenue:sum"), MetricSpec.parse("score:mean"))
    with RedisServer(tmp_path / "redis") as server:
        client = server.client()
        write_calls(client, "cuped-empty", calls, cuped_phase)
        write_feedback(client, "cuped-empty", events)
        client.close()
        plain = run_analysis(server, Query(model="cuped-empty", window=WINDOW, metrics=metrics))
        empty_pre = Window(T0 - 2 * HOUR_NS, T0 - HOUR_NS)
        adjusted = run_analysis(
            server, Query(model="cuped-empty", window=WINDOW, metrics=metrics, pre_window=empty_pre)
        )
    for metric in plain.phases[0].comparisons:
        with_pre = comparison(adjusted.phases[0], metric.metric)
        assert with_pre.absolute_ci == metric.absolute_ci, metric.metric
        assert with_pre.p_value == metric.p_value, metric.metric


# -- the CLI ---------------------------------------------------------------------------------


def window_flags() -> list[str]:
    return ["--since", str(WINDOW.since_ns // 10**9), "--until", str(WINDOW.until_ns // 10**9)]


@pytest.mark.slow
def test_the_cli_prints_verdicts_and_writes_analysis_json_and_html(shop: Shop, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = cli(
        SHOP, "--redis-url", shop.redis.url, *window_flags(), "--metric", "click:proportion",
        "--metric", "satisfaction:mean", "--metric", "revenue:sum", "--sequential", "--output-dir", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert re.search(r"v2 vs v1: click \+\d+\.\d % \(always-valid 95 % CI .*: v2 better", result.stdout)
    assert "spill" in result.stdout  # shown apart
    document = json.loads((out / "analysis.json").read_text())
    assert document["model"] == SHOP
    assert document["sequential"] is True
    assert document["phases"][0]["srm"]["flagged"] is False
    assert document["phases"][0]["crossover_units"] == CROSSOVER_USERS
    assert document["feedback"]["unknown"] == UNKNOWN_EVENTS
    assert any(line.endswith("v2 better") for line in document["verdicts"])
    html = (out / "analysis.html").read_text()
    # A p-value below the printed precision reads "p < 0.001" in a sentence, never "p = < 0.001".
    assert "p < 0.001: v2 better" in result.stdout
    for text in (result.stdout, html, *document["verdicts"]):
        assert "p = <" not in text
        assert "p = &lt;" not in text
    assert "<script" not in html
    assert "http://" not in html
    assert "https://" not in html
    for marker in ("class='srm'", "class='charts lift'", "class='interval'", "class='band'", "class='sequence'",
                   "latency-cdf", "class='series' data-label='v1'", "class='non-randomized'"):  # fmt: skip
        assert marker in html, marker


@pytest.mark.slow
def test_relative_times_and_the_environment_work_like_the_replayers(shop: Shop, tmp_path: Path) -> None:
    result = launcher.run(
        [sys.executable, "-m", "splitstream.admin", "analyze", SHOP, "--since", "-4h", "--until", "-1h",
         "--output-dir", str(tmp_path)],
        env={**{k: v for k, v in os.environ.items() if not k.startswith("SPLITSTREAM_")},
             "SPLITSTREAM_ADMIN_REDIS_URL": shop.redis.url,
             "SPLITSTREAM_ADMIN_METRIC": "click:proportion,revenue:sum"},
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "v2 vs v1: click" in result.stdout
    assert "v2 vs v1: revenue" in result.stdout
    assert "v2 better" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--metric", "click"], "bad metric 'click'"),
        (["--metric", "click:median"], "unknown kind 'median'"),
        (["--metric", "click:proportion:sideways"], "unknown kind 'sideways'"),
        (["--metric", "click:lower"], "bad metric 'click:lower' (expected NAME:KIND[:DIRECTION]"),
        (["--metric", "click:proportion", "--since", "yesterday"], "--since: bad time 'yesterday'"),
        (["--metric", "click:proportion", "--unit", "team"], "invalid choice: 'team'"),
        (["--metric", "click:proportion", "--alpha", "2"], "alpha must be between 0 and 1"),
        (["--metric", "click:proportion", "--until", "-5h"], "--until must be after --since"),
        (["--metric", "click:proportion", "--cuped-pre-since", "-9h"], "give both --cuped-pre-since"),
        (["--metric", "click:proportion", "--metric", "click:sum"], "a metric is named twice: click"),
        (["--metric", "click:proportion", "--max-lateness", "100000000d"], "--max-lateness: at most 3650d"),
        (["--metric", "click:rate", "--sequential-tuning", "0"], "--sequential-tuning: must be between 2"),
        (["--metric", "click:rate", "--correction", "bonferroni"], "invalid choice: 'bonferroni'"),
        (["--metric", "click:rate", "--planned-units", "lots"], "--planned-units: not a whole number of units"),
        (["--metric", "click:proportion", "--since", "9000-01-01T00:00:00Z"], "is after anything recorded can be"),
        (
            ["--metric", "click:proportion", "--unit", "call", "--cuped-pre-since", "-9h", "--cuped-pre-until", "-8h"],
            "needs --unit user",
        ),
    ],
    ids=[
        "no-kind",
        "bad-kind",
        "bad-direction",
        "direction-without-kind",
        "bad-time",
        "bad-unit",
        "bad-alpha",
        "empty-window",
        "half-cuped",
        "twice",
        "lateness-past-int64",
        "zero-tuning",
        "bad-correction",
        "bad-planned-units",
        "since-past-int64",
        "cuped-per-call",
    ],
)
def test_bad_flags_exit_2_with_one_line_naming_the_problem(flags: list[str], message: str) -> None:
    result = cli(SHOP, "--redis-url", "redis://127.0.0.1:1/0", "--since", "-4h", *flags)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert message in lines[0]


@pytest.mark.slow
def test_an_unknown_model_exits_2_listing_the_recorded_ones(shop: Shop, tmp_path: Path) -> None:
    result = cli("nope", "--redis-url", shop.redis.url, "--since", "-4h", "--metric", "click:proportion",
                 "--output-dir", str(tmp_path))  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "unknown model 'nope'" in lines[0]
    assert SHOP in lines[0]


@pytest.mark.slow
def test_unreachable_redis_exits_1_with_one_line(tmp_path: Path) -> None:
    result = cli("shop", "--redis-url", f"redis://:secret-pw@127.0.0.1:{free_port()}/0", "--since", "-4h",
                 "--metric", "click:proportion", "--output-dir", str(tmp_path))  # fmt: skip
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "unreachable" in lines[0]
    assert "secret-pw" not in lines[0]


def test_an_output_dir_that_cannot_be_written_exits_2_with_one_line(shop: Shop, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    result = cli(SHOP, "--redis-url", shop.redis.url, *window_flags(), "--metric", "click:proportion",
                 "--output-dir", str(blocker / "out"))  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "cannot write --output-dir" in lines[0]


def test_each_phase_is_analysed_on_its_own_weights_and_events_join_the_phase_of_their_time(tmp_path: Path) -> None:
    ramp = phase({"v1": 90, "v2": 10}, "v1", salt="ramp")
    half = phase({"v1": 50, "v2": 50}, "v1", salt="ramp")
    middle = T0 + HOUR_NS // 2
    early: list[Call] = []
    late: list[Call] = []
    events: list[Event] = []
    for i in range(1_000):
        unit = user_unit(f"p{i}")
        early.append(Call(f"a{i}", T0 + i * 10**6, "v2" if i % 10 == 0 else "v1", unit=unit))
        late.append(Call(f"b{i}", middle + i * 10**6, "v2" if i % 2 else "v1", unit=unit))
        # One purchase per user in each phase, named by the user only.
        events.append(Event("revenue", 1.0, T0 + 5 * 60 * 10**9, unit=unit, idempotency_key=f"ra{i}"))
        events.append(Event("revenue", 2.0, middle + 5 * 60 * 10**9, unit=unit, idempotency_key=f"rb{i}"))
    with RedisServer(tmp_path / "redis") as server:
        client = server.client()
        write_calls(client, "ramp", early, ramp)
        write_calls(client, "ramp", late, half)
        write_feedback(client, "ramp", events)
        client.close()
        result = run_analysis(server, Query(model="ramp", window=WINDOW, metrics=(MetricSpec.parse("revenue:sum"),)))
    first, second = result.phases
    assert first.weights == {"v1": 90, "v2": 10}
    assert second.weights == {"v1": 50, "v2": 50}
    assert first.srm is not None
    assert second.srm is not None
    assert first.srm.observed == {"v1": 900, "v2": 100}
    assert second.srm.observed == {"v1": 500, "v2": 500}
    assert not first.srm.flagged
    assert not second.srm.flagged
    # Users moved arms between phases, which is no crossover: units are compared within one phase.
    assert first.crossover_units == second.crossover_units == 0
    totals = [{arm.arm: arm.metrics["revenue"].value for arm in p.arms} for p in (first, second)]
    assert totals == [{"v1": 1.0, "v2": 1.0}, {"v1": 2.0, "v2": 2.0}]
    assert result.feedback.used == 2_000


@pytest.mark.slow
def test_clicks_after_the_window_count_for_its_calls_within_the_attribution_window(tmp_path: Path) -> None:
    # Calls in the window's last minute, clicked 20 minutes later (past --until); a user-level purchase at the
    # same time stays out (it names no call of the window), and so does a click two hours late.
    end = WINDOW.until_ns
    calls = [Call(f"late-{i}", end - 60 * 10**9 + i * 10**7, "v1" if i % 2 else "v2") for i in range(400)]
    events = [
        Event("click", 1.0, call.time_ns + 20 * 60 * 10**9, request_id=call.request_id, idempotency_key=call.request_id)
        for call in calls
    ]
    events.append(Event("click", 1.0, end + 2 * HOUR_NS, request_id="late-0", idempotency_key="again"))
    events.append(Event("click", 1.0, end + 60 * 10**9, unit=user_unit("someone"), idempotency_key="unit"))
    with RedisServer(tmp_path / "redis") as server:
        client = server.client()
        write_calls(client, "late", calls, phase({"v1": 50, "v2": 50}, "v1"))
        write_feedback(client, "late", events)
        client.close()
        flags = ["--redis-url", server.url, *window_flags(), "--metric", "click:proportion"]
        default = cli("late", *flags, "--output-dir", str(tmp_path / "default"))
        cut = cli("late", *flags, "--attribution-window", "0s", "--output-dir", str(tmp_path / "cut"))
        wide = cli("late", *flags, "--attribution-window", "3h", "--output-dir", str(tmp_path / "wide"))
        bad = cli("late", *flags, "--attribution-window", "soon")
    for result in (default, cut, wide):
        assert result.returncode == 0, result.stderr
    # Default: the --max-lateness (1h): every call's click joins it; the late click and the user's do not.
    document = json.loads((tmp_path / "default" / "analysis.json").read_text())
    assert document["attribution_ns"] == HOUR_NS
    assert document["feedback"]["used"] == 400
    assert document["feedback"]["outside_window"] == 2
    [result] = document["phases"]
    assert {arm["arm"]: arm["metrics"]["click"]["value"] for arm in result["arms"]} == {"v1": 1.0, "v2": 1.0}
    assert "counted until" in default.stdout
    # No attribution window: the old cut at --until, every click outside.
    document = json.loads((tmp_path / "cut" / "analysis.json").read_text())
    assert document["feedback"]["used"] == 0
    assert document["feedback"]["outside_window"] == 401  # (the two-hour-late click is past what is read at all)
    # Three hours: the two-hour-late click is a duplicate-free second click of late-0, counted too.
    document = json.loads((tmp_path / "wide" / "analysis.json").read_text())
    assert document["feedback"]["used"] == 401
    assert document["feedback"]["outside_window"] == 1
    assert bad.returncode == 2
    assert "--attribution-window: bad duration 'soon'" in bad.stderr.strip().splitlines()[-1]


def test_a_short_horizon_holds_few_calls_and_joins_what_it_promises(tmp_path: Path) -> None:
    # An hour of calls (one every 0.6 s, 200 users), a third clicked a second later; the streams hold each entry
    # at its arrival, copies of calls and clicks delivered 30 s after the originals (within the lateness).
    # With --max-lateness 2m --attribution-window 5m, a click 4 minutes after its call joins it, one 6 minutes
    # after it (past the attribution window) or a minute before it (more than the clock skew) is unknown,
    # copies count once, a user's purchase joins the user whenever it comes, and the analysis holds the calls
    # of some minutes for the join, not the hour's.
    minute = 60 * 10**9
    users = [user_unit(f"horizon-{u}") for u in range(200)]
    calls = [
        Call(f"h{i}", T0 + i * 600_000_000, "v1" if i % 2 == 0 else "v2", unit=users[i % 200]) for i in range(6_000)
    ]
    clicks = [
        Event("click", 1.0, call.time_ns + 10**9, request_id=call.request_id, idempotency_key=f"c{i}")
        for i, call in enumerate(calls)
        if i % 3 == 0
    ]
    within = Event("click", 1.0, calls[4501].time_ns + 4 * minute, request_id="h4501", idempotency_key="within")
    past = Event("click", 1.0, calls[3001].time_ns + 6 * minute, request_id="h3001", idempotency_key="past")
    before = Event("click", 1.0, calls[3002].time_ns - minute, request_id="h3002", idempotency_key="before")
    purchase = Event("revenue", 7.0, T0 + 50 * minute, unit=users[8], idempotency_key="buy")
    events = [*clicks, within, past, before, purchase]
    arrivals: list[tuple[int, Call | Event]] = [(c.time_ns, c) for c in calls] + [(e.event_ns, e) for e in events]
    arrivals += [(c.time_ns + 30 * 10**9, c) for c in calls[::500]]  # 12 calls stored twice
    arrivals += [(e.event_ns + 30 * 10**9, e) for e in clicks[::100]]  # 20 clicks delivered twice
    metrics = (MetricSpec.parse("click:proportion"), MetricSpec.parse("revenue:sum"))
    short = Window(T0, T0 + HOUR_NS, max_lateness_ns=2 * minute, attribution_ns=5 * minute)
    with RedisServer(tmp_path / "redis") as server:
        client = server.client()
        write_arrivals(client, "horizon", arrivals, phase({"v1": 50, "v2": 50}, "v1"))
        client.close()
        result = run_analysis(server, Query(model="horizon", window=short, metrics=metrics, page_size=200))
        hour = run_analysis(server, Query(model="horizon", window=WINDOW, metrics=metrics, page_size=200))
    assert (result.calls.calls, result.calls.duplicates) == (6_000, 12)
    assert result.feedback.duplicates == 20
    assert result.feedback.unknown == 2  # the click past the attribution window, and the one before its call
    assert result.feedback.used == 2_000 + 1 + 1  # the clicks, the one 4 minutes on, the purchase
    [phase_result] = result.phases
    arms = {arm.arm: arm for arm in phase_result.arms}
    assert arms["v1"].metrics["click"].value == pytest.approx(1_000 / 3_000)
    assert arms["v2"].metrics["click"].value == pytest.approx(1_001 / 3_000)
    assert arms["v1"].metrics["revenue"].events == 1
    # Held for the join at most: the calls of about 5 + 2·2 minutes and a page or two, not the hour's 6,000.
    assert 0 < result.calls.held_for_join_peak < 6_000 // 3
    # The default horizon (an hour's lateness) holds every call, and the click 6 minutes late joins its call.
    assert hour.calls.held_for_join_peak == 6_000
    assert (hour.feedback.used, hour.feedback.unknown, hour.feedback.duplicates) == (2_003, 1, 20)


def test_analyze_needs_no_registry_but_the_other_commands_still_do() -> None:
    result = launcher.run(
        [sys.executable, "-m", "splitstream.admin", "versions", "shop"],
        env={k: v for k, v in os.environ.items() if not k.startswith("SPLITSTREAM_")},
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "splitstream: error: the following arguments are required: --registry"
    ]


def test_entries_that_are_not_records_or_events_are_counted_and_skipped(tmp_path: Path) -> None:
    odd = phase({"v1": 50, "v2": 50}, "v1", salt="odd")
    calls = [Call(f"o{i}", T0 + i * 10**9, "v1" if i % 2 else "v2", unit=user_unit(f"o{i}")) for i in range(40)]
    events = [Event("click", 1.0, T0 + i * 10**9 + 1, request_id=f"o{i}") for i in range(0, 40, 4)]
    with RedisServer(tmp_path / "redis") as server:
        client = server.client()
        write_calls(client, "odd", calls[:20], odd)
        # Written by hand between the recorder's entries: a page of mixed layouts.
        client.xadd("splitstream:calls:odd", {"record": b"not a record"}, id=f"{(T0 + 21 * 10**9) // 10**6}-*")
        client.xadd(
            "splitstream:calls:odd", {"time_ns": b"soon", "latency_ms": b"1"}, id=f"{(T0 + 22 * 10**9) // 10**6}-*"
        )
        write_calls(client, "odd", calls[23:], odd)
        write_feedback(client, "odd", events)
        at_ms = (T0 + 50 * 10**9) // 10**6
        client.xadd("splitstream:feedback:odd", {"metric": "click", "value": "lots", "event_ns": T0}, id=f"{at_ms}-*")
        client.close()
        result = run_analysis(server, Query(model="odd", window=WINDOW, metrics=(METRICS[0],)))
    assert result.calls.corrupt == 2
    assert result.calls.calls == 37
    assert result.feedback.corrupt == 1
    assert result.feedback.used == len(events) - 1  # o20's call is one of the three never written
    assert result.feedback.unknown == 1
    assert sum(arm.units for arm in result.phases[0].arms) == 37
