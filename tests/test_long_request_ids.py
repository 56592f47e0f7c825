"""A request id of any length, through a real router and worker.

``ModelInferRequest.id`` is a protobuf string of any length, and a worker alone serves an id of
40,000 characters. The router echoed every id in metadata (to the worker and in its trailers), and
gRPC refuses metadata past 8 KiB at random and past 16 KiB always: found by probing a running
stack, ids of 9,000 to 15,000 bytes failed most calls with RESOURCE_EXHAUSTED, longer ones all.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from splitstream.common.headers import MAX_ID_HEADER_BYTES, REQUEST_ID_HEADER, from_header_value
from tests.harness import InferClient, ServiceProcess, make_request, one_version_router

MODEL = "affine"


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    with one_version_router(tmp_path_factory.mktemp("long-ids"), MODEL, salt="long-ids") as router:
        yield router


@pytest.mark.parametrize("length", [9_000, 12_000, 15_000, 40_000])
def test_a_request_id_too_long_for_a_header_is_served_and_kept_in_the_response_id(
    router: ServiceProcess, length: int
) -> None:
    client = InferClient(router.address)
    x = np.ones((1, 4), dtype=np.float32)
    try:
        for i in range(5):  # the soft limit refuses at random: one call passing proves little
            request_id = f"{i}-" + "ü" * (length // 2)
            response, trailers = client.infer(make_request(MODEL, x, request_id=request_id), timeout_s=10)
            assert response.id == request_id
            assert REQUEST_ID_HEADER not in trailers
            np.testing.assert_array_equal(
                np.frombuffer(response.raw_output_contents[0], dtype=np.float32), 2.0 * x.ravel()
            )
    finally:
        client.close()


def test_a_request_id_that_fits_a_header_still_comes_back_in_the_trailers(router: ServiceProcess) -> None:
    request_id = "é" * (MAX_ID_HEADER_BYTES // 6)  # six header bytes each: %C3%A9
    client = InferClient(router.address)
    try:
        response, trailers = client.infer(make_request(MODEL, np.ones((1, 4), np.float32), request_id=request_id))
    finally:
        client.close()
    assert response.id == request_id
    assert from_header_value(trailers[REQUEST_ID_HEADER]) == request_id
