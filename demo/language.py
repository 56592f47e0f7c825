"""Real, tiny language models for token streams: byte-level n-grams counted from text shipped with Python.

The text is ``pydoc_data.topics`` (the language reference pages ``help()`` shows, about 460 kB of
English prose and code, in every CPython installation), so nothing is downloaded and a model is a
function of the Python version's text alone: counting it twice gives the same bytes.

A model predicts the next byte from the last ``order - 1`` bytes. Its vocabulary is the 256 byte
values (token id = byte value), so any UTF-8 prompt is a token sequence, but only printable ASCII
and newline (the 96 bytes it was counted over) ever get a usable probability: every other byte has
a logit of -1e9, so neither greedy decoding nor sampling at any temperature produces a byte that
would break UTF-8 text. Probabilities are add-k smoothed counts; a trigram context never seen in the
text takes the bigram row of its last byte (otherwise it would be uniform noise).

Exported with ``onnx.helper`` as a next-token graph, the interface the worker's generation backend
steps (``generation:`` in config.yaml): input ``tokens`` INT64 [batch, order - 1], output ``logits``
FP32 [batch, 256]. The graph is three Gathers over a table of [97^(order-1), 97] log probabilities
(0.04 MB for a bigram, 3.7 MB for a trigram)::

    classes = class_of[tokens]                       # byte → alphabet index, 96 = "other"
    row     = sum(classes * [97^(n-2), ..., 97, 1])  # the context's row
    logits  = table[row][:, class_of]                # back to 256 byte columns
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import yaml
from onnx import TensorProto, helper, numpy_helper

#: The bytes the models were counted over: printable ASCII and newline.
ALPHABET = bytes(range(32, 127)) + b"\n"
#: Alphabet classes plus one for every other byte.
CLASSES = len(ALPHABET) + 1
OTHER = len(ALPHABET)
VOCABULARY = 256
#: The logit of a byte outside the alphabet: never chosen, at any temperature a client may ask for.
NEVER = -1e9
#: Add-k smoothing constant: small, so the counted text dominates where it has evidence.
ADD_K = 0.1


def corpus() -> bytes:
    """The training text: every ``pydoc_data.topics`` page in key order, newline-separated (deterministic).

    Runs of spaces (the pages' indentation) become one space: counted as they are, a space is most
    often followed by another, and a greedy bigram writes nothing but spaces."""
    from pydoc_data.topics import topics

    text = "\n".join(topics[key] for key in sorted(topics)).encode("utf-8")
    return re.sub(rb" {2,}", b" ", text)


def _class_of() -> np.ndarray:
    classes = np.full(VOCABULARY, OTHER, dtype=np.int64)
    classes[np.frombuffer(ALPHABET, dtype=np.uint8)] = np.arange(len(ALPHABET))
    return classes


@dataclass(frozen=True)
class NgramModel:
    """Log probabilities of the next alphabet class for each context of ``order - 1`` classes."""

    order: int
    #: FP32 [CLASSES ** (order - 1), CLASSES]; the OTHER column is NEVER.
    table: np.ndarray

    @property
    def context(self) -> int:
        return self.order - 1

    def next_logits(self, context: bytes) -> np.ndarray:
        """The model's 256 logits after ``context`` (its last ``order - 1`` bytes), computed in NumPy:
        what the ONNX graph must return, for tests."""
        classes = _class_of()[np.frombuffer(context[-self.context :], dtype=np.uint8)]
        row = int(np.sum(classes * _powers(self.context)))
        return self.table[row][_class_of()]


def _powers(context: int) -> np.ndarray:
    return np.array([CLASSES ** (context - 1 - i) for i in range(context)], dtype=np.int64)


def count(text: bytes, order: int) -> NgramModel:
    """Count ``order``-grams of ``text``'s bytes into an add-k smoothed log probability table."""
    if order not in (2, 3):
        raise ValueError(f"order must be 2 (bigram) or 3 (trigram), got {order}")
    classes = _class_of()[np.frombuffer(text, dtype=np.uint8)]
    context = order - 1
    rows = CLASSES**context
    index = np.zeros(len(classes) - context, dtype=np.int64)
    for offset, power in enumerate(_powers(context)):
        index += classes[offset : len(classes) - context + offset] * power
    counts = np.bincount(index * CLASSES + classes[context:], minlength=rows * CLASSES).reshape(rows, CLASSES)
    counts = counts[:, :OTHER].astype(np.float64)  # "other" is never a prediction
    logp = np.log((counts + ADD_K) / (counts.sum(axis=1, keepdims=True) + ADD_K * OTHER))
    if order == 3:
        bigram = count(text, 2).table[:, :OTHER].astype(np.float64)
        unseen = counts.sum(axis=1) == 0
        logp[unseen] = bigram[np.arange(rows)[unseen] % CLASSES]
    table = np.full((rows, CLASSES), NEVER, dtype=np.float32)
    table[:, :OTHER] = logp
    return NgramModel(order=order, table=table)


def to_onnx(model: NgramModel) -> onnx.ModelProto:
    """The next-token graph described in the module docstring (opset 17, checked)."""
    tokens = helper.make_tensor_value_info("tokens", TensorProto.INT64, ["batch", model.context])
    logits = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", VOCABULARY])
    nodes = [
        helper.make_node("Gather", ["class_of", "tokens"], ["classes"], axis=0),
        helper.make_node("Mul", ["classes", "powers"], ["weighted"]),
        helper.make_node("ReduceSum", ["weighted", "sum_axes"], ["row"], keepdims=0),
        helper.make_node("Gather", ["table", "row"], ["class_logits"], axis=0),
        helper.make_node("Gather", ["class_logits", "class_of"], ["logits"], axis=1),
    ]
    initializers = [
        numpy_helper.from_array(_class_of(), "class_of"),
        numpy_helper.from_array(_powers(model.context), "powers"),
        numpy_helper.from_array(np.array([1], dtype=np.int64), "sum_axes"),
        numpy_helper.from_array(model.table, "table"),
    ]
    graph = helper.make_graph(nodes, f"byte_{model.order}gram", [tokens], [logits], initializer=initializers)
    onnx_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx_model.ir_version = 8
    onnx.checker.check_model(onnx_model)
    return onnx_model


#: What the demo and tests serve: v1 a bigram, v2 a trigram, so the two versions write visibly different text.
ORDERS = {"v1": 2, "v2": 3}


def generation_config(**overrides: Any) -> dict[str, Any]:
    """The config.yaml of a served n-gram version: up to 64 sequences stepped together."""
    config: dict[str, Any] = {"backend": "onnxruntime", "max_batch_size": 64, "generation": {}}
    config.update(overrides)
    return config


def write_version(
    repository: Path, model: str, version: str, *, order: int, text: bytes | None = None, **config: Any
) -> Path:
    """Lay out ``<repository>/<model>/<version>/{model.onnx,config.yaml}`` for an n-gram of ``order``
    counted from ``text`` (default :func:`corpus`); ``config`` overrides config.yaml's top-level keys."""
    directory = repository / model / version
    directory.mkdir(parents=True, exist_ok=True)
    onnx.save(to_onnx(count(corpus() if text is None else text, order)), directory / "model.onnx")
    (directory / "config.yaml").write_text(yaml.safe_dump(generation_config(**config), sort_keys=False))
    return directory


def write_versions(repository: Path, model: str, **config: Any) -> dict[str, Path]:
    """v1 (bigram) and v2 (trigram) of ``model``, counted from one read of the corpus."""
    text = corpus()
    return {
        version: write_version(repository, model, version, order=order, text=text, **config)
        for version, order in ORDERS.items()
    }
