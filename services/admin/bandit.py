"""``splitstream bandit``: move an experiment's weights each interval by Thompson sampling on the feedback.

Every ``--interval`` the bandit reads the analysis of its own experiment phases from the recorder's Redis
(:func:`splitstream.analysis.analyze.analyze`, through the rollout's :class:`~splitstream.admin.outcomes.
OutcomeReader`), draws from each arm's posterior of the metric (:mod:`splitstream.admin.thompson`) and sets
each arm's weight to its probability of being best, after a holdout split evenly over the arms and a floor.
Each new set of weights is a new experiment phase, so each phase is a fixed-weight randomized experiment
and the read-out printed at the end (each phase's lift, averaged with its units) is unbiased.

Like a rollout it holds the model's rollout lock (:mod:`splitstream.admin.lock`: a rollout and a bandit of one
model would fight over the weights), and it puts the weights back as they were at its start when the split is
broken (sample ratio mismatch in the current phase, the rollout's test), when an arm's error rate passes
``--max-error-rate``, and on SIGINT, SIGTERM or SIGHUP (:class:`~splitstream.admin.rollout.Interrupts`).
``--max-steps`` or ``--duration`` end it leaving the last weights in place.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import scipy
import scipy.stats  # loaded now, not lazily: a SIGINT landing in its first load exited -2

from splitstream.admin import lock, thompson
from splitstream.admin.outcome_reader import OutcomeReader
from splitstream.admin.outcomes import Check, judge
from splitstream.admin.rollout import (
    FAILED,
    ROLLED_BACK,
    Interrupts,
    LockLost,
    Tripped,
    Verdict,
    rebuilt,
    write_checked,
)
from splitstream.admin.store import AdminError, Conflict, Invalid, Store, check_versions_exist, weights_text
from splitstream.analysis.model import Analysis, MetricSpec, PhaseResult
from splitstream.analysis.statistics import MetricKind
from splitstream.common.argv_secrets import give_warnings
from splitstream.common.errors import ConfigError
from splitstream.common.experiment import Experiment
from splitstream.common.redis_settings import redis_security_from_args
from splitstream.common.secrets import redact_text, redact_url

ENDED = 0
#: Who the rollout lock says holds it (the lock's "version" field), so a rollout refused names the bandit.
LOCK_HOLDER = "bandit"
#: Routers' clocks may run behind this one's: calls of the bandit's phases are read from this much earlier.
CLOCK_SKEW_NS = 5 * 10**9


@dataclass(frozen=True, kw_only=True)
class BanditPlan:
    model: str
    metric: MetricSpec
    interval_s: float = 60.0
    #: Traffic split evenly over the arms whatever the posteriors say (a fraction).
    holdout: float = 0.20
    #: No arm's weight below this (a fraction of a whole percent).
    min_weight: float = 0.05
    max_steps: int | None = None
    duration_s: float | None = None
    max_error_rate: float = 0.01
    #: Calls an arm needs in the current phase before its error rate is judged.
    min_calls: int = 20
    draws: int = thompson.DEFAULT_DRAWS
    alpha: float = 0.05
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise Invalid(f"--interval: must be positive, got {self.interval_s:g}s")
        if not 0 <= self.holdout < 1:
            raise Invalid(f"--holdout: a share within [0, 100 %), got {self.holdout * 100:g} %")
        if not 0 <= self.min_weight < 1 or abs(self.min_weight * 100 - round(self.min_weight * 100)) > 1e-9:
            raise Invalid(f"--min-weight: a whole percent within [0, 100 %), got {self.min_weight * 100:g} %")
        if self.max_steps is not None and self.max_steps < 1:
            raise Invalid(f"--max-steps: must be at least 1, got {self.max_steps}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise Invalid(f"--duration: must be positive, got {self.duration_s:g}s")
        if not 0 <= self.max_error_rate <= 1:
            raise Invalid(
                f"--max-error-rate: a fraction within 0..1 (or a percentage like 1%), got {self.max_error_rate}"
            )
        if self.min_calls < 1:
            raise Invalid(f"--min-calls: must be at least 1, got {self.min_calls}")
        if self.draws < 100:
            raise Invalid(f"--draws: at least 100 (P(best) is a share of the draws), got {self.draws}")
        if not 0 < self.alpha < 1:
            raise Invalid(f"--alpha: must be between 0 and 1, got {self.alpha}")


@dataclass(frozen=True)
class ArmPosterior:
    arm: str
    mean: float | None
    p_best: float
    weight: int


class Bandit:
    def __init__(
        self,
        store: Store,
        plan: BanditPlan,
        *,
        outcomes: Callable[[int], Analysis],
        out: Callable[[str], None] = print,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        wall_clock_ns: Callable[[], int] = time.time_ns,
        interrupts: Interrupts | None = None,
        lock_lost: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.store = store
        self.plan = plan
        self.outcomes = outcomes
        self.out = out
        self.sleep = sleep
        self.clock = clock
        self.wall_clock_ns = wall_clock_ns
        self.interrupts = interrupts or Interrupts()
        self.lock_lost = lock_lost
        self.rng = np.random.default_rng(plan.seed)
        #: The experiment phases this bandit wrote (its first weights included): the only ones it reads.
        self.phases: list[str] = []
        self._holds: Experiment | None = None
        self._start: Experiment | None = None
        self._last: Analysis | None = None
        self._since_ns = 0

    # -- the loop -----------------------------------------------------------------------------------

    def run(self) -> Verdict:
        """Raises Invalid (nothing changed) for an experiment the bandit cannot work on; AdminError when the
        registry cannot be read."""
        plan = self.plan
        view = self.store.read(plan.model)
        if view.problem:
            raise AdminError(f"{view.problem}; fix it with `splitstream experiment set` first")
        start = view.stored or view.effective
        if start is None:
            raise Invalid(f"model '{plan.model}' has no experiment and no passing instance")
        arms = [a.version for a in start.arms]
        if len(arms) < 2:
            raise Invalid(f"model '{plan.model}' has one arm ({arms[0]}): list the versions to choose between first")
        if plan.min_weight * len(arms) > 1 + 1e-9:
            raise Invalid(f"--min-weight: {len(arms)} arms at {plan.min_weight * 100:g} % each make more than 100 %")
        self._start, self._holds = start, view.stored
        first = self._with_weights(start, self._weights(np.full(len(arms), 1 / len(arms))))
        check_versions_exist(view, first)
        since_ns = self._since_ns = self.wall_clock_ns() - CLOCK_SKEW_NS
        started = self.clock()
        revision = view.revision
        try:
            with self.interrupts.held():
                revision = self._write(first, revision)
            self.interrupts.raise_pending()
        except Conflict as error:
            return Verdict(FAILED, f"{error}; bandit stopped, nothing changed")
        except AdminError as error:
            return Verdict(FAILED, f"the first weights could not be written: {error}")
        except KeyboardInterrupt:
            return self._revert("interrupted")
        current = first
        self.out(
            f"start: {plan.model} {weights_text(first)}; {plan.metric} read every {plan.interval_s:g}s, "
            f"holdout {plan.holdout * 100:g} %, floor {plan.min_weight * 100:g} %"
        )
        step = 0
        try:
            while True:
                self._wait(started)
                step += 1
                lost = self.lock_lost()
                if lost:
                    raise LockLost(lost)
                analysis = self.outcomes(since_ns)
                self._last = analysis
                check = self._guard(analysis, current)
                posteriors = self._posteriors(analysis, current)
                weights = {p.arm: p.weight for p in posteriors}
                new = self._with_weights(current, [weights[a.version] for a in current.arms])
                if new != current:
                    with self.interrupts.held():
                        revision = self._write(new, revision)
                    self.interrupts.raise_pending()
                    current = new
                units = ", ".join(f"{arm} {n}" for arm, n in check.units.items()) or "none yet"
                srm = f"SRM p = {check.srm_p:.3g}" if check.srm_p is not None else "SRM not tested yet"
                self.out(
                    f"interval {step}: "
                    + "; ".join(_arm_text(p) for p in posteriors)
                    + f" | phase units {units}, {srm}"
                )
                if plan.max_steps is not None and step >= plan.max_steps:
                    reason = f"--max-steps {plan.max_steps}"
                    break
                if plan.duration_s is not None and self.clock() - started >= plan.duration_s - 1e-6:
                    reason = f"--duration {plan.duration_s:g}s"
                    break
        except KeyboardInterrupt:
            return self._revert("interrupted")
        except (Tripped, OSError) as why:
            return self._revert(str(why))
        except LockLost as lost:
            return Verdict(FAILED, f"{lost}; bandit stopped, the experiment left to it")
        except Conflict as error:
            return Verdict(FAILED, f"{error}; bandit stopped, the experiment left as it is")
        except AdminError as error:
            return self._revert(f"the weights could not be written: {error}")
        self._read_out()
        return Verdict(ENDED, f"ended after {reason}: {plan.model} left at {weights_text(current)}")

    def _wait(self, started: float) -> None:
        """One interval, cut short by ``--duration``."""
        remaining = self.plan.interval_s
        if self.plan.duration_s is not None:
            remaining = min(remaining, started + self.plan.duration_s - self.clock())
        if remaining > 0:
            self.sleep(remaining)

    # -- guards -------------------------------------------------------------------------------------

    def _guard(self, analysis: Analysis, current: Experiment) -> Check:
        """Tripped on a sample ratio mismatch in the current phase (the rollout's test, with its minimum of
        expected units) or an arm failing more than ``--max-error-rate`` of its calls in it."""
        check = judge(analysis, phase=current.phase.id, version=current.control, guards=(), min_units=0)
        if check.srm_flagged:
            observed = ", ".join(f"{arm} {n}" for arm, n in check.units.items())
            expected = ", ".join(f"{arm} {n:.0f}" for arm, n in check.srm_expected.items())
            raise Tripped(
                f"sample ratio mismatch in the current phase (p = {check.srm_p:.2g} < 0.001): units per arm "
                f"{observed}, expected {expected} from the weights; the split is broken, so no outcome can be trusted"
            )
        phase = _phase(analysis, current.phase.id)
        for arm in phase.arms if phase else ():
            if arm.calls >= self.plan.min_calls and (arm.error_rate or 0) > self.plan.max_error_rate:
                raise Tripped(
                    f"{arm.arm} error rate {arm.error_rate * 100 if arm.error_rate else 0:.2f} % ({arm.errors} of "
                    f"{arm.calls} calls) exceeds --max-error-rate {self.plan.max_error_rate * 100:.2f} %"
                )
        return check

    # -- posteriors ---------------------------------------------------------------------------------

    def _posteriors(self, analysis: Analysis, current: Experiment) -> list[ArmPosterior]:
        plan = self.plan
        arms = [a.version for a in current.arms]
        ours = [p for p in analysis.phases if p.id in self.phases]
        name = plan.metric.name
        higher = plan.metric.higher_is_better
        if plan.metric.kind is MetricKind.CONVERSION:
            successes, units = np.zeros(len(arms)), np.zeros(len(arms))
            for phase in ours:
                for summary in phase.arms:
                    value = summary.metrics.get(name)
                    if summary.arm in arms and value is not None and value.value is not None:
                        i = arms.index(summary.arm)
                        successes[i] += round(value.value * summary.units)
                        units[i] += summary.units
            means, samples = thompson.beta_draws(successes, units, plan.draws, self.rng)
            shown: list[float | None] = [float(m) for m in means]
            probabilities = thompson.p_best(samples, higher_is_better=higher)
        else:
            z = float(scipy.stats.norm.ppf(1 - plan.alpha / 2))
            precision, weighted = np.zeros(len(arms)), np.zeros(len(arms))
            for phase in ours:
                for summary in phase.arms:
                    value = summary.metrics.get(name)
                    if summary.arm not in arms or value is None or value.value is None:
                        continue
                    low, high = value.ci.low, value.ci.high
                    if low is None or high is None or not high > low:
                        continue
                    variance = ((high - low) / (2 * z)) ** 2
                    i = arms.index(summary.arm)
                    precision[i] += 1 / variance
                    weighted[i] += value.value / variance
            if (precision > 0).all():
                means, samples = thompson.normal_draws(weighted / precision, 1 / precision, plan.draws, self.rng)
                shown = [float(m) for m in means]
                probabilities = thompson.p_best(samples, higher_is_better=higher)
            else:  # an arm with no value yet: nothing to prefer anyone on
                shown = [float(w / p) if p > 0 else None for w, p in zip(weighted, precision, strict=True)]
                probabilities = np.full(len(arms), 1 / len(arms))
        weights = self._weights(probabilities)
        return [ArmPosterior(arm, shown[i], float(probabilities[i]), weights[i]) for i, arm in enumerate(arms)]

    def _weights(self, probabilities: np.ndarray) -> list[int]:
        plan = self.plan
        return thompson.whole_percents(
            thompson.allocate(probabilities, holdout=plan.holdout, min_weight=plan.min_weight)
        )

    # -- read-out -----------------------------------------------------------------------------------

    def _read_out(self) -> None:
        """Each arm's lift over the control, per phase of the bandit's (fixed weights each: a clean randomized
        comparison), averaged with the phases' units; see :func:`splitstream.admin.thompson.stratified`."""
        analysis, start = self._last, self._start
        if analysis is None or start is None:
            return
        plan = self.plan
        z = float(scipy.stats.norm.ppf(1 - plan.alpha / 2))
        ours = [p for p in analysis.phases if p.id in self.phases]
        for arm in (a.version for a in start.arms if a.version != start.control):
            lifts, variances, units = [], [], []
            for phase in ours:
                comparison = next((c for c in phase.comparisons if c.metric == plan.metric.name and c.arm == arm), None)
                ci = comparison.absolute_ci if comparison else None
                if comparison is None or comparison.absolute_lift is None or ci is None:
                    continue
                if ci.low is None or ci.high is None:
                    continue
                lifts.append(comparison.absolute_lift)
                variances.append(((ci.high - ci.low) / (2 * z)) ** 2)
                units.append(phase.units)
            pooled = thompson.combine(lifts, variances, units)
            interval = pooled.interval(z)
            if pooled.estimate is None or interval is None:
                self.out(f"read-out: {arm} - {start.control} {plan.metric}: no phase with both arms measured yet")
                continue
            self.out(
                f"read-out: {arm} - {start.control} {plan.metric} {pooled.estimate:+.4g} "
                f"({(1 - plan.alpha) * 100:g} % CI {interval[0]:+.4g} .. {interval[1]:+.4g}), per-phase lifts "
                f"averaged by units over {pooled.phases} phase{'s' if pooled.phases != 1 else ''}"
            )
        self.out(
            f"each phase: splitstream analyze {plan.model} --since {self._since_ns / 1e9:.0f} --metric {plan.metric} "
            "--redis-url ..."
        )

    # -- writing ------------------------------------------------------------------------------------

    def _with_weights(self, base: Experiment, weights: Sequence[float]) -> Experiment:
        return rebuilt(base, base.control, {a.version: w for a, w in zip(base.arms, weights, strict=True)})

    def _write(self, experiment: Experiment, revision: object) -> object:
        """The rollout's check-and-set write (an edit elsewhere in a registry file is written over again;
        a change to the experiment is a Conflict)."""
        revision = write_checked(self.store, self.plan.model, experiment, revision, holds=self._holds)
        self._holds = experiment
        self.phases.append(experiment.phase.id)
        return revision

    def _revert(self, why: str) -> Verdict:
        """The starting weights back, whatever signals come now; the read-out of what was measured first."""
        self.interrupts.hold_to_the_end()
        start = self._start
        assert start is not None
        self._read_out()
        self.out(f"reverting {self.plan.model} to {weights_text(start)}")
        for _ in range(30):
            try:
                view = self.store.read(self.plan.model)
                if view.stored != self._holds:
                    return Verdict(FAILED, f"{why}; not reverted: someone else changed the experiment meanwhile")
                if view.stored != start:
                    self.store.write(self.plan.model, start, view.revision)
                return Verdict(ROLLED_BACK, f"REVERTED: {why}; {self.plan.model} now {weights_text(start)}")
            except Conflict:
                continue
            except AdminError as error:
                self.out(f"  reverting: {error}; trying again")
                self.sleep(1.0)
        return Verdict(FAILED, f"{why}; and reverting failed: {self.plan.model} may still hold the bandit's weights")


