"""``splitstream rollout``: ramp a new version step by step, judged by the routers' metrics.

For each step (e.g. 10, 50, 100 %) the new version gets that weight, the control
the rest (other arms keep theirs). During the step's interval the routers'
``/metrics`` are read every ``check_every_s``; the step is judged on the calls of
that interval only (deltas between scrapes, summed over routers):

- error rate of the new version (statuses other than OK, INVALID_ARGUMENT,
  NOT_FOUND, CANCELLED) at most ``max_error_rate`` — checked at every scrape, so a
  failing version is pulled as soon as ``min_calls`` of its calls are in;
- at least ``min_calls`` calls of the new version by the end of the step (else
  there is nothing to judge);
- p99 latency of the new version at most ``max_p99_ratio`` times the control's p99,
  both from histogram buckets over the interval. When the control took too few
  calls (its weight is 0 at the 100 % step) the control's p99 from the last step
  that had them is the reference. When the first step already leaves the control no
  traffic (``--steps 100``), there is no such step: the rollout first reads the
  control's p99 over one interval at the weights as they stand (the *baseline*,
  nothing written), and stops there, nothing changed, if the control answers too few
  calls in it. A latency guard still without a reference at a step where the control
  takes no traffic (no step measured it) has not held: the rollout rolls back rather
  than promote on a guard never judged;
- for token streams (``ModelStreamInfer``; a stream counts as one call above),
  when asked: the p99 time to first token at most ``max_ttft_p99_ratio`` times the
  control's, and the p99 inter-token gap at most ``max_itl_p99_ratio`` times the
  control's, judged the same way from the routers' stream histograms (a version
  with no streams in the step is not judged on them).

With ``--guard`` (:mod:`splitstream.admin.outcomes`), business outcomes are judged
too, at every check, from the recorder's Redis: the new version's lift over the
control in the current step's experiment phase, with the always-valid confidence
sequence. Significant harm (the sequence entirely past the guard's bound) rolls
back at once; a sample ratio mismatch in the phase (the units per arm do not
match the weights, p < 0.001) stops the rollout and rolls back, because a broken
split makes every comparison meaningless; with ``promote_on_win``, a significant
win on every guard ends the step early (the step's other guards are still judged
on the calls so far). A guard still not judged at the end of a step (too few
units, no events of its metric) rolls back, as too few calls do. At a step where
the control takes no traffic (100 %) there is nothing to compare and the outcome
guards are not judged.

A guard that trips, metrics or Redis that cannot be read, or an interrupt set the new
version back to 0 % (its share goes to the control) and the rollout ends with
:data:`ROLLED_BACK`. When every step held and the last one is 100 %, the new
version is promoted: it becomes the control and the old control leaves the arms.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from splitstream.admin import metrics
from splitstream.admin.constants import FAILED as FAILED
from splitstream.admin.constants import PROMOTED as PROMOTED
from splitstream.admin.constants import ROLLED_BACK as ROLLED_BACK
from splitstream.admin.constants import USAGE as USAGE
from splitstream.admin.judge import JudgeConfig, OutcomeSpec, Series
from splitstream.admin.outcomes import Check, Guard, OutcomeGuard, judge
from splitstream.admin.store import AdminError, Conflict, Invalid, ModelView, Store, check_versions_exist, weights_text
from splitstream.analysis.model import Analysis
from splitstream.common.errors import ConfigError
from splitstream.common.experiment import Experiment

#: How long a rollback keeps trying a registry that fails, before it gives up saying what the registry holds.
ROLLBACK_PATIENCE_S = 30.0


@dataclass(frozen=True, kw_only=True)
class RolloutPlan:
    model: str
    version: str
    steps: tuple[float, ...]
    interval_s: float
    max_error_rate: float
    max_p99_ratio: float
    metrics_urls: tuple[str, ...]
    min_calls: int = 20
    check_every_s: float = 1.0
    #: Token-stream guards (None: not judged).
    max_ttft_p99_ratio: float | None = None
    max_itl_p99_ratio: float | None = None
    #: Outcome guards (judged from Redis at every check; none: outcomes are not judged).
    guards: tuple[Guard, ...] = ()
    #: Advance to the next step as soon as every outcome guard shows a significant win.
    promote_on_win: bool = False
    #: Units each arm needs in the step's phase before an outcome guard is judged.
    guard_min_units: int = 30
    #: 1 - the confidence of the guards' always-valid intervals.
    guard_alpha: float = 0.05
    #: ``--judge``: Kayenta's canary judge on the step's per-interval metrics (:mod:`splitstream.admin.judge`).
    judge: JudgeConfig | None = None

    def __post_init__(self) -> None:
        if not self.steps:
            raise Invalid("--steps: give at least one step")
        if any(not 0 < s <= 100 for s in self.steps):
            raise Invalid(f"--steps: each step must be within (0, 100], got {list(self.steps)}")
        finer = [s for s in self.steps if abs(s * 100 - round(s * 100)) > 1e-6]
        if finer:  # the weight written is rounded to 0.01 %: 0.001 became a step of 0 % judged for nothing
            raise Invalid(f"--steps: weights go by 0.01 %, got {', '.join(f'{s:g}' for s in finer)}")
        if list(self.steps) != sorted(set(self.steps)):
            raise Invalid(f"--steps: must increase, got {list(self.steps)}")
        if self.interval_s <= 0 or self.check_every_s <= 0:
            raise Invalid("--interval and --check-every must be positive")
        if not 0 <= self.max_error_rate <= 1:
            raise Invalid(
                f"--max-error-rate: a fraction within 0..1 (or a percentage like 1%), got {self.max_error_rate}"
            )
        for flag, ratio in (
            ("--max-p99-ratio", self.max_p99_ratio),
            ("--max-ttft-p99-ratio", self.max_ttft_p99_ratio),
            ("--max-itl-p99-ratio", self.max_itl_p99_ratio),
        ):
            if ratio is not None and not ratio > 0:
                raise Invalid(f"{flag}: must be positive, got {ratio}")
        if not self.metrics_urls:
            raise Invalid("--metrics: give the /metrics URL of every router (repeat the flag)")
        if self.min_calls < 1:
            raise Invalid("--min-calls: must be at least 1")
        if self.promote_on_win and not self.guards:
            raise Invalid("--promote-on-win needs at least one --guard (a win is judged on outcomes)")
        if self.guard_min_units < 2:
            raise Invalid("--guard-min-units: must be at least 2")
        if not 0 < self.guard_alpha < 1:
            raise Invalid(f"--guard-alpha: must be between 0 and 1, got {self.guard_alpha}")
        kinds: dict[str, tuple[str, str | None]] = {}
        for guard in (g for g in self.guards if isinstance(g, OutcomeGuard)):
            measured = (guard.metric.kind.value, guard.metric.cap)
            if kinds.setdefault(guard.metric.name, measured) != measured:
                # One analysis reads each metric once: two kinds, or two caps, of it cannot both be judged.
                what = "kinds" if kinds[guard.metric.name][0] != measured[0] else "caps"
                raise Invalid(f"--guard: metric '{guard.metric.name}' is given two {what}")
        if self.judge is not None:
            try:
                self.judge.chosen(judged_names(self.guards))
            except ValueError as error:
                raise Invalid(str(error)) from None


@dataclass(frozen=True)
class Verdict:
    code: int
    message: str


@dataclass(frozen=True)
class _LatencyGuard:
    """A p99 ratio guard: the new version's p99 of one histogram against the control's."""

    name: str  # as the output line shows it
    flag: str
    limit: float
    histogram: Callable[[metrics.VersionCounts], Mapping[float, float]]


class Tripped(Exception):
    """A guard failed; the message says which and by how much."""


class LockLost(Exception):
    """Another rollout took this one's lock (its session expired): it watches the model now."""


