"""What the router hands the recorder: real router, worker, recorder and redis-server processes.

The routing key is never stored raw on any path (only its HMAC), credentials are not
recorded unless the deployment asks, and request ids are recorded as the client meant them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from splitstream.common.headers import header_value
from splitstream.common.records import routing_key_hmac
from tests.harness import InferClient, make_request
from tests.recording_stack import HMAC_KEY, MODEL, RecordingStack

#: The experiment's own routing-key header; clients may send the default ``x-routing-key`` too.
KEY_HEADER = "x-user-id"
CREDENTIALS = {
    "authorization": "Bearer tok-authz-51c3",
    "proxy-authorization": "Basic cHJveHktNTFjMw==",
    "cookie": "session=cookie-51c3",
    "set-cookie": "sid=setcookie-51c3",
    "x-api-key": "apikey-51c3",
    "x-auth-token": "authtoken-51c3",
}


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RecordingStack]:
    experiment = {
        "salt": "router-recording",
        "control": "v1",
        "arms": [{"version": "v1", "weight": 100}],
        "routing_key_header": KEY_HEADER,
    }
    stack = RecordingStack(tmp_path_factory.mktemp("router-recording"), experiment=experiment)
    yield stack
    stack.close()


def refused(client: InferClient, request: Any, metadata: list[tuple[str, str]]) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as caught:
        client.infer(request, metadata=metadata, timeout_s=5)
    code: grpc.StatusCode = caught.value.code()
    return code


@pytest.mark.slow
def test_calls_refused_at_routing_are_recorded_with_the_routing_key_only_as_its_hmac(
    recording: RecordingStack,
) -> None:
    x = np.ones((1, 4), dtype=np.float32)
    client = InferClient(recording.router.address)
    try:
        unknown_pin = refused(
            client,
            make_request(MODEL, x, request_id="refused-pin"),
            [(KEY_HEADER, "key-pin-7d1e"), ("x-routing-key", "key-default-7d1e"), ("x-splitstream-version", "v9")],
        )
        conflict = refused(
            client,
            make_request(MODEL, x, request_id="refused-conflict", version="v2"),
            [(KEY_HEADER, "key-conflict-7d1e"), ("x-splitstream-version", "v1")],
        )
        client.infer(
            make_request(MODEL, x, request_id="served"),
            metadata=[(KEY_HEADER, "key-served-7d1e"), ("x-routing-key", "key-served-default-7d1e")],
        )
    finally:
        client.close()
    assert (unknown_pin, conflict) == (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT)
    records = {r.request_id: r for r in recording.wait_recorded({"refused-pin", "refused-conflict", "served"})}
    key = HMAC_KEY.encode()
    assert records["refused-pin"].routing_key_hmac == routing_key_hmac(key, "key-pin-7d1e")
    assert records["refused-conflict"].routing_key_hmac == routing_key_hmac(key, "key-conflict-7d1e")
    assert records["served"].routing_key_hmac == routing_key_hmac(key, "key-served-7d1e")
    for record in records.values():
        assert KEY_HEADER not in record.metadata
        assert "x-routing-key" not in record.metadata
    everything = recording.redis_bytes()
    for raw in ("key-pin-7d1e", "key-default-7d1e", "key-conflict-7d1e", "key-served-7d1e", "key-served-default-7d1e"):
        assert raw.encode() not in everything


def test_credential_headers_are_not_recorded_by_default_on_served_or_refused_calls(
    recording: RecordingStack,
) -> None:
    x = np.ones((1, 4), dtype=np.float32)
    metadata = [*CREDENTIALS.items(), ("x-tenant", "acme")]
    client = InferClient(recording.router.address)
    try:
        client.infer(make_request(MODEL, x, request_id="with-credentials"), metadata=metadata)
        refused(
            client,
            make_request(MODEL, x, request_id="refused-with-credentials"),
            [*metadata, ("x-splitstream-version", "v9")],
        )
    finally:
        client.close()
    records = recording.wait_recorded({"with-credentials", "refused-with-credentials"})
    for record in records:
        if record.request_id in {"with-credentials", "refused-with-credentials"}:
            assert dict(record.metadata).keys() & CREDENTIALS.keys() == set()
            assert record.metadata["x-tenant"] == "acme"
    everything = recording.redis_bytes()
    for value in CREDENTIALS.values():
        assert value.encode() not in everything


def test_credentials_are_left_out_after_clients_sent_more_header_names_than_the_router_keeps_decisions_for(
    recording: RecordingStack,
) -> None:
    """The router decides once per header name whether it is recorded, and keeps at most 1,024 decisions per
    routing-key header: names past that are decided afresh on every call, never waved through."""
    x = np.ones((1, 4), dtype=np.float32)
    client = InferClient(recording.router.address)
    try:
        for batch in range(22):  # 1,100 names nobody sends twice
            odd = [(f"x-odd-{batch}-{i}", "v") for i in range(50)]
            client.infer(make_request(MODEL, x, request_id=f"odd-names-{batch}"), metadata=odd)
        late = [*CREDENTIALS.items(), (KEY_HEADER, "user-late"), ("x-tenant", "late"), ("x-odd-0-0", "again")]
        client.infer(make_request(MODEL, x, request_id="credentials-after-odd-names"), metadata=late)
    finally:
        client.close()
    (record,) = [
        r
        for r in recording.wait_recorded({"credentials-after-odd-names"})
        if r.request_id == "credentials-after-odd-names"
    ]
    assert dict(record.metadata).keys() & {*CREDENTIALS, KEY_HEADER} == set()
    assert record.metadata["x-tenant"] == "late"
    assert record.metadata["x-odd-0-0"] == "again"
    everything = recording.redis_bytes()
    assert b"user-late" not in everything
    for value in CREDENTIALS.values():
        assert value.encode() not in everything


@pytest.mark.slow
def test_a_router_started_with_record_credential_headers_keeps_them_in_the_record(tmp_path: Path) -> None:
    """The opt-in, through the router's flag: the same headers the default drops reach Redis as sent."""
    stack = RecordingStack(tmp_path, router_args=("--record-credential-headers",))
    try:
        client = InferClient(stack.router.address)
        try:
            client.infer(
                make_request(MODEL, np.ones((1, 4), dtype=np.float32), request_id="kept-credentials"),
                metadata=[*CREDENTIALS.items(), ("x-tenant", "acme")],
            )
        finally:
            client.close()
        (record,) = [r for r in stack.wait_recorded({"kept-credentials"}) if r.request_id == "kept-credentials"]
    finally:
        stack.close()
    assert dict(record.metadata).items() >= {**CREDENTIALS, "x-tenant": "acme"}.items()


