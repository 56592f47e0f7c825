"""A replay from the archive opens only the files its selection needs: the hour partitions its window
overlaps, and in them only the row groups whose statistics admit its version, status and principal.

Proved on a real archive (a real archiver over a real redis-server) whose other files are damaged: every file
of every other hour is garbage, and in the selected hour the files of the calls the selection leaves out
keep their footers (the statistics the reader decides by) but lose their data pages. A replay that read any
of them would exit 2 naming it; the real replay process must exit 0 having sent exactly the selected calls.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from splitstream.common.records import entry_fields, stream_key
from tests import launcher
from tests.harness import ROOT, Stack
from tests.harness import wait_for as wait_until
from tests.models import add_version
from tests.redis_server import RedisServer
from tests.test_archive import SYNTHETIC, archived_everything, running_archiver, synthetic_record

HOUR_NS = 3600 * 10**9
#: Hours of traffic around the selected one (a day and more: two date partitions).
HOURS = 30
SELECTED_HOUR = 20
#: The selected hour's calls, each group archived in files of its own: (version, status code, principal).
GROUPS = {
    "chosen-ok": ("v2", 0, "tenant-0"),
    "other-version": ("v1", 0, "tenant-0"),
    "other-principal": ("v2", 0, "tenant-1"),
    "failed": ("v2", 14, "tenant-0"),
}


def write_calls(
    client: Any, prefix: str, count: int, start_ns: int, version: str, code: int, principal: str
) -> list[str]:
    pipe = client.pipeline(transaction=False)
    ids = []
    for i in range(count):
        record = synthetic_record(i, start_ns + i * 10**9)
        record.request_id = f"{prefix}-{i}"
        record.version = record.arm = version
        record.status_code = code
        record.principal = principal
        pipe.xadd(stream_key(SYNTHETIC), entry_fields(record))
        ids.append(record.request_id)
    pipe.execute()
    return ids


def damage_data_pages(path: Path) -> None:
    """Overwrite everything between the leading magic and the footer: the footer (schema, row groups and their
    statistics) still reads, any page does not."""
    data = bytearray(path.read_bytes())
    footer = int.from_bytes(data[-8:-4], "little")
    data[4 : len(data) - 8 - footer] = b"\xff" * (len(data) - 12 - footer)
    path.write_bytes(bytes(data))
    assert pq.ParquetFile(path).metadata.num_rows > 0
    with pytest.raises((OSError, pa.ArrowException)):
        pq.read_table(path)


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, dict[str, list[str]]]:
    """An archive of :data:`HOURS` hours; the selected hour's :data:`GROUPS` each in files of their own (each
    archived before the next is written). Returns its directory, the selected hour's start and the ids by group.
    Tests copy it before damaging it."""
    tmp_path = tmp_path_factory.mktemp("archive-selection")
    base_ns = (time.time_ns() // HOUR_NS - HOURS - 2) * HOUR_NS
    hour_ns = base_ns + SELECTED_HOUR * HOUR_NS
    server = RedisServer(tmp_path / "redis").start()
    client = server.client()
    ids: dict[str, list[str]] = {}
    try:
        with running_archiver(tmp_path, server.url):
            for hour in range(HOURS):
                if hour != SELECTED_HOUR:
                    write_calls(client, f"h{hour}", 4, base_ns + hour * HOUR_NS, "v2", 0, "tenant-0")
            for group, (version, code, principal) in GROUPS.items():
                wait_until(lambda: archived_everything(client, stream_key(SYNTHETIC)), timeout_s=60, what="archived")
                ids[group] = write_calls(client, group, 6, hour_ns + 60 * 10**9, version, code, principal)
            wait_until(lambda: archived_everything(client, stream_key(SYNTHETIC)), timeout_s=60, what="archived")
    finally:
        client.close()
        server.stop()
    return tmp_path / "archive", hour_ns, ids


def selected_files(directory: Path, hour_ns: int) -> dict[str, Path]:
    """The selected hour's files, by the group their rows belong to (each holds one group)."""
    files = {}
    when = time.strftime("date=%Y-%m-%d/hour=%H", time.gmtime(hour_ns // 10**9))
    for path in sorted(directory.glob(f"calls/model={SYNTHETIC}/{when}/*.parquet")):
        groups = {
            rid.rsplit("-", 1)[0] for rid in pq.read_table(path, columns=["request_id"])["request_id"].to_pylist()
        }
        assert len(groups) == 1, (path, groups)
        files[groups.pop()] = path
    assert sorted(files) == sorted(GROUPS)
    return files


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "wanted"),
    [
        (["--version", "v2", "--principal", "tenant-0", "--status", "ok"], "chosen-ok"),
        (["--version", "v2", "--principal", "tenant-0", "--errors-only"], "failed"),
    ],
)
def test_one_hour_of_the_archive_is_replayed_from_its_files_and_the_row_groups_its_filters_admit(
    archive: tuple[Path, int, dict[str, list[str]]], tmp_path: Path, flags: list[str], wanted: str
) -> None:
    directory, hour_ns, ids = archive
    damaged = tmp_path / "damaged"
    shutil.copytree(directory, damaged)
    kept = selected_files(damaged, hour_ns)
    others = [path for path in damaged.rglob("*.parquet") if path not in kept.values()]
    assert len(others) >= HOURS - 1  # a file or more per other hour, over two dates
    assert len({path.parent.parent for path in others}) >= 2
    for path in others:
        path.write_bytes(b"not a parquet file")
    for group, path in kept.items():
        if group != wanted:
            damage_data_pages(path)
    add_version(tmp_path / "models", SYNTHETIC, "v1", scale=2.0)
    stack = Stack(tmp_path)
    try:
        worker = stack.worker(tmp_path / "models", SYNTHETIC, "v1")
        done = launcher.run(
            [sys.executable, "-m", "splitstream.replayer", "--model", SYNTHETIC, "--source", f"archive:{damaged}",
             "--target", worker.address, "--speed", "max", "--no-progress", "--output-dir", str(tmp_path / "out"),
             "--since", str(hour_ns // 10**9), "--until", str((hour_ns + HOUR_NS) // 10**9), *flags],
            capture_output=True, text=True, timeout=120, cwd=ROOT, check=False,
        )  # fmt: skip
    finally:
        stack.close()
    assert done.returncode == 0, done.stderr
    rows = (tmp_path / "out" / "results.jsonl").read_text().splitlines()
    assert sorted(json.loads(row)["request_id"] for row in rows) == sorted(ids[wanted])
