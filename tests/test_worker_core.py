"""The worker's core in-process: batching, validation, config and metadata rules.

The schedulers run a small Python backend (``y = 2x``) that records the shape
of every run and can be held, so the tests can see exactly how requests were
grouped. Everything else is the real code.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import structlog
from prometheus_client import CollectorRegistry

from splitstream.common.errors import ConfigError, InvalidInput, ModelNotReady
from splitstream.worker.batching import BackendError, DirectScheduler, DynamicBatcher, Scheduler
from splitstream.worker.config import ModelConfig
from splitstream.worker.metadata import ModelMetadata, TensorSpec, resolve
from splitstream.worker.metrics import WorkerMetrics
from splitstream.worker.validation import InputHeader, validate_request


class Doubler:
    """A Backend.run computing ``y = 2x`` that records each run's input shape; :attr:`gate` holds runs."""

    def __init__(self, *, fail_runs: int = 0) -> None:
        self.shapes: list[tuple[int, ...]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.running = threading.Event()
        self._fail_runs = fail_runs

    def __call__(self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str]) -> dict[str, np.ndarray]:
        self.running.set()
        assert self.gate.wait(timeout=10), "a test forgot to open the gate"
        self.shapes.append(inputs["x"].shape)
        if self._fail_runs:
            self._fail_runs -= 1
            raise RuntimeError("the engine fell over")
        return {"y": inputs["x"] * 2, "rows": np.arange(len(inputs["x"]))}


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def metrics_for(registry: CollectorRegistry) -> WorkerMetrics:
    return WorkerMetrics(registry, model="m", version="v1")


def sample(registry: CollectorRegistry, name: str) -> float:
    value = registry.get_sample_value(name, {"model": "m", "version": "v1"})
    return value or 0.0


@contextlib.asynccontextmanager
async def started(scheduler: Scheduler) -> AsyncIterator[Scheduler]:
    scheduler.start()
    try:
        yield scheduler
    finally:
        await scheduler.stop()


def batcher(
    run: Doubler, registry: CollectorRegistry, *, max_queue_delay_us: int, max_batch_size: int = 8
) -> DynamicBatcher:
    return DynamicBatcher(
        run,
        max_batch_size=max_batch_size,
        max_queue_delay_us=max_queue_delay_us,
        instance_count=1,
        metrics=metrics_for(registry),
        logger=structlog.get_logger(),
    )


def rows(n: int, width: int = 4, start: float = 0.0) -> np.ndarray:
    return (np.arange(n * width, dtype=np.float32) + start).reshape(n, width)


async def until(condition: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.001)


# --- dynamic batching ---------------------------------------------------------------------------------------------


async def test_a_full_batch_runs_at_once_and_every_request_gets_its_own_rows(registry: CollectorRegistry) -> None:
    run = Doubler()
    inputs = [rows(1, start=0), rows(2, start=100), rows(3, start=200), rows(2, start=300)]
    async with started(batcher(run, registry, max_queue_delay_us=5_000_000)) as scheduler:
        began = time.monotonic()
        results = await asyncio.gather(*(scheduler.submit({"x": x}, ("y",), len(x)) for x in inputs))
        elapsed = time.monotonic() - began

    assert run.shapes == [(8, 4)]
    assert elapsed < 2.5, "a full batch must not wait for the queue delay (5 s)"
    for x, result in zip(inputs, results, strict=True):
        assert list(result) == ["y"]
        np.testing.assert_array_equal(result["y"], x * 2)
    assert sample(registry, "splitstream_worker_batch_size_sum") == 8
    assert sample(registry, "splitstream_worker_queue_seconds_count") == 4


async def test_a_lone_request_runs_when_the_queue_delay_has_passed(registry: CollectorRegistry) -> None:
    run = Doubler()
    async with started(batcher(run, registry, max_queue_delay_us=30_000)) as scheduler:
        began = time.monotonic()
        result = await scheduler.submit({"x": rows(1)}, ("y",), 1)
        elapsed = time.monotonic() - began

    assert run.shapes == [(1, 4)]
    assert 0.03 <= elapsed < 5.0  # after the delay, and not held for ever
    np.testing.assert_array_equal(result["y"], rows(1) * 2)


async def test_requests_with_different_non_batch_dims_are_never_stacked(registry: CollectorRegistry) -> None:
    run = Doubler()
    inputs = [rows(1, width=4), rows(1, width=3), rows(2, width=4)]
    async with started(batcher(run, registry, max_queue_delay_us=20_000)) as scheduler:
        results = await asyncio.gather(*(scheduler.submit({"x": x}, ("y",), len(x)) for x in inputs))

    assert sorted(run.shapes) == [(1, 3), (3, 4)]
    for x, result in zip(inputs, results, strict=True):
        np.testing.assert_array_equal(result["y"], x * 2)


