"""What a service imports at start: the libraries only some deployments use are imported on first use.

py-consul with requests, PyJWT, redis-py and aiohttp were a third of a router's start-up CPU (every test
that starts one, and every restart in production), for a Consul registry, JWT callers, a Redis or an
HTTP port that most routers do without."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import ROOT, clean_env
from tests.redis_server import RedisServer

#: Libraries a service imports only when its flags ask for them.
ON_FIRST_USE = ("consul", "requests", "jwt", "redis", "aiohttp")


def loaded(module: str, names: tuple[str, ...]) -> set[str]:
    """Which of ``names`` are in ``sys.modules`` once a fresh interpreter imported ``module``."""
    probe = f"import sys, {module}; print(' '.join(sorted(n for n in {names!r} if n in sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return set(result.stdout.split())


@pytest.mark.parametrize(
    ("module", "needed"),
    [
        ("splitstream.router.main", ()),
        ("splitstream.worker.main", ()),
        ("splitstream.recorder.main", ("redis",)),
        # aiohttp: an HTTP replay imports it when it makes its target; a gRPC replay does without.
        ("splitstream.replayer.main", ("redis",)),
    ],
)
def test_a_service_imports_what_its_flags_may_not_need_only_on_first_use(module: str, needed: tuple[str, ...]) -> None:
    assert loaded(module, ON_FIRST_USE) == set(needed)


@pytest.mark.parametrize("module", ["splitstream.router.main", "splitstream.shipper.main"])
def test_a_router_and_a_shipper_start_without_numpy(module: str) -> None:
    """They import the record layout for its names; NumPy (0.15 s of CPU a start) only decodes tensors of
    recorded answers, which the recorder does, and a router's HTTP port (imported with ``--http-port``)."""
    assert loaded(module, ("numpy",)) == set()


@pytest.mark.parametrize(
    "module",
    ["splitstream.router.main", "splitstream.worker.main", "splitstream.recorder.main", "splitstream.shipper.main"],
)
def test_a_service_loads_the_certificate_parser_only_with_an_allow_list(module: str) -> None:
    """cryptography's X.509 reads client certificates for ``--allowed-client-identities`` (a worker's, a
    recorder's), imported as the server with one starts; the others do without it."""
    assert loaded(module, ("cryptography.x509",)) == set()


def test_a_worker_starts_without_the_registrys_experiment_schemas() -> None:
    """A worker talks to Consul only to register itself (splitstream.common.consul_agent); the experiment
    schemas and the registry backends are the routers' (a twelfth of a worker's import CPU)."""
    assert loaded("splitstream.worker.main", ("splitstream.common.experiment", "splitstream.common.registry")) == set()


def test_a_router_without_auth_principals_does_not_load_the_authentication_stack() -> None:
    """Policies (pydantic models), credentials and limits are imported as a router with ``--auth-principals``
    starts (splitstream.router.main); every call reads only the principal's name (splitstream.router.auth.call)."""
    stack = ("splitstream.router.auth.policy", "splitstream.router.auth.credentials", "splitstream.router.auth.gate")
    assert loaded("splitstream.router.main", stack) == set()


#: What the ``splitstream`` admin CLI's registry commands (experiment, versions, rollout without outcome guards)
#: and its usage errors do without: the analysis's libraries, imported when a command reads the analysis.
ANALYSIS_LIBRARIES = ("scipy.stats", "scipy.optimize", "pyarrow", "duckdb", "sqlglot", "pandas", "aiohttp")


def test_the_admin_cli_runs_a_registry_command_without_the_analysis_libraries(tmp_path: Path) -> None:
    """Every ``splitstream`` start imported them (2.2 s of CPU on top of 0.7 s): a rollout script calling
    ``experiment get`` in a loop, and the suite's hundreds of calls, paid it each time."""
    registry = tmp_path / "registry.yaml"
    registry.write_text(
        "models:\n  m:\n    endpoints: {v1: ['127.0.0.1:1']}\n"
        "    experiment:\n      control: v1\n      arms: [{version: v1, weight: 100}]\n"
    )
    probe = (
        "import sys\nfrom splitstream.admin.main import main\ntry:\n"
        f"    code = main(['--registry', 'file:{registry}', 'experiment', 'get', 'm'])\nfinally:\n"
        f"    print('loaded:', ' '.join(sorted(n for n in {ANALYSIS_LIBRARIES!r} if n in sys.modules)))\n"
        "sys.exit(code)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert '"control": "v1"' in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "loaded:"


def test_an_analysis_of_redis_imports_the_analysis_but_not_the_sql_engine(redis_server: RedisServer) -> None:
    """The other side of the lazy imports: ``analyze`` finds the analysis (here Redis holds no call of the
    model: exit 2 with one line, once Redis was read), and reading Redis it does without DuckDB and sqlglot,
    which only an archive, ``--aggregates`` or ``--print-sql`` need."""
    probe = (
        "import sys\nfrom splitstream.admin.main import main\ntry:\n"
        f"    code = main(['analyze', 'm', '--redis-url', '{redis_server.url}', '--metric', 'click:rate',\n"
        "                 '--since', '-1h'])\n"
        "finally:\n    print('loaded:', 'splitstream.analysis.analyze' in sys.modules,\n"
        "          ' '.join(n for n in ('duckdb', 'sqlglot') if n in sys.modules))\n"
        "sys.exit(code)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "'m'" in result.stderr, result.stderr
    assert result.stdout.strip().splitlines()[-1].strip() == "loaded: True", result.stdout


#: What the ``splitstream`` admin CLI's parser, built at every start, does without: numpy and scipy (through the
#: analysis's models, the judge, the guards and the bandit's sampler), the rollout and its metrics' parser
#: (prometheus_client), the feedback import (its row model and stubs), and py-consul with requests, which only a
#: Consul registry needs.
COMPUTING_OR_CONSUL = (
    "numpy",
    "scipy",
    "splitstream.analysis.model",
    "splitstream.admin.rollout",
    "prometheus_client",
    "splitstream.admin.feedback_import",
    "consul",
    "requests",
    "redis",
)


@pytest.mark.parametrize("library", COMPUTING_OR_CONSUL)
def test_a_registry_command_on_a_file_registry_does_without(tmp_path: Path, library: str) -> None:
    """``experiment set`` (the suite's rollout tests call it dozens of times) on a file registry paid for these
    at every start: about a third of its CPU."""
    registry = tmp_path / "registry.yaml"
    registry.write_text(
        "models:\n  m:\n    endpoints: {v1: ['127.0.0.1:1'], v2: ['127.0.0.1:1']}\n"
        "    experiment:\n      control: v1\n      arms: [{version: v1, weight: 100}]\n"
    )
    probe = (
        "import sys\nfrom splitstream.admin.main import main\n"
        f"code = main(['--registry', 'file:{registry}', 'experiment', 'set', 'm', '--weights', 'v1=90,v2=10'])\n"
        f"print('loaded:', {library!r} in sys.modules)\nsys.exit(code)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "v1 90 %, v2 10 %" in result.stdout, result.stdout
    assert result.stdout.strip().splitlines()[-1] == "loaded: False"


def test_the_replayer_reads_redis_without_the_archive_libraries() -> None:
    """pyarrow, through the archive's module, was a quarter of every replay's start: only ``--archive`` and
    ``--source archive:URL`` read an archive, and the replay imports it when it opens one."""
    probe = "import sys, splitstream.replayer.main; print('pyarrow' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
