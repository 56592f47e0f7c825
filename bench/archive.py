"""How fast the archiver drains a stream, next to how fast the same entries can merely be read.

One run, one redis-server (own, on a free port) holding ``--records`` call records shaped like the
demo's traffic (an 8x8 digit as 64 float32 pixels in, 10 float32 class scores out, readable fields,
a routing-key HMAC, the experiment phase, request metadata). Measured side by side in one run:

- raw XRANGE: redis-py's asyncio client reads every entry in pages of 1000 (nothing decoded);
- XREADGROUP + XACK only: the same through a consumer group, acknowledged, nothing decoded (the floor
  of any reader that may not lose an entry);
- archive → directory: the archiver's own loop (consumer group, decode, Parquet zstd, XACK, mark)
  until the archive mark passes the last entry, writing to a temporary directory, its files built
  in the builder process (``--builder process``, what ``auto`` picks on two cores or more);
- the same with the files built in a thread of the archiver's process (``--builder thread``);
- archive → S3: the same into a real S3 API server (moto's server mode, a local process);
- ``splitstream-archive --processes N`` (``--processes 1,2``: N = 1 and 2), the command itself, each
  child its own consumer in the group, with its files built in a builder process per child and in a
  thread of each child: started and idle on a group created at the stream's end, then the clock starts
  and the group is moved to the stream's start (``XGROUP SETID``), so no start-up is timed; once every
  entry is delivered it is sent SIGTERM (its drain writes the children's last, partly filled files) and
  the clock stops when the archive mark passes the last entry.

Then bytes per record: the Parquet files' size against Redis's own ``MEMORY USAGE`` of the stream.
Targets: archiving at least half the raw read rate; Parquet at most half the bytes of the entries.

Last, reading back: the archive of ``--records`` and one of twice as many, each read whole in a fresh
process as a replay does (every record decoded), part by part (``iter_calls``) and all at once
(``read_calls``): the peak of Arrow's memory pool and of the process's resident memory.

    .venv/bin/python bench/archive.py [--records 50000] [--rounds 3] [--processes 1,2]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing
import os
import resource
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from redis.asyncio import Redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import contextlib
from concurrent.futures import ProcessPoolExecutor

from splitstream.archiver.config import ArchiverSettings
from splitstream.archiver.core import Archiver
from splitstream.archiver.metrics import ArchiverMetrics
from splitstream.common.archive import Archive, ArchiveQuery, iter_calls, open_archive, read_calls
from splitstream.common.logs import configure_logging
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.common.proto.splitstream.v1 import recorder_pb2
from splitstream.common.records import (
    ARCHIVE_GROUP,
    archive_mark_key,
    decode_record,
    entry_fields,
    read_entries,
    stream_key,
)
from tests.redis_server import RedisServer
from tests.s3_server import S3_ENV, S3Server

ROOT = Path(__file__).resolve().parent.parent
MODEL = "digits"
WAKE = "bench-wake"
ARCHIVE_PATHS = ("archive -> directory", "  the same, thread-built", "archive -> S3 (moto)")


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def demo_record(i: int, rng: np.random.Generator, now_ns: int) -> recorder_pb2.CallRecord:
    pixels = rng.integers(0, 17, 64).astype(np.float32)
    request = oip.ModelInferRequest(model_name=MODEL, id=f"req-{i:08d}")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[1, 64])
    del tensor  # raw contents carry the data
    request.raw_input_contents.append(pixels.tobytes())
    scores = rng.dirichlet(np.ones(10)).astype(np.float32)
    response = oip.ModelInferResponse(model_name=MODEL, model_version="v1", id=request.id)
    response.outputs.add(name="probabilities", datatype="FP32", shape=[1, 10])
    response.raw_output_contents.append(scores.tobytes())
    record = recorder_pb2.CallRecord(
        schema_version=1,
        request_id=request.id,
        receive_unix_ns=now_ns + i * 1000,
        model=MODEL,
        version="v1" if i % 2 else "v2",
        arm="v1" if i % 2 else "v2",
        routing_key_hmac=f"{rng.integers(0, 2**63):032x}{rng.integers(0, 2**63):032x}",
        status_code=0,
        latency_ns=int(rng.integers(500_000, 3_000_000)),
        endpoint="127.0.0.1:9001",
        router_id="router-a",
        assignment=recorder_pb2.ASSIGNMENT_HASH,
    )
    # As the router records a demo call: the experiment's phase, the request's metadata, no tags (the
    # recorder tags only records it redacted outputs from or the router cut payloads from).
    record.phase.id = "a1b2c3d4"
    record.phase.weights["v1"] = 50.0
    record.phase.weights["v2"] = 50.0
    record.phase.control = "v1"
    record.metadata["user-agent"] = "grpc-python/1.80.0 grpc-c/50.0.0 (linux; chttp2)"
    record.metadata["x-routing-key"] = "hmac:" + record.routing_key_hmac
    record.request.inline = request.SerializeToString()
    record.request.size_bytes = len(record.request.inline)
    record.response.inline = response.SerializeToString()
    record.response.size_bytes = len(record.response.inline)
    return record


async def fill(redis: Redis, count: int, first: int = 0) -> None:
    rng = np.random.default_rng(7 + first)
    now_ns = time.time_ns() - count * 1000
    for start in range(first, first + count, 1000):
        pipe = redis.pipeline(transaction=False)
        for i in range(start, min(start + 1000, first + count)):
            pipe.xadd(stream_key(MODEL), entry_fields(demo_record(i, rng, now_ns)))  # type: ignore[arg-type]
        await pipe.execute()


async def raw_read(redis: Redis) -> float:
    started = time.perf_counter()
    count = 0
    async for _ in read_entries(redis, MODEL, page_size=1000):
        count += 1
    return count / (time.perf_counter() - started)


async def group_read(redis: Redis, count: int) -> float:
    """XREADGROUP + XACK of every entry, nothing decoded or written: the floor of any consumer-group reader
    (Redis adds each entry to the group's pending list and removes it again)."""
    stream = stream_key(MODEL)
    with contextlib.suppress(Exception):
        await redis.xgroup_destroy(stream, "bench-floor")
    await redis.xgroup_create(stream, "bench-floor", id="0")
    started = time.perf_counter()
    done = 0
    while done < count:
        reply: Any = await redis.xreadgroup("bench-floor", "c", {stream: ">"}, count=1000)
        if not reply:
            break
        ids = [entry_id for entry_id, _ in reply[0][1]]
        await redis.xack(stream, "bench-floor", *ids)
        done += len(ids)
    return done / (time.perf_counter() - started)


def child_cpu_s(pid: int | None) -> float:
    """CPU seconds (user + system) a live child process has used so far; 0 for none."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def archive_all(
    redis: Redis, archive: Archive, count: int, *, process: bool = True, server_pid: int | None = None
) -> tuple[float, float, float, float]:
    """Records/s, and CPU µs a record of the archiver's own process (the loop, and a builder thread), of
    its builder process and of ``server_pid`` (the local S3 stand-in, which shares these cores where real
    object storage would not): CPU time does not depend on what else the machine runs, wall time does."""
    stream = stream_key(MODEL)
    await redis.delete(archive_mark_key(stream))
    with contextlib.suppress(Exception):
        await redis.xgroup_destroy(stream, ARCHIVE_GROUP)
    settings = ArchiverSettings(
        group=ARCHIVE_GROUP,
        consumer="bench",
        max_file_rows=10_000,
        flush_interval_s=30,
        claim_idle_s=600,
        builder_process=process,
    )
    archiver = Archiver(redis, archive, settings, ArchiverMetrics())
    await archiver.start()  # the builder process spawned before the clock starts, as a running archiver's is
    newest: Any = await redis.xrevrange(stream, count=1)
    last = newest[0][0].decode()
    last_key = tuple(int(p) for p in last.split("-"))
    try:
        child_cpu = child_cpu_s(archiver.builder.pid)
        server_cpu = child_cpu_s(server_pid)
        cpu = time.process_time()
        started = time.perf_counter()
        while True:
            await archiver.step()
            mark: Any = await redis.get(archive_mark_key(stream))
            if mark is not None and tuple(int(p) for p in mark.decode().split("-")) > last_key:
                break  # checked after every step: the step after the last file would wait for new entries
        rate = count / (time.perf_counter() - started)
        own_us = (time.process_time() - cpu) / count * 1e6
        server_us = (child_cpu_s(server_pid) - server_cpu) / count * 1e6 if server_pid else math.nan
        return rate, own_us, (child_cpu_s(archiver.builder.pid) - child_cpu) / count * 1e6, server_us
    finally:
        await archiver.close()


def process_label(processes: int, builder: str) -> str:
    return f"--processes {processes}, {builder} builder"


async def archive_command(
    redis: Redis, redis_url: str, directory: Path, count: int, *, processes: int, builder: str, group: str
) -> float:
    """Records/s of ``splitstream-archive --processes N`` into ``directory`` (see the module's docstring)."""
    stream = stream_key(MODEL)
    await redis.xgroup_create(stream, group, id="$")  # idle: nothing to deliver until SETID below
    # SETID does not wake an XREADGROUP blocked on the stream (only a new entry does): an entry added to a
    # second stream the archiver reads does, so neither the start nor the drain waits out a blocked read.
    wake = stream_key(WAKE)
    wake_fields: Any = entry_fields(demo_record(0, np.random.default_rng(0), time.time_ns()))
    await redis.xadd(wake, wake_fields)
    await redis.xgroup_create(wake, group, id="$")
    command = [
        sys.executable, "-m", "splitstream.archiver", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
        "--redis-url", redis_url, "--archive", str(directory), "--group", group, "--consumer", "bench",
        "--max-file-rows", "10000", "--flush-interval-s", "30", "--claim-idle-s", "600", "--scan-interval-s", "0.2",
        "--processes", str(processes), "--builder", builder, "--log-level", "WARNING",
    ]  # fmt: skip
    process = await asyncio.create_subprocess_exec(*command, cwd=ROOT, env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    try:
        names = {f"bench-{i}" for i in range(processes)} if processes > 1 else {"bench"}
        deadline = time.monotonic() + 120
        while True:  # every child has read (found the stream, joined the group) and its builder is up
            rows: Any = await redis.xinfo_consumers(stream, group)
            if {row["name"].decode() for row in rows} >= names:
                break
            if process.returncode is not None or time.monotonic() > deadline:
                raise RuntimeError(f"splitstream-archive did not start: {process.returncode}")
            await asyncio.sleep(0.05)
        newest: Any = await redis.xrevrange(stream, count=1)
        last = newest[0][0]
        last_key = tuple(int(p) for p in last.decode().split("-"))
        await redis.delete(archive_mark_key(stream))
        started = time.perf_counter()
        deadline = time.monotonic() + 600
        await redis.execute_command("XGROUP", "SETID", stream, group, "0")
        await redis.xadd(wake, wake_fields)
        signalled = False
        while True:
            await asyncio.sleep(0.01)
            if not signalled:
                groups: Any = await redis.xinfo_groups(stream)
                info = next(g for g in groups if g["name"].decode() == group)
                if info["last-delivered-id"] == last:
                    process.send_signal(signal.SIGTERM)  # the drain writes what the children hold
                    await redis.xadd(wake, wake_fields)
                    signalled = True
            exited = process.returncode is not None  # before the mark is read: it may be raised just before the exit
            mark: Any = await redis.get(archive_mark_key(stream))
            if mark is not None and tuple(int(p) for p in mark.decode().split("-")) > last_key:
                break
            if exited:
                raise RuntimeError(f"splitstream-archive exited {process.returncode} before the mark passed {last!r}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"splitstream-archive: the mark did not pass {last!r} within the deadline")
        rate = count / (time.perf_counter() - started)
        try:
            code = await asyncio.wait_for(process.wait(), 15)
        except TimeoutError:
            # Everything is archived, yet it has not exited: each archiver's Python stacks to stderr
            # (PYTHONFAULTHANDLER: SIGABRT prints them), then it is killed; counted, not timed.
            print(f"WARNING: --processes {processes} --builder {builder} did not exit; stacks:", file=sys.stderr)
            for pid in archiver_pids(process.pid, processes):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGABRT)
            code = await process.wait()
        if code != 0:
            print(f"WARNING: splitstream-archive exited {code} after archiving everything", file=sys.stderr)
        return rate
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


def archiver_pids(pid: int, processes: int) -> list[int]:
    """The archiver processes of a ``splitstream-archive`` (its children with ``--processes`` > 1)."""
    if processes == 1:
        return [pid]
    with contextlib.suppress(OSError):
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return []


def read_back(url: str, whole: bool) -> tuple[int, int, int]:
    """In a fresh process: read every call of the archive at ``url`` as a replay does (each record
    decoded, then dropped). Rows, the peak bytes of Arrow's memory pool, the peak resident set."""
    query = ArchiveQuery(model=MODEL, since_ns=0, until_ns=time.time_ns() + 3600 * 10**9)
    parts = [read_calls(open_archive(url), query)] if whole else iter_calls(open_archive(url), query)
    rows = 0
    for part in parts:
        for data in part["record"].to_pylist():
            decode_record(data)
            rows += 1
        del part
    max_rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rows, pa.default_memory_pool().max_memory(), max_rss_kib * 1024


def peak_read(url: str, whole: bool) -> tuple[int, int, int]:
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(read_back, url, whole).result()


def parquet_bytes(archive: Archive) -> int:
    import pyarrow.fs as pafs

    infos = archive.filesystem.get_file_info(pafs.FileSelector(archive.base, recursive=True))
    return sum(info.size or 0 for info in infos if info.path.endswith(".parquet"))


async def main_async(args: argparse.Namespace) -> None:
    os.environ.update(S3_ENV)
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp) / "redis").start()
        s3 = S3Server(Path(tmp) / "s3").start()
        redis = Redis.from_url(server.url, socket_timeout=30)
        try:
            s3.create_bucket("bench")
            await fill(redis, args.records)
            memory: Any = await redis.memory_usage(stream_key(MODEL), samples=0)
            # Interleaved rounds, so machine noise (other processes on a shared machine) hits each path alike;
            # each round writes a fresh archive (the group and mark are reset).
            raws: list[float] = []
            floors: list[float] = []
            paths: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name in ARCHIVE_PATHS}
            commands = [(n, builder) for n in args.processes for builder in ("process", "thread")]
            for n, builder in commands:
                paths[process_label(n, builder)] = []
            for round_ in range(args.rounds):
                raws.append(await raw_read(redis))
                floors.append(await group_read(redis, args.records))
                local = open_archive(str(Path(tmp) / f"archive-{round_}"))
                paths["archive -> directory"].append(await archive_all(redis, local, args.records))
                threaded = open_archive(str(Path(tmp) / f"archive-thread-{round_}"))
                paths["  the same, thread-built"].append(
                    await archive_all(redis, threaded, args.records, process=False)
                )
                remote = open_archive(f"s3://bench/archive-{round_}", endpoint=s3.endpoint)
                moto = s3.process.pid if s3.process is not None else None
                paths["archive -> S3 (moto)"].append(await archive_all(redis, remote, args.records, server_pid=moto))
                for n, builder in commands:
                    rate = await archive_command(
                        redis,
                        server.url,
                        Path(tmp) / f"archive-{n}-{builder}-{round_}",
                        args.records,
                        processes=n,
                        builder=builder,
                        group=f"bench-{n}-{builder}-{round_}",
                    )
                    paths[process_label(n, builder)].append((rate, math.nan, math.nan, math.nan))
                print(
                    f"round {round_ + 1}: "
                    + ", ".join(f"{name.strip()} {runs[-1][0] / raws[-1]:.2f}x" for name, runs in paths.items()),
                    file=sys.stderr,
                )
            on_disk = parquet_bytes(local)
            in_s3 = parquet_bytes(remote)
            await fill(redis, args.records, first=args.records)
            double = open_archive(str(Path(tmp) / "archive-double"))
            await archive_all(redis, double, 2 * args.records)
            reads = [
                (f"{label}, {size:,} calls", *peak_read(archive.url, whole))
                for whole, label in ((False, "iter_calls (part by part)"), (True, "read_calls (all at once)"))
                for size, archive in ((args.records, local), (2 * args.records, double))
            ]
        finally:
            await redis.aclose()
            s3.stop()
            server.stop()
    raw_rate, floor = median(raws), median(floors)
    print(f"{args.records} demo-shaped call records (64 float32 in, 10 float32 out, inline); median of {args.rounds}")
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"usable cores {len(os.sched_getaffinity(0))}, load average {load} (1, 5, 15 min, at the end)\n")
    ratios = " ".join(f"{'round ' + str(i + 1):>8}" for i in range(args.rounds))
    print(
        f"{'path':<32}{'records/s':>12}{'vs raw XRANGE':>16} {ratios}{'loop CPU us/rec':>17}{'builder CPU':>13}"
        f"{'S3 server CPU':>15}"
    )
    print(f"{'raw XRANGE (no decode)':<32}{raw_rate:>12,.0f}{1.0:>15.2f}x")
    print(f"{'XREADGROUP + XACK only':<32}{floor:>12,.0f}{floor / raw_rate:>15.2f}x")
    for name, runs in paths.items():
        rate = median([run[0] for run in runs])
        each = " ".join(f"{run[0] / raw:>7.2f}x" for run, raw in zip(runs, raws, strict=True))
        own, child = median([run[1] for run in runs]), median([run[2] for run in runs])
        cpu = f"{own:>17.1f}{child:>13.1f}" if not math.isnan(own) else f"{'-':>17}{'-':>13}"
        storage_cpu = median([run[3] for run in runs])
        cpu += f"{storage_cpu:>15.1f}" if not math.isnan(storage_cpu) else ""
        print(f"{name:<32}{rate:>12,.0f}{rate / raw_rate:>15.2f}x {each}{cpu}")
    print()
    print(f"{'storage':<32}{'bytes/record':>12}{'vs Redis':>16}")
    print(f"{'Redis stream (MEMORY USAGE)':<32}{memory / args.records:>12,.1f}{1.0:>15.2f}x")
    print(f"{'Parquet, directory':<32}{on_disk / args.records:>12,.1f}{on_disk / memory:>15.2f}x")
    print(f"{'Parquet, S3':<32}{in_s3 / args.records:>12,.1f}{in_s3 / memory:>15.2f}x")
    print()
    print(f"{'reading back (fresh process)':<40}{'rows':>8}{'Arrow peak MiB':>16}{'RSS peak MiB':>14}")
    for label, rows, arrow_peak, rss_peak in reads:
        print(f"{label:<40}{rows:>8,}{arrow_peak / 2**20:>16.1f}{rss_peak / 2**20:>14.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median is shown")
    parser.add_argument(
        "--processes",
        type=lambda text: [int(n) for n in text.split(",") if n.strip()],
        default=[1, 2],
        help="splitstream-archive --processes values to time, comma-separated (each with both builders)",
    )
    args = parser.parse_args()
    configure_logging("WARNING", service="bench")  # the archivers' per-file debug lines would bury the table
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
