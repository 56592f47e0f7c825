"""Fuzzing a real worker with mutated ModelInfer bytes, odd tensors and odd metadata.

The worker decodes what the router passes through untouched, so whatever a client
sends must end, within its deadline, with a status a client can act on: never
UNKNOWN (grpc's answer to an exception escaping a handler) nor INTERNAL (a bug of
ours), and the worker must go on serving with no traceback in its log. Bounded
(``max_examples``) and derandomized, so a run takes seconds and a failure reproduces.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.common.tensors import output_arrays
from tests.fuzzing import DEADLINE_S, FAULTS, call, metadata, mutated, request_bytes, structured_requests
from tests.harness import ServiceProcess, Stack, make_request
from tests.models import add_version

MODEL = "affine"
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
#: The worker's other methods, whose requests it parses itself.
TYPED_METHODS = (
    "/inference.GRPCInferenceService/ServerLive",
    "/inference.GRPCInferenceService/ServerReady",
    "/inference.GRPCInferenceService/ModelReady",
    "/inference.GRPCInferenceService/ServerMetadata",
    "/inference.GRPCInferenceService/ModelMetadata",
    "/grpc.health.v1.Health/Check",
)


#: Requests that parse, addressed to the served model: most reach its tensor checks, some the model.
structured = structured_requests(MODEL, "v1", input_names=("x",), input_shape=(-1, 4), output_names=("y", "label"))


class Fuzzed:
    def __init__(self, tmp: Path) -> None:
        repository = tmp / "models"
        # Dynamic batching on, so fuzzed calls that pass validation meet in the scheduler's batches.
        add_version(repository, MODEL, "v1", scale=2.0, config={"dynamic_batching": {"max_queue_delay_us": 2000}})
        self.stack = Stack(tmp)
        self.worker: ServiceProcess = self.stack.worker(repository, MODEL, "v1")
        self.channel = grpc.insecure_channel(self.worker.address)
        # Bytes in, bytes out: what the fuzzer sends is what arrives.
        self.model_infer = self.channel.unary_unary(MODEL_INFER)

    def close(self) -> None:
        self.channel.close()
        self.stack.close()


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzzed]:
    target = Fuzzed(tmp_path_factory.mktemp("worker-fuzz"))
    yield target
    target.close()


FUZZ_SETTINGS = settings(
    deadline=None,  # each example is bounded by the call's own deadline, asserted in call()
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@settings(FUZZ_SETTINGS, max_examples=120)
@given(request=structured, headers=metadata)
def test_requests_with_any_tensors_and_metadata_end_within_the_deadline_with_neither_unknown_nor_internal(
    fuzzed: Fuzzed, request: bytes, headers: list[tuple[str, str | bytes]]
) -> None:
    call(fuzzed.model_infer, request, headers)


@settings(FUZZ_SETTINGS, max_examples=60)
@given(request=request_bytes(MODEL), headers=metadata)
def test_mutated_truncated_and_random_bytes_end_within_the_deadline_with_neither_unknown_nor_internal(
    fuzzed: Fuzzed, request: bytes, headers: list[tuple[str, str | bytes]]
) -> None:
    call(fuzzed.model_infer, request, headers)


@settings(FUZZ_SETTINGS, max_examples=40)
@given(method=st.sampled_from(TYPED_METHODS), request=st.binary(max_size=64) | mutated(MODEL), headers=metadata)
def test_any_bytes_sent_to_the_other_methods_end_within_the_deadline_with_neither_unknown_nor_internal(
    fuzzed: Fuzzed, method: str, request: bytes, headers: list[tuple[str, str | bytes]]
) -> None:
    call(fuzzed.channel.unary_unary(method), request, headers)


@settings(FUZZ_SETTINGS, max_examples=15)
@given(requests=st.lists(structured, min_size=6, max_size=6))
def test_fuzzed_calls_batched_with_valid_ones_end_well_and_leave_the_valid_answers_right(
    fuzzed: Fuzzed, requests: list[bytes]
) -> None:
    """All in flight at once, so the scheduler (2 ms queue delay) puts fuzzed and valid calls in one batch."""
    started = time.monotonic()
    valid = [np.full((rows, 4), rows, dtype=np.float32) for rows in (1, 2, 3)]
    valid_calls = [
        fuzzed.model_infer.future(make_request(MODEL, x).SerializeToString(), timeout=DEADLINE_S) for x in valid
    ]
    fuzzed_calls = [fuzzed.model_infer.future(request, timeout=DEADLINE_S) for request in requests]
    for future in fuzzed_calls:
        error = future.exception()
        assert error is None or error.code() not in FAULTS, (error.code(), error.details())
    for x, future in zip(valid, valid_calls, strict=True):
        np.testing.assert_array_equal(output_arrays(oip.ModelInferResponse.FromString(future.result()))["y"], 2.0 * x)
    assert time.monotonic() - started < DEADLINE_S


def test_the_worker_still_serves_a_normal_call_after_the_fuzzing(fuzzed: Fuzzed) -> None:
    x = np.ones((2, 4), dtype=np.float32)
    answer = fuzzed.model_infer(make_request(MODEL, x, request_id="after-fuzz").SerializeToString(), timeout=5)
    response = oip.ModelInferResponse.FromString(answer)
    assert response.id == "after-fuzz"
    np.testing.assert_array_equal(output_arrays(response)["y"], 2.0 * x)
    assert fuzzed.worker.process is not None
    assert fuzzed.worker.process.poll() is None
    assert "Traceback" not in fuzzed.worker.log()  # a bug answered as INTERNAL still leaves one
