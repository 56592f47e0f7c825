"""What TensorRT-LLM's own clients send, answered by real generating workers.

TensorRT-LLM's ``end_to_end_grpc_client.py`` (tensorrtllm_backend, ``inflight_batcher_llm/client``)
sends ``beam_width``, ``exclude_input_in_output``, ``stream``, ``temperature``, word lists and, when
asked, ``return_log_probs``, ``repetition_penalty``, ``top_p``, ``end_id`` and ``pad_id``. These tests
send each of them to a worker process and check the answer against the model's own logits computed
here in NumPy: a bigram (demo/language.py) whose greedy text from "The " is "the the the ...", and a
byte table whose greedy text is made of multi-byte UTF-8 characters, one byte a step.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from demo import language
from splitstream.common import tensors
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from tests import launcher
from tests.harness import InferClient, ServiceProcess, Stack
from tests.models import save_graph
from tests.streams import Answer, StreamClient, generation_request, is_final, token_text
from tests.tensors import add_raw_input

MODEL = "writer"
UTF8_MODEL = "unicode"
LIMIT = 4096
#: The byte table's greedy walk: each byte is followed by the next one here, the last by the first, so
#: from "x" it writes "é€a😀xé€a😀x...", a character of 2, 3, 1, 4 and 1 bytes.
CYCLE = "é€a😀x".encode()


@dataclass
class Workers:
    writer: ServiceProcess
    unicode: ServiceProcess


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    tmp = tmp_path_factory.mktemp("generation_inputs")
    language.write_version(tmp / "models", MODEL, "v1", order=2, generation={"max_tokens_limit": LIMIT})
    _write_byte_table(tmp / "models" / UTF8_MODEL / "v1")
    stack = Stack(tmp)
    try:
        yield Workers(
            writer=stack.worker(tmp / "models", MODEL, "v1"), unicode=stack.worker(tmp / "models", UTF8_MODEL, "v1")
        )
    finally:
        stack.close()


def _byte_table() -> np.ndarray:
    """Next-token logits by last byte: the byte after it in CYCLE gets 0, every other byte -10."""
    table = np.full((256, 256), -10.0, dtype=np.float32)
    for index, byte in enumerate(CYCLE):
        table[byte, CYCLE[(index + 1) % len(CYCLE)]] = 0.0
    return table


def _write_byte_table(directory: Path) -> None:
    graph = helper.make_graph(
        [
            helper.make_node("Squeeze", ["tokens", "axes"], ["last"]),
            helper.make_node("Gather", ["table", "last"], ["logits"], axis=0),
        ],
        "byte_table",
        [helper.make_tensor_value_info("tokens", TensorProto.INT64, ["batch", 1])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 256])],
        initializer=[
            numpy_helper.from_array(_byte_table(), "table"),
            numpy_helper.from_array(np.array([1], dtype=np.int64), "axes"),
        ],
    )
    save_graph(graph, directory / "model.onnx")
    (directory / "config.yaml").write_text(yaml.safe_dump(language.generation_config()))


@dataclass
class Reference:
    text: bytes
    log_probs: list[float]


def reference(
    prompt: bytes,
    tokens: int,
    *,
    bad_words: Sequence[bytes] = (),
    repetition_penalty: float = 1.0,
    pad: bytes = b"\n",
) -> Reference:
    """The bigram's greedy continuation and each token's log-probability, in NumPy: the repetition
    penalty on every byte of the prompt and text so far, bad words' last bytes banned after the rest."""
    model = language.count(language.corpus(), 2)
    text = pad * model.context + prompt
    seen = set(prompt)
    out = Reference(text=b"", log_probs=[])
    for _ in range(tokens):
        scores = model.next_logits(text).astype(np.float64)
        for byte in seen:
            scores[byte] = scores[byte] / repetition_penalty if scores[byte] > 0 else scores[byte] * repetition_penalty
        for word in bad_words:
            if (prompt + out.text).endswith(word[:-1]):
                scores[word[-1]] = -np.inf
        token = int(np.argmax(scores))
        top = scores.max()
        out.log_probs.append(float(scores[token] - top - np.log(np.exp(scores - top).sum())))
        out.text += bytes((token,))
        text += bytes((token,))
        seen.add(token)
    return out


