"""ParseRequests on a real grpc.aio server (in-process) with the library servicers every service registers,
and on real router, worker and recorder processes (the shared runtime installs it on every server).

grpc.health.v1 and server reflection come with their own deserializers, so bytes that do not parse
were answered UNKNOWN "Unexpected <class DecodeError>"; through the interceptor they are
INVALID_ARGUMENT naming the message, and well-formed calls are served as before.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from splitstream.common.handlers import ParseRequests
from splitstream.common.health import SERVING, HealthServicer
from splitstream.common.runtime import add_health_and_reflection
from tests.harness import ServiceProcess, free_port, health_status, running_stack, write_registry
from tests.models import add_version
from tests.redis_server import RedisServer

SERVICE = "test.Service"
CORRUPT_TAG = b"\xff\xff\xff"
#: Field 1 (a string in both requests) holding bytes that are not UTF-8.
BAD_UTF8 = b"\x0a\x02\xc3\x28"


@pytest.fixture
async def address() -> AsyncIterator[str]:
    server = aio.server(interceptors=[ParseRequests()])
    health = HealthServicer()
    await health.set(SERVICE, SERVING)
    add_health_and_reflection(server, health, [SERVICE])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    health.end_watches()
    await server.stop(None)


@pytest.mark.parametrize("garbage", [CORRUPT_TAG, BAD_UTF8], ids=["corrupt", "not-utf8"])
async def test_bytes_that_do_not_parse_sent_to_health_get_invalid_argument_naming_the_message(
    address: str, garbage: bytes
) -> None:
    async with aio.insecure_channel(address) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        with pytest.raises(aio.AioRpcError) as checked:
            await check(garbage, timeout=5)
        watch = channel.unary_stream("/grpc.health.v1.Health/Watch")
        with pytest.raises(aio.AioRpcError) as watched:
            async for _ in watch(garbage, timeout=5):
                pass

    for caught in (checked, watched):
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
        assert "not a valid grpc.health.v1.HealthCheckRequest" in (caught.value.details() or "")


async def test_bytes_that_do_not_parse_in_a_reflection_stream_get_invalid_argument_naming_the_message(
    address: str,
) -> None:
    async with aio.insecure_channel(address) as channel:
        info = channel.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
        with pytest.raises(aio.AioRpcError) as caught:
            async for _ in info(iter([BAD_UTF8]), timeout=5):
                pass

    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert "not a valid grpc.reflection.v1alpha.ServerReflectionRequest" in (caught.value.details() or "")


async def test_health_and_reflection_still_serve_well_formed_calls(address: str) -> None:
    async with aio.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        checked = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5)
        watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5)
        first = await watch.read()
        watch.cancel()
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = [
            answer
            async for answer in reflection.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
            )
        ]

    assert checked.status == SERVING
    assert first.status == SERVING
    assert SERVICE in {service.name for service in answers[0].list_services_response.service}


def health_check_of_bytes_that_do_not_parse(address: str) -> grpc.RpcError:
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as caught:
        channel.unary_unary("/grpc.health.v1.Health/Check")(BAD_UTF8, timeout=5)
    assert health_status(address) == SERVING  # a well-formed check still answers
    return caught.value


@pytest.mark.slow
def test_real_router_worker_and_recorder_answer_bytes_that_do_not_parse_sent_to_health_invalid_argument(
    tmp_path: Path,
) -> None:
    """Every service's server gets ParseRequests from the runtime; grpc answered UNKNOWN before."""
    add_version(tmp_path / "models", "affine", "v1", scale=2.0)
    errors: dict[str, grpc.RpcError] = {}
    with running_stack(tmp_path) as stack, RedisServer(tmp_path / "redis") as redis_server:
        worker = stack.worker(tmp_path / "models", "affine", "v1")
        experiment = {"salt": "parse", "control": "v1", "arms": [{"version": "v1", "weight": 100}]}
        write_registry(
            tmp_path / "registry.yaml", {"affine": {"endpoints": {"v1": [worker.address]}, "experiment": experiment}}
        )
        router = stack.router(tmp_path / "registry.yaml")
        port = free_port()
        recorder = ServiceProcess(
            "recorder",
            "splitstream.recorder",
            ["--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0", "--redis-url", redis_server.url],
            log_dir=tmp_path,
            port=port,
        ).start()
        try:
            for name, process in (("router", router), ("worker", worker), ("recorder", recorder)):
                errors[name] = health_check_of_bytes_that_do_not_parse(process.address)
        finally:
            recorder.stop()

    for name, error in errors.items():
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, error.details())
        assert "not a valid grpc.health.v1.HealthCheckRequest" in (error.details() or ""), name