def test_a_request_id_that_is_not_printable_ascii_is_recorded_as_the_client_sent_it(
    recording: RecordingStack,
) -> None:
    x = np.ones((1, 4), dtype=np.float32)
    client = InferClient(recording.router.address)
    try:
        _, in_body = client.infer(make_request(MODEL, x, request_id="bödy\tid"), timeout_s=5)
        _, in_header = client.infer(
            make_request(MODEL, x), metadata=[("x-request-id", header_value("hëader id"))], timeout_s=5
        )
    finally:
        client.close()
    assert (in_body["x-request-id"], in_header["x-request-id"]) == (header_value("bödy\tid"), header_value("hëader id"))
    recording.wait_recorded({"bödy\tid", "hëader id"})


@pytest.mark.slow
def test_a_shadow_of_a_call_whose_id_is_not_printable_ascii_is_answered_and_recorded(tmp_path: Path) -> None:
    """The shadow copy carries the id in its metadata too: encoded, it is answered like the call."""
    stack = RecordingStack(
        tmp_path,
        versions={"v1": {"scale": 2.0}, "v3": {"scale": 5.0}},
        experiment={
            "control": "v1",
            "arms": [{"version": "v1", "weight": 100}],
            "shadows": [{"version": "v3", "sample_rate": 1.0}],
        },
        router_args=("--shadow-timeout-s", "2"),
    )
    try:
        client = InferClient(stack.router.address)
        try:
            client.infer(make_request(MODEL, np.ones((1, 4), dtype=np.float32), request_id="shädow"), timeout_s=5)
        finally:
            client.close()
        (record,) = stack.wait_recorded({"shädow"})
        (shadow,) = record.shadows
        assert (shadow.version, shadow.status_code) == ("v3", grpc.StatusCode.OK.value[0]), shadow.status_message
    finally:
        stack.close()