def with_inputs(request: oip.ModelInferRequest, **inputs: np.ndarray) -> oip.ModelInferRequest:
    for name, array in inputs.items():
        add_raw_input(request, name, array)
    return request


def one(value: object, dtype: type) -> np.ndarray:
    """A [1, 1] tensor, as TensorRT-LLM's client shapes every scalar input."""
    return np.array([[value]], dtype=dtype)


def words(*items: str) -> np.ndarray:
    """A word list as TensorRT-LLM's client sends it: BYTES [1, n]."""
    return np.array([[item.encode() for item in items]], dtype=np.object_)


def outputs(response: oip.ModelStreamInferResponse) -> dict[str, np.ndarray]:
    return tensors.output_arrays(response.infer_response)


def generate(worker: ServiceProcess, request: oip.ModelInferRequest) -> Answer:
    client = StreamClient(worker.address)
    try:
        return client.generate(request)
    finally:
        client.close()


# -- TensorRT-LLM's client ----------------------------------------------------------------------


def test_the_requests_of_tensorrt_llms_end_to_end_client_are_answered_as_tensorrt_llm_answers_them(
    workers: Workers,
) -> None:
    """The tensors end_to_end_grpc_client.py builds (its prepare_inputs: [1, 1] each, beam_width INT32,
    stream and exclude_input_in_output BOOL, word lists BYTES [1, n]; ``--temperature 0``), sent with
    tritonclient's streaming API as it sends them (start_stream, async_stream_infer, stop_stream):
    not streaming, one response with the prompt and the text; streaming, the text a token at a time
    without the prompt; ``--return-log-probs``, the two log-prob outputs it asks for."""
    triton_python = os.environ.get("SPLITSTREAM_TRITON_PYTHON")
    assert triton_python, "run through `make test`, which provides tritonclient in its own venv"
    script = f"""
import json, queue, numpy as np, tritonclient.grpc as tc
from tritonclient.utils import np_to_triton_dtype

def tensor(name, array):
    t = tc.InferInput(name, array.shape, np_to_triton_dtype(array.dtype)); t.set_data_from_numpy(array); return t

def run(streaming, log_probs):
    inputs = {{
        "text_input": np.array([["The "]]).astype(object),
        "max_tokens": np.ones_like([["The "]]).astype(np.int32) * 24,
        "stream": np.array([[streaming]], dtype=bool),
        "beam_width": np.array([[1]], dtype=np.int32),
        "temperature": np.array([[0.0]], dtype=np.float32),
        "bad_words": np.array([["the"]], dtype=object),
        "stop_words": np.array([["zq", "e a"]], dtype=object),
        "exclude_input_in_output": np.array([[False]], dtype=bool),
    }}
    wanted = [tc.InferRequestedOutput("text_output")]
    if log_probs:
        inputs["return_log_probs"] = np.array([[True]], dtype=bool)
        wanted += [tc.InferRequestedOutput("cum_log_probs"), tc.InferRequestedOutput("output_log_probs")]
    results = queue.Queue()
    client = tc.InferenceServerClient("{workers.writer.address}")
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer("{MODEL}", [tensor(k, v) for k, v in inputs.items()], outputs=wanted, request_id="e2e")
    client.stop_stream()
    seen = []
    while not results.empty():
        result, error = results.get()
        assert error is None, str(error)
        row = {{"text": result.as_numpy("text_output")[0][0].decode("utf-8")}}
        for name in ("cum_log_probs", "output_log_probs", "prompt_tokens", "completion_tokens"):
            value = result.as_numpy(name)
            if value is not None:
                row[name] = value.tolist()
        seen.append(row)
    client.close()
    return seen

print(json.dumps({{"whole": run(False, False), "streamed": run(True, False), "log_probs": run(False, True)}}))
"""
    done = launcher.run([triton_python, "-c", script], check=True, timeout=180, capture_output=True, text=True)
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    expected = reference(b"The ", 24, bad_words=[b"the"])
    text = expected.text.decode()
    assert "the" not in text, "the bad word is never written"
    assert "e a" not in text, "no stop word comes"
    (whole,) = seen["whole"]
    assert whole["text"] == "The " + text
    assert whole["prompt_tokens"] == [[4]]
    assert whole["completion_tokens"] == [[24]]
    streamed = seen["streamed"]
    assert [row["text"] for row in streamed] == list(text)
    assert streamed[-1]["completion_tokens"] == [[24]]
    (scored,) = seen["log_probs"]
    assert scored["text"] == "The " + text
    np.testing.assert_allclose(scored["output_log_probs"], [[expected.log_probs]], rtol=1e-5)
    np.testing.assert_allclose(scored["cum_log_probs"], [[sum(expected.log_probs)]], rtol=1e-5)


