"""``rollout --judge`` on an outcome metric of ``--guard``, on real processes (router, workers, recorder,
redis-server: the stack of ``tests/test_ab_end_to_end.py``): a canary whose answers are clicked far less often
is classified Low on clicks, which fails a higher-is-better metric, and is rolled back by the judge even though
its guard's bound is too loose to trip."""

from __future__ import annotations

import pytest

from tests.recording_stack import RecordingStack
from tests.test_ab_end_to_end import Users, rollout_with_traffic, set_experiment, stack, weights

__all__ = ["stack"]  # the module-scoped fixture, imported

pytestmark = pytest.mark.slow


def test_a_canary_clicked_less_is_classified_low_on_clicks_and_rolled_back_by_the_judge(
    stack: RecordingStack,
) -> None:
    set_experiment(stack, "judge-clicks", {"v1": 100, "v2": 0})
    users = Users(stack, "judge-clicks", {"v1": 0.6, "v2": 0.15}, seed=5)
    result = rollout_with_traffic(
        stack, users, "--steps", "50", "--interval", "20s",
        # An absolute bound no click rate can cross: only the judge can stop this rollout.
        "--guard", "click:lift>=-10", "--judge", "--judge-metric", "click=50", "--judge-metric", "error_rate",
    )  # fmt: skip
    assert result.returncode == 3, result.stdout + result.stderr
    judged = [line for line in result.stdout.splitlines() if line.startswith("  judge score ")]
    assert judged, result.stdout
    assert "click Low" in judged[-1]
    assert "error_rate Pass" in judged[-1]
    assert judged[-1].endswith(": fail")
    assert "ROLLED BACK: v2 judge score 50 " in result.stdout
    assert "v2 harms" not in result.stdout  # the guard itself held
    assert weights(stack) == {"v1": 100, "v2": 0}


def test_an_early_win_advances_only_with_the_judges_pass(stack: RecordingStack) -> None:
    set_experiment(stack, "judge-win", {"v1": 100, "v2": 0})
    users = Users(stack, "judge-win", {"v1": 0.2, "v2": 0.7}, seed=6)
    result = rollout_with_traffic(
        stack, users, "--steps", "50", "--interval", "10m", "--guard", "click:lift>=-1%", "--promote-on-win",
        "--judge", "--judge-metric", "click",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    advanced = next(i for i, line in enumerate(lines) if line.endswith("advancing early"))
    # The judge passed the step just before it ended early: clicks up is High, the good side of this metric.
    assert lines[advanced - 1].startswith("  judge score 100 (click "), lines[advanced - 1]
    assert lines[advanced - 1].endswith(": pass")
    assert weights(stack) == {"v1": 50, "v2": 50}
