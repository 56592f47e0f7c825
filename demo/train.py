"""Train the demo's digit classifier in two versions and export both to ONNX.

scikit-learn's bundled 8x8 digits data (no download): v1 is a logistic
regression that saw only 150 training images, v2 one that saw all of them, so
v2 is measurably better and the two disagree on a known share of inputs — what
the demo's split, recording and replay then show. Both take ``x`` (FP32
[batch, 64], pixel values 0..16) and return ``label`` (INT64 [batch]) and
``probabilities`` (FP32 [batch, 10]).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml
from skl2onnx import to_onnx
from sklearn.datasets import load_digits
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import train_test_split
from threadpoolctl import threadpool_limits

MODEL = "digits"
#: Training images each version sees: v2 is the better model.
TRAINING_IMAGES = {"v1": 150, "v2": None}


@dataclass(frozen=True)
class DemoData:
    """Held-out images (the demo's traffic) and their true labels."""

    images: np.ndarray  # float32 [n, 64]
    labels: np.ndarray  # int64 [n]


def train(repository: Path, *, seed: int = 0) -> tuple[DemoData, dict[str, float]]:
    """Write ``<repository>/digits/{v1,v2}/{model.onnx,config.yaml}``; return the test data and accuracies."""
    digits = load_digits()
    x = digits.data.astype(np.float32)
    y = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.4, random_state=seed, stratify=y)
    accuracies = {}
    for version, count in TRAINING_IMAGES.items():
        classifier = LogisticRegression(max_iter=2000)
        # One BLAS thread: the fit's products are small (64 features), and OpenBLAS's threads spin waiting
        # for each other on them. On 2 cores the fit of v2 took 4.2 s of CPU with them, 0.05 s without.
        with threadpool_limits(limits=1, user_api="blas"):
            classifier.fit(x_train[:count], y_train[:count])
        accuracies[version] = float(classifier.score(x_test, y_test))
        onnx_model = to_onnx(
            classifier,
            x_train[:1],
            options={id(classifier): {"zipmap": False}},
            target_opset={"": 17, "ai.onnx.ml": 3},
            final_types=None,
        )
        _rename_io(onnx_model)
        directory = repository / MODEL / version
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "model.onnx").write_bytes(onnx_model.SerializeToString())
        config = {"backend": "onnxruntime", "max_batch_size": 64, "dynamic_batching": {"max_queue_delay_us": 1000}}
        (directory / "config.yaml").write_text(yaml.safe_dump(config))
    return DemoData(images=x_test, labels=y_test), accuracies


def _rename_io(model: object) -> None:
    """skl2onnx names the input ``X`` and outputs ``label``/``probabilities``: serve the input as ``x``."""
    graph = model.graph  # type: ignore[attr-defined]
    old = graph.input[0].name
    graph.input[0].name = "x"
    for node in graph.node:
        node.input[:] = ["x" if name == old else name for name in node.input]


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Train the demo digit classifier (v1, v2) into a model repository.")
    parser.add_argument("--repository", type=Path, required=True, help="model repository to write into")
    args = parser.parse_args()
    _, accuracies = train(args.repository)
    for version, accuracy in accuracies.items():
        print(f"{MODEL} {version}: test accuracy {accuracy:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
