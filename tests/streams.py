"""Token-stream requests and a blocking ModelStreamInfer client, for tests and benchmarks.

Requests are shaped as clients of TensorRT-LLM's Triton ensemble send them: ``text_input`` BYTES
[1, 1], ``max_tokens`` INT32 [1, 1], optional sampling inputs of the same shape.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from splitstream.common import tensors
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.common.proto.inference import grpc_service_pb2_grpc
from tests.tensors import add_raw_input


def generation_request(
    model: str,
    prompt: str | bytes,
    max_tokens: int,
    *,
    request_id: str = "",
    version: str = "",
    temperature: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop_words: Sequence[str] = (),
    end_id: int | None = None,
    empty_final: bool = False,
) -> oip.ModelInferRequest:
    request = oip.ModelInferRequest(model_name=model, model_version=version, id=request_id)
    text = prompt.encode() if isinstance(prompt, str) else prompt
    add_raw_input(request, "text_input", np.array([[text]], dtype=np.object_))
    add_raw_input(request, "max_tokens", np.array([[max_tokens]], dtype=np.int32))
    if temperature is not None:
        add_raw_input(request, "temperature", np.array([[temperature]], dtype=np.float32))
    if top_k is not None:
        add_raw_input(request, "top_k", np.array([[top_k]], dtype=np.int32))
    if seed is not None:
        add_raw_input(request, "random_seed", np.array([[seed]], dtype=np.uint64))
    if stop_words:
        add_raw_input(request, "stop_words", np.array([[word.encode() for word in stop_words]], dtype=np.object_))
    if end_id is not None:
        add_raw_input(request, "end_id", np.array([[end_id]], dtype=np.int32))
    if empty_final:
        request.parameters["triton_enable_empty_final_response"].bool_param = True
    return request


def is_final(response: oip.ModelStreamInferResponse) -> bool:
    parameters = response.infer_response.parameters
    return "triton_final_response" in parameters and parameters["triton_final_response"].bool_param


def token_text(response: oip.ModelStreamInferResponse) -> bytes | None:
    """The response's ``text_output`` element; None when it has none (an empty final response)."""
    if not any(output.name == "text_output" for output in response.infer_response.outputs):
        return None
    return bytes(tensors.output_arrays(response.infer_response)["text_output"].reshape(-1)[0])


@dataclass
class Answer:
    """What one request of a stream received, in order."""

    responses: list[oip.ModelStreamInferResponse] = field(default_factory=list)

    @property
    def text(self) -> str:
        return b"".join(token_text(r) or b"" for r in self.responses).decode()

    @property
    def finals(self) -> int:
        return sum(is_final(r) for r in self.responses)

    @property
    def errors(self) -> list[str]:
        return [r.error_message for r in self.responses if r.error_message]


class StreamClient:
    """A blocking client of ``ModelStreamInfer`` on one channel."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(self.channel)

    def stream(
        self, requests: Iterable[oip.ModelInferRequest], *, timeout_s: float = 30.0, metadata: Any = ()
    ) -> Iterator[oip.ModelStreamInferResponse]:
        return self.stub.ModelStreamInfer(iter(list(requests)), timeout=timeout_s, metadata=list(metadata))  # type: ignore[no-any-return]

    def answers(self, requests: Sequence[oip.ModelInferRequest], *, timeout_s: float = 30.0) -> dict[str, Answer]:
        """Every response of one stream carrying ``requests``, grouped by request id (ids must differ)."""
        grouped: dict[str, Answer] = {request.id: Answer() for request in requests}
        for response in self.stream(requests, timeout_s=timeout_s):
            grouped[response.infer_response.id].responses.append(response)
        return grouped

    def generate(self, request: oip.ModelInferRequest, *, timeout_s: float = 30.0) -> Answer:
        return self.answers([request], timeout_s=timeout_s)[request.id]

    def close(self) -> None:
        self.channel.close()