class Won(Exception):
    """Every outcome guard shows a significant win: the step may end early."""


class Interrupts:
    """SIGINT and SIGTERM as KeyboardInterrupt, except while held: a registry write with its read-back, and
    a rollback or promotion to the end of the run, go on whatever signals arrive. A second Ctrl-C in a
    rollback stopped it with a traceback, v2 left at its step's weight and nothing watching it; one that
    comes during a step's write is raised once the write is read back (:meth:`raise_pending`), and rolls
    back from there. (The handler runs when the main thread next runs Python, which a blocking call in
    another library's thread may delay by its timeout: a signal then lands later than sent, never lost.)"""

    def __init__(self) -> None:
        self._depth = 0
        self.pending = False

    def install(self) -> None:
        # SIGHUP too: the terminal of a rollout run over ssh goes with the connection, and its default
        # action ended the process at once, v2 left at its step's weight with nothing watching it.
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        if not self._depth:
            raise KeyboardInterrupt
        self.pending = True
        # (print is not safe here: the signal may have come in the middle of one; and a terminal gone
        # must not raise here, inside the write)
        with contextlib.suppress(OSError):
            os.write(2, b"splitstream: interrupt noted; the registry write under way goes on to its end\n")

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    def hold_to_the_end(self) -> None:
        """For what ends the run: a rollback, a promotion."""
        self._depth += 1

    def raise_pending(self) -> None:
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt


Scrape = Callable[[Iterable[str], str], metrics.Snapshot]
#: The analysis of the model's calls and feedback since a unix time in ns (OSError when Redis fails).
Outcomes = Callable[[int], Analysis]


class Rollout:
    def __init__(
        self,
        store: Store,
        plan: RolloutPlan,
        *,
        out: Callable[[str], None] = print,
        scrape: Scrape = metrics.scrape,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        outcomes: Outcomes | None = None,
        wall_clock_ns: Callable[[], int] = time.time_ns,
        interrupts: Interrupts | None = None,
        lock_lost: Callable[[], str | None] = lambda: None,
    ) -> None:
        """``outcomes`` reads the analysis the outcome guards judge; needed when the plan has guards.
        ``interrupts``: the installed handler of SIGINT and SIGTERM, which holds them during writes."""
        self.store = store
        self.plan = plan
        self.out = out
        self.scrape = scrape
        self.sleep = sleep
        self.clock = clock
        if plan.guards and outcomes is None:
            raise Invalid("--guard needs --redis-url, the recorder's Redis")
        self.outcomes = outcomes
        self.wall_clock_ns = wall_clock_ns
        self.interrupts = interrupts or Interrupts()
        #: Why this rollout's lock is no longer its own (:mod:`splitstream.admin.lock`), or None.
        self.lock_lost = lock_lost
        #: Per guard, the control's p99 from the last step in which it had enough calls (or the baseline).
        self._references: dict[str, float] = {}
        #: The step being judged leaves the control no traffic: no later step can measure its p99.
        self._final = False
        self.control = ""
        #: The experiment the registry holds as far as this rollout knows: as read, then as last written.
        self._holds: Experiment | None = None
        self._guards = [_LatencyGuard("p99", "--max-p99-ratio", plan.max_p99_ratio, lambda c: c.buckets)]
        if plan.max_ttft_p99_ratio is not None:
            self._guards.append(
                _LatencyGuard("TTFT p99", "--max-ttft-p99-ratio", plan.max_ttft_p99_ratio, lambda c: c.ttft)
            )
        if plan.max_itl_p99_ratio is not None:
            self._guards.append(
                _LatencyGuard("ITL p99", "--max-itl-p99-ratio", plan.max_itl_p99_ratio, lambda c: c.gaps)
            )

    def run(self) -> Verdict:
        """Raises Invalid (nothing changed) for a plan the registry refuses; AdminError if it cannot be written."""
        plan = self.plan
        try:
            view = self.store.read(plan.model)
            base = self._base(view)
            self.control = base.control
            self._holds = view.stored
            try:
                self.scrape(plan.metrics_urls, plan.model)
            except metrics.NotMetrics as error:  # a --metrics naming the wrong thing: the operator's to mend
                raise Invalid(f"{error}; nothing changed") from None
            except OSError as error:
                raise AdminError(f"{error}; nothing changed") from None
            # A first step of 100 % leaves the control no traffic, and no earlier step measured its p99:
            # without a baseline the p99 guard would go unjudged and promote the version on its error rate alone.
            if self._control_weight(self._with_weight(base, plan.steps[0])) == 0:
                refused = self._baseline(view.effective or base)
                if refused is not None:
                    return refused
        except KeyboardInterrupt:
            return interrupted_before_start(plan.model)
        revision = view.revision
        try:
            for number, weight in enumerate(plan.steps, start=1):
                experiment = self._with_weight(base, weight)
                try:
                    with self.interrupts.held():
                        revision = self._write(experiment, revision)
                except Conflict as error:
                    return Verdict(FAILED, f"{error}; rollout stopped, the experiment left as it is")
                except AdminError as error:  # a full disk, Consul failing: the last step's weights may hold
                    return self._roll_back(f"step {number} could not be written: {error}", failed=number == 1)
                self.interrupts.raise_pending()
                self.out(
                    f"step {number}/{len(plan.steps)}: {plan.model} {weights_text(experiment)}, "
                    f"judged over {plan.interval_s:g}s"
                )
                try:
                    self._judge_step(experiment)
                except (Tripped, OSError, metrics.NotMetrics) as reason:
                    return self._roll_back(str(reason))
                except LockLost as lost:  # a rollback now would undo the other rollout's step
                    return Verdict(FAILED, f"{lost}; rollout stopped, the experiment left to it")
            if plan.steps[-1] < 100:
                return Verdict(PROMOTED, f"{plan.model} {plan.version} holds at {plan.steps[-1]:g} %; every guard held")
            promoted = self._promoted(base)
            try:
                self.interrupts.hold_to_the_end()  # (an interrupt now comes too late: the guards all held)
                self._write(promoted, revision)
            except Conflict as error:
                return Verdict(FAILED, f"{error}: every step held, but the experiment changed before promotion")
        except KeyboardInterrupt:
            return self._roll_back("interrupted")
        return Verdict(PROMOTED, f"promoted: {plan.model} {weights_text(promoted)}; every guard held")

    # -- experiments --------------------------------------------------------------------------------

    def _base(self, view: ModelView) -> Experiment:
        plan = self.plan
        if view.problem:
            raise AdminError(f"{view.problem}; fix it with `splitstream experiment set` first")
        base = view.effective
        if base is None:
            raise Invalid(f"model '{plan.model}' has no experiment and no passing instance")
        if plan.version == base.control:
            raise Invalid(f"'{plan.version}' is already the control of '{plan.model}'")
        others = sum(a.weight for a in base.arms if a.version not in {base.control, plan.version})
        if plan.steps[-1] > 100 - others:
            raise Invalid(
                f"other arms hold {others:g} %, so {plan.version} can reach at most {100 - others:g} %; "
                "lower --steps or those arms first"
            )
        check_versions_exist(view, self._with_weight(base, plan.steps[-1]))
        return base

    def _with_weight(self, base: Experiment, weight: float) -> Experiment:
        version = self.plan.version
        weights = {a.version: a.weight for a in base.arms}
        others = sum(w for v, w in weights.items() if v not in {base.control, version})
        weights[version] = weight
        weights[base.control] = 100 - others - weight
        return self._rebuilt(base, base.control, weights)

    def _promoted(self, base: Experiment) -> Experiment:
        weights = {a.version: a.weight for a in base.arms if a.version != base.control}
        weights[self.plan.version] = 100
        return self._rebuilt(base, self.plan.version, weights)

    def _rebuilt(self, base: Experiment, control: str, weights: dict[str, float]) -> Experiment:
        return rebuilt(base, control, weights)

    def _write(self, experiment: Experiment, revision: object) -> object:
        revision = write_checked(self.store, self.plan.model, experiment, revision, holds=self._holds)
        self._holds = experiment
        return revision

    def _roll_back(self, why: str, *, failed: bool = False) -> Verdict:
        """Move the new version's share to the control in the experiment as it is now (retrying a conflict).
        Where it has none (a first step that could not be written) nothing is written; ``failed``: the
        rollout did not get to change anything, which is exit 1 rather than a rollback's 3."""
        self.interrupts.hold_to_the_end()
        if not failed:
            self.out(f"rolling back {self.plan.model} {self.plan.version} to 0 %")  # (a slow registry shows here)
        plan = self.plan
        conflicts, deadline = 0, self.clock() + ROLLBACK_PATIENCE_S
        while conflicts < 5:
            try:
                view = self.store.read(plan.model)
                current = view.stored or view.effective
                if current is None:
                    return Verdict(FAILED, f"{why}; and rolling back failed: {plan.model} has no experiment now")
                weights = {a.version: a.weight for a in current.arms}
                share = weights.get(plan.version, 0)
                weights[plan.version] = 0
                weights[current.control] = weights.get(current.control, 0) + share
                rolled = self._rebuilt(current, current.control, weights)
                if share:
                    self.store.write(plan.model, rolled, view.revision)
            except Conflict:
                conflicts += 1
                continue
            except AdminError as error:  # Consul restarting, a disk full for a moment: worth waiting for
                if self.clock() >= deadline:
                    return Verdict(FAILED, f"{why}; and rolling back failed: {error}; {self._state()}")
                self.out(f"  rolling back: {error}; trying again")
                self.sleep(1.0)
                continue
            except Invalid as error:
                return Verdict(FAILED, f"{why}; and rolling back failed: {error}; {self._state()}")
            return Verdict(
                FAILED if failed else ROLLED_BACK,
                f"{'' if failed else 'ROLLED BACK: '}{why}; {plan.model} now {weights_text(rolled)}",
            )
        return Verdict(FAILED, f"{why}; and rolling back failed: the experiment kept changing; {self._state()}")

    def _state(self) -> str:
        """What the registry holds, for an operator left to mend it."""
        try:
            view = self.store.read(self.plan.model)
        except (AdminError, Invalid) as error:
            held = f"last written as {weights_text(self._holds)}" if self._holds else "not known"
            return f"{self.plan.model} {held} (it cannot be read: {error})"
        current = view.stored or view.effective
        return f"{self.plan.model} is still {weights_text(current) if current else 'without an experiment'}"

    # -- judging ------------------------------------------------------------------------------------

    @staticmethod
    def _control_weight(experiment: Experiment) -> float:
        return next((a.weight for a in experiment.arms if a.version == experiment.control), 0)

    def _baseline(self, current: Experiment) -> Verdict | None:
        """The control's latency over one interval at the weights as they stand, as the reference of a first
        step that leaves it no traffic; nothing is written. A Verdict (nothing changed) when it cannot be had."""
        plan = self.plan
        self.out(
            f"baseline: {plan.model} {weights_text(current)} as it stands, the control's latency read over "
            f"{plan.interval_s:g}s (at {plan.steps[0]:g} % {self.control} takes no traffic to compare with)"
        )
        try:
            before = self.scrape(plan.metrics_urls, plan.model)
            end = self.clock() + plan.interval_s
            while (remaining := end - self.clock()) > 0:
                self.sleep(min(plan.check_every_s, remaining))
            counts = metrics.interval(before, self.scrape(plan.metrics_urls, plan.model))
        except (OSError, metrics.NotMetrics) as error:
            return Verdict(FAILED, f"baseline: {error}; {plan.model} left as it was")
        control = counts.get(self.control, metrics.VersionCounts())
        line = f"  {self.control}: {control.calls:g} calls"
        for guard in self._guards:
            histogram = guard.histogram(control)
            if metrics.observations(histogram) >= plan.min_calls:
                self._references[guard.name] = p99 = metrics.quantile(histogram, 0.99) or 0.0
                line += f" | {guard.name} {_ms(p99)}"
        if "p99" not in self._references:
            return Verdict(
                ROLLED_BACK,
                f"baseline: {self.control} answered {metrics.observations(control.buckets):g} timed calls in "
                f"{plan.interval_s:g}s, fewer than --min-calls {plan.min_calls}: no p99 to judge {plan.version} on "
                f"at {plan.steps[0]:g} %; {plan.model} left as it was",
            )
        self.out(line + ": the reference of the steps where it takes no traffic")
        return None

    def _judge_step(self, experiment: Experiment) -> None:
        plan = self.plan
        before = self.scrape(plan.metrics_urls, plan.model)
        # Calls of this step's phase are recorded after the write above; a few seconds earlier covers
        # routers whose clocks run behind this one's (other phases in the window are left out by id).
        since_ns = self.wall_clock_ns() - 5 * 10**9
        control_weight = next((a.weight for a in experiment.arms if a.version == experiment.control), 0)
        judge_outcomes = bool(plan.guards) and control_weight > 0
        if plan.guards and not judge_outcomes:
            self.out(f"  outcome guards not judged in this step: {self.control} takes no traffic to compare with")
        started = self.clock()
        end = started + plan.interval_s
        last_check: Check | None = None
        series = self._judge_series(control_weight)
        counts: dict[str, metrics.VersionCounts] = {}
        held = False
        while True:
            remaining = end - self.clock()
            if remaining > 0:
                self.sleep(min(plan.check_every_s, remaining))
            previous, counts = counts, metrics.interval(before, self.scrape(plan.metrics_urls, plan.model))
            if series is not None:
                series.add(*(_since(counts, previous, v) for v in (self.control, plan.version)))
            lost = self.lock_lost()
            if lost:
                raise LockLost(lost)
            new = counts.get(plan.version, metrics.VersionCounts())
            if new.calls >= plan.min_calls and new.error_rate > plan.max_error_rate:
                raise Tripped(self._error_rate_text(new))
            if judge_outcomes and remaining > 0:  # (the step's closing scrape follows the last check at once)
                try:
                    last_check = self._judge_outcomes(experiment, since_ns, self.clock() - started, series)
                except Won as won:
                    if series is None or self._judge_passes(series):
                        self.out(f"  {won}: advancing early")
                        last_check = None
                        break
            if remaining <= 0:
                if series is not None and self._judged_marginal(series, held):
                    held, end = True, end + plan.interval_s
                    continue
                break
        # Like --min-calls: a guard the step could not judge (too few units, no events of its metric) has
        # not held; promoting on it would let a misspelt metric wave every version through.
        unjudged = [r for r in last_check.readings if r.state == "not judged"] if last_check else []
        if unjudged:
            raise Tripped(
                "the step ended before every outcome guard could be judged: "
                + "; ".join(f"{r.guard.text}: {r.why}" for r in unjudged)
            )
        control = counts.get(self.control, metrics.VersionCounts())
        self._final = self._control_weight(experiment) == 0
        if new.calls < plan.min_calls:
            raise Tripped(
                f"{plan.version} answered {new.calls:g} calls in the step, fewer than --min-calls {plan.min_calls}: "
                "nothing to judge it on"
            )
        line = (
            f"  {plan.version}: {new.calls:g} calls, {_percent(new.error_rate)} errors"
            f" | {self.control}: {control.calls:g} calls"
        )
        for guard in self._guards:
            line += self._judge(guard, new, control)
        self.out(line + ": guards hold")

    def _judge_series(self, control_weight: float) -> Series | None:
        """Where the step's per-interval values go for ``--judge``; None when not judging this step."""
        if self.plan.judge is None:
            return None
        if control_weight <= 0:
            self.out(f"  judge not applied in this step: {self.control} takes no traffic to compare with")
            return None
        guards = [g for g in self.plan.guards if isinstance(g, OutcomeGuard)]  # (a quantile guard's: the routers')
        outcomes = {
            g.metric.name: OutcomeSpec(g.metric.kind, "Low" if g.metric.higher_is_better else "High") for g in guards
        }
        return Series(self.plan.judge.chosen(judged_names(self.plan.guards)), outcomes)

    def _judge_passes(self, series: Series) -> bool:
        """Whether ``--judge`` passes the step so far: an early advance (``--promote-on-win``) needs it too, or
        the judge would be skipped by the very steps that end soonest. A step it does not pass goes on."""
        config = self.plan.judge
        assert config is not None
        judgement = config.judge(series)
        if config.decide(judgement) == "pass":
            self.out(f"  {judgement.text()} over {series.intervals} intervals: pass")
            return True
        return False

    def _judged_marginal(self, series: Series, held: bool) -> bool:
        """Judge the step so far: True to hold it one more interval (a first marginal score); raises Tripped on a
        failing score, or on a marginal one after the hold."""
        config = self.plan.judge
        assert config is not None
        judgement = config.judge(series)
        decision = config.decide(judgement)
        self.out(f"  {judgement.text()} over {series.intervals} intervals: {decision}")
        if decision == "pass":
            return False
        if decision == "marginal" and not held:
            self.out(
                f"  judge: marginal (--judge-marginal {config.marginal_score:g} <= score < --judge-pass "
                f"{config.pass_score:g}): holding the step one more interval"
            )
            return True
        bound = (
            f"below --judge-marginal {config.marginal_score:g}"
            if decision == "fail"
            else f"still below --judge-pass {config.pass_score:g} after holding the step one more interval"
        )
        raise Tripped(f"{self.plan.version} {judgement.text()}, {bound}")

    def _judge_outcomes(
        self, experiment: Experiment, since_ns: int, elapsed_s: float, series: Series | None = None
    ) -> Check:
        """One check of the outcome guards; prints its line, raises Tripped on harm or SRM, Won on a win.
        ``series``: where ``--judge`` keeps the outcome metrics' values since the last check."""
        plan = self.plan
        assert self.outcomes is not None
        analysis = self.outcomes(since_ns)
        if series is not None:
            series.add_outcomes(analysis, experiment.phase.id, self.control, plan.version)
        check: Check = judge(
            analysis,
            phase=experiment.phase.id,
            version=plan.version,
            guards=plan.guards,
            min_units=plan.guard_min_units,
        )
        self.out(f"  check {elapsed_s:.0f}s: {check.text}")
        if check.srm_flagged:
            expected = ", ".join(f"{arm} {n:.0f}" for arm, n in check.srm_expected.items())
            observed = ", ".join(f"{arm} {n}" for arm, n in check.units.items())
            raise Tripped(
                f"sample ratio mismatch in this step (p = {check.srm_p:.2g} < 0.001): units per arm {observed}, "
                f"expected {expected} from the weights; the split is broken, so no outcome can be trusted"
            )
        for reading in check.readings:
            if reading.state == "harm":
                raise Tripped(f"{plan.version} harms {reading.text.replace(': harm', '')} (guard {reading.guard.text})")
        if plan.promote_on_win and all(r.state == "win" for r in check.readings):
            raise Won("every outcome guard shows a significant win")
        return check

    def _judge(self, guard: _LatencyGuard, new: metrics.VersionCounts, control: metrics.VersionCounts) -> str:
        """One guard's part of the step's line; raises Tripped when the ratio is over its limit."""
        plan = self.plan
        new_histogram, control_histogram = guard.histogram(new), guard.histogram(control)
        new_p99 = metrics.quantile(new_histogram, 0.99)
        control_p99 = (
            metrics.quantile(control_histogram, 0.99)
            if metrics.observations(control_histogram) >= plan.min_calls
            else None
        )
        if control_p99 is not None:
            self._references[guard.name] = control_p99
        reference = self._references.get(guard.name)
        text = f" | {guard.name} {_ms(new_p99)} vs {self.control} {_ms(control_p99)}"
        if new_p99 is not None and not reference and self._final:
            raise Tripped(
                f"{plan.version} {guard.name} {_ms(new_p99)} could not be judged: no step measured the control's "
                f"{guard.name} (each had fewer than --min-calls {plan.min_calls} of its calls), and {self.control} "
                "takes no traffic now"
            )
        if new_p99 is None or not reference:
            reason = "none measured for this version" if new_p99 is None else "no control reference yet"
            return text + f" ({guard.name} ratio not judged: {reason})"
        ratio = new_p99 / reference
        if ratio > guard.limit:
            raise Tripped(
                f"{plan.version} {guard.name} {_ms(new_p99)} is {ratio:.2f}x the control's {_ms(reference)}, "
                f"over {guard.flag} {guard.limit:g}"
            )
        return text + f", ratio {ratio:.2f}"

    def _error_rate_text(self, new: metrics.VersionCounts) -> str:
        return (
            f"{self.plan.version} error rate {_percent(new.error_rate)} ({new.errors:g} of {new.calls:g} calls) "
            f"exceeds --max-error-rate {_percent(self.plan.max_error_rate)}"
        )


