"""The removal rule both registry backends share (registry/removal.py), case by case."""

from __future__ import annotations

from pathlib import Path

from splitstream.common.experiment import Experiment
from splitstream.common.registry import FileRegistry, ModelEntry, RegistryState
from splitstream.common.registry.removal import refused_removal


def state(**models: tuple[str, ...]) -> RegistryState:
    """model → its v1 addresses (empty: a model listed with no endpoint)."""
    return RegistryState(
        models={
            name: ModelEntry(
                experiment=Experiment.build(model=name, salt=name, control="v1", arms=[("v1", 100)]),
                endpoints={"v1": addresses} if addresses else {},
            )
            for name, addresses in models.items()
        }
    )


def test_the_first_state_is_never_refused_even_empty() -> None:
    assert refused_removal(None, state()) is None


def test_dropping_every_serving_model_is_refused_naming_them_and_how_to_remove() -> None:
    problem = refused_removal(state(a=("h:1",), b=("h:2",)), state(), how_to_remove="say so")
    assert problem == "refused: it would drop every model (a, b) and leave nothing to route; say so"


def test_dropping_one_serving_model_is_refused_and_one_without_endpoints_is_not() -> None:
    before = state(a=("h:1",), b=("h:2",), idle=())
    assert refused_removal(before, state(a=("h:1",), b=("h:2",))) is None
    assert refused_removal(before, state(a=("h:1",), idle=())) == "refused: it would drop model(s) b, which are serving"
    assert refused_removal(state(idle=()), state()) is None  # nothing was routable: nothing is lost


def test_models_named_for_removal_may_go_serving_or_not() -> None:
    before = state(a=("h:1",), b=("h:2",))
    assert refused_removal(before, state(a=("h:1",)), removable={"b"}) is None
    assert refused_removal(before, state(), removable={"a", "b"}) is None
    assert refused_removal(before, state(), removable={"a"}) is not None


def test_adding_models_or_changing_endpoints_is_no_removal() -> None:
    assert refused_removal(state(a=("h:1",)), state(a=("h:9",), b=("h:2",))) is None
    assert refused_removal(state(a=("h:1",)), state(a=())) is None  # endpoints gone is an outage, not a removal


async def test_a_watch_started_again_still_refuses_a_file_that_drops_every_model(tmp_path: Path) -> None:
    """The router starts a new watch after one fails; the last accepted state must outlive the old watch,
    or the new watch's first read of a half-saved file would drop every model (issue 11, fault 3)."""
    path = tmp_path / "registry.yaml"
    path.write_text("models:\n  m:\n    endpoints: {v1: ['127.0.0.1:9001']}\n")
    registry = FileRegistry(path, poll_interval_s=0.01)
    first = registry.watch()
    assert (await anext(first)).state is not None
    await first.aclose()
    path.write_text("models: {}\n")
    again = registry.watch()
    try:
        update = await anext(again)
    finally:
        await again.aclose()
    assert update.state is None
    assert "remove_models" in (update.error or "")
