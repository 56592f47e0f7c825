"""Optimisation profiles: from ``config.yaml`` and the model's inputs to the shapes TensorRT builds for.

A TensorRT engine accepts, per optimisation profile, input shapes between a
profile's ``min`` and ``max`` and runs fastest at ``opt``. :func:`resolve_profiles`
turns the config's profiles (or, when there are none, one derived from
``max_batch_size``) into :class:`Profile` objects checked against the model's
inputs; :func:`plan_chunks` decides at run time which profile runs a batch and
whether a batch larger than every profile must be split.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from splitstream.common.errors import ConfigError, InvalidInput
from splitstream.worker.config import ProfileConfig
from splitstream.worker.metadata import DYNAMIC

Shape = tuple[int, ...]


@dataclass(frozen=True)
class InputShape:
    """An input as the model declares it: ``-1`` for a dynamic dimension."""

    name: str
    shape: Shape

    @property
    def dynamic(self) -> bool:
        return any(dim == DYNAMIC for dim in self.shape)


@dataclass(frozen=True)
class Profile:
    """One optimisation profile: ``(min, opt, max)`` for every input with a dynamic dimension, sorted by name."""

    shapes: tuple[tuple[str, tuple[Shape, Shape, Shape]], ...]

    def range_of(self, name: str) -> tuple[Shape, Shape, Shape] | None:
        return next((ranges for input_name, ranges in self.shapes if input_name == name), None)

    def contains(self, shapes: Mapping[str, Shape], *, ignore_batch: bool = False) -> bool:
        """True when every named shape lies within this profile (dimension 0 is skipped with ``ignore_batch``)."""
        for name, shape in shapes.items():
            ranges = self.range_of(name)
            if ranges is None:
                continue  # a static input: its shape was validated against the model already
            low, _, high = ranges
            if len(shape) != len(low):
                return False
            start = 1 if ignore_batch else 0
            if not all(low[i] <= shape[i] <= high[i] for i in range(start, len(shape))):
                return False
        return True

    @property
    def min_batch(self) -> int:
        return max((low[0] for _, (low, _, _) in self.shapes if low), default=1)

    @property
    def max_batch(self) -> int:
        return min((high[0] for _, (_, _, high) in self.shapes if high), default=1)

    @property
    def dynamic(self) -> bool:
        return any(low != high for _, (low, _, high) in self.shapes)

    def to_json(self) -> dict[str, list[list[int]]]:
        """``{input: [min, opt, max]}``: how the profile enters the engine cache key."""
        return {name: [list(low), list(opt), list(high)] for name, (low, opt, high) in self.shapes}

    def ort_options(self) -> dict[str, str]:
        """ONNX Runtime's TensorRT provider options for this profile (``"x:1x4,y:1x8"`` per bound)."""
        options = {}
        for key, index in (("trt_profile_min_shapes", 0), ("trt_profile_opt_shapes", 1), ("trt_profile_max_shapes", 2)):
            options[key] = ",".join(
                f"{name}:{'x'.join(str(dim) for dim in ranges[index])}" for name, ranges in self.shapes
            )
        return options


def resolve_profiles(
    configured: Sequence[ProfileConfig], inputs: Sequence[InputShape], *, max_batch_size: int, where: str = "tensorrt"
) -> tuple[Profile, ...]:
    """The profiles an engine is built with; raises ConfigError naming the profile, input and problem.

    Every configured profile must give shapes for every input that has a
    dynamic dimension, with the input's rank and its static dimensions, and
    may name no other tensor. Without configured profiles one is derived, which
    needs every dynamic dimension to be the batch dimension: batch
    ``1..max_batch_size``, tuned for ``max_batch_size`` (full batches are what
    dynamic batching forms under load). With a batch dimension, some profile
    must accept a batch of one row.
    """
    by_name = {spec.name: spec for spec in inputs}
    dynamic = [spec for spec in inputs if spec.dynamic]
    if not configured:
        return (_derived(dynamic, max_batch_size=max_batch_size, where=where),)
    profiles = []
    for index, profile in enumerate(configured):
        here = f"{where}.profiles[{index}]"
        unknown = sorted(set(profile.min) - set(by_name))
        if unknown:
            raise ConfigError(f"{here}: '{unknown[0]}' is not an input of the model (inputs: {sorted(by_name)})")
        missing = [spec.name for spec in dynamic if spec.name not in profile.min]
        if missing:
            raise ConfigError(f"{here}: lacks shapes for input '{missing[0]}', which has dynamic dimensions")
        shapes = []
        for name in sorted(profile.min):
            low, opt, high = profile.min[name], profile.opt[name], profile.max[name]
            declared = by_name[name].shape
            if len(low) != len(declared):
                raise ConfigError(
                    f"{here}: input '{name}' has rank {len(declared)} {list(declared)}, the profile gives {list(low)}"
                )
            for axis, dim in enumerate(declared):
                if dim != DYNAMIC and not low[axis] == opt[axis] == high[axis] == dim:
                    raise ConfigError(
                        f"{here}: input '{name}' dimension {axis} is fixed at {dim} by the model, the profile gives "
                        f"{low[axis]}..{high[axis]}"
                    )
            if max_batch_size > 0 and declared and declared[0] == DYNAMIC and low[0] < 1:
                raise ConfigError(f"{here}: input '{name}' batch dimension min must be >= 1, got {low[0]}")
            shapes.append((name, (low, opt, high)))
        profiles.append(Profile(tuple(shapes)))
    if max_batch_size > 0 and dynamic and not any(profile.min_batch <= 1 for profile in profiles):
        raise ConfigError(f"{where}.profiles: no profile accepts a batch of 1 row (every min batch is above 1)")
    return tuple(profiles)