async def test_requests_accumulate_while_every_instance_is_busy(registry: CollectorRegistry) -> None:
    run = Doubler()
    run.gate.clear()
    async with started(batcher(run, registry, max_queue_delay_us=0)) as scheduler:
        first = asyncio.ensure_future(scheduler.submit({"x": rows(1)}, ("y",), 1))
        await asyncio.to_thread(run.running.wait, 5)
        later = [asyncio.ensure_future(scheduler.submit({"x": rows(1, start=i)}, ("y",), 1)) for i in range(5)]
        await until(lambda: scheduler.depth() == 5)
        run.gate.set()
        await asyncio.gather(first, *later)

    assert run.shapes == [(1, 4), (5, 4)]


async def test_a_request_that_does_not_fit_waits_for_the_next_batch(registry: CollectorRegistry) -> None:
    run = Doubler()
    run.gate.clear()
    async with started(batcher(run, registry, max_queue_delay_us=0, max_batch_size=4)) as scheduler:
        first = asyncio.ensure_future(scheduler.submit({"x": rows(1)}, ("y",), 1))
        await asyncio.to_thread(run.running.wait, 5)
        sizes = [3, 2, 1]
        later = [asyncio.ensure_future(scheduler.submit({"x": rows(n)}, ("y",), n)) for n in sizes]
        await until(lambda: scheduler.depth() == 3)
        run.gate.set()
        results = await asyncio.gather(first, *later)

    assert run.shapes == [(1, 4), (4, 4), (2, 4)]  # 3 + 1 fill the second batch; the 2-row request runs next
    assert [len(r["y"]) for r in results] == [1, 3, 2, 1]


async def test_a_cancelled_request_leaves_its_batch_and_the_others_still_succeed(registry: CollectorRegistry) -> None:
    run = Doubler()
    async with started(batcher(run, registry, max_queue_delay_us=50_000)) as scheduler:
        calls = [asyncio.ensure_future(scheduler.submit({"x": rows(1, start=i)}, ("y",), 1)) for i in range(3)]
        await until(lambda: scheduler.depth() == 3)
        calls[1].cancel()
        await asyncio.gather(*calls, return_exceptions=True)

    assert calls[1].cancelled()
    np.testing.assert_array_equal(calls[0].result()["y"], rows(1, start=0) * 2)
    np.testing.assert_array_equal(calls[2].result()["y"], rows(1, start=2) * 2)
    assert run.shapes == [(2, 4)]


async def test_a_request_cancelled_while_its_batch_runs_does_not_disturb_the_others(
    registry: CollectorRegistry,
) -> None:
    run = Doubler()
    run.gate.clear()
    async with started(batcher(run, registry, max_queue_delay_us=20_000)) as scheduler:
        calls = [asyncio.ensure_future(scheduler.submit({"x": rows(1, start=i)}, ("y",), 1)) for i in range(2)]
        await asyncio.to_thread(run.running.wait, 5)
        calls[0].cancel()
        run.gate.set()
        await asyncio.gather(*calls, return_exceptions=True)

    assert calls[0].cancelled()
    np.testing.assert_array_equal(calls[1].result()["y"], rows(1, start=1) * 2)


async def test_a_failing_backend_run_fails_only_the_requests_of_that_batch(registry: CollectorRegistry) -> None:
    run = Doubler(fail_runs=1)
    async with started(batcher(run, registry, max_queue_delay_us=20_000)) as scheduler:
        failed = await asyncio.gather(
            *(scheduler.submit({"x": rows(1)}, ("y",), 1) for _ in range(2)), return_exceptions=True
        )
        after = await scheduler.submit({"x": rows(1)}, ("y",), 1)

    assert all(isinstance(error, BackendError) for error in failed)
    assert str(failed[0]) == "inference failed", "the client sees no internals"
    np.testing.assert_array_equal(after["y"], rows(1) * 2)


async def test_each_request_gets_only_the_outputs_it_asked_for(registry: CollectorRegistry) -> None:
    run = Doubler()
    async with started(batcher(run, registry, max_queue_delay_us=20_000)) as scheduler:
        both, only_rows = await asyncio.gather(
            scheduler.submit({"x": rows(2)}, ("rows", "y"), 2), scheduler.submit({"x": rows(1)}, ("rows",), 1)
        )

    assert list(both) == ["rows", "y"]
    assert list(only_rows) == ["rows"]
    np.testing.assert_array_equal(both["rows"], [0, 1])
    np.testing.assert_array_equal(only_rows["rows"], [2])


