"""How close the recorder gets to what its Redis can take.

One run, one redis-server (own, on a free port), one payload size: a 2 KiB
request and a 1 KiB response per record, inline. Two paths, measured for the
same number of seconds, in interleaved rounds so machine noise hits both alike:

- recorder: a gRPC client streams batches of ``--batch`` records to a real
  recorder process, keeping ``--window`` batches unacknowledged, as fast as acks
  come back; records/s counts acknowledged records.
- raw XADD: redis-py's asyncio client sends the same entries (same fields, same
  sizes) as pipelines of ``--batch`` XADDs, one pipeline after another.

Both trim with ``MAXLEN ~ --maxlen`` so memory stays bounded. The ratio is the
share of Redis's pipelined XADD rate the recorder sustains; the CPU columns charge
each server process's CPU time to the records written (on the raw path the
recorder idles). On a small machine all three processes (client, recorder,
redis-server) share the cores.

Scale-out table (same run, also interleaved, in rounds whose order rotates): a recorder of ``--processes 1`` and one of
``--processes 2`` (one port, SO_REUSEPORT) writing into one Redis and into a 3-master Redis Cluster
(``redis+cluster://``), each fed by ``--streams`` client streams on their own connections (as that many
routers' would be; the kernel spreads connections over the processes), the records of each batch spread
over ``--models`` models (one stream per model, so the streams spread over the cluster's masters; one
model's stream lives on one master, so one model alone gains nothing). records/s counts acknowledged
records of all streams together. For 2 processes the last column says how evenly the kernel spread the
connections that round: the busiest child's share of the children's CPU (50 % is even, 100 % one child
did everything).

    .venv/bin/python bench/recorder_throughput.py [--seconds 4] [--rounds 2] [--models 6] [--streams 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
from grpc import aio
from redis.asyncio import Redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.common.proto.splitstream.v1 import recorder_pb2
from splitstream.common.records import stream_key
from tests.harness import ServiceProcess, free_port
from tests.redis_server import RedisClusterServers, RedisServer
from tests.tensors import add_raw_input

REQUEST_BYTES, RESPONSE_BYTES = 2048, 1024
METHOD = "/splitstream.v1.Recorder/Record"
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


@dataclass
class Round:
    records_per_s: float
    recorder_cpu_us: float  # per record
    redis_cpu_us: float


def template_record() -> recorder_pb2.CallRecord:
    """A realistic record: ~2 KiB request and ~1 KiB response, both inline."""
    rng = np.random.default_rng(0)
    request = oip.ModelInferRequest(model_name="bench", id="r")
    add_raw_input(request, "x", rng.standard_normal(REQUEST_BYTES // 4 - 12).astype(np.float32))
    response = oip.ModelInferResponse(model_name="bench", model_version="v1", id="r")
    response.outputs.add(name="y", datatype="FP32", shape=[RESPONSE_BYTES // 4 - 12])
    response.raw_output_contents.append(rng.standard_normal(RESPONSE_BYTES // 4 - 12).astype(np.float32).tobytes())
    record = recorder_pb2.CallRecord(
        schema_version=1,
        model="bench",
        version="v1",
        arm="v1",
        routing_key_hmac="ab" * 32,
        latency_ns=1_200_000,
        endpoint="127.0.0.1:9000",
        router_id="bench",
        metadata={"x-trace": "t" * 16},
    )
    record.request.inline = request.SerializeToString()
    record.response.inline = response.SerializeToString()
    return record


def serialized_batches(template: recorder_pb2.CallRecord, size: int, count: int, models: int = 0) -> list[bytes]:
    """Distinct pre-serialized batches, so the client spends its CPU on sending, not on protobuf; with
    ``models``, each batch's records are spread round-robin over that many models."""
    batches = []
    now = time.time_ns()
    for b in range(count):
        batch = recorder_pb2.RecordBatch(sequence=b)
        for i in range(size):
            record = batch.records.add()
            record.CopyFrom(template)
            if models:
                record.model = f"bench-{i % models}"
            record.request_id = f"req-{b}-{i}"
            record.receive_unix_ns = now + b * size + i
        batches.append(batch.SerializeToString())
    return batches


async def drive_recorder(
    address: str, batches: list[bytes], batch_size: int, window: int, seconds: float, *, own_connection: bool = False
) -> float:
    """Records acknowledged per second over ``seconds``, with ``window`` batches in flight (``own_connection``:
    on a TCP connection of its own, not one shared with other channels to ``address``)."""
    options = [("grpc.use_local_subchannel_pool", 1)] if own_connection else []
    async with aio.insecure_channel(address, options=options) as channel:
        call = channel.stream_stream(METHOD, response_deserializer=recorder_pb2.RecordAck.FromString)()
        sent = acked = 0
        for _ in range(window):
            await call.write(batches[sent % len(batches)])
            sent += 1
        started = time.perf_counter()
        deadline = started + seconds
        while True:
            await call.read()
            acked += 1
            if time.perf_counter() >= deadline:
                break
            await call.write(batches[sent % len(batches)])
            sent += 1
        elapsed = time.perf_counter() - started
        call.cancel()
    # The first `window` acks may include batches sent before the clock started: count them anyway,
    # the window is small against the thousands of batches a run acknowledges.
    return acked * batch_size / elapsed


