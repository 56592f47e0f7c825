"""KServe v2 REST and Triton's generate extension on the router's HTTP port, end to end: a router with
--http-port in front of ONNX workers (``affine`` v1 and v2) and generating workers (``writer`` v1 and v2 of
demo/language.py), called with NVIDIA's ``tritonclient.http`` (in its own interpreter: it registers the same
protobuf symbols as our stubs) and with raw HTTP requests, as curl would send them."""

from __future__ import annotations

import gzip
import http.client
import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime
import pytest

from demo import language
from splitstream.common import tensors
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from tests import launcher
from tests.harness import (
    ServiceProcess,
    Stack,
    free_port,
    metric_samples,
    scrape_metrics,
    wait_for,
    write_registry,
)
from tests.models import add_version
from tests.recording_stack import MODEL, RecordingStack
from tests.replays import run_replay
from tests.test_router_http import accepts, cancelled_generations, events, start_router, worker_metric

AFFINE = "affine"
SCALES = {"v1": 2.0, "v2": 3.0}
WRITER = "writer"
LIMIT = 1_000_000
#: A model listed with an endpoint nobody serves: no healthy version.
GHOST = "ghost"


@dataclass
class Deployment:
    tmp: Path
    repository: Path
    router: ServiceProcess
    http_port: int
    writers: dict[str, ServiceProcess]

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.http_port}"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    tmp = tmp_path_factory.mktemp("kserve")
    repository = tmp / "models"
    for version, scale in SCALES.items():
        add_version(repository, AFFINE, version, scale=scale)
    language.write_versions(repository, WRITER, generation={"max_tokens_limit": LIMIT})
    stack = Stack(tmp)
    try:
        affine = {version: stack.worker(repository, AFFINE, version) for version in SCALES}
        writer = {version: stack.worker(repository, WRITER, version) for version in language.ORDERS}
        split = [{"version": "v1", "weight": 50}, {"version": "v2", "weight": 50}]
        registry = tmp / "registry.yaml"
        write_registry(
            registry,
            {
                AFFINE: {
                    "endpoints": {v: [w.address] for v, w in affine.items()},
                    "experiment": {"salt": "kserve", "control": "v1", "arms": split},
                },
                WRITER: {
                    "endpoints": {v: [w.address] for v, w in writer.items()},
                    "experiment": {"salt": "kserve", "control": "v1", "arms": split},
                },
                GHOST: {"endpoints": {"v1": [f"127.0.0.1:{free_port()}"]}},
            },
        )
        router, http_port = start_router(stack, registry)
        yield Deployment(tmp, repository, router, http_port, writer)
    finally:
        stack.close()


def run_tritonclient(script: str) -> None:
    triton_python = os.environ.get("SPLITSTREAM_TRITON_PYTHON")
    assert triton_python, "run through `make test`, which provides tritonclient in its own venv"
    launcher.run([triton_python, "-c", script], check=True, timeout=120)


