"""The served model version: the worker's transport-neutral core.

It owns the backend, the resolved metadata and the scheduler, and answers the
questions the servicer asks (is this the model? is it ready? is this request
valid? what are the outputs?) with domain types and errors only. Life cycle::

    load() → warm_up() → ready → start_draining() → stop()

Only a successful warm-up makes the model ready; a failed one leaves it
loaded but never ready, so health stays NOT_SERVING and the log says why.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import structlog

from splitstream.common.errors import ModelNotFound, ModelNotReady
from splitstream.common.tensors import NUMPY_DTYPES
from splitstream.worker.backends import create_backend
from splitstream.worker.backends.base import Backend
from splitstream.worker.batching import DirectScheduler, DynamicBatcher, Scheduler
from splitstream.worker.config import ModelConfig
from splitstream.worker.generation import (
    METADATA,
    GenerationRequest,
    GenerationScheduler,
    Token,
    check_headers,
    read_request,
    step_interface,
)
from splitstream.worker.metadata import DYNAMIC, ModelMetadata, resolve
from splitstream.worker.metrics import WorkerMetrics
from splitstream.worker.validation import InputHeader, RequestPlan, validate_request


class ServedModel:
    """One model version from ``<repository>/<name>/<version>/``."""

    def __init__(
        self,
        *,
        name: str,
        version: str,
        directory: Path,
        config: ModelConfig,
        metrics: WorkerMetrics,
        logger: structlog.stdlib.BoundLogger,
    ) -> None:
        self.name = name
        self.version = version
        self.config = config
        self._directory = directory
        self._metrics = metrics
        self._logger = logger
        self._backend: Backend = create_backend(config, directory, logger=logger)
        self._metadata: ModelMetadata | None = None
        self._scheduler: Scheduler | None = None
        self._generator: GenerationScheduler | None = None
        #: A generative model's next-token graph: input name, output name, context length.
        self._step: tuple[str, str, int] | None = None
        self._warm = False
        self._draining = False

    @property
    def platform(self) -> str:
        return self._backend.platform

    @property
    def engine_tag(self) -> str:
        """A human tag of what serves this version, for registries and dashboards.

        The TensorRT backend's engine tag once loaded (``<model>-<version>-<precision>-<dyn|static>``,
        e.g. ``resnet-v2-fp16-dyn``); otherwise ``<model>-<version>-<backend>``.
        """
        return self._backend.engine_tag or f"{self.name}-{self.version}-{self.config.backend}"

    @property
    def metadata(self) -> ModelMetadata:
        if self._metadata is None:
            raise ModelNotReady(f"model '{self.name}' version '{self.version}' is still loading")
        return self._metadata

    @property
    def generative(self) -> bool:
        """A ``generation:`` model: answers ModelStreamInfer with one response per token."""
        return self.config.generation is not None

    @property
    def ready(self) -> bool:
        """Warmed up and not draining: new work is welcome."""
        return self._warm and not self._draining

    def serves(self, name: str, version: str) -> bool:
        """True when ``name``/``version`` address this model (an empty version means "the served one")."""
        return name == self.name and version in ("", self.version)

    def check(self, name: str, version: str) -> None:
        """Raise ModelNotFound unless ``name``/``version`` address this model."""
        if name != self.name:
            raise ModelNotFound(f"model '{name}' is not served here (this worker serves '{self.name}')")
        if version not in ("", self.version):
            raise ModelNotFound(
                f"model '{name}' version '{version}' is not served here (this worker serves version '{self.version}')"
            )

    async def load(self) -> None:
        """Build the engine off the event loop and resolve metadata; raises ConfigError."""
        await asyncio.to_thread(self._backend.load)
        if self.config.generation is not None:
            self._load_generation()
            return
        self._metadata = resolve(
            self._backend.metadata(),
            inputs=self.config.inputs,
            outputs=self.config.outputs,
            max_batch_size=self.config.max_batch_size,
            source=str(self._directory / "config.yaml"),
        )
        self._metrics.engine_loaded(
            backend=self.config.backend,
            engine_tag=self.engine_tag,
            context_device_memory_bytes=self._backend.context_device_memory_bytes,
        )
        config = self.config
        scheduler: Scheduler
        if config.batching:
            scheduler = DynamicBatcher(
                self._backend.run,
                max_batch_size=config.max_batch_size,
                max_queue_delay_us=config.dynamic_batching.max_queue_delay_us,
                instance_count=config.instance_count,
                metrics=self._metrics,
                logger=self._logger,
            )
        else:
            scheduler = DirectScheduler(
                self._backend.run, instance_count=config.instance_count, metrics=self._metrics, logger=self._logger
            )
        scheduler.start()
        self._metrics.watch_queue_depth(scheduler.depth)
        self._scheduler = scheduler

    def _load_generation(self) -> None:
        """Clients see the request interface (text_input, max_tokens, ...) as metadata; the graph's own
        tensors are the step interface only the scheduler uses."""
        source = str(self._directory / "config.yaml")
        engine = resolve(
            self._backend.metadata(),
            inputs=self.config.inputs,
            outputs=self.config.outputs,
            max_batch_size=self.config.max_batch_size,
            source=source,
        )
        self._step = step_interface(engine, source)
        self._metadata = METADATA
        self._metrics.engine_loaded(
            backend=self.config.backend,
            engine_tag=self.engine_tag,
            context_device_memory_bytes=self._backend.context_device_memory_bytes,
        )
        assert self.config.generation is not None
        input_name, output_name, context = self._step
        generator = GenerationScheduler(
            self._backend.run,
            input_name=input_name,
            output_name=output_name,
            context=context,
            max_sequences=self.config.max_batch_size,
            pad_id=self.config.generation.pad_id,
            metrics=self._metrics,
            logger=self._logger,
        )
        generator.start()
        self._metrics.watch_queue_depth(generator.depth)
        self._metrics.watch_active_sequences(generator.active)
        self._metrics.watch_paused_sequences(generator.paused)
        self._generator = generator

    async def warm_up(self) -> None:
        """Run zeros of the input shapes (dynamic dims = 1) once; the model is ready only if this succeeds.

        The first run is where engines allocate and compile, so it happens
        before any client waits on it. With a batch dimension it also checks
        that every output keeps it, which batching relies on. A backend whose
        engine takes only some shapes (TensorRT's profiles) names the shapes
        to use in ``warm_up_shapes``.
        """
        if self._step is not None:
            input_name, output_name, context = self._step
            tokens = np.zeros((1, context), dtype=np.int64)
            outputs = await asyncio.to_thread(self._backend.run, {input_name: tokens}, [output_name])
            if outputs[output_name].shape != (1, 256):
                raise ValueError(f"output '{output_name}' has shape {list(outputs[output_name].shape)} for one row")
            self._warm = True
            return
        metadata = self.metadata
        shapes = self._backend.warm_up_shapes
        inputs = {spec.name: _zeros(shapes.get(spec.name, spec.shape), spec.datatype) for spec in metadata.inputs}
        outputs = await asyncio.to_thread(self._backend.run, inputs, metadata.output_names)
        if self.config.max_batch_size > 0:
            for name, array in outputs.items():
                if array.ndim == 0 or array.shape[0] != 1:
                    raise ValueError(
                        f"output '{name}' has shape {list(array.shape)} for a batch of 1; with max_batch_size > 0 "
                        "every output must keep the batch dimension first"
                    )
        self._warm = True

    def start_draining(self) -> None:
        """Stop reporting ready; requests are still answered until the server stops taking them."""
        self._draining = True

    def plan(self, inputs: Sequence[InputHeader], requested_outputs: Sequence[str]) -> RequestPlan:
        """Validate a request's headers (InvalidInput) once the model is ready (else ModelNotReady)."""
        if not self._warm or self._metadata is None:
            raise ModelNotReady(f"model '{self.name}' version '{self.version}' is not ready")
        plan = validate_request(inputs, requested_outputs, self._metadata, max_batch_size=self.config.max_batch_size)
        self._backend.check_request({header.name: tuple(header.shape) for header in inputs})
        return plan

    async def infer(self, inputs: Mapping[str, np.ndarray], plan: RequestPlan) -> dict[str, np.ndarray]:
        """The planned outputs for decoded, validated ``inputs``."""
        if self._scheduler is None:
            raise ModelNotReady(f"model '{self.name}' version '{self.version}' is not ready")
        return await self._scheduler.submit(inputs, plan.output_names, plan.rows)

    def check_generation(self, inputs: Sequence[InputHeader], requested_outputs: Sequence[str]) -> None:
        """A generation request's headers (InvalidInput) once the model is ready (else ModelNotReady)."""
        if not self._warm or self._generator is None:
            raise ModelNotReady(f"model '{self.name}' version '{self.version}' is not ready")
        check_headers(inputs, requested_outputs)

    def generation_request(
        self, arrays: Mapping[str, np.ndarray], requested_outputs: Sequence[str] = ()
    ) -> GenerationRequest:
        """Decoded inputs whose headers passed :meth:`check_generation` → a request (InvalidInput naming a value)."""
        assert self.config.generation is not None
        return read_request(
            arrays, max_tokens_limit=self.config.generation.max_tokens_limit, requested_outputs=requested_outputs
        )

    def generate(self, request: GenerationRequest) -> AsyncIterator[Token]:
        """The request's tokens as the scheduler steps them; the last one is ``final``."""
        if self._generator is None:
            raise ModelNotReady(f"model '{self.name}' version '{self.version}' is not ready")
        return self._generator.generate(request)

    async def stop(self) -> None:
        """Finish running batches, fail queued requests, release threads and the engine."""
        self._draining = True
        if self._scheduler is not None:
            await self._scheduler.stop()
        if self._generator is not None:
            await self._generator.stop()
        self._backend.close()


def _zeros(shape: Sequence[int], datatype: str) -> np.ndarray:
    concrete = tuple(1 if dim == DYNAMIC else dim for dim in shape)
    if datatype == "BYTES":
        return np.full(concrete, b"", dtype=np.object_)
    return np.zeros(concrete, dtype=NUMPY_DTYPES[datatype])