# -- each input --------------------------------------------------------------------------------


def test_beam_width_1_is_served_and_any_other_width_is_refused_as_unsupported_beam_search(workers: Workers) -> None:
    served = generate(workers.writer, with_inputs(generation_request(MODEL, "The ", 8), beam_width=one(1, np.int32)))
    assert served.text == reference(b"The ", 8).text.decode()
    for width in (2, 4, 0):
        refused = generate(
            workers.writer, with_inputs(generation_request(MODEL, "The ", 8), beam_width=one(width, np.uint32))
        )
        assert len(refused.responses) == 1
        assert is_final(refused.responses[0])
        assert refused.errors == [
            f"input 'beam_width': beam search is not supported, beam_width must be 1, got {width}"
        ]


def test_stream_false_answers_once_with_the_whole_text_and_the_prompt_unless_excluded(workers: Workers) -> None:
    text = reference(b"The ", 30).text
    for name in ("stream", "streaming"):  # the ensemble's name, and its older one
        whole = generate(
            workers.writer, with_inputs(generation_request(MODEL, "The ", 30), **{name: one(False, np.bool_)})
        )
        assert len(whole.responses) == 1
        assert is_final(whole.responses[0])
        assert token_text(whole.responses[0]) == text
    echoed = generate(
        workers.writer,
        with_inputs(
            generation_request(MODEL, "The ", 30),
            stream=one(False, np.bool_),
            exclude_input_in_output=one(False, np.bool_),
        ),
    )
    assert [token_text(r) for r in echoed.responses] == [b"The " + text]
    excluded = generate(
        workers.writer,
        with_inputs(
            generation_request(MODEL, "The ", 30),
            stream=one(False, np.bool_),
            exclude_input_in_output=one(True, np.bool_),
        ),
    )
    assert [token_text(r) for r in excluded.responses] == [text]
    streamed = generate(
        workers.writer,
        with_inputs(
            generation_request(MODEL, "The ", 30),
            stream=one(True, np.bool_),
            exclude_input_in_output=one(False, np.bool_),
        ),
    )
    assert [token_text(r) for r in streamed.responses] == [bytes((b,)) for b in text], (
        "a stream never repeats the prompt"
    )
    client = InferClient(workers.writer.address)
    try:
        unary, _ = client.infer(
            with_inputs(generation_request(MODEL, "The ", 30), exclude_input_in_output=one(False, np.bool_))
        )
    finally:
        client.close()
    assert bytes(tensors.output_arrays(unary)["text_output"][0, 0]) == b"The " + text


def test_bad_words_are_never_written_and_word_lists_are_read_as_tensorrt_llm_reads_them(workers: Workers) -> None:
    plain = reference(b"The ", 40).text
    assert b"the" in plain
    banned = generate(workers.writer, with_inputs(generation_request(MODEL, "The ", 40), bad_words=words("the", "zz")))
    expected = reference(b"The ", 40, bad_words=[b"the", b"zz"]).text
    assert banned.text == expected.decode()
    assert "the" not in banned.text
    # TensorRT-LLM's preprocessing splits each element as CSV: "the,zz" is two words, a quoted one keeps its comma.
    split = generate(workers.writer, with_inputs(generation_request(MODEL, "The ", 40), bad_words=words("the,zz")))
    assert split.text == banned.text
    stop = generate(workers.writer, generation_request(MODEL, "The ", 40, stop_words=['"a,b",he t']))
    assert stop.text == plain[: plain.index(b"he t") + 4].decode()