def _phase(analysis: Analysis, phase_id: str) -> PhaseResult | None:
    return next((p for p in analysis.phases if p.id == phase_id), None)


def _arm_text(p: ArmPosterior) -> str:
    mean = "n/a" if p.mean is None else f"{p.mean:.4g}"
    return f"{p.arm} mean {mean} P(best) {p.p_best:.3f} -> {p.weight} %"


# -- the command line -------------------------------------------------------------------------------


def run(store: Store, args: argparse.Namespace, *, env_prefix: str, say: Callable[..., None]) -> int:
    """The exit code: 0 ended by --max-steps or --duration, 3 reverted, 2 usage (Invalid raised), 1 failed."""
    plan = BanditPlan(
        model=args.model,
        metric=args.metric,
        interval_s=args.interval,
        holdout=args.holdout,
        min_weight=args.min_weight,
        max_steps=args.max_steps,
        duration_s=args.duration,
        max_error_rate=args.max_error_rate,
        min_calls=args.min_calls,
        draws=args.draws,
        alpha=args.alpha,
        seed=args.seed,
    )
    if not args.redis_url:
        raise Invalid("--redis-url: needed, the recorder's Redis (calls and feedback are read there)")
    try:
        security = redis_security_from_args(args, url=args.redis_url, env_prefix=env_prefix)
    except ConfigError as error:
        raise Invalid(str(error)) from None
    reader = OutcomeReader(
        args.redis_url, model=plan.model, metrics=(plan.metric,), alpha=plan.alpha, security=security
    )
    interrupts = Interrupts()
    interrupts.install()
    try:
        with lock.held(store, plan.model, LOCK_HOLDER) as held:
            try:
                reader.check_reachable()
            except ValueError as error:
                raise Invalid(f"bad --redis-url {redact_url(args.redis_url)!r}: {redact_text(str(error))}") from None
            except OSError as error:
                raise AdminError(f"{error}; nothing changed") from None
            # Secrets on the command line: warned of now, not when the bandit ends (admin.main gives the rest).
            give_warnings(lambda line: say(line, stream=sys.stderr))
            verdict = Bandit(
                store, plan, outcomes=reader.read, out=say, interrupts=interrupts, lock_lost=held.lost
            ).run()
    except KeyboardInterrupt:  # before the first write
        verdict = Verdict(ROLLED_BACK, f"interrupted before the first weights; {plan.model} left as it was")
    say(verdict.message, stream=sys.stdout if verdict.code in (ENDED, ROLLED_BACK) else sys.stderr)
    return verdict.code