async def drive_raw(
    url: str, entries: list[dict[str, bytes | str]], batch_size: int, maxlen: int, seconds: float
) -> float:
    """Pipelined XADD rate of the same entries, one pipeline of ``batch_size`` at a time."""
    redis = Redis.from_url(url)
    key = stream_key("bench-raw")
    written = 0
    started = time.perf_counter()
    deadline = started + seconds
    try:
        while time.perf_counter() < deadline:
            pipe = redis.pipeline(transaction=False)
            for i in range(batch_size):
                pipe.xadd(key, entries[(written + i) % len(entries)], maxlen=maxlen, approximate=True)  # type: ignore[arg-type]
            await pipe.execute()
            written += batch_size
        return written / (time.perf_counter() - started)
    finally:
        await redis.aclose()


async def recorded_entries(url: str, count: int) -> list[dict[str, bytes | str]]:
    """Entries exactly as the recorder wrote them (same fields, same sizes), for the raw path."""
    redis = Redis.from_url(url)
    try:
        found = cast(list[tuple[bytes, dict[bytes, bytes]]], await redis.xrange(stream_key("bench"), count=count))
        return [{k.decode(): v for k, v in fields.items()} for _, fields in found]
    finally:
        await redis.aclose()


def measured(run: Callable[[], Coroutine[Any, Any, float]], recorder_pid: int, redis_pid: int) -> Round:
    """Run one path and charge the CPU both server processes used to the records it wrote."""
    before = cpu_seconds(recorder_pid), cpu_seconds(redis_pid)
    started = time.perf_counter()
    rate = asyncio.run(run())
    records = rate * (time.perf_counter() - started)
    used = cpu_seconds(recorder_pid) - before[0], cpu_seconds(redis_pid) - before[1]
    return Round(rate, used[0] / records * 1e6, used[1] / records * 1e6)


async def drive_many(addresses: list[str], batches: list[bytes], batch_size: int, window: int, seconds: float) -> float:
    """Records acknowledged per second by all of ``addresses`` together, one stream (and connection) each,
    concurrently."""
    rates = await asyncio.gather(
        *(drive_recorder(address, batches, batch_size, window, seconds, own_connection=True) for address in addresses)
    )
    return sum(rates)


def start_recorder(tmp: Path, name: str, url: str, maxlen: int, processes: int = 1) -> ServiceProcess:
    port = free_port()
    return ServiceProcess(
        name,
        "splitstream.recorder",
        [
            *("--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0", "--redis-url", url),
            *("--retention-maxlen", str(maxlen), "--log-level", "WARNING", "--processes", str(processes)),
        ],
        log_dir=tmp,
        port=port,
    ).start()


