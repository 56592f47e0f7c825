"""How long ``splitstream analyze`` takes next to merely reading the same entries out of Redis, and its memory.

One redis-server (own, on a free port) holds ``--calls`` call entries (written with ``entry_fields`` at their
call time, a 64-byte inline request each, like a small model's) from ``--users`` users over one hour, and
``--events`` feedback events (written with ``feedback_entry_fields``): clicks and satisfaction scores naming
a call by request id, revenue naming a user, ``--duplicates`` of them delivered twice (the copy right after
the original, as a retried delivery arrives).

Each measurement runs in a fresh process, so its peak RSS is its own:

- raw XRANGE: the calls and feedback streams over the window, pages of ``--page-size`` entries, nothing
  done with them: once through redis-py's ``xrange`` (entries as dicts, what a reader gets by default), once
  with the replies as Redis sent them (what the analysis reads: the floor any reader of Redis pays);
- analysis: :func:`splitstream.analysis.analyze.analyze` over the same window, three metrics;
- analysis of the first quarter of the window: about a quarter of the calls and events, nearly every user
  (users come back), to show how memory grows with calls at a fixed number of users;
- analysis of a second model whose stream holds twice the calls and events from the same ``--users``
  (over the same hour): the same comparison the other way round. (It reads the same
  entries: the stream ids of a window run to its end plus the lateness allowance, 1 h.)
- the whole window and the 2x model again with a short horizon (``--short-lateness``, 2 min, and
  ``--short-attribution``, 10 min, as ``splitstream analyze --max-lateness 2m --attribution-window 10m``
  would; the events come a second after their call): a call is held for the join only while an event may
  still name it, so what grows with calls is the calls of about the attribution window and twice the
  lateness, not of the hour; the rows print the most calls held at once;
- analysis from the archive (``--source archive:DIR``): the same window, after a real ``splitstream-archive``
  process wrote both streams to a local directory as Parquet (the archiving time is printed, not compared).

Peak memory is the process's peak RSS (``VmHWM``, reset after its imports) less its RSS then (``ru_maxrss``
would not do: Linux carries it over from the parent, this script, across fork and exec). Target: the full analysis in at
most 2x the raw read; memory bounded by users, not calls (see docs/analysis.md, Cost, for what does grow with calls).
Every child calls ``gc.freeze()`` after its imports, as the ``splitstream`` command does (``--no-gc-freeze``:
none does), so the raw reads and the analyses are measured alike.

    .venv/bin/python bench/analysis.py [--calls 1000000] [--events 1000000] [--users 50000]
        [--short-lateness 2m] [--short-attribution 10m] [--no-gc-freeze]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import hashlib
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import cast

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from splitstream.analysis.analyze import Query, analyze  # noqa: E402
from splitstream.analysis.loading import Window, read_pages  # noqa: E402
from splitstream.analysis.model import MetricSpec  # noqa: E402
from splitstream.common.durations import parse_duration_ns  # noqa: E402
from splitstream.common.proto.splitstream.v1 import feedback_pb2  # noqa: E402
from splitstream.common.records import entry_fields, feedback_entry_fields, feedback_key, stream_key  # noqa: E402
from tests.experiments import Call, call_record, phase  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

MODEL = "bench"
#: Children call gc.freeze() after their imports, as the splitstream command does (``--no-gc-freeze``: not).
GC_FREEZE = True
#: The same users calling twice as often.
DOUBLED = "bench-2x"
HOUR_NS = 3_600 * 10**9
METRICS = ("click:proportion", "satisfaction:mean", "revenue:sum")


def populate(
    url: str, *, model: str, calls: int, events: int, users: int, duplicates: int, until_ns: int, seed: int
) -> None:
    import redis

    rng = np.random.default_rng(seed)
    client = redis.Redis.from_url(url)
    since_ns = until_ns - HOUR_NS
    units = [hashlib.sha256(f"user-{i}".encode()).hexdigest() for i in range(users)]
    bench_phase = phase({"v1": 50, "v2": 50}, "v1", salt="bench")
    times = np.sort(rng.integers(since_ns, until_ns - 60 * 10**9, calls))
    who = rng.integers(0, users, calls)
    payload = bytes(64)
    pipe = client.pipeline(transaction=False)
    for i in range(calls):
        user = int(who[i])
        call = Call(f"r{i}", int(times[i]), "v1" if user % 2 else "v2", unit=units[user], latency_ms=4.0 + i % 7)
        pipe.xadd(
            stream_key(model), entry_fields(call_record(model, call, bench_phase, payload)), id=f"{times[i] // 10**6}-*"
        )  # type: ignore[arg-type]
        if i % 5_000 == 4_999:
            pipe.execute()
    pipe.execute()
    kinds = rng.random(events)
    about = np.sort(rng.integers(0, calls, events))  # event j names a call a second before it
    event_times = np.sort(times[about] + 10**9)
    twice = set(rng.choice(events, size=min(duplicates, events), replace=False).tolist())
    order = [j for i in range(events) for j in ((i, i) if i in twice else (i,))]  # a copy right after its original
    for i, j in enumerate(order):
        call_index = int(about[j])
        if kinds[j] < 0.5:
            event = feedback_pb2.FeedbackEvent(request_id=f"r{call_index}", metric="click", value=1.0)
        elif kinds[j] < 0.8:
            event = feedback_pb2.FeedbackEvent(request_id=f"r{call_index}", metric="satisfaction", value=3.0 + j % 3)
        else:
            event = feedback_pb2.FeedbackEvent(routing_key_hmac=units[int(who[call_index])], metric="revenue",
                                               value=float(j % 50))  # fmt: skip
        event.event_unix_ns = event.receive_unix_ns = int(event_times[j])
        event.idempotency_key = f"e{j}"
        at_ms = int(event_times[j]) // 10**6
        pipe.xadd(feedback_key(model), feedback_entry_fields(event), id=f"{at_ms}-*")  # type: ignore[arg-type]
        if i % 5_000 == 4_999:
            pipe.execute()
    pipe.execute()
    client.close()


async def measure_raw(url: str, model: str, window: Window, page_size: int, *, as_dicts: bool) -> dict[str, float]:
    """Page through both streams and do nothing with the entries: with redis-py's ``xrange`` (each entry's
    fields made a dict, what a reader gets by default) or with the replies as Redis sent them (what the
    analysis reads, :func:`splitstream.analysis.loading.read_pages`)."""
    from redis.asyncio import Redis

    from splitstream.analysis.loading import bounds

    redis = Redis.from_url(url)
    start, end = bounds(window)
    entries = 0
    began = time.perf_counter()
    for key in (stream_key(model), feedback_key(model)):
        if as_dicts:
            lower = start
            while True:
                page = cast(
                    list[tuple[bytes, dict[bytes, bytes]]], await redis.xrange(key, min=lower, max=end, count=page_size)
                )
                entries += len(page)
                if len(page) < page_size:
                    break
                lower = "(" + page[-1][0].decode()
        else:
            async for raw in read_pages(redis, key, start=start, end=end, page_size=page_size):
                entries += len(raw)
    elapsed = time.perf_counter() - began
    await redis.aclose()
    return {"seconds": elapsed, "entries": entries}


async def measure_analysis(
    url: str, model: str, window: Window, page_size: int, *, archive: str = ""
) -> dict[str, float]:
    from redis.asyncio import Redis

    from splitstream.analysis.sources import ArchiveSource
    from splitstream.common.archive import open_archive

    redis = Redis.from_url(url)
    query = Query(model=model, window=window, metrics=tuple(MetricSpec.parse(m) for m in METRICS), page_size=page_size)
    began = time.perf_counter()
    result = await analyze(ArchiveSource(open_archive(archive)) if archive else redis, query)
    elapsed = time.perf_counter() - began
    await redis.aclose()
    units = sum(p.units for p in result.phases)
    return {
        "seconds": elapsed,
        "entries": result.calls.entries_read + result.feedback.entries_read,
        "calls": result.calls.calls,
        "events": result.feedback.used,
        "units": units,
        "duplicates": result.feedback.duplicates,
        "held": result.calls.held_for_join_peak,
    }


def _memory_kib(field: str) -> int | None:
    """A ``Vm*`` line of /proc/self/status in KiB (Linux), or None."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _start_measuring() -> int:
    """Reset the peak RSS (``clear_refs`` 5) and return the RSS now, in KiB. ``ru_maxrss`` would not do: Linux
    carries it over from the parent across fork and exec, so a child reports the bench's own peak (the
    writer's, hundreds of MiB) until it passes it."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")
    now = _memory_kib("VmRSS")
    return now if now is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _peak_kib() -> int:
    peak = _memory_kib("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def child(args: argparse.Namespace) -> int:
    if not args.no_gc_freeze:
        gc.freeze()  # what the splitstream command does once its imports are done (raw reads alike)
    baseline = _start_measuring()
    window = Window(args.since_ns, args.until_ns)
    if args.lateness_ns is not None:
        window = Window(
            args.since_ns, args.until_ns, max_lateness_ns=args.lateness_ns, attribution_ns=args.attribution_ns
        )
    if args.measure == "analysis":
        result = asyncio.run(measure_analysis(args.url, args.model, window, args.page_size))
    elif args.measure == "analysis-archive":
        result = asyncio.run(measure_analysis(args.url, args.model, window, args.page_size, archive=args.archive))
    else:
        result = asyncio.run(measure_raw(args.url, args.model, window, args.page_size, as_dicts=args.measure == "raw"))
    result["peak_mib"] = (_peak_kib() - baseline) / 1024
    print(json.dumps(result))
    return 0


def run_child(
    url: str,
    measure: str,
    since_ns: int,
    until_ns: int,
    page_size: int,
    archive: str = "",
    model: str = MODEL,
    horizon: tuple[int, int] | None = None,
) -> dict[str, float]:
    """One measurement in a fresh process. ``horizon``: (lateness, attribution) in ns, else the defaults."""
    extra = ["--lateness-ns", str(horizon[0]), "--attribution-ns", str(horizon[1])] if horizon else []
    extra += ["--no-gc-freeze"] if not GC_FREEZE else []
    out = subprocess.run(
        [sys.executable, __file__, "--child", measure, "--url", url, "--model", model, "--since-ns", str(since_ns),
         "--until-ns", str(until_ns), "--page-size", str(page_size), "--archive", archive, *extra],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def archive_streams(server: RedisServer, directory: Path) -> None:
    """Run a real ``splitstream-archive`` until both streams are in Parquet files under ``directory``."""
    import redis

    from splitstream.common.records import archive_mark_key

    client = redis.Redis.from_url(server.url)
    archiver = subprocess.Popen(
        [sys.executable, "-m", "splitstream.archiver", "--port", "0", "--metrics-port", "0", "--redis-url",
         server.url, "--archive", str(directory), "--flush-interval-s", "0.5", "--log-level", "WARNING"],
        cwd=ROOT,
    )  # fmt: skip
    try:
        for key in (stream_key(MODEL), feedback_key(MODEL)):
            last = cast(list[tuple[bytes, object]], client.xrevrange(key, count=1))[0][0].decode()
            wanted = tuple(int(part) for part in last.split("-"))
            while True:
                mark = cast(bytes | None, client.get(archive_mark_key(key)))
                if mark is not None and tuple(int(part) for part in mark.decode().split("-")) > wanted:
                    break
                if archiver.poll() is not None:
                    raise RuntimeError(f"the archiver exited with {archiver.returncode}")
                time.sleep(0.5)
    finally:
        archiver.terminate()
        archiver.wait(timeout=60)
        client.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=1_000_000)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--users", type=int, default=50_000)
    parser.add_argument("--duplicates", type=int, default=10_000, help="events delivered twice")
    parser.add_argument("--page-size", type=int, default=5_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--child",
        dest="measure",
        choices=("raw", "raw-unparsed", "analysis", "analysis-archive"),
        help=argparse.SUPPRESS,
    )
    parser.add_argument("--short-lateness", default="2m", help="--max-lateness of the short-horizon rows")
    parser.add_argument("--short-attribution", default="10m", help="--attribution-window of the short-horizon rows")
    parser.add_argument(
        "--no-gc-freeze",
        action="store_true",
        help="measure without gc.freeze() after the imports (the splitstream command freezes; see docs/benchmarks.md)",
    )
    parser.add_argument("--lateness-ns", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--attribution-ns", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--archive", default="", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--model", default=MODEL, help=argparse.SUPPRESS)
    parser.add_argument("--since-ns", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--until-ns", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    global GC_FREEZE
    GC_FREEZE = not args.no_gc_freeze
    if args.measure:
        return child(args)
    short = (parse_duration_ns(args.short_lateness), parse_duration_ns(args.short_attribution))
    until_ns = (time.time_ns() // 10**9 - 120) * 10**9
    since_ns = until_ns - HOUR_NS
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp)) as server:
        began = time.perf_counter()
        populate(
            server.url, model=MODEL, calls=args.calls, events=args.events, users=args.users,
            duplicates=args.duplicates, until_ns=until_ns, seed=args.seed,
        )  # fmt: skip
        # The same users calling twice as often (and giving twice the feedback): memory should not double.
        populate(
            server.url, model=DOUBLED, calls=2 * args.calls, events=2 * args.events, users=args.users,
            duplicates=2 * args.duplicates, until_ns=until_ns, seed=args.seed + 1,
        )  # fmt: skip
        print(
            f"wrote {args.calls:,} calls and {args.events + args.duplicates:,} feedback entries "
            f"({args.users:,} users), and twice that from the same users, in {time.perf_counter() - began:.0f} s"
        )
        quarter_ns = since_ns + HOUR_NS // 4
        rows = [
            ("raw XRANGE, entries as dicts", run_child(server.url, "raw", since_ns, until_ns, args.page_size)),
            ("raw XRANGE, replies as sent", run_child(server.url, "raw-unparsed", since_ns, until_ns, args.page_size)),
            ("analysis", run_child(server.url, "analysis", since_ns, until_ns, args.page_size)),
            ("analysis, first quarter", run_child(server.url, "analysis", since_ns, quarter_ns, args.page_size)),
            (
                "analysis, same users, 2x calls",
                run_child(server.url, "analysis", since_ns, until_ns, args.page_size, model=DOUBLED),
            ),
            (
                "short horizon",
                run_child(server.url, "analysis", since_ns, until_ns, args.page_size, horizon=short),
            ),
            (
                "short horizon, 2x calls",
                run_child(server.url, "analysis", since_ns, until_ns, args.page_size, model=DOUBLED, horizon=short),
            ),
        ]
        archive = Path(tmp) / "archive"
        began = time.perf_counter()
        archive_streams(server, archive)
        print(f"archived both streams in {time.perf_counter() - began:.0f} s")
        rows.append(
            (
                "analysis from the archive",
                run_child(server.url, "analysis-archive", since_ns, until_ns, args.page_size, str(archive)),
            )
        )
    raw = rows[0][1]["seconds"]
    unparsed = rows[1][1]["seconds"]
    print(
        f"\n{'path':<30} {'entries':>10} {'units':>8} {'seconds':>8} {'x raw':>6} {'x sent':>7} {'peak MiB':>9} "
        f"{'calls held':>11}"
    )
    print("-" * 96)
    for name, row in rows:
        units = f"{int(row['units']):,}" if "units" in row else "-"
        held = f"{int(row['held']):,}" if "held" in row else "-"
        print(
            f"{name:<30} {int(row['entries']):>10,} {units:>8} {row['seconds']:>8.2f} "
            f"{row['seconds'] / raw:>6.2f} {row['seconds'] / unparsed:>7.2f} {row['peak_mib']:>9.0f} {held:>11}"
        )
    print(
        "x raw: time over the redis-py xrange read; x sent: over the read of the replies as sent (the floor). "
        "Every row reads the same entries (the window's stream ids plus the lateness allowance)."
    )
    full, quarter, doubled, short_full, short_doubled = (row for _, row in rows[2:7])
    print(
        f"\nanalysis memory, full window / first quarter: {full['peak_mib'] / max(quarter['peak_mib'], 1):.2f}x "
        f"for {full['calls'] / max(quarter['calls'], 1):.2f}x the calls and "
        f"{full['units'] / max(quarter['units'], 1):.2f}x the units"
    )
    print(
        f"analysis memory, 2x calls / 1x calls (same users): {doubled['peak_mib'] / max(full['peak_mib'], 1):.2f}x "
        f"for {doubled['calls'] / max(full['calls'], 1):.2f}x the calls and "
        f"{doubled['units'] / max(full['units'], 1):.2f}x the units"
    )
    print(
        f"short horizon ({args.short_lateness} lateness, {args.short_attribution} attribution), 2x calls / 1x calls: "
        f"{short_doubled['peak_mib'] / max(short_full['peak_mib'], 1):.2f}x the memory "
        f"({short_doubled['peak_mib']:.0f} / {short_full['peak_mib']:.0f} MiB), calls held at most "
        f"{short_full['held'] / max(short_full['calls'], 1):.0%} and "
        f"{short_doubled['held'] / max(short_doubled['calls'], 1):.0%} of the calls; "
        f"against the hour's lateness: {short_full['peak_mib'] / max(full['peak_mib'], 1):.2f}x and "
        f"{short_doubled['peak_mib'] / max(doubled['peak_mib'], 1):.2f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
