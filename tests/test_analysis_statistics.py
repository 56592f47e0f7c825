"""The A/B statistics against scipy/statsmodels on textbook cases, and by seeded simulation (each a few seconds).

The simulations are what a rollout relies on: a fixed-horizon test that is wrong 5 % of the time at alpha 0.05,
an always-valid test that stays at or under 5 % however often it is looked at (where looking at a fixed-horizon
test 20 times is wrong far more often), a power estimate that predicts how often a real lift is found, and an
SRM check that catches a 52/48 split and rarely cries wolf on an honest one.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats
from statsmodels.stats.multitest import multipletests
from statsmodels.stats.power import NormalIndPower
from statsmodels.stats.proportion import confint_proportions_2indep, proportions_ztest
from statsmodels.stats.weightstats import CompareMeans, DescrStatsW

from splitstream.analysis.statistics import (
    DEFAULT_TUNING_UNITS,
    Estimate,
    UnitValues,
    adjusted_p_values,
    compare,
    confidence_sequence_half_width,
    corrected_alpha,
    cuped_estimates,
    estimate,
    minimum_detectable_effect,
    mixing_variance,
    msprt_p_value,
    power,
    running_msprt_p_values,
    sample_ratio_mismatch,
    two_proportions,
    units_needed,
    with_sequential,
)

SIMULATIONS = 2_000


def test_welch_comparison_agrees_with_scipy_and_statsmodels() -> None:
    rng = np.random.default_rng(1)
    control = rng.normal(10.0, 3.0, 400)
    treatment = rng.normal(10.6, 5.0, 250)
    result = compare(estimate(UnitValues.of_means(control)), estimate(UnitValues.of_means(treatment)), alpha=0.05)
    reference = stats.ttest_ind(treatment, control, equal_var=False)
    assert result.p_value == pytest.approx(reference.pvalue, rel=1e-9)
    low, high = CompareMeans(DescrStatsW(treatment), DescrStatsW(control)).tconfint_diff(alpha=0.05, usevar="unequal")
    assert result.absolute_ci == pytest.approx((low, high), rel=1e-9)
    assert result.absolute == pytest.approx(treatment.mean() - control.mean())
    assert result.relative == pytest.approx(treatment.mean() / control.mean() - 1)


def test_two_proportion_test_agrees_with_statsmodels() -> None:
    result = two_proportions(480, 10_000, 560, 10_000, alpha=0.05)
    _, p = proportions_ztest([560, 480], [10_000, 10_000])
    assert result.p_value == pytest.approx(p, rel=1e-9)
    low, high = confint_proportions_2indep(560, 10_000, 480, 10_000, method="wald", compare="diff", alpha=0.05)
    assert result.absolute_ci == pytest.approx((low, high), rel=1e-9)
    assert result.relative == pytest.approx(0.056 / 0.048 - 1)


def test_delta_method_variance_of_a_ratio_is_the_textbook_formula() -> None:
    rng = np.random.default_rng(2)
    x = rng.poisson(5, 2_000).astype(float) + 1
    y = rng.binomial(x.astype(int), 0.3).astype(float)
    result = estimate(UnitValues(y, x))
    n, mx, my = len(x), x.mean(), y.mean()
    ratio = my / mx
    covariance = np.cov(y, x, ddof=1)
    textbook = (covariance[0, 0] - 2 * ratio * covariance[0, 1] + ratio**2 * covariance[1, 1]) / (n * mx**2)
    assert result.value == pytest.approx(y.sum() / x.sum())
    assert result.variance == pytest.approx(textbook, rel=1e-9)


def test_delta_method_interval_of_a_ratio_covers_the_true_rate_95_percent_of_the_time() -> None:
    rng = np.random.default_rng(3)
    covered = 0
    for _ in range(1_000):
        x = rng.geometric(0.2, 300).astype(float)  # calls per user, heavy-ish tail
        y = rng.binomial(x.astype(int), 0.1).astype(float)  # clicks among them
        low, high = estimate(UnitValues(y, x)).interval(0.05)
        covered += low <= 0.1 <= high
    assert 0.93 <= covered / 1_000 <= 0.97


def test_the_fixed_horizon_test_is_wrong_5_percent_of_the_time_in_aa_experiments() -> None:
    rng = np.random.default_rng(4)
    data = rng.exponential(2.0, size=(SIMULATIONS, 2, 500))  # skewed, like revenue
    rejections = 0
    for control, treatment in data:
        result = compare(estimate(UnitValues.of_means(control)), estimate(UnitValues.of_means(treatment)))
        rejections += result.p_value < 0.05
    assert 0.04 <= rejections / SIMULATIONS <= 0.06


def _peeks(rng: np.random.Generator, looks: int, block: int, lift: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Differences of means and their variances at each of ``looks`` looks (after every ``block`` units per arm)
    in SIMULATIONS experiments: arrays of shape (SIMULATIONS, looks)."""
    control = rng.normal(1.0, 1.0, size=(SIMULATIONS, looks * block))
    treatment = rng.normal(1.0 + lift, 1.0, size=(SIMULATIONS, looks * block))
    n = np.arange(1, looks + 1) * block

    def mean_and_var(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        sums = np.cumsum(values, axis=1)[:, n - 1]
        squares = np.cumsum(values**2, axis=1)[:, n - 1]
        mean = sums / n
        return mean, (squares - n * mean**2) / (n - 1)

    mc, vc = mean_and_var(control)
    mt, vt = mean_and_var(treatment)
    return mt - mc, (vc + vt) / n


def test_peeking_20_times_inflates_the_naive_test_but_not_the_always_valid_one() -> None:
    rng = np.random.default_rng(5)
    diffs, variances = _peeks(rng, looks=20, block=50)
    naive = 2 * stats.norm.sf(np.abs(diffs) / np.sqrt(variances))
    naive_rate = float((naive < 0.05).any(axis=1).mean())
    # The variance estimated at each look, as compare() does (the plug-in GrowthBook uses), tuned for 1,000 units
    # in both arms.
    units = np.arange(1, 21) * 50
    tau2 = mixing_variance(variances, 2 * units, alpha=0.05, tuning_units=1_000)
    always_valid = running_msprt_p_values(diffs, variances, tau2)
    sequential_rate = float((always_valid[:, -1] < 0.05).mean())
    assert naive_rate > 0.10
    assert sequential_rate <= 0.05


def test_the_confidence_sequence_excludes_zero_exactly_when_the_msprt_p_value_is_below_alpha() -> None:
    variance = 0.01
    tau2 = float(mixing_variance(variance, 200, alpha=0.05, tuning_units=1000))
    half = confidence_sequence_half_width(variance, tau2, alpha=0.05)
    assert msprt_p_value(half * 1.001, variance, tau2) < 0.05 < msprt_p_value(half * 0.999, variance, tau2)
    fixed_half = stats.norm.ppf(0.975) * math.sqrt(variance)
    assert half > fixed_half  # the price of looking any number of times


def test_a_planted_lift_is_found_as_often_as_the_power_calculation_predicts() -> None:
    rng = np.random.default_rng(6)
    units, lift = 400, 0.18
    predicted = power(lift, 1.0, 1.0, units, units, alpha=0.05)
    assert 0.6 < predicted < 0.8  # a case where power matters, not a sure thing
    data = rng.normal(0.0, 1.0, size=(SIMULATIONS, 2, units))
    data[:, 1] += lift
    detected = 0
    for control, treatment in data:
        result = compare(estimate(UnitValues.of_means(control)), estimate(UnitValues.of_means(treatment)))
        detected += result.p_value < 0.05 and result.absolute > 0
    assert abs(detected / SIMULATIONS - predicted) < 0.04


def test_units_needed_agrees_with_statsmodels_power_solver_at_even_and_uneven_splits() -> None:
    # statsmodels solves for the first sample's size, the second being ratio times it: here the treatment's.
    for control_share in (0.5, 0.9, 0.2):
        needed = units_needed(0.1, 1.0, 1.0, control_share=control_share, alpha=0.05, power=0.8)
        ratio = control_share / (1 - control_share)
        treatment = NormalIndPower().solve_power(effect_size=0.1, alpha=0.05, power=0.8, ratio=ratio)
        # statsmodels counts the far tail's sliver of power too: a few parts in a million.
        assert needed == pytest.approx(treatment * (1 + ratio), rel=1e-4)
    assert units_needed(0.0, 1.0, 1.0, control_share=0.5, alpha=0.05) is None
    assert units_needed(0.1, 1.0, 1.0, control_share=1.0, alpha=0.05) is None


def test_power_and_the_detectable_effect_use_each_arms_own_size() -> None:
    """The uneven split the issue measured: 2,691 and 309 users. Power with both arms at the smaller arm's size
    (what the analysis used to compute) is far lower than with the sizes there are."""
    effect, variance = 0.03, 0.0625  # a 3-point lift of a 6.7 % conversion
    actual = power(effect, variance, variance, 2_691, 309, alpha=0.05)
    reference = NormalIndPower().power(
        effect_size=effect / math.sqrt(variance), nobs1=309, alpha=0.05, ratio=2691 / 309
    )
    assert actual == pytest.approx(reference, rel=1e-6)
    assert actual > power(effect, variance, variance, 309, 309, alpha=0.05) + 0.1
    mde = minimum_detectable_effect(variance, variance, 2_691, 309, alpha=0.05, power=0.8)
    solved = NormalIndPower().solve_power(nobs1=309, alpha=0.05, power=0.8, ratio=2691 / 309)
    assert mde == pytest.approx(solved * math.sqrt(variance), rel=1e-4)
    assert power(mde, variance, variance, 2_691, 309, alpha=0.05) == pytest.approx(0.8, abs=1e-3)


def _growthbook_half_width(variance: float, total: int, alpha: float, tuning: int) -> float:
    """The confidence sequence's half-width as GrowthBook's gbstats writes it (SequentialTwoSidedTTest): ``s2`` the
    difference's variance times the units in both arms, ``rho`` from the tuning parameter, in total units."""
    rho = math.sqrt((-2 * math.log(alpha) + math.log(-2 * math.log(alpha) + 1)) / tuning)
    s2 = variance * total
    return math.sqrt(s2) * math.sqrt(
        ((total * rho**2 + 1) / (total**2 * rho**2)) * math.log((total * rho**2 + 1) / alpha**2)
    )


def test_the_confidence_sequences_match_growthbooks_formula_with_the_tuning_in_total_units() -> None:
    rng = np.random.default_rng(8)
    control = rng.normal(10.0, 3.0, 700)
    treatment = rng.normal(10.9, 4.0, 300)
    c, t = estimate(UnitValues.of_means(control)), estimate(UnitValues.of_means(treatment))
    for tuning in (DEFAULT_TUNING_UNITS, 500, 100_000):
        result = compare(c, t, alpha=0.05, test="z", sequential=True, tuning_units=tuning)
        assert result.sequential_ci is not None
        assert result.sequential_relative_ci is not None
        half = _growthbook_half_width(c.variance + t.variance, 1_000, 0.05, tuning)
        assert result.sequential_ci == pytest.approx((result.absolute - half, result.absolute + half), rel=1e-9)
        # The relative lift's own variance by the delta method, written out independently.
        mc, mt = control.mean(), treatment.mean()
        relative_variance = t.variance / mc**2 + mt**2 * c.variance / mc**4
        relative_half = _growthbook_half_width(relative_variance, 1_000, 0.05, tuning)
        lift = mt / mc - 1
        assert result.sequential_relative_ci == pytest.approx((lift - relative_half, lift + relative_half), rel=1e-9)
    assert DEFAULT_TUNING_UNITS == 5_000  # GrowthBook's default, which counts units in both arms


def test_the_relative_sequence_counts_the_controls_variance() -> None:
    """Dividing the absolute sequence by the control's mean leaves out the control's own noise: with a noisy
    control the relative sequence must be wider than that."""
    control, treatment = Estimate(10.0, 0.25, 500), Estimate(11.0, 0.04, 500)
    result = with_sequential(compare(control, treatment, test="z"), alpha=0.05)
    assert result.sequential_ci is not None
    assert result.sequential_relative_ci is not None
    naive = (result.sequential_ci[1] - result.sequential_ci[0]) / control.value
    assert result.sequential_relative_ci[1] - result.sequential_relative_ci[0] > naive * 1.05


@pytest.mark.slow
def test_peeking_at_the_relative_sequence_20_times_stays_under_alpha_in_aa_experiments() -> None:
    rng = np.random.default_rng(9)
    looks, block, simulations = 20, 50, 1_000
    data = rng.exponential(2.0, size=(simulations, 2, looks * block))  # skewed, like revenue
    false_alarms = 0
    for control, treatment in data:
        for n in range(block, looks * block + 1, block):
            c, t = estimate(UnitValues.of_means(control[:n])), estimate(UnitValues.of_means(treatment[:n]))
            result = with_sequential(compare(c, t, test="z"), alpha=0.05, tuning_units=1_000)
            assert result.sequential_relative_ci is not None
            low, high = result.sequential_relative_ci
            if low > 0 or high < 0:
                false_alarms += 1
                break
    assert false_alarms / simulations <= 0.05


def test_a_52_48_split_of_100000_units_is_flagged_with_expected_and_observed_counts() -> None:
    result = sample_ratio_mismatch({"v1": 52_000, "v2": 48_000}, {"v1": 50, "v2": 50})
    assert result is not None
    assert result.flagged
    assert result.expected == {"v1": 50_000, "v2": 50_000}
    assert result.observed == {"v1": 52_000, "v2": 48_000}
    assert result.p_value == pytest.approx(stats.chisquare([52_000, 48_000]).pvalue)


def test_an_honest_split_is_flagged_in_about_one_in_a_thousand_experiments() -> None:
    rng = np.random.default_rng(7)
    draws = rng.multinomial(100_000, [0.9, 0.1], size=20_000)
    p = stats.chisquare(draws, f_exp=np.array([90_000, 10_000]), axis=1).pvalue
    flagged = sum(
        sample_ratio_mismatch({"v1": int(a), "v2": int(b)}, {"v1": 90, "v2": 10}).flagged  # type: ignore[union-attr]
        for a, b in draws[p < 0.01]  # only these can be flagged; the rest are checked in bulk above
    )
    assert flagged / len(draws) <= 0.003


def test_arms_at_weight_zero_are_left_out_of_the_srm_test() -> None:
    result = sample_ratio_mismatch({"v1": 500, "v2": 500, "v3": 3}, {"v1": 50, "v2": 50, "v3": 0})
    assert result is not None
    assert set(result.expected) == {"v1", "v2"}
    assert not result.flagged


def test_cuped_keeps_the_estimate_unbiased_and_narrows_the_interval() -> None:
    rng = np.random.default_rng(8)
    pre = rng.normal(10, 3, size=(2, 2_000))
    post = pre * 0.8 + rng.normal(0, 1.5, size=(2, 2_000))
    post[1] += 0.3
    control, treatment = (UnitValues.of_means(v) for v in post)
    plain = compare(estimate(control), estimate(treatment))
    adjusted_control, adjusted_treatment, theta = cuped_estimates(
        control, treatment, UnitValues.of_means(pre[0]), UnitValues.of_means(pre[1])
    )
    cuped = compare(adjusted_control, adjusted_treatment)
    assert theta == pytest.approx(0.8, abs=0.05)
    assert cuped.absolute_ci[1] - cuped.absolute_ci[0] < 0.6 * (plain.absolute_ci[1] - plain.absolute_ci[0])
    assert cuped.absolute_ci[0] < 0.3 < cuped.absolute_ci[1]


def test_cuped_with_an_uninformative_covariate_changes_nothing() -> None:
    rng = np.random.default_rng(9)
    post = rng.normal(5, 1, size=(2, 1_000))
    zeros = UnitValues.of_means(np.zeros(1_000))
    control, treatment = (UnitValues.of_means(v) for v in post)
    adjusted_control, adjusted_treatment, theta = cuped_estimates(control, treatment, zeros, zeros)
    assert theta == 0
    assert adjusted_treatment.value == pytest.approx(estimate(treatment).value)
    assert adjusted_control.variance == pytest.approx(estimate(control).variance)


# -- multiple comparisons ---------------------------------------------------------------------


def test_holm_and_bh_adjustments_agree_with_statsmodels() -> None:
    rng = np.random.default_rng(10)
    p = np.concatenate([rng.uniform(0, 0.01, 5), rng.uniform(0, 1, 20), [0.04, 0.04]])  # with ties
    for method, reference in (("holm", "holm"), ("bh", "fdr_bh")):
        assert adjusted_p_values(p, method) == pytest.approx(multipletests(p, method=reference)[1], abs=1e-12)
    assert corrected_alpha(adjusted_p_values(p, "holm"), "holm", 0.05) == pytest.approx(0.05 / len(p))
    discoveries = int(multipletests(p, alpha=0.05, method="fdr_bh")[0].sum())
    assert corrected_alpha(adjusted_p_values(p, "bh"), "bh", 0.05) == pytest.approx(0.05 * discoveries / len(p))
    with pytest.raises(ValueError, match="unknown correction"):
        adjusted_p_values(p, "bonferroni")


def test_a_family_of_ten_aa_comparisons_is_wrong_at_most_alpha_of_the_time_once_corrected() -> None:
    """Ten metrics with no true effect: uncorrected, some test is "significant" in about 40 % of experiments;
    with Holm (any false positive) and BH (under no true effect, the same), in about 5 %."""
    rng = np.random.default_rng(11)
    experiments, family, units = 2_000, 10, 200
    data = rng.normal(0.0, 1.0, size=(experiments, family, 2, units))
    diff = data[:, :, 1].mean(axis=2) - data[:, :, 0].mean(axis=2)
    se = np.sqrt((data[:, :, 1].var(axis=2, ddof=1) + data[:, :, 0].var(axis=2, ddof=1)) / units)
    p = 2 * stats.norm.sf(np.abs(diff) / se)
    uncorrected = float((p < 0.05).any(axis=1).mean())
    holm = float(np.mean([(adjusted_p_values(row, "holm") < 0.05).any() for row in p]))
    bh = float(np.mean([(adjusted_p_values(row, "bh") < 0.05).any() for row in p]))
    # 2,000 experiments estimate a 5 % rate within about ±1 % (two standard errors).
    assert uncorrected > 0.3
    assert holm <= 0.06
    assert bh <= 0.06


# -- capping ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [200, 1_000, 1_001, 5_000])
def test_a_percentile_cap_winsorizes_as_scipy_does_and_the_estimate_is_of_the_capped_values(n: int) -> None:
    from scipy.stats import mstats

    from splitstream.analysis.capping import CapRule, cap_value, capped, units_capped

    rng = np.random.default_rng(n)
    values = rng.lognormal(2.0, 1.5, n)
    cap = cap_value(CapRule.parse("P99"), values)
    winsorized = np.asarray(mstats.winsorize(values, limits=(0, 0.01)))
    np.testing.assert_array_equal(capped(values, cap), winsorized)
    assert units_capped(values, cap) == round(0.01 * n)
    result = estimate(UnitValues.of_means(capped(values, cap)))
    assert result.value == pytest.approx(winsorized.mean())
    assert result.variance == pytest.approx(winsorized.var(ddof=1) / n)


def test_a_capped_mean_caps_each_units_total_and_keeps_its_event_count() -> None:
    from splitstream.analysis.capping import CapRule, cap_value, capped

    rng = np.random.default_rng(3)
    counts = rng.integers(1, 5, 800).astype(np.float64)
    totals = counts * rng.lognormal(1.0, 1.0, 800)
    cap = cap_value(CapRule.parse("250"), totals)
    assert cap == 250
    result = estimate(UnitValues(capped(totals, cap), counts))
    clipped = np.clip(totals, None, 250)
    ratio = clipped.sum() / counts.sum()
    linear = (clipped - ratio * counts) / counts.mean()  # the delta method written out
    assert result.value == pytest.approx(ratio)
    assert result.variance == pytest.approx(linear.var(ddof=1) / 800)


# -- non-inferiority --------------------------------------------------------------------------


def _arms(rng: np.random.Generator, n: int, control: float, treatment: float, sd: float) -> tuple[np.ndarray, ...]:
    return rng.normal(control, sd, n), rng.normal(treatment, sd * 1.3, n + 37)


@pytest.mark.parametrize("higher", [True, False])
def test_an_absolute_margin_is_welchs_one_sided_test_on_shifted_data(higher: bool) -> None:
    from splitstream.analysis.noninferiority import Margin, margin_test

    rng = np.random.default_rng(8)
    control, treatment = _arms(rng, 400, 10.0, 9.9, 2.0)
    result = compare(estimate(UnitValues.of_means(control)), estimate(UnitValues.of_means(treatment)))
    found = margin_test(result, Margin.parse("0.3"), higher_is_better=higher, alpha=0.05, sequential=False)
    assert found is not None
    # Higher is better: H0 mean(t) - mean(c) <= -0.3, i.e. mean(t + 0.3) <= mean(c); lower: the margin is above.
    shifted = treatment + 0.3 if higher else treatment - 0.3
    reference = stats.ttest_ind(shifted, control, equal_var=False, alternative="greater" if higher else "less")
    assert found.p_value == pytest.approx(reference.pvalue, rel=1e-9)
    interval = reference.confidence_interval(0.95)
    bound = interval.low - 0.3 if higher else interval.high + 0.3
    assert found.bound == pytest.approx(bound, rel=1e-9)
    assert found.margin == (-0.3 if higher else 0.3)


def test_a_relative_margin_uses_the_delta_method_bound_written_out() -> None:
    from splitstream.analysis.noninferiority import Margin, margin_test

    rng = np.random.default_rng(9)
    control, treatment = _arms(rng, 3_000, 20.0, 19.9, 5.0)
    result = compare(estimate(UnitValues.of_means(control)), estimate(UnitValues.of_means(treatment)))
    found = margin_test(result, Margin.parse("1%"), higher_is_better=True, alpha=0.05, sequential=False)
    assert found is not None
    mc, mt = control.mean(), treatment.mean()
    vc, vt = control.var(ddof=1) / len(control), treatment.var(ddof=1) / len(treatment)
    lift = mt / mc - 1
    se = math.sqrt(vt / mc**2 + mt**2 * vc / mc**4)
    assert found.p_value == pytest.approx(stats.norm.sf((lift + 0.01) / se), rel=1e-9)
    assert found.bound == pytest.approx(lift - stats.norm.ppf(0.95) * se, rel=1e-9)
    assert found.far_bound == pytest.approx(lift + stats.norm.ppf(0.95) * se, rel=1e-9)


def test_the_always_valid_bound_is_the_edge_of_the_confidence_sequence() -> None:
    from splitstream.analysis.noninferiority import Margin, margin_test

    rng = np.random.default_rng(10)
    control, treatment = _arms(rng, 2_000, 5.0, 5.0, 1.0)
    result = compare(estimate(UnitValues.of_means(control)), estimate(UnitValues.of_means(treatment)), sequential=True)
    found = margin_test(result, Margin.parse("0.1"), higher_is_better=True, alpha=0.05, sequential=True)
    assert found is not None
    assert result.sequential_ci is not None
    assert found.bound == pytest.approx(result.sequential_ci[0])
    # The always-valid p-value against the margin is below alpha exactly when the sequence clears it.
    assert (found.p_value < 0.05) == (found.bound > -0.1)
    variance = result.control.variance + result.treatment.variance
    tau2 = float(mixing_variance(variance, len(control) + len(treatment), alpha=0.05))
    assert found.p_value == pytest.approx(msprt_p_value(result.absolute + 0.1, variance, tau2))


SIMULATIONS = 2_000


def test_at_the_margin_non_inferiority_is_declared_at_most_alpha_of_the_time() -> None:
    """The true lift sits exactly at the margin (-1 % relative, -0.1 absolute): the rate of "non-inferior" is the
    test's error rate, which must be at most alpha; the always-valid form checked 20 times per experiment too
    (vectorised: the sequence's edge, which the test above ties to :func:`margin_test`)."""
    from splitstream.analysis.noninferiority import Margin, margin_test

    rng = np.random.default_rng(2026)
    n, looks, alpha = 500, 20, 0.05
    control = rng.normal(10.0, 2.0, (SIMULATIONS, n))
    treatment = rng.normal(9.9, 2.0, (SIMULATIONS, n))
    declared = {"relative 1%": 0, "absolute 0.1": 0}
    margins = {name: Margin.parse(name.split()[1]) for name in declared}
    mean_c, mean_t = control.mean(axis=1), treatment.mean(axis=1)
    var_c, var_t = control.var(axis=1, ddof=1) / n, treatment.var(axis=1, ddof=1) / n
    for i in range(SIMULATIONS):
        result = compare(Estimate(mean_c[i], var_c[i], n), Estimate(mean_t[i], var_t[i], n))
        for name, margin in margins.items():
            found = margin_test(result, margin, higher_is_better=True, alpha=alpha, sequential=False)
            assert found is not None
            declared[name] += found.p_value < alpha
    # Always valid: 20 looks at 25, 50, ... 500 units per arm; declared once any look's sequence clears -0.1.
    sizes = np.arange(1, looks + 1) * (n // looks)
    sums_c, sums_t = np.cumsum(control, axis=1), np.cumsum(treatment, axis=1)
    squares_c, squares_t = np.cumsum(control**2, axis=1), np.cumsum(treatment**2, axis=1)
    k = sizes - 1
    diff = sums_t[:, k] / sizes - sums_c[:, k] / sizes
    var = sum(
        (sq[:, k] - s[:, k] ** 2 / sizes) / (sizes - 1) / sizes for s, sq in ((sums_c, squares_c), (sums_t, squares_t))
    )
    tau2 = mixing_variance(var, 2 * sizes, alpha=alpha)
    half = np.sqrt(var * (var + tau2) / tau2 * (2 * math.log(1 / alpha) + np.log((var + tau2) / var)))
    sequential = float(((diff - half) > -0.1).any(axis=1).mean())
    rates = {name: count / SIMULATIONS for name, count in declared.items()} | {"always-valid, 20 looks": sequential}
    # 2,000 experiments: the binomial error of a 5 % rate is about 0.5 %.
    assert 0.035 <= rates["relative 1%"] <= 0.062, rates
    assert 0.035 <= rates["absolute 0.1"] <= 0.062, rates
    assert rates["always-valid, 20 looks"] <= alpha, rates
    print(f"declared non-inferior at the margin, of {SIMULATIONS:,}: {rates}")
