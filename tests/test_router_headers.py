"""Request-id headers a client may send that the router cannot decode, through a real router and worker."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from splitstream.common.headers import REQUEST_ID_HEADER, VERSION_HEADER, from_header_value
from tests.harness import InferClient, ServiceProcess, make_request, one_version_router

MODEL = "affine"


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    with one_version_router(tmp_path_factory.mktemp("router-headers"), MODEL, salt="headers") as router:
        yield router


@pytest.mark.parametrize("header", ["%80", "%c3", "%ff%zz"])
def test_a_request_id_header_whose_escapes_are_not_utf8_is_served_and_comes_back_as_sent(
    router: ServiceProcess, header: str
) -> None:
    """Decoding such a header raised UnicodeDecodeError and the call was answered INTERNAL with a traceback
    in the log (found by the fuzz test). No id encoded by header_value contains one, so it is taken as sent."""
    client = InferClient(router.address)
    try:
        x = np.ones((1, 4), dtype=np.float32)
        response, trailers = client.infer(make_request(MODEL, x), metadata=[(REQUEST_ID_HEADER, header)], timeout_s=5)
    finally:
        client.close()
    np.testing.assert_array_equal(np.frombuffer(response.raw_output_contents[0], dtype=np.float32), 2.0 * x.ravel())
    assert trailers[VERSION_HEADER] == "v1"
    assert from_header_value(trailers[REQUEST_ID_HEADER]) == header
    assert "Traceback" not in router.log()