async def test_stop_lets_the_running_batch_finish_and_fails_queued_requests(registry: CollectorRegistry) -> None:
    run = Doubler()
    run.gate.clear()
    scheduler = batcher(run, registry, max_queue_delay_us=0)
    scheduler.start()
    running = asyncio.ensure_future(scheduler.submit({"x": rows(1)}, ("y",), 1))
    await asyncio.to_thread(run.running.wait, 5)
    queued = asyncio.ensure_future(scheduler.submit({"x": rows(1)}, ("y",), 1))
    await until(lambda: scheduler.depth() == 1)

    stopping = asyncio.ensure_future(scheduler.stop())
    run.gate.set()
    await stopping

    np.testing.assert_array_equal((await running)["y"], rows(1) * 2)
    with pytest.raises(ModelNotReady):
        await queued
    with pytest.raises(ModelNotReady):
        await scheduler.submit({"x": rows(1)}, ("y",), 1)


async def test_without_dynamic_batching_every_request_runs_alone(registry: CollectorRegistry) -> None:
    run = Doubler()
    scheduler = DirectScheduler(run, instance_count=2, metrics=metrics_for(registry), logger=structlog.get_logger())
    async with started(scheduler):
        results = await asyncio.gather(*(scheduler.submit({"x": rows(2, start=i)}, ("y",), 2) for i in range(4)))

    assert run.shapes == [(2, 4)] * 4
    assert [r["y"][0, 0] for r in results] == [0, 2, 4, 6]
    assert sample(registry, "splitstream_worker_batch_size_count") == 4


# --- validation ---------------------------------------------------------------------------------------------------

METADATA = ModelMetadata(
    inputs=(
        TensorSpec(name="x", datatype="FP32", shape=(-1, 4)),
        TensorSpec(name="ids", datatype="INT64", shape=(-1,)),
    ),
    outputs=(
        TensorSpec(name="y", datatype="FP32", shape=(-1, 4)),
        TensorSpec(name="label", datatype="INT64", shape=(-1,)),
    ),
)
X = InputHeader("x", "FP32", (2, 4))
IDS = InputHeader("ids", "INT64", (2,))


def test_a_valid_request_plans_its_rows_and_outputs_in_the_requested_order() -> None:
    assert validate_request([X, IDS], [], METADATA, max_batch_size=8).output_names == ("y", "label")
    plan = validate_request([IDS, X], ["label", "y"], METADATA, max_batch_size=8)
    assert (plan.rows, plan.output_names) == (2, ("label", "y"))


@pytest.mark.parametrize(
    ("inputs", "outputs", "message"),
    [
        ([X, IDS, InputHeader("z", "FP32", (2,))], [], "unknown input 'z'; the model's inputs are ['x', 'ids']"),
        ([X, X, IDS], [], "input 'x' appears more than once"),
        ([X], [], "missing input 'ids'"),
        ([InputHeader("x", "FP64", (2, 4)), IDS], [], "input 'x': wrong datatype, expected FP32, got FP64"),
        (
            [InputHeader("x", "FP32", (2, 5)), IDS],
            [],
            "input 'x': wrong shape, expected [-1, 4] (-1 = any size), got [2, 5]",
        ),
        ([InputHeader("x", "FP32", (2, 4, 1)), IDS], [], "input 'x': wrong shape"),
        ([InputHeader("x", "FP32", (-2, 4)), IDS], [], "input 'x': shape [-2, 4] has a negative dimension"),
        ([InputHeader("x", "FP32", (9, 4)), IDS], [], "input 'x': batch of 9 exceeds max_batch_size 8"),
        ([InputHeader("x", "FP32", (0, 4)), IDS], [], "input 'x': batch dimension must be at least 1"),
        ([X, InputHeader("ids", "INT64", (3,))], [], "input 'ids': batch of 3 differs from input 'x' with batch of 2"),
        ([X, IDS], ["probs"], "unknown requested output 'probs'; the model's outputs are ['y', 'label']"),
        ([X, IDS], ["y", "y"], "output 'y' is requested more than once"),
    ],
)
def test_an_invalid_request_is_rejected_naming_the_tensor_and_the_problem(
    inputs: list[InputHeader], outputs: list[str], message: str
) -> None:
    with pytest.raises(InvalidInput) as caught:
        validate_request(inputs, outputs, METADATA, max_batch_size=8)

    assert message in str(caught.value)


def test_without_a_batch_dimension_the_first_dimension_is_an_ordinary_one() -> None:
    metadata = ModelMetadata(inputs=(TensorSpec(name="x", datatype="FP32", shape=(3, -1)),), outputs=())

    assert validate_request([InputHeader("x", "FP32", (3, 100))], [], metadata, max_batch_size=0).rows == 1
    with pytest.raises(InvalidInput, match="wrong shape"):
        validate_request([InputHeader("x", "FP32", (2, 100))], [], metadata, max_batch_size=0)


# --- config.yaml --------------------------------------------------------------------------------------------------


