"""What a model name may be, checked alike where names enter (registry) and where they are stored (recorder).

A model name becomes part of Redis keys (``splitstream:calls:<model>``), metric
labels and log fields, so it is bounded and free of whitespace and control
characters. The registry refuses such a name up front, so a router never makes
a record that the recorder would have to reject.
"""

from __future__ import annotations

#: Longest model name accepted.
MAX_MODEL_CHARS = 200


def check_model_name(model: str) -> None:
    """Raise ValueError saying what is wrong with ``model``."""
    if not model:
        raise ValueError("model is empty")
    if len(model) > MAX_MODEL_CHARS:
        raise ValueError(f"model name is {len(model)} characters, at most {MAX_MODEL_CHARS} fit in a stream key")
    if "*" in model:
        # The wildcard of the router's grants (models: ["*"]) and of stream-key patterns
        # (splitstream:calls:*): a model of that name could be neither granted alone nor listed apart.
        raise ValueError(f"model {model!r} contains '*', which means 'every model' in grants and key patterns")
    if "{" in model or "}" in model:
        # Keys beside a model's streams carry the stream key as a Redis Cluster hash tag ({...}) to share its
        # slot; a brace in the name would end the tag early (or start one in the stream key itself).
        raise ValueError(f"model {model!r} contains a brace, which Redis Cluster reads as a hash tag in its keys")
    bad = next((ch for ch in model if ch.isspace() or not ch.isprintable()), None)
    if bad is not None:
        raise ValueError(f"model {model!r} contains {bad!r}; whitespace and control characters cannot be in a key")