def children_cpu(pid: int) -> dict[int, float]:
    """CPU seconds used so far by each child of ``pid`` (a ``--processes`` parent's recorders; none for one)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return {int(child): cpu_seconds(int(child)) for child in children}


def busiest_share(before: dict[int, float], after: dict[int, float]) -> float | None:
    """The busiest child's share of the CPU its siblings and it used between two readings (None: no children).
    The kernel hashes each connection to a child, so 4 streams over 2 children are often 3 and 1, or 4 and 0."""
    used = [after[pid] - before[pid] for pid in after if pid in before]
    return max(used) / sum(used) if used and sum(used) > 0 else None


@dataclass
class Row:
    rates: list[float]
    #: Per round, the busiest child's share of the children's CPU (None for one process).
    shares: list[float | None]


def scale_out(args: argparse.Namespace, template: recorder_pb2.CallRecord) -> dict[str, Row]:
    """records/s of a recorder of 1 and of 2 processes into one Redis and into a 3-master cluster, interleaved
    in rounds whose order rotates (with a fixed order the last row always ran last, when other load had risen
    most: that row, 2 processes into the cluster, once read 0.49x of one process into one Redis)."""
    with tempfile.TemporaryDirectory(prefix="recorder-scale-") as tmp_name:
        tmp = Path(tmp_name)
        with RedisServer(tmp / "single") as single, RedisClusterServers(tmp / "cluster") as cluster:
            recorders = {
                f"{n} process{'es' if n > 1 else ''} -> {store}": start_recorder(
                    tmp, f"{store.replace(' ', '-')}-{n}", url, args.maxlen, processes=n
                )
                for store, url in (("one Redis", single.url), ("cluster", cluster.url))
                for n in (1, 2)
            }
            try:
                time.sleep(3)  # the health check reaches one child: let the second one start serving too
                batches = serialized_batches(template, args.batch, 16, args.models)
                streams = {name: [r.address] * args.streams for name, r in recorders.items()}
                for addresses in streams.values():  # warm-up: streams created, connections made
                    asyncio.run(drive_many(addresses, batches, args.batch, args.window, 0.5))
                rows = {name: Row([], []) for name in streams}
                names = list(streams)
                for round_index in range(args.rounds):
                    # The order rotates: load that rises (or falls) during a run must not always hit the same row.
                    shift = round_index % len(names)
                    for name in names[shift:] + names[:shift]:
                        parent = recorders[name].process
                        assert parent is not None
                        before = children_cpu(parent.pid)
                        rate = asyncio.run(drive_many(streams[name], batches, args.batch, args.window, args.seconds))
                        rows[name].rates.append(rate)
                        rows[name].shares.append(busiest_share(before, children_cpu(parent.pid)))
                return rows
            finally:
                for recorder in recorders.values():
                    recorder.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=4.0, help="measured seconds per path per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=256, help="records per batch / XADDs per pipeline")
    parser.add_argument("--window", type=int, default=2, help="unacknowledged batches the client keeps in flight")
    parser.add_argument("--maxlen", type=int, default=50_000, help="MAXLEN ~ on both paths (bounds Redis memory)")
    parser.add_argument(
        "--models", type=int, default=6, help="models (streams) the scale-out table's records spread over"
    )
    parser.add_argument(
        "--streams", type=int, default=4, help="client streams (connections) feeding each scale-out recorder"
    )
    parser.add_argument("--no-scale-out", action="store_true", help="skip the recorders x Redis Cluster table")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="recorder-bench-") as tmp, RedisServer(Path(tmp) / "redis") as redis:
        port = free_port()
        recorder = ServiceProcess(
            "recorder",
            "splitstream.recorder",
            [
                *("--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0", "--redis-url", redis.url),
                *("--retention-maxlen", str(args.maxlen), "--log-level", "WARNING"),
            ],
            log_dir=Path(tmp),
            port=port,
        ).start()
        try:
            template = template_record()
            batches = serialized_batches(template, args.batch, 16)
            record_bytes = len(template.SerializeToString())
            asyncio.run(drive_recorder(recorder.address, batches, args.batch, args.window, 0.5))  # warm-up
            entries = asyncio.run(recorded_entries(redis.url, args.batch * 4))
            assert recorder.process is not None
            assert redis.process is not None
            pids = recorder.process.pid, redis.process.pid
            rounds: dict[str, list[Round]] = {"recorder": [], "raw XADD": []}
            for _ in range(args.rounds):
                rounds["recorder"].append(
                    measured(
                        lambda: drive_recorder(recorder.address, batches, args.batch, args.window, args.seconds), *pids
                    )
                )
                rounds["raw XADD"].append(
                    measured(lambda: drive_raw(redis.url, entries, args.batch, args.maxlen, args.seconds), *pids)
                )
        finally:
            recorder.stop()

    entry_bytes = sum(len(k) + len(v) for k, v in entries[0].items())
    print(
        f"\nrecords of ~{record_bytes} B (request {REQUEST_BYTES} B + response {RESPONSE_BYTES} B inline), "
        f"stream entries of ~{entry_bytes} B, batches of {args.batch}, window {args.window}, "
        f"{args.rounds} x {args.seconds:g} s per path\n"
    )
    raw = max(r.records_per_s for r in rounds["raw XADD"])
    header = ("path", "records/s (best)", "each round", "MB/s", "vs raw", "recorder CPU µs/rec", "redis CPU µs/rec")
    print("{:<10} {:>17} {:>18} {:>7} {:>7} {:>20} {:>17}".format(*header))
    for path, results in rounds.items():
        best = max(results, key=lambda r: r.records_per_s)
        each = ", ".join(f"{r.records_per_s:,.0f}" for r in results)
        print(
            f"{path:<10} {best.records_per_s:>17,.0f} {each:>18} {best.records_per_s * entry_bytes / 1e6:>7.1f} "
            f"{best.records_per_s / raw:>7.2f} {best.recorder_cpu_us:>20.1f} {best.redis_cpu_us:>17.1f}"
        )
    if args.no_scale_out:
        return 0
    rows = scale_out(args, template)
    base = max(rows["1 process -> one Redis"].rates)
    print(
        f"\nscale-out: records spread over {args.models} models, {args.streams} client streams per recorder, "
        f"{os.cpu_count()} CPU cores for everything\n"
    )
    print(
        "{:<28} {:>17} {:>18} {:>16}  {}".format(
            "recorder --processes -> store",
            "records/s (best)",
            "each round",
            "vs 1 -> one Redis",
            "busiest child's CPU share, each round",
        )
    )
    for name, row in rows.items():
        each = ", ".join(f"{rate:,.0f}" for rate in row.rates)
        shares = ", ".join("-" if share is None else f"{share:.0%}" for share in row.shares)
        print(f"{name:<28} {max(row.rates):>17,.0f} {each:>18} {max(row.rates) / base:>16.2f}  {shares}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