def judged_names(guards: Iterable[Guard]) -> list[str]:
    """The names ``--judge`` knows the guards' metrics by: an outcome guard's metric (``click``), a quantile
    guard's quantile (``latency_p90``), in the order given."""
    return list(dict.fromkeys(g.metric.name if isinstance(g, OutcomeGuard) else g.judge_metric for g in guards))


def rebuilt(base: Experiment, control: str, weights: dict[str, float]) -> Experiment:
    """``base`` with these weights and control (its salt, header and the shadows of versions not taking
    traffic kept); Invalid when the result is no valid experiment."""
    live = {v for v, w in weights.items() if w > 0}
    try:
        return Experiment.build(
            model=base.model,
            salt=base.salt,
            control=control,
            arms=[(v, _tidy(w)) for v, w in weights.items()],
            shadows=[(s.version, s.sample_rate) for s in base.shadows if s.version not in live],
            routing_key_header=base.routing_key_header,
        )
    except ConfigError as error:
        raise Invalid(str(error)) from None


def write_checked(
    store: Store, model: str, experiment: Experiment, revision: object, *, holds: Experiment | None
) -> object:
    """Write with check-and-set; return the new revision, read back with the experiment it must hold.
    ``holds``: the experiment the registry held as far as the writer knows (as read, then as last written).

    A file registry's revision is the whole file's: an edit elsewhere in it during a step (another
    model, a comment) made the next step's write a conflict, which stopped the rollout with v2 at its
    step's weight. While the experiment is still the one last written, the write is made again on the
    file as it is now, keeping that edit; a change to the experiment itself stays a conflict."""
    for _ in range(5):
        try:
            store.write(model, experiment, revision)
            break
        except Conflict:
            view = store.read(model)
            if view.stored != holds:
                raise
            revision = view.revision
    else:
        raise Conflict(f"{store.description} kept changing while we wrote; nothing written")
    view = store.read(model)
    if view.stored != experiment:
        raise Conflict("someone else changed the experiment right after our write")
    return view.revision


def interrupted_before_start(model: str) -> Verdict:
    """Interrupted before any write: nothing to roll back, the exit code of an interrupt all the same."""
    return Verdict(ROLLED_BACK, f"interrupted before the first step; {model} left as it was")


def _since(
    counts: Mapping[str, metrics.VersionCounts], previous: Mapping[str, metrics.VersionCounts], version: str
) -> metrics.VersionCounts:
    """A version's calls between two reads of the step (the judge's per-interval values)."""
    now = counts.get(version, metrics.VersionCounts())
    return now.minus(previous.get(version, metrics.VersionCounts()))


def _tidy(weight: float) -> float:
    """Keep whole weights as ints in what is written (``90``, not ``90.0``)."""
    rounded = round(weight, 2)
    return int(rounded) if rounded == int(rounded) else rounded


def _percent(fraction: float) -> str:
    return f"{fraction * 100:.2f} %"


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.1f} ms"