def test_repetition_penalty_lowers_the_tokens_already_in_the_prompt_or_the_text(workers: Workers) -> None:
    plain = reference(b"The ", 40).text
    penalised = reference(b"The ", 40, repetition_penalty=1.6).text
    assert penalised != plain
    answer = generate(
        workers.writer, with_inputs(generation_request(MODEL, "The ", 40), repetition_penalty=one(1.6, np.float32))
    )
    assert answer.text == penalised.decode()
    neutral = generate(
        workers.writer, with_inputs(generation_request(MODEL, "The ", 40), repetition_penalty=one(1.0, np.float32))
    )
    assert neutral.text == plain.decode()


def test_top_p_samples_from_the_nucleus_only(workers: Workers) -> None:
    """At temperature 1 the bigram's most likely byte rarely has half the probability: a seed samples
    something other than the greedy text, and a tiny top_p leaves only the most likely byte to draw."""
    greedy = reference(b"The ", 48).text.decode()

    def sample(**inputs: np.ndarray) -> str:
        request = generation_request(MODEL, "The ", 48, temperature=1.0, seed=3)
        return generate(workers.writer, with_inputs(request, **inputs)).text

    assert sample() != greedy
    assert sample(top_p=one(1e-6, np.float32)) == greedy
    assert sample(top_p=one(0.9, np.float32)) == sample(top_p=one(0.9, np.float32)), "seeded"


def test_return_log_probs_answers_each_tokens_log_probability_and_their_sum(workers: Workers) -> None:
    expected = reference(b"The ", 12)
    answer = generate(
        workers.writer, with_inputs(generation_request(MODEL, "The ", 12), return_log_probs=one(True, np.bool_))
    )
    assert len(answer.responses) == 12
    cumulative = 0.0
    for response, log_prob in zip(answer.responses, expected.log_probs, strict=True):
        values = outputs(response)
        assert values["output_log_probs"].shape == (1, 1, 1)
        np.testing.assert_allclose(values["output_log_probs"][0, 0], [log_prob], rtol=1e-5)
        cumulative += log_prob
        np.testing.assert_allclose(values["cum_log_probs"], [[cumulative]], rtol=1e-5)
    plain = generate(workers.writer, generation_request(MODEL, "The ", 3))
    assert all("cum_log_probs" not in outputs(r) for r in plain.responses), "only when asked"


def test_the_final_response_carries_the_token_usage(workers: Workers) -> None:
    answer = generate(workers.writer, generation_request(MODEL, "The quick ", 9))
    *tokens, final = answer.responses
    assert all(set(outputs(r)) == {"text_output"} for r in tokens)
    usage = outputs(final)
    assert usage["prompt_tokens"].tolist() == [[10]]
    assert usage["prompt_tokens"].dtype == np.int32
    assert usage["completion_tokens"].tolist() == [[9]]
    # An end token ends it: the empty final response carries the usage, and the end token is not counted.
    ended = generate(workers.writer, generation_request(MODEL, "The ", 20, end_id=ord(" "), empty_final=True))
    assert ended.text == "the"
    assert token_text(ended.responses[-1]) is None
    assert outputs(ended.responses[-1])["completion_tokens"].tolist() == [[3]]


def test_a_request_pad_id_pads_a_short_prompt(workers: Workers) -> None:
    """The bigram reads one byte of context, so the empty prompt is all padding."""
    for pad in (b"\n", b"T", b"("):
        answer = generate(workers.writer, with_inputs(generation_request(MODEL, "", 16), pad_id=one(pad[0], np.int32)))
        assert answer.text == reference(b"", 16, pad=pad).text.decode()
    assert reference(b"", 16, pad=b"T").text != reference(b"", 16).text