def _derived(dynamic: Sequence[InputShape], *, max_batch_size: int, where: str) -> Profile:
    shapes = []
    for spec in dynamic:
        later = [axis for axis, dim in enumerate(spec.shape) if dim == DYNAMIC and axis > 0]
        if later or max_batch_size == 0:
            axis = later[0] if later else 0
            raise ConfigError(
                f"{where}.profiles: input '{spec.name}' has dynamic dimension {axis} (shape {list(spec.shape)}); "
                "list its min/opt/max shapes in tensorrt.profiles"
            )
        low = (1, *spec.shape[1:])
        high = (max_batch_size, *spec.shape[1:])
        shapes.append((spec.name, (low, high, high)))
    return Profile(tuple(sorted(shapes)))


def batch_split_warning(profiles: Sequence[Profile], *, max_batch_size: int) -> str | None:
    """A line to log when batches of ``max_batch_size`` rows will be split (every profile's max is smaller)."""
    if max_batch_size == 0 or not any(profile.shapes for profile in profiles):
        return None
    largest = max(profile.max_batch for profile in profiles)
    if largest >= max_batch_size:
        return None
    return (
        f"max_batch_size is {max_batch_size} but the largest profile takes {largest} rows: "
        "larger batches run in several engine calls"
    )


def check_shapes(profiles: Sequence[Profile], shapes: Mapping[str, Shape], *, batched: bool) -> None:
    """Raise InvalidInput unless some profile accepts ``shapes`` (the batch dimension is free when ``batched``).

    Called for each request before it is queued, so a shape the engine cannot
    run is refused naming the tensor, instead of failing a whole batch later.
    """
    if any(profile.contains(shapes, ignore_batch=batched) for profile in profiles):
        return
    for name, shape in shapes.items():
        ranges = [profile.range_of(name) for profile in profiles]
        bounds = [r for r in ranges if r is not None]
        if not bounds:
            continue
        first = 1 if batched else 0
        fits = [
            len(shape) == len(low) and all(low[i] <= shape[i] <= high[i] for i in range(first, len(shape)))
            for low, _, high in bounds
        ]
        if not any(fits):
            allowed = " or ".join(_describe(low, high, batched=batched) for low, _, high in bounds)
            raise InvalidInput(
                f"input '{name}': shape {list(shape)} is outside the engine's optimisation profiles "
                f"(allowed: {allowed})"
            )
    raise InvalidInput(
        f"inputs {sorted(shapes)}: shapes {[list(s) for s in shapes.values()]} do not fit one optimisation "
        "profile together"
    )


def _describe(low: Shape, high: Shape, *, batched: bool) -> str:
    dims = [
        "*" if batched and axis == 0 else f"{a}..{b}" if a != b else str(a)
        for axis, (a, b) in enumerate(zip(low, high, strict=True))
    ]
    return "[" + ", ".join(dims) + "]"


def plan_chunks(
    profiles: Sequence[Profile], shapes: Mapping[str, Shape], *, batched: bool
) -> list[tuple[int, int, int]]:
    """How to run one (possibly stacked) batch: ``[(profile index, first row, end row), ...]``.

    One chunk when a profile takes the whole batch. Otherwise, with a batch
    dimension, the rows are cut into chunks of the largest batch a profile
    that takes the other dimensions accepts, and the remainder goes to a
    profile that takes it. Raises InvalidInput when no profile fits.
    """
    for index, profile in enumerate(profiles):
        if profile.contains(shapes):
            rows = next(iter(shapes.values()))[0] if batched and shapes else 0
            return [(index, 0, rows)]
    if not batched:
        check_shapes(profiles, shapes, batched=False)
        raise InvalidInput(f"inputs {sorted(shapes)}: no optimisation profile accepts these shapes")
    rows = next(iter(shapes.values()))[0]
    candidates = [i for i, profile in enumerate(profiles) if profile.contains(shapes, ignore_batch=True)]
    if not candidates:
        check_shapes(profiles, shapes, batched=True)
        raise InvalidInput(f"inputs {sorted(shapes)}: no optimisation profile accepts these shapes")
    widest = max(candidates, key=lambda i: profiles[i].max_batch)
    step = profiles[widest].max_batch
    chunks = []
    start = 0
    while start < rows:
        size = min(step, rows - start)
        part = {name: (size, *shape[1:]) for name, shape in shapes.items()}
        chosen = widest if size == step else next((i for i in candidates if profiles[i].contains(part)), None)
        if chosen is None:
            raise InvalidInput(f"a batch of {size} rows fits no optimisation profile (after splitting {rows} rows)")
        chunks.append((chosen, start, start + size))
        start += size
    return chunks


def profile_from_json(data: Mapping[str, Any]) -> Profile:
    """The inverse of :meth:`Profile.to_json` (for records read back from the engine cache)."""
    return Profile(
        tuple(
            sorted((name, (tuple(r[0]), tuple(r[1]), tuple(r[2]))) for name, r in data.items())  # type: ignore[misc]
        )
    )