def call(
    deployment: Deployment, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    """A raw HTTP request (POST with a body, else GET): (status, headers, body)."""
    request = urllib.request.Request(
        f"http://{deployment.url}{path}",
        data=body,
        method="POST" if body is not None else "GET",
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def post_json(deployment: Deployment, path: str, document: Any) -> tuple[int, dict[str, str], Any]:
    status, headers, body = call(deployment, path, json.dumps(document).encode())
    return status, headers, json.loads(body) if body else None


def onnx_outputs(deployment: Deployment, version: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    session = onnxruntime.InferenceSession(str(deployment.repository / AFFINE / version / "model.onnx"))
    y, label = session.run(["y", "label"], {"x": x})
    return y, label


# -- tritonclient.http ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_tritonclient_http_infers_with_json_and_binary_tensors_and_pins_a_version(
    deployment: Deployment, tmp_path: Path
) -> None:
    x = np.random.default_rng(5).standard_normal((3, 4)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    run_tritonclient(f"""
import numpy as np, tritonclient.http as th
client = th.InferenceServerClient("{deployment.url}")
x = np.load("{tmp_path / "x.npy"}")
for binary in (False, True):
    inp = th.InferInput("x", list(x.shape), "FP32"); inp.set_data_from_numpy(x, binary_data=binary)
    outputs = [th.InferRequestedOutput("y", binary_data=binary), th.InferRequestedOutput("label", binary_data=binary)]
    for version in ("v1", "v2"):
        result = client.infer("{AFFINE}", [inp], model_version=version, request_id=f"r-{{version}}", outputs=outputs)
        response = result.get_response()
        assert response["model_name"] == "{AFFINE}" and response["model_version"] == version, response
        assert response["id"] == f"r-{{version}}", response
        for output in response["outputs"]:
            assert ("data" in output) != binary, output  # JSON data, or binary data after the JSON
            assert ("binary_data_size" in output.get("parameters", {{}})) == binary, output
        np.save("{tmp_path}/y-" + version + "-" + str(binary) + ".npy", result.as_numpy("y"))
        np.save("{tmp_path}/label-" + version + "-" + str(binary) + ".npy", result.as_numpy("label"))
# No outputs named: tritonclient asks for every output as binary data (binary_data_output); compressed both ways.
inp = th.InferInput("x", list(x.shape), "FP32"); inp.set_data_from_numpy(x, binary_data=True)
result = client.infer("{AFFINE}", [inp], model_version="v2", request_compression_algorithm="gzip",
                      response_compression_algorithm="deflate")
np.save("{tmp_path}/y-all.npy", result.as_numpy("y"))
""")
    for version in SCALES:
        y, label = onnx_outputs(deployment, version, x)
        for binary in (False, True):
            np.testing.assert_array_equal(np.load(tmp_path / f"y-{version}-{binary}.npy"), y)
            np.testing.assert_array_equal(np.load(tmp_path / f"label-{version}-{binary}.npy"), label)
    np.testing.assert_array_equal(np.load(tmp_path / "y-all.npy"), onnx_outputs(deployment, "v2", x)[0])


def test_tritonclient_http_health_ready_and_metadata(deployment: Deployment) -> None:
    run_tritonclient(f"""
import tritonclient.http as th
from tritonclient.utils import InferenceServerException
client = th.InferenceServerClient("{deployment.url}")
assert client.is_server_live() and client.is_server_ready()
assert client.is_model_ready("{AFFINE}") and client.is_model_ready("{AFFINE}", "v2")
assert not client.is_model_ready("{GHOST}")  # listed, but no worker answers
server = client.get_server_metadata()
assert server["name"] == "splitstream-router" and "binary_tensor_data" in server["extensions"], server
meta = client.get_model_metadata("{AFFINE}", "v2")
assert meta["name"] == "{AFFINE}" and meta["versions"] == ["v1", "v2"], meta
assert [(i["name"], i["datatype"]) for i in meta["inputs"]] == [("x", "FP32")], meta
assert {{o["name"] for o in meta["outputs"]}} == {{"y", "label"}}, meta
for call in (lambda: client.get_model_metadata("nope"), lambda: client.get_model_metadata("{AFFINE}", "v9")):
    try:
        call()
    except InferenceServerException as error:
        assert error.status() == "404", error
    else:
        raise AssertionError("an unknown model or version must be refused")
""")


# -- raw requests: wire details and errors ---------------------------------------------------------


def test_a_json_infer_answers_flattened_row_major_outputs_and_the_served_version(deployment: Deployment) -> None:
    x = [[1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]]
    document = {"id": "j-1", "inputs": [{"name": "x", "shape": [2, 4], "datatype": "FP32", "data": x}]}
    status, headers, answer = post_json(deployment, f"/v2/models/{AFFINE}/versions/v2/infer", document)
    assert status == 200, answer
    assert headers["Content-Type"].startswith("application/json")
    assert headers["x-splitstream-version"] == "v2"
    assert (answer["model_name"], answer["model_version"], answer["id"]) == (AFFINE, "v2", "j-1")
    outputs = {output["name"]: output for output in answer["outputs"]}
    assert outputs["y"] == {
        "name": "y",
        "datatype": "FP32",
        "shape": [2, 4],
        "data": [3.0, 6.0, 9.0, 12.0, 12.0, 9.0, 6.0, 3.0],
    }
    assert outputs["label"] == {"name": "label", "datatype": "INT64", "shape": [2], "data": [3, 0]}


def test_a_binary_infer_answers_with_the_header_length_and_the_tensor_bytes(deployment: Deployment) -> None:
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    head = json.dumps(
        {
            "inputs": [{"name": "x", "shape": [2, 4], "datatype": "FP32", "parameters": {"binary_data_size": 32}}],
            "outputs": [{"name": "y", "parameters": {"binary_data": True}}, {"name": "label"}],
        }
    ).encode()
    status, headers, body = call(
        deployment,
        f"/v2/models/{AFFINE}/versions/v1/infer",
        head + x.tobytes(),
        {"Inference-Header-Content-Length": str(len(head)), "Content-Type": "application/octet-stream"},
    )
    assert status == 200, body
    length = int(headers["Inference-Header-Content-Length"])
    answer = json.loads(body[:length])
    outputs = {output["name"]: output for output in answer["outputs"]}
    assert outputs["y"]["parameters"] == {"binary_data_size": 32}
    assert "data" not in outputs["y"]
    np.testing.assert_array_equal(np.frombuffer(body[length:], dtype="<f4").reshape(2, 4), x * 2)
    assert outputs["label"]["data"] == [3, 3]  # not asked as binary: JSON


def error_of(status_body: tuple[int, dict[str, str], bytes]) -> tuple[int, str]:
    status, _, body = status_body
    document = json.loads(body)
    assert set(document) == {"error"}, document
    assert isinstance(document["error"], str), document
    return status, document["error"]


FP32_X = {"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "says"),
    [
        (f"/v2/models/{AFFINE}/infer", b"{not json", {}, 400, "not valid JSON"),
        (f"/v2/models/{AFFINE}/infer", b"[]", {}, 400, "JSON object"),
        (f"/v2/models/{AFFINE}/infer", json.dumps({"inputs": []}).encode(), {}, 400, "inputs"),
        (
            f"/v2/models/{AFFINE}/infer",
            json.dumps({"inputs": [{**FP32_X, "data": ["a", "b", "c", "d"]}]}).encode(),
            {},
            400,
            "not a FP32 value",
        ),
        (
            f"/v2/models/{AFFINE}/infer",
            json.dumps({"inputs": [{**FP32_X, "datatype": "FP33"}]}).encode(),
            {},
            400,
            "unknown datatype",
        ),
        (
            f"/v2/models/{AFFINE}/infer",
            json.dumps({"inputs": [{**FP32_X, "shape": [2, 4]}]}).encode(),
            {},
            400,
            "needs 8",
        ),
        (
            f"/v2/models/{AFFINE}/infer",
            json.dumps({"inputs": [{**FP32_X, "shape": [1, 3], "data": [1, 2, 3]}]}).encode(),
            {},
            400,
            "x",  # the worker refuses the shape: INVALID_ARGUMENT → 400, its message
        ),
        ("/v2/models/nope/infer", json.dumps({"inputs": [FP32_X]}).encode(), {}, 404, "nope"),
        (f"/v2/models/{AFFINE}/versions/v9/infer", json.dumps({"inputs": [FP32_X]}).encode(), {}, 404, "v9"),
        (f"/v2/models/{GHOST}/infer", json.dumps({"inputs": [FP32_X]}).encode(), {}, 503, "healthy"),
        (f"/v2/models/{AFFINE}/infer", b"{}", {"Inference-Header-Content-Length": "99"}, 400, "outside"),
        (f"/v2/models/{AFFINE}/stats", None, {}, 404, "/v2/models/{m}[/versions/{v}]/infer"),
    ],
)
def test_bad_requests_get_kserve_errors_with_tritons_statuses(
    deployment: Deployment, path: str, body: bytes | None, headers: dict[str, str], status: int, says: str
) -> None:
    got, message = error_of(call(deployment, path, body, headers))
    assert (got, says in message) == (status, True), message


@pytest.mark.parametrize(("size", "says"), [(28, "needs 32"), (32, "follow"), (40, "runs past")])
def test_binary_data_of_the_wrong_size_is_refused(deployment: Deployment, size: int, says: str) -> None:
    head = json.dumps(
        {"inputs": [{"name": "x", "shape": [2, 4], "datatype": "FP32", "parameters": {"binary_data_size": size}}]}
    ).encode()
    body = head + bytes(36)
    status, message = error_of(
        call(deployment, f"/v2/models/{AFFINE}/infer", body, {"Inference-Header-Content-Length": str(len(head))})
    )
    assert (status, says in message) == (400, True), message


def test_kserve_routes_are_counted_by_route_template(deployment: Deployment) -> None:
    status, _, _ = post_json(deployment, f"/v2/models/{AFFINE}/versions/v1/infer", {"inputs": [FP32_X]})
    assert status == 200
    samples = metric_samples(scrape_metrics(deployment.router.metrics_port), "splitstream_router_http_requests_total")
    routes = {(labels["route"], labels["model"], labels["status"]) for labels, _ in samples}
    assert ("/v2/models/{model}/versions/{version}/infer", AFFINE, "200") in routes


# -- generate --------------------------------------------------------------------------------------


def sse_events(body: bytes) -> list[Any]:
    events = []
    for block in body.decode().split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            events.append(json.loads(block[len("data: ") :]))
    return events


def test_generate_answers_one_object_and_generate_stream_the_same_text_token_by_token(deployment: Deployment) -> None:
    request = {"text_input": "The ", "max_tokens": 9}
    status, headers, whole = post_json(deployment, f"/v2/models/{WRITER}/versions/v2/generate", request)
    assert status == 200, whole
    assert (whole["model_name"], whole["model_version"]) == (WRITER, "v2")
    assert len(whole["text_output"]) == 9  # one ASCII byte a token
    assert whole["completion_tokens"] == 9
    status, headers, body = call(
        deployment, f"/v2/models/{WRITER}/versions/v2/generate_stream", json.dumps(request).encode()
    )
    assert status == 200
    assert headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(body)
    assert {(event["model_name"], event["model_version"]) for event in events} == {(WRITER, "v2")}
    texts = [event["text_output"] for event in events]
    assert len([text for text in texts if text]) == 9  # a response per token, relayed as it came
    assert "".join(texts) == whole["text_output"]  # greedy: the same text
    # Fields may also come under "parameters", as Triton's generate takes them.
    status, _, again = post_json(
        deployment, f"/v2/models/{WRITER}/versions/v2/generate", {"text_input": "The ", "parameters": {"max_tokens": 9}}
    )
    assert (status, again["text_output"]) == (200, whole["text_output"])


def test_generate_errors_are_kserve_errors(deployment: Deployment) -> None:
    status, _, answer = post_json(
        deployment, f"/v2/models/{WRITER}/generate", {"text_input": "The ", "max_tokens": LIMIT + 1}
    )
    assert (status, "max_tokens" in answer["error"]) == (400, True), answer
    status, _, answer = post_json(deployment, f"/v2/models/{WRITER}/generate_stream", {"max_tokens": 3})
    assert (status, "text_input" in answer["error"]) == (400, True), answer
    status, _, answer = post_json(deployment, "/v2/models/nope/generate", {"text_input": "a"})
    assert (status, "nope" in answer["error"]) == (404, True), answer


def test_a_client_that_leaves_generate_stream_cancels_the_worker_stream(deployment: Deployment) -> None:
    worker = deployment.writers["v1"]
    cancelled_before = cancelled_generations(worker)
    connection = http.client.HTTPConnection("127.0.0.1", deployment.http_port, timeout=30)
    body = {"text_input": "The ", "max_tokens": LIMIT}
    connection.request("POST", f"/v2/models/{WRITER}/versions/v1/generate_stream", json.dumps(body))
    response = connection.getresponse()
    assert response.status == 200
    stream = events(response)
    for _ in range(5):
        json.loads(next(stream))
    assert worker_metric(worker, "splitstream_worker_active_sequences") == 1
    response.close()
    connection.close()  # the socket goes: the router's handler is cancelled, and the worker's stream with it
    wait_for(
        lambda: worker_metric(worker, "splitstream_worker_active_sequences") == 0,
        timeout_s=10,
        what="the worker's generation to end",
    )
    assert cancelled_generations(worker) == cancelled_before + 1
    route = "/v2/models/{model}/versions/{version}/generate_stream"
    wait_for(
        lambda: (
            ({"route": route, "model": WRITER, "version": "v1", "status": "499"}, 1.0)
            in metric_samples(scrape_metrics(deployment.router.metrics_port), "splitstream_router_http_requests_total")
        ),
        timeout_s=10,
        what="the call to be counted as a client that went away (499), not a failure of ours",
    )


def test_health_routes_answer_200_and_model_ready_400_without_a_healthy_endpoint(deployment: Deployment) -> None:
    assert call(deployment, "/v2/health/live")[0] == 200
    assert call(deployment, "/v2/health/ready")[0] == 200
    assert call(deployment, f"/v2/models/{AFFINE}/versions/v1/ready")[0] == 200
    assert call(deployment, f"/v2/models/{GHOST}/ready")[0] == 400
    assert error_of(call(deployment, "/v2/models/nope/ready"))[0] == 404


# -- recording and replay ----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_kserve_infer_is_recorded_as_a_grpc_model_infer_and_replays(tmp_path: Path) -> None:
    """The record holds the translated ModelInferRequest and ModelInferResponse, the routing fields and the
    client's own headers (not HTTP's), so the replayer sends it over gRPC as any recorded ModelInfer."""
    stack = RecordingStack(
        tmp_path / "stack",
        versions={"v1": {"scale": 2.0}, "v2": {"scale": 3.0}},
        experiment={"salt": "kserve", "control": "v1", "arms": [{"version": "v1", "weight": 100}]},
        router_args=("--http-port", str(http_port := free_port())),
    )
    try:
        wait_for(lambda: accepts(http_port), timeout_s=10, what="the HTTP port to accept")
        deployment = Deployment(tmp_path, tmp_path, stack.router, http_port, {})
        x = np.arange(4, dtype=np.float32).reshape(1, 4)
        x_binary = {"name": "x", "shape": [1, 4], "datatype": "FP32", "parameters": {"binary_data_size": 16}}
        head = json.dumps({"id": "k-bin", "inputs": [x_binary]}).encode()
        status, _, _ = call(
            deployment,
            f"/v2/models/{MODEL}/versions/v2/infer",
            head + x.tobytes(),
            {"Inference-Header-Content-Length": str(len(head)), "x-tenant": "acme"},
        )
        assert status == 200
        document = {"id": "k-json", "inputs": [{**FP32_X, "data": x.reshape(-1).tolist()}]}
        assert post_json(deployment, f"/v2/models/{MODEL}/infer", document)[0] == 200
        records = {r.request_id: r for r in stack.wait_recorded({"k-bin", "k-json"})}
        pinned = records["k-bin"]
        assert (pinned.version, pinned.pinned, pinned.status_code) == ("v2", True, 0)
        request = oip.ModelInferRequest.FromString(pinned.request.inline)
        assert (request.model_name, request.model_version, request.id) == (MODEL, "v2", "k-bin")
        assert request.raw_input_contents == [x.tobytes()]
        response = oip.ModelInferResponse.FromString(pinned.response.inline)
        np.testing.assert_array_equal(tensors.output_arrays(response)["y"], x * 3)
        assert pinned.metadata["x-tenant"] == "acme"
        assert not {"content-type", "host", "inference-header-content-length"} & set(pinned.metadata)
        assert records["k-json"].version == "v1"
        received = [record.receive_unix_ns for record in records.values()]
        window = ["--since", f"{min(received) / 1e9 - 1:.9f}", "--until", f"{max(received) / 1e9 + 1:.9f}"]
        code, _, stderr = run_replay(
            stack.redis.url, tmp_path / "replay", "--target", stack.router.address, "--speed", "max", *window
        )
        assert code == 0, stderr
        summary = json.loads((tmp_path / "replay" / "summary.json").read_text())
        assert summary["outcomes"] == {"match": 2, "mismatch": 0, "status_change": 0}
    finally:
        stack.close()


def test_an_infer_body_may_be_compressed_both_ways_as_tritonclient_can_ask(deployment: Deployment) -> None:
    document = {"inputs": [FP32_X], "outputs": [{"name": "y", "parameters": {"binary_data": True}}]}
    status, headers, body = call(
        deployment,
        f"/v2/models/{AFFINE}/versions/v1/infer",
        gzip.compress(json.dumps(document).encode()),
        {"Content-Encoding": "gzip", "Accept-Encoding": "gzip"},
    )
    assert status == 200, body
    assert headers["Content-Encoding"] == "gzip"
    plain = gzip.decompress(body)
    length = int(headers["Inference-Header-Content-Length"])  # of the JSON before compression
    assert json.loads(plain[:length])["outputs"][0]["parameters"] == {"binary_data_size": 16}
    np.testing.assert_array_equal(np.frombuffer(plain[length:], dtype="<f4"), [2, 4, 6, 8])
