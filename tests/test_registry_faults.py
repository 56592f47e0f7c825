"""A real router on a file registry given the edits that used to freeze or empty it (issue 11, faults 2 and 3).

Fault 2: a value of the wrong type (``sample_rate: abc``, ``weight: .nan``) raised a ValueError that
killed the registry watch silently: the router stayed healthy, Status showed no error, and no later
edit (a rollback included) ever applied; ``weight: true`` was taken as 1 %. Fault 3: an empty,
comment-only or ``models: {}`` file was applied as healthy and every call got NOT_FOUND.

The file is written in place (truncate, then write), as a careless editor or ``echo > file`` does.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from tests.harness import InferClient, ServiceProcess, Stack, make_request, registry_healthy, router_status, wait_for
from tests.models import add_version

MODEL = "affine"
OTHER = "other"
X = np.ones((1, 4), dtype=np.float32)


def registry_text(v1: str, v2: str, *, shadow_rate: str = "0.5", workers: dict[str, str]) -> str:
    """The registry as an operator types it: values go in verbatim, so YAML's own types are exercised."""
    return f"""\
models:
  {MODEL}:
    endpoints: {{v1: ["{workers["v1"]}"], v2: ["{workers["v2"]}"]}}
    experiment:
      salt: faults
      control: v1
      arms:
        - {{version: v1, weight: {v1}}}
        - {{version: v2, weight: {v2}}}
      shadows: [{{version: v3, sample_rate: {shadow_rate}}}]
"""


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    stack = Stack(tmp_path)
    yield stack
    stack.close()


@pytest.fixture
def workers(stack: Stack, tmp_path: Path) -> dict[str, str]:
    repository = tmp_path / "models"
    for version, scale in (("v1", 1.0), ("v2", 2.0)):
        add_version(repository, MODEL, version, scale=scale)
    return {version: stack.worker(repository, MODEL, version).address for version in ("v1", "v2")}


def served_version(router: ServiceProcess, model: str = MODEL) -> str:
    client = InferClient(router.address)
    try:
        response, _ = client.infer(make_request(model, X), metadata=[("x-routing-key", "user-1")], timeout_s=5)
    finally:
        client.close()
    return str(response.model_version)


def edit_in_place(path: Path, text: str) -> None:
    """Truncate and rewrite the same inode, as an editor saving without a rename does."""
    with open(path, "w") as handle:
        handle.write(text)


def wait_refused(router: ServiceProcess, fragment: str) -> None:
    wait_for(
        lambda: fragment in router_status(router).registry_error, timeout_s=10, what=f"the error naming {fragment!r}"
    )
    assert registry_healthy(router) == 0


def router_all_on_v1(stack: Stack, registry: Path, workers: dict[str, str]) -> ServiceProcess:
    """A router on ``registry``, written to send every call to v1, checked to do so before any edit."""
    edit_in_place(registry, registry_text("100", "0", workers=workers))
    router = stack.router(registry)
    assert served_version(router) == "v1"
    return router


def assert_applied(router: ServiceProcess) -> None:
    """The last edit applied: no error in Status and the registry healthy again."""
    assert router_status(router).registry_error == ""
    assert registry_healthy(router) == 1


def stop_cleanly(router: ServiceProcess) -> None:
    router.signal(signal.SIGTERM)
    assert router.wait() == 0, router.log()
    assert "Traceback" not in router.log()


@pytest.mark.slow
def test_a_bad_value_in_the_file_is_reported_and_the_next_good_edit_still_applies(
    stack: Stack, tmp_path: Path, workers: dict[str, str]
) -> None:
    registry = tmp_path / "registry.yaml"
    router = router_all_on_v1(stack, registry, workers)
    assert registry_healthy(router) == 1
    good = {"v1": ("100", "0"), "v2": ("0", "100")}
    expect = "v2"
    bad_edits = [
        (registry_text("100", "0", shadow_rate="abc", workers=workers), "shadows[0].sample_rate"),
        (registry_text(".nan", "100", workers=workers), "arms[0].weight: Input should be a finite number"),
        (registry_text("99", "true", workers=workers), "arms[1].weight: Input should be a valid number, got True"),
        (registry_text('"10"', "90", workers=workers), "arms[0].weight: Input should be a valid number, got '10'"),
        (registry_text(".inf", "0", workers=workers), "arms[0].weight: Input should be a finite number"),
    ]
    for text, fragment in bad_edits:
        edit_in_place(registry, text)
        wait_refused(router, fragment)
        before = "v1" if expect == "v2" else "v2"
        assert served_version(router) == before  # the last good state still routes
        # The next good edit (here a full switch of the split) applies: the watch survived.
        edit_in_place(registry, registry_text(*good[expect], workers=workers))
        wait_for(lambda: served_version(router) == expect, timeout_s=10, what=f"the split to move to {expect}")  # noqa: B023
        assert_applied(router)
        expect = before
    stop_cleanly(router)