def test_bad_values_are_refused_naming_the_input_and_what_was_wrong(workers: Workers) -> None:
    def request(request_id: str, **inputs: np.ndarray) -> oip.ModelInferRequest:
        return with_inputs(generation_request(MODEL, "x", 4, request_id=request_id), **inputs)

    asks_log_probs = request("log-probs-unasked")
    asks_log_probs.outputs.add(name="cum_log_probs")
    unknown_output = request("unknown-output")
    unknown_output.outputs.add(name="generation_logits")
    bad = [
        (request("beam", beam_width=one(2, np.int32)), "input 'beam_width': beam search is not supported"),
        (request("beam-type", beam_width=one(1.0, np.float32)), "input 'beam_width': wrong datatype, expected INT32"),
        (
            request("exclude-type", exclude_input_in_output=one(0, np.int32)),
            "input 'exclude_input_in_output': wrong datatype, expected BOOL",
        ),
        (request("stream-type", stream=one(1, np.int32)), "input 'stream': wrong datatype, expected BOOL"),
        (
            request("log-probs-type", return_log_probs=one(b"yes", np.object_)),
            "input 'return_log_probs': wrong datatype",
        ),
        (request("top-p", top_p=one(1.5, np.float32)), "input 'top_p': must be between 0 and 1"),
        (request("top-p-nan", top_p=one(np.nan, np.float32)), "input 'top_p': must be between 0 and 1"),
        (
            request("penalty", repetition_penalty=one(0.0, np.float32)),
            "input 'repetition_penalty': must be a finite number > 0",
        ),
        (request("pad", pad_id=one(300, np.int32)), "input 'pad_id': must be a token id between 0 and 255"),
        (
            request("two-names", stream=one(True, np.bool_), streaming=one(True, np.bool_)),
            "inputs 'streaming' and 'stream'",
        ),
        (
            request("two-seeds", random_seed=one(1, np.uint64), seed=one(1, np.uint64)),
            "inputs 'seed' and 'random_seed'",
        ),
        (request("empty-word", bad_words=words("the,")), "input 'bad_words': element 0 has an empty word"),
        (
            request("bytes-word", bad_words=np.array([[b"\xff"]], dtype=np.object_)),
            "input 'bad_words': element 0 is not UTF-8",
        ),
        (
            request("two-beams", beam_width=np.array([[1, 1]], dtype=np.int32)),
            "input 'beam_width': needs exactly one value",
        ),
        (asks_log_probs, "requested output 'cum_log_probs' needs the input 'return_log_probs' set to true"),
        (unknown_output, "unknown requested output 'generation_logits'"),
        (request("context-logits", return_context_logits=one(True, np.bool_)), "unknown input 'return_context_logits'"),
    ]
    good = generation_request(MODEL, "The ", 8, request_id="good")
    client = StreamClient(workers.writer.address)
    try:
        answers = client.answers([pair[0] for pair in bad] + [good])
    finally:
        client.close()
    for sent, expected in bad:
        answer = answers[sent.id]
        assert len(answer.responses) == 1, sent.id
        assert answer.errors, sent.id
        assert expected in answer.errors[0], (sent.id, answer.errors)
    assert answers["good"].text == reference(b"The ", 8).text.decode()


# -- UTF-8 ---------------------------------------------------------------------------------------


def test_a_byte_level_model_streams_whole_utf8_characters_and_flushes_an_unfinished_one_at_the_end(
    workers: Workers,
) -> None:
    """The table writes é (2 bytes), € (3), a, 😀 (4), x: one byte a step. Each response holds one whole
    character; a generation cut inside a character sends its bytes in the final response."""
    answer = generate(workers.unicode, generation_request(UTF8_MODEL, "x", 2 * len(CYCLE), request_id="u"))
    texts = [token_text(r) for r in answer.responses]
    assert [text.decode() for text in texts if text is not None] == list("é€a😀x" * 2)
    assert [is_final(r) for r in answer.responses] == [False] * 9 + [True]
    assert outputs(answer.responses[-1])["completion_tokens"].tolist() == [[2 * len(CYCLE)]]
    cut = generate(workers.unicode, generation_request(UTF8_MODEL, "x", 4, request_id="cut"))  # é and 2 bytes of €
    assert [token_text(r) for r in cut.responses] == ["é".encode(), "€".encode()[:2]]
    assert is_final(cut.responses[-1])
    scored = generate(
        workers.unicode,
        with_inputs(generation_request(UTF8_MODEL, "x", 5, request_id="lp"), return_log_probs=one(True, np.bool_)),
    )
    assert [outputs(r)["output_log_probs"].shape for r in scored.responses] == [(1, 1, 2), (1, 1, 3)]
    # Each picked byte has logit 0 against 255 at -10.
    np.testing.assert_allclose(
        outputs(scored.responses[-1])["cum_log_probs"], [[-5 * np.log1p(255 * np.exp(-10.0))]], rtol=1e-5
    )
