"""``splitstream-build-engine``: build the TensorRT engines of a model repository for this machine's GPU.

Meant for CI on a runner with the target GPU (or for a worker host before
deployment): for each model version whose ``config.yaml`` says
``backend: tensorrt``, run the precision step, build the engine and store it
in ``<repo>/<model>/<version>/engines/`` under the key a worker on the same
GPU and TensorRT looks for. An engine already there is kept (``--force``
rebuilds). The builder's timing cache is reused and saved beside the engines.

``--prepare-only FILE`` runs only the precision step (it needs neither
TensorRT nor a GPU), to inspect or test the ONNX the builder would consume.

Exit codes: 0 all built or already there; 1 TensorRT failed to parse or build
(every parser error is printed); 2 bad flag or config, or TensorRT, cuda-python
or a GPU missing (one line on stderr).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from splitstream.common.cli import EnvArgumentParser
from splitstream.common.errors import ConfigError
from splitstream.common.logs import configure_logging
from splitstream.worker.config import ModelConfig, add_model_repository_argument

PROG = "splitstream-build-engine"
ENV_PREFIX = "SPLITSTREAM_BUILD_"


def build_parser() -> argparse.ArgumentParser:
    parser = EnvArgumentParser(
        prog=PROG,
        env_prefix=ENV_PREFIX,
        description=(
            "Build TensorRT engines for this machine's GPU into the model repository's engine cache "
            "(MODEL_REPOSITORY/MODEL/VERSION/engines/), for every version with backend: tensorrt, or for the one "
            "--model/--version names. Precision, profiles, workspace, compatibility and timing cache come from "
            "each version's config.yaml (section tensorrt)."
        ),
        epilog=(
            "Exit codes: 0 engines built or already cached, 1 TensorRT could not parse or build a model (its "
            "errors are printed in full), 2 bad flag or config, or TensorRT / cuda-python / a GPU missing."
        ),
    )
    add_model_repository_argument(parser)
    parser.add_argument("--model", default="", metavar="NAME", help="only this model (default: every model)")
    parser.add_argument("--version", default="", metavar="V", help="only this version (needs --model)")
    parser.add_argument("--force", action="store_true", help="rebuild even when the engine is already cached")
    parser.add_argument(
        "--prepare-only",
        type=Path,
        default=None,
        metavar="FILE",
        help="only run the precision step for --model/--version and write the ONNX the builder would consume",
    )
    parser.add_argument("--verbose", action="store_true", help="forward TensorRT's INFO messages to the log")
    parser.add_argument(
        "--log-level", type=str.upper, default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="log level"
    )
    return parser


def versions(repository: Path, model: str, version: str) -> list[tuple[str, str, Path, ModelConfig]]:
    """The selected versions with backend tensorrt; raises ConfigError when a named one is absent or not TensorRT."""
    if version and not model:
        raise ConfigError("--version: needs --model")
    if not repository.is_dir():
        raise ConfigError(f"--model-repository: no directory {repository}")
    if model and version:
        directories = [repository / model / version]
        if not directories[0].is_dir():
            raise ConfigError(f"--model/--version: no directory {directories[0]}")
    else:
        pattern = f"{model}/*" if model else "*/*"
        directories = sorted(path for path in repository.glob(pattern) if (path / "config.yaml").is_file())
    selected = []
    for directory in directories:
        config = ModelConfig.from_file(directory / "config.yaml")
        if config.backend == "tensorrt":
            selected.append((directory.parent.name, directory.name, directory, config))
        elif model and version:
            raise ConfigError(f"{directory / 'config.yaml'}: backend is {config.backend}, not tensorrt")
    if not selected:
        raise ConfigError(f"{repository}: no model version with backend: tensorrt" + (f" for {model}" if model else ""))
    return selected


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``splitstream-build-engine``."""
    args = build_parser().parse_args(argv)
    log = configure_logging(args.log_level, service="build-engine")
    try:
        selected = versions(args.model_repository, args.model, args.version)
        if args.prepare_only is not None:
            return _prepare_only(selected, args)
        from splitstream.worker.engines.builder import BuildError, build_and_store
        from splitstream.worker.engines.environment import load_environment

        env = load_environment(PROG)
        log.info("building for", gpu=env.device.gpu_name, sm=env.device.sm, tensorrt=env.device.tensorrt_version)
        failures = 0
        for model, version, directory, config in selected:
            try:
                outcome = build_and_store(
                    env,
                    directory,
                    config,
                    model=model,
                    version=version,
                    log=log.bind(model=model, version=version),
                    force=args.force,
                    verbose=args.verbose,
                )
            except BuildError as error:
                failures += 1
                print(f"{PROG}: {model}/{version}: {error}", file=sys.stderr)
                continue
            state = "built" if outcome.built else "cached"
            print(f"{state} {model}/{version} {outcome.record['tag']} {outcome.path}")
        return 1 if failures else 0
    except ConfigError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2


def _prepare_only(selected: list[tuple[str, str, Path, ModelConfig]], args: argparse.Namespace) -> int:
    from splitstream.worker.engines.precision import prepare_onnx
    from splitstream.worker.engines.spec import resolve_spec

    if len(selected) != 1 or not args.version:
        raise ConfigError("--prepare-only: needs --model and --version naming one version")
    model, version, directory, config = selected[0]
    resolved = resolve_spec(directory, config, model=model, version=version)
    spec = resolved.spec
    prepared = prepare_onnx(resolved.source, spec.precision, args.prepare_only, precision_mode=spec.precision_mode)
    if prepared != args.prepare_only:
        args.prepare_only.parent.mkdir(parents=True, exist_ok=True)
        args.prepare_only.write_bytes(prepared.read_bytes())
    print(f"prepared {model}/{version} {spec.tag} {args.prepare_only}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