@pytest.mark.slow
def test_a_registry_file_that_is_not_text_is_reported_and_the_next_good_edit_applies(
    stack: Stack, tmp_path: Path, workers: dict[str, str]
) -> None:
    """A UnicodeDecodeError is a ValueError, not an OSError: it too used to end the watch silently."""
    registry = tmp_path / "registry.yaml"
    router = router_all_on_v1(stack, registry, workers)
    registry.write_bytes(b"models:\n  \xff\xfe: {}\n")
    wait_refused(router, "not UTF-8 text")
    assert served_version(router) == "v1"
    edit_in_place(registry, registry_text("0", "100", workers=workers))
    wait_for(lambda: served_version(router) == "v2", timeout_s=10, what="the good edit to apply")
    assert registry_healthy(router) == 1
    stop_cleanly(router)


@pytest.mark.slow
def test_a_file_that_would_drop_every_model_is_refused_until_the_removal_is_explicit(
    stack: Stack, tmp_path: Path, workers: dict[str, str]
) -> None:
    registry = tmp_path / "registry.yaml"
    router = router_all_on_v1(stack, registry, workers)
    text = registry_text("100", "0", workers=workers)  # what router_all_on_v1 wrote
    for empty, fragment in (
        ("", "the file is empty"),
        ("# models: gone for now\n", "the file is empty"),
        ("models: {}\n", f"would drop every model ({MODEL})"),
    ):
        edit_in_place(registry, empty)
        wait_refused(router, fragment)
        assert served_version(router) == "v1"  # calls keep working on the last good state
        edit_in_place(registry, text)
        wait_for(lambda: router_status(router).registry_error == "", timeout_s=10, what="the full file to apply again")
    edit_in_place(registry, f"models: {{}}\nremove_models: [{MODEL}]\n")
    wait_for(lambda: not router_status(router).models, timeout_s=10, what="the explicit removal to apply")
    assert_applied(router)
    with pytest.raises(grpc.RpcError) as failure:
        served_version(router)
    assert failure.value.code() == grpc.StatusCode.NOT_FOUND
    stop_cleanly(router)


@pytest.mark.slow
def test_dropping_one_serving_model_of_two_is_refused_unless_it_is_named_for_removal(
    stack: Stack, tmp_path: Path, workers: dict[str, str]
) -> None:
    registry = tmp_path / "registry.yaml"
    # The other model's endpoint only has to exist in the file: Status shows what the router routes.
    only_model = f"models:\n  {MODEL}: {{endpoints: {{v1: ['{workers['v1']}']}}}}\n"
    both = only_model + f"  {OTHER}: {{endpoints: {{v1: ['127.0.0.1:1']}}}}\n"
    edit_in_place(registry, both)
    router = stack.router(registry)
    routed = lambda: sorted(m.model for m in router_status(router).models)  # noqa: E731
    assert routed() == [MODEL, OTHER]
    edit_in_place(registry, only_model)
    wait_refused(router, f"would drop model(s) {OTHER}, which are serving")
    assert routed() == [MODEL, OTHER]
    assert served_version(router) == "v1"
    edit_in_place(registry, only_model + f"remove_models: [{OTHER}]\n")
    wait_for(lambda: routed() == [MODEL], timeout_s=10, what="the explicit removal to apply")
    assert_applied(router)
    stop_cleanly(router)


def test_a_router_started_on_an_empty_registry_file_exits_2_with_one_line(stack: Stack, tmp_path: Path) -> None:
    """An empty file at start is the same half-saved file; a router serving nothing as healthy hides it."""
    registry = tmp_path / "registry.yaml"
    registry.write_text("# to be filled in\n")
    router = stack.router(registry, start=False)
    router.start(wait_serving=False)
    assert router.wait() == 2
    lines = router.log().strip().splitlines()
    assert len(lines) == 1, router.log()
    assert lines[0].startswith("splitstream-router: error: registry file:")
    assert "the file is empty" in lines[0]