def test_a_dynamic_batching_section_turns_batching_on_and_its_absence_off() -> None:
    on = ModelConfig.from_mapping(
        {"backend": "onnxruntime", "max_batch_size": 8, "dynamic_batching": {"max_queue_delay_us": 500}}
    )
    off = ModelConfig.from_mapping({"backend": "onnxruntime", "max_batch_size": 8})
    disabled = ModelConfig.from_mapping(
        {"backend": "onnxruntime", "max_batch_size": 8, "dynamic_batching": {"enabled": False}}
    )

    assert (on.batching, on.dynamic_batching.max_queue_delay_us) == (True, 500)
    assert not off.batching
    assert not disabled.batching
    assert (on.instance_count, on.intra_op_threads, on.execution_providers) == (1, 1, ("cpu",))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({}, "backend: is required"),
        ({"backend": "tensorflow"}, "backend: must be one of ['onnxruntime', 'tensorrt']"),
        ({"backend": "onnxruntime", "batch": 4}, "batch: unknown field"),
        (
            {"backend": "onnxruntime", "max_batch_size": "8"},
            "max_batch_size: must be an integer within 0..65536, got '8'",
        ),
        ({"backend": "onnxruntime", "max_batch_size": True}, "max_batch_size: must be an integer"),
        ({"backend": "onnxruntime", "instance_count": 0}, "instance_count: must be an integer >= 1"),
        ({"backend": "onnxruntime", "dynamic_batching": {}}, "dynamic_batching: needs max_batch_size > 0"),
        (
            {"backend": "onnxruntime", "max_batch_size": 4, "dynamic_batching": {"delay_us": 5}},
            "dynamic_batching.delay_us: unknown field",
        ),
        (
            {"backend": "onnxruntime", "max_batch_size": 4, "dynamic_batching": {"max_queue_delay_us": -1}},
            "dynamic_batching.max_queue_delay_us: must be an integer within 0..10000000",
        ),
        ({"backend": "onnxruntime", "execution_providers": ["cuda", "cuda"]}, "execution_providers: ['cuda', 'cuda']"),
        ({"backend": "onnxruntime", "execution_providers": []}, "execution_providers: must list at least one"),
        ({"backend": "onnxruntime", "inputs": [{"name": "x", "datatype": "FP32"}]}, "inputs[0]: lacks ['shape']"),
        (
            {"backend": "onnxruntime", "inputs": [{"name": "x", "datatype": "FLOAT", "shape": [1]}]},
            "inputs[0]: tensor 'x': datatype must be one of",
        ),
        (
            {"backend": "onnxruntime", "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, "n"]}]},
            "outputs[0].shape: must be a list of integers",
        ),
        ([1, 2], "must be a mapping of settings"),
    ],
)
def test_a_bad_config_names_the_field_and_the_problem(settings: Any, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        ModelConfig.from_mapping(settings)

    assert message in str(caught.value)


def test_a_config_file_that_is_not_yaml_is_reported_with_its_path(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("backend: [onnxruntime\n")

    with pytest.raises(ConfigError, match=r"config\.yaml: not valid YAML"):
        ModelConfig.from_file(path)
    with pytest.raises(ConfigError, match="no such file"):
        ModelConfig.from_file(tmp_path / "missing.yaml")


# --- metadata: the engine's tensors and config.yaml's --------------------------------------------------------------

ENGINE = ModelMetadata(
    inputs=(TensorSpec(name="x", datatype="FP32", shape=(-1, -1)),),
    outputs=(TensorSpec(name="y", datatype="FP32", shape=(-1, 4)),),
)


def test_config_may_fix_a_dimension_the_model_leaves_dynamic() -> None:
    declared = (TensorSpec(name="x", datatype="FP32", shape=(-1, 4)),)

    merged = resolve(ENGINE, inputs=declared, outputs=None, max_batch_size=8)

    assert merged.inputs == declared
    assert merged.outputs == ENGINE.outputs


@pytest.mark.parametrize(
    ("inputs", "outputs", "message"),
    [
        ((TensorSpec(name="image", datatype="FP32", shape=(-1, 4)),), None, "inputs must name exactly the model's"),
        (
            (TensorSpec(name="x", datatype="FP16", shape=(-1, 4)),),
            None,
            "datatype FP16 does not match the model's FP32",
        ),
        ((TensorSpec(name="x", datatype="FP32", shape=(-1,)),), None, "has a different rank"),
        (None, (TensorSpec(name="y", datatype="FP32", shape=(-1, 5)),), "conflicts with the model's [-1, 4]"),
        ((TensorSpec(name="x", datatype="FP32", shape=(2, 4)),), None, "its first dimension must be -1"),
    ],
)
def test_config_cannot_contradict_the_model(
    inputs: tuple[TensorSpec, ...] | None, outputs: tuple[TensorSpec, ...] | None, message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        resolve(ENGINE, inputs=inputs, outputs=outputs, max_batch_size=8)

    assert message in str(caught.value)
