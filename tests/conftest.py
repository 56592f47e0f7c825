"""Fixtures shared by the test modules.

``s3``: one moto S3 server per test process (a session fixture: under pytest-xdist each worker has its own),
emptied between tests through moto's reset API and given its ``archive`` bucket again. Starting moto costs
seconds of CPU; emptying it, milliseconds. A test that stops, pauses or restarts its S3 server, or needs one
with other settings, starts its own :class:`~tests.s3_server.S3Server`.

``redis_server``: a redis-server of the test's own (it starts in milliseconds: sharing one would save nothing).

Modules run longest first (:func:`pytest_collection_modifyitems`, with ``--no-loadscope-reorder`` in the
Makefile): pytest-xdist's own order, most tests first, started the modules of one or two long tests (Spark,
the demos: 100 s each) last, and the run ended with one test process busy and the others idle.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.redis_server import RedisServer
from tests.s3_server import S3Server

#: Seconds each module took in a full run (``scripts/module_seconds.py`` writes it).
MODULE_SECONDS = Path(__file__).with_name("module_seconds.json")
#: A module not measured yet: its tests at the suite's mean.
MEAN_TEST_SECONDS = 1.4


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest modules first, each module's tests in their own order."""
    measured: dict[str, float] = json.loads(MODULE_SECONDS.read_text()) if MODULE_SECONDS.exists() else {}
    modules = [item.nodeid.split("::", 1)[0] for item in items]
    counts = Counter(modules)
    first_seen = {module: index for index, module in reversed(list(enumerate(modules)))}

    def weight(module: str) -> float:
        return measured.get(module, counts[module] * MEAN_TEST_SECONDS)

    order = {module: rank for rank, module in enumerate(sorted(counts, key=lambda m: (-weight(m), first_seen[m])))}
    items.sort(key=lambda item: order[item.nodeid.split("::", 1)[0]])  # stable: a module's order is kept


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def shared_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """The test process's moto server; tests take it through :func:`s3`, which empties it first."""
    server = S3Server(tmp_path_factory.mktemp("s3")).start()
    yield server
    server.stop()


@pytest.fixture
def s3(shared_s3: S3Server) -> S3Server:
    """An empty S3 server with an empty ``archive`` bucket (started again if an earlier test's left it dead)."""
    if not shared_s3.running:
        shared_s3.start()
    shared_s3.reset()
    shared_s3.create_bucket("archive")
    return shared_s3
