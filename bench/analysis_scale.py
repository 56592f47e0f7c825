"""``splitstream analyze --source archive:`` at scale, next to the bare scan of the same columns by DuckDB.

A child process writes a synthetic archive in the archive's real layout (:mod:`splitstream.common.archive`:
``calls/`` and ``feedback/`` partitioned by model, date and hour, files cut at 100 000 rows as the archiver
cuts them, :data:`CALL_SCHEMA` and :data:`FEEDBACK_SCHEMA`, written by :func:`write_file`): ``--calls`` calls
(``10M``, ``100M``; default 1M, a minute here) over ``--hours`` hours (48: two days of partitions), from
``--users`` users (default: a tenth of the calls, at most 1 M), in ``--phases`` experiment phases that ramp v2
from 10 % to 80 % (each user's arm sticky within a phase, by a per-user draw as a hash split gives), 1 % of
calls failed. Each call's ``record`` is a real serialized ``CallRecord`` of its phase and arm, built once per
(phase, arm) and repeated: the analysis decodes one record per phase, for its weights, and nothing reads the
others. Feedback on ``--feedback-share`` of the calls: a click naming the call, half as many satisfaction
scores naming the call, a quarter as many revenue events naming the user, 1..60 s after the call. Delivery is
at least once, so 0.2 % of the calls and 1 % of the events are written twice (a later stream id, in a file of
their own), as a resent record or event lands in the archive. Every column is built with numpy and pyarrow a
file at a time: no Python loop per call.

Then, each in a fresh process started by this one, side by side in one run:

- the floor: DuckDB's bare scan of the columns the analysis reads (``SELECT count(*), sum(latency_ms), ...``
  over ``read_parquet`` of the calls and the feedback, every such column decoded, nothing joined);
- ``splitstream analyze MODEL --source archive:DIR --archive-engine duckdb`` over the whole window, three metrics
  (without the flag, in code before the DuckDB engine: its only reader);
- ``--archive-engine python`` (the page reader) where the command has that flag and the archive holds at most
  ``--python-max-calls`` calls (above it the row says why it was left out); a command without the flag has
  one reader, the default row's.

Seconds (wall, the process's start and imports included), CPU seconds (user and system, from ``wait4``: on a
machine other jobs load, the figure they move least), rows per second (calls and feedback rows in the
archive, duplicates included), and peak RSS: each child is started with ``posix_spawn`` and reaped with
``wait4``, whose ``ru_maxrss`` is that child's own peak. This process imports nothing heavy (the archive is
written by a child), because Linux carries a parent's peak over into its children's ``ru_maxrss``; the row
``python -c pass`` shows that floor. Last, whether analysis.json of the two engines is equal field by field
(floats to a relative 1e-9), on the same window.

    .venv/bin/python bench/analysis_scale.py [--calls 1M] [--users N] [--hours 48] [--phases 3]
        [--feedback-share 0.3] [--python-max-calls 20M] [--dir DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODEL = "scale"
#: 2026-11-02T00:00:00Z: the first hour partition.
T0_NS = 1_793_577_600 * 10**9
HOUR_NS = 3_600 * 10**9
METRICS = ("click:rate", "satisfaction:mean", "revenue:sum")
#: v2's weight in percent, phase by phase (the control, v1, has the rest): a ramp.
RAMP = (10, 50, 80, 90, 95)
#: Rows a file holds at most (the archiver's --max-file-rows).
FILE_ROWS = 100_000
#: What differs between two analyses of one window read differently: pages read, copies met, calls held.
UNCOMPARED = frozenset({"entries_read", "duplicates", "held_for_join_peak"})
#: The columns of each table the analysis reads (splitstream.analysis.sources), which the floor scans.
CALL_COLUMNS = (
    "request_id",
    "receive_time",
    "status",
    "latency_ms",
    "arm",
    "assignment",
    "phase",
    "routing_key_hmac",
    "principal",
    "ttft_ms",
    "tokens",
    "prompt_tokens",
    "completion_tokens",
    "stream_id",
)
FEEDBACK_COLUMNS = ("metric", "request_id", "unit", "value", "event_time", "receive_time", "idempotency_key")


def count(text: str) -> int:
    """``10M``, ``100M``, ``500k``, ``2500000``: a count (argparse type)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"expected a count such as 1000000, 500k or 10M, got {text!r}")
    value = float(match.group(1)) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[match.group(2).lower()]
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"expected a whole count of at least 1, got {text!r}")
    return int(value)


# -- the synthetic archive (in a child: numpy and pyarrow stay out of this process) ------------


def generate(directory: Path, calls: int, users: int, hours: int, phases: int, share: float, seed: int) -> None:
    import hashlib

    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    sys.path.insert(0, str(ROOT))
    from splitstream.common.archive import (
        CALL_SCHEMA,
        CALLS,
        FEEDBACK,
        FEEDBACK_SCHEMA,
        file_name,
        open_archive,
        partition_dir,
        write_file,
    )
    from splitstream.common.records import status_name
    from tests.experiments import Call, call_record, phase

    archive = open_archive(str(directory))
    rng = np.random.default_rng(seed)
    units = pa.array([hashlib.sha256(b"user-%d" % i).hexdigest() for i in range(users)], pa.string())
    draws = rng.random(users) * 100  # a user's place in the split: v2 while below v2's weight
    phase_messages = [
        phase({"v1": 100 - RAMP[p % len(RAMP)], "v2": RAMP[p % len(RAMP)]}, "v1", salt=f"scale-{p}")
        for p in range(phases)
    ]
    phase_ids = pa.array([message.id for message in phase_messages], pa.string())
    # One real record per (phase, arm), repeated: the analysis decodes one per phase, for its weights.
    records = pa.array(
        [
            call_record(MODEL, Call(f"phase-{p}-{arm}", T0_NS, arm, unit=units[0].as_py()), message).SerializeToString()
            for p, message in enumerate(phase_messages)
            for arm in ("v1", "v2")
        ],
        pa.binary(),
    )
    arms = pa.array(["v1", "v2"], pa.string())
    statuses = pa.array([status_name(0), status_name(14)], pa.string())
    per_hour = np.full(hours, calls // hours)
    per_hour[: calls % hours] += 1
    first = np.concatenate([[0], np.cumsum(per_hour)])
    events_by_hour: dict[int, list[pa.Table]] = {}
    event_seq = 0

    def text(values: Any) -> pa.Array:
        return pc.cast(pa.array(values), pa.string())

    def stream_ids(times_ns: Any, seq: Any) -> pa.Array:
        return pc.binary_join_element_wise(text(times_ns // 10**6), text(seq), "-")

    def write(kind: str, table: pa.Table, schema: pa.Schema) -> None:
        for offset in range(0, table.num_rows, FILE_ROWS):
            part = table.slice(offset, FILE_ROWS).cast(schema)
            ids = part["stream_id"]
            where = partition_dir(kind, MODEL, int(part["receive_time"][0].value))
            write_file(archive, f"{where}/{file_name(ids[0].as_py(), ids[-1].as_py())}", part)

    for hour in range(hours):
        n = int(per_hour[hour])
        if n == 0:
            continue
        index = np.arange(first[hour], first[hour + 1])
        times = T0_NS + hour * HOUR_NS + np.sort(rng.integers(0, HOUR_NS, n))
        who = rng.integers(0, users, n)
        phase_index = hour * phases // hours
        weight = RAMP[phase_index % len(RAMP)]
        arm = (draws[who] < weight).astype(np.int64)
        failed = (rng.random(n) < 0.01).astype(np.int64)
        request_ids = pc.binary_join_element_wise("req-", text(index), "")
        unit = units.take(pa.array(who))
        table = pa.table(
            {
                "request_id": request_ids,
                "receive_time": pa.array(times, pa.timestamp("ns", tz="UTC")),
                "version": arms.take(pa.array(arm)),
                "arm": arms.take(pa.array(arm)),
                "assignment": pa.repeat(pa.scalar("hash"), n),
                "phase": pa.repeat(phase_ids[phase_index], n),
                "status": statuses.take(pa.array(failed)),
                "status_code": pa.array(failed * 14, pa.int32()),
                "latency_ms": pa.array(np.round(rng.lognormal(np.log(20.0) + 0.05 * arm, 0.5), 3)),
                "routing_key_hmac": unit,
                "principal": pa.repeat(pa.scalar(""), n),
                "tags": pa.nulls(n, CALL_SCHEMA.field("tags").type),
                "streamed": pa.repeat(pa.scalar(False), n),
                # Redis wrote the entry a few ms after the router received the call.
                "stream_id": stream_ids(times + 3_000_000, index),
                "record": records.take(pa.array(phase_index * 2 + arm)),
                "ttft_ms": pa.nulls(n, pa.float64()),
                "tokens": pa.nulls(n, pa.int64()),
                "prompt_tokens": pa.nulls(n, pa.int64()),
                "completion_tokens": pa.nulls(n, pa.int64()),
            }
        )
        write(CALLS, table, CALL_SCHEMA)
        again = np.flatnonzero(rng.random(n) < 0.002)  # resent: the same call under a later stream id
        if again.size:
            copies = table.take(pa.array(again)).set_column(
                table.schema.get_field_index("stream_id"),
                "stream_id",
                stream_ids(times[again] + 1_000_000_000, index[again] + calls),
            )
            write(CALLS, copies, CALL_SCHEMA)
        # Feedback: clicks and scores naming calls, revenue naming users, 1..60 s after the call.
        for metric, fraction, by_user in (("click", share, False), ("satisfaction", share / 2, False),
                                          ("revenue", share / 4, True)):  # fmt: skip
            picked = np.flatnonzero(rng.random(n) < fraction)
            m = picked.size
            if m == 0:
                continue
            at = times[picked] + rng.integers(10**9, 60 * 10**9, m)
            if metric == "click":
                values = np.ones(m)
            elif metric == "satisfaction":
                values = rng.integers(1, 6, m).astype(np.float64) + 0.5 * arm[picked]
            else:
                values = np.round(rng.gamma(2.0, 10.0 + 2.0 * arm[picked]), 2)
            seq = np.arange(event_seq, event_seq + m)
            event_seq += m
            events = pa.table(
                {
                    "request_id": pa.repeat(pa.scalar(""), m) if by_user else request_ids.take(pa.array(picked)),
                    "unit": unit.take(pa.array(picked)) if by_user else pa.repeat(pa.scalar(""), m),
                    "metric": pa.repeat(pa.scalar(metric), m),
                    "value": pa.array(values, pa.float64()),
                    "event_time": pa.array(at, pa.timestamp("ns", tz="UTC")),
                    "receive_time": pa.array(at, pa.timestamp("ns", tz="UTC")),
                    "idempotency_key": pc.binary_join_element_wise(f"{metric}-", text(seq), ""),
                    "stream_id": stream_ids(at + 2_000_000, seq),
                }
            )
            twice = np.flatnonzero(rng.random(m) < 0.01)  # delivered twice: the same key, a later entry
            if twice.size:
                copy = events.take(pa.array(twice))
                copy = copy.set_column(
                    copy.schema.get_field_index("stream_id"), "stream_id", stream_ids(at[twice] + 10**9, seq[twice])
                )
                events = pa.concat_tables([events, copy])
            event_hour = (events["receive_time"].cast(pa.int64()).to_numpy() - T0_NS) // HOUR_NS
            for h in np.unique(event_hour):
                events_by_hour.setdefault(int(h), []).append(events.filter(pa.array(event_hour == h)))
        # An hour's events are complete once the calls of the hour before it are written (they come within 60 s).
        for h in [h for h in events_by_hour if h < hour]:
            write_events(events_by_hour.pop(h), write, FEEDBACK, FEEDBACK_SCHEMA)
    for h in sorted(events_by_hour):
        write_events(events_by_hour.pop(h), write, FEEDBACK, FEEDBACK_SCHEMA)


def write_events(parts: list[Any], write: Any, kind: str, schema: Any) -> None:
    import pyarrow as pa

    table = pa.concat_tables(parts)
    write(kind, table.sort_by([("stream_id", "ascending")]), schema)


# -- measuring --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Measured:
    seconds: float
    #: CPU time (user and system) of the child and of what it waited for: less moved by other jobs than the wall.
    cpu_seconds: float
    peak_mib: float
    output: str


def spawn(argv: list[str], *, env: dict[str, str] | None = None) -> Measured:
    """Run ``argv`` to its end; its wall time and its own peak RSS (``wait4``'s ``ru_maxrss``). Its output goes
    to a file, not a pipe, so nothing has to be read while it runs."""
    with tempfile.TemporaryFile(mode="w+") as out:
        actions = [(os.POSIX_SPAWN_DUP2, out.fileno(), 1), (os.POSIX_SPAWN_DUP2, out.fileno(), 2)]
        began = time.perf_counter()
        pid = os.posix_spawn(argv[0], argv, env if env is not None else dict(os.environ), file_actions=actions)
        _, status, usage = os.wait4(pid, 0)
        seconds = time.perf_counter() - began
        out.seek(0)
        output = out.read()
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} ... exited with {code}:\n{output[-3000:]}")
    return Measured(seconds, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, output)


SCAN = """
import sys, duckdb
base = sys.argv[1]
calls, feedback = sys.argv[2], sys.argv[3]
print(duckdb.sql(f"SELECT count(*), {calls} FROM read_parquet('{base}/calls/*/*/*/*.parquet')").fetchall())
print(duckdb.sql(f"SELECT count(*), {feedback} FROM read_parquet('{base}/feedback/*/*/*/*.parquet')").fetchall())
"""


def scan_expressions(columns: tuple[str, ...]) -> str:
    """One aggregate per column, each of which must decode it: lengths of text, sums of numbers and times."""
    numeric = {"latency_ms", "ttft_ms", "tokens", "prompt_tokens", "completion_tokens", "value"}
    times = {"receive_time", "event_time"}
    parts = []
    for column in columns:
        if column in numeric:
            parts.append(f"sum({column})")
        elif column in times:
            parts.append(f"sum(epoch_ns({column}))")
        else:
            parts.append(f"sum(length({column}))")
    return ", ".join(parts)


def attempt(name: str, argv: list[str], env: dict[str, str]) -> tuple[str, Measured | None, str]:
    """A row of the table: what ``argv`` measured, or why it has no figures (it failed: its last line)."""
    try:
        return name, spawn(argv, env=env), ""
    except RuntimeError as error:
        lines = [line for line in str(error).splitlines() if line.strip()]
        return name, None, f"failed: {lines[0].rpartition(' ... ')[2].rstrip(':')}: {lines[-1][:160]}"


def analyze_argv(directory: Path, out: Path, hours: int, engine: str | None) -> list[str]:
    since, until = T0_NS // 10**9, (T0_NS + hours * HOUR_NS) // 10**9
    metrics = [part for metric in METRICS for part in ("--metric", metric)]
    extra = ["--archive-engine", engine] if engine else []
    return [sys.executable, "-m", "splitstream.admin", "analyze", MODEL, "--source", f"archive:{directory}",
            "--since", str(since), "--until", str(until), *metrics, "--output-dir", str(out), *extra]  # fmt: skip


def has_engine_flag() -> bool:
    """Whether ``splitstream analyze`` has ``--archive-engine`` (the DuckDB engine beside the page reader)."""
    done = subprocess.run(
        [sys.executable, "-m", "splitstream.admin", "analyze", "--help"],
        capture_output=True, text=True, cwd=ROOT, check=True,
    )  # fmt: skip
    return "--archive-engine" in done.stdout


def differences(left: Any, right: Any, where: str = "") -> list[str]:
    """Where two analysis.json documents differ, field by field (floats to a relative 1e-9)."""
    if isinstance(left, dict) and isinstance(right, dict):
        found = [f"{where}.{key}: only in one" for key in sorted(set(left) ^ set(right))]
        for key in sorted(set(left) & set(right) - UNCOMPARED):
            found += differences(left[key], right[key], f"{where}.{key}")
        return found
    if isinstance(left, list) and isinstance(right, list):
        if len(left) != len(right):
            return [f"{where}: {len(left)} against {len(right)} items"]
        return [d for i, (a, b) in enumerate(zip(left, right, strict=True)) for d in differences(a, b, f"{where}[{i}]")]
    numbers = isinstance(left, float | int) and isinstance(right, float | int)
    if numbers and (isinstance(left, float) or isinstance(right, float)):
        if math.isclose(left, right, rel_tol=1e-9, abs_tol=1e-12) or (math.isnan(left) and math.isnan(right)):
            return []
    elif left == right:
        return []
    return [f"{where}: {left!r} against {right!r}"]


def archive_rows(directory: Path) -> tuple[int, int, int]:
    """Rows of calls and feedback (every copy), and the archive's bytes, from the generator's note."""
    note = json.loads((directory / "generated.json").read_text())
    return note["call_rows"], note["feedback_rows"], note["bytes"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=count, default=1_000_000, help="calls in the archive: 1M, 10M, 100M")
    parser.add_argument("--users", type=count, default=None, help="distinct users (default: calls/10, at most 1M)")
    parser.add_argument("--hours", type=int, default=48, help="hour partitions the calls spread over")
    parser.add_argument("--phases", type=int, default=3, help="experiment phases (v2's weight ramps)")
    parser.add_argument("--feedback-share", type=float, default=0.3, help="share of the calls that get a click")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--python-max-calls",
        type=count,
        default=20_000_000,
        help="--archive-engine python (the page reader) only up to this many calls (it reads at ~0.1 M rows/s)",
    )
    parser.add_argument("--dir", type=Path, default=None, help="write the archive here (default: a temporary dir)")
    parser.add_argument("--keep", action="store_true", help="keep the archive (with --dir: reuse one written before)")
    parser.add_argument("--generate", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    users = args.users or max(1, min(1_000_000, args.calls // 10))
    if not 0 < args.feedback_share <= 1 or args.hours < 1 or args.phases < 1 or args.phases > args.hours:
        parser.error("--feedback-share must be in (0, 1], --hours at least 1, --phases from 1 to --hours")
    if args.generate:
        generate(args.dir, args.calls, users, args.hours, args.phases, args.feedback_share, args.seed)
        return 0
    work = Path(tempfile.mkdtemp(prefix="analysis-scale-"))
    directory = args.dir.resolve() if args.dir else work / "archive"
    try:
        return run(args, users, directory, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if args.dir is None or not args.keep:
            shutil.rmtree(directory, ignore_errors=True)


def run(args: argparse.Namespace, users: int, directory: Path, work: Path) -> int:
    wanted = {"calls": args.calls, "users": users, "hours": args.hours, "phases": args.phases,
              "feedback_share": args.feedback_share, "seed": args.seed}  # fmt: skip
    note_path = directory / "generated.json"
    reuse = args.keep and note_path.exists() and json.loads(note_path.read_text()).get("wanted") == wanted
    if not reuse:
        shutil.rmtree(directory, ignore_errors=True)
        made = spawn([sys.executable, __file__, "--generate", "--dir", str(directory), "--calls", str(args.calls),
                      "--users", str(users), "--hours", str(args.hours), "--phases", str(args.phases),
                      "--feedback-share", str(args.feedback_share), "--seed", str(args.seed)])  # fmt: skip
        files = [path for path in directory.rglob("*.parquet")]
        call_rows, feedback_rows = (int(spawn_count(directory, kind)) for kind in ("calls", "feedback"))
        note = {"wanted": wanted, "call_rows": call_rows, "feedback_rows": feedback_rows,
                "bytes": sum(path.stat().st_size for path in files), "files": len(files),
                "seconds": made.seconds, "peak_mib": made.peak_mib}  # fmt: skip
        note_path.write_text(json.dumps(note))
    note = json.loads(note_path.read_text())
    call_rows, feedback_rows, size = note["call_rows"], note["feedback_rows"], note["bytes"]
    print(
        f"archive: {call_rows:,} call rows and {feedback_rows:,} feedback rows (duplicates included), {users:,} users, "
        f"{args.hours} hours, {args.phases} phases, {note['files']:,} files, {size / 2**20:,.0f} MiB on disk; "
        f"written in {note['seconds']:.0f} s (peak RSS {note['peak_mib']:.0f} MiB)" + (" (reused)" if reuse else "")
    )
    rows_total = call_rows + feedback_rows
    table: list[tuple[str, Measured | None, str]] = []
    table.append(("python -c pass (the RSS floor)", spawn([sys.executable, "-c", "pass"]), ""))
    table.append(
        (
            "DuckDB bare scan of the columns",
            spawn(
                [sys.executable, "-c", SCAN, str(directory), *map(scan_expressions, (CALL_COLUMNS, FEEDBACK_COLUMNS))]
            ),
            "",
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITSTREAM_")}
    two_engines = has_engine_flag()
    default_out = work / "default"
    # The DuckDB engine by name: it is not (yet) the default (docs/analysis.md says why).
    first = ("analyze --archive-engine duckdb", "duckdb") if two_engines else ("analyze (its only reader)", None)
    table.append(attempt(first[0], analyze_argv(directory, default_out, args.hours, first[1]), env))
    python_out = work / "python"
    if not two_engines:
        table.append(("analyze --archive-engine python", None, "not run: this analyze has no --archive-engine"))
    elif call_rows > args.python_max_calls:
        table.append(
            (
                "analyze --archive-engine python",
                None,
                f"not run: {call_rows:,} calls is over --python-max-calls {args.python_max_calls:,}",
            )
        )
    else:
        table.append(
            attempt("analyze --archive-engine python", analyze_argv(directory, python_out, args.hours, "python"), env)
        )
    scan = table[1][1]
    assert scan is not None
    print(f"\n{'path':<34} {'seconds':>8} {'M rows/s':>9} {'x scan rate':>11} {'CPU s':>8} {'peak RSS MiB':>13}")
    print("-" * 89)
    for name, measured, why in table:
        if measured is None:
            print(f"{name:<34} {why}")
            continue
        if name.startswith("python -c"):
            print(f"{name:<34} {measured.seconds:>8.2f} {'':>9} {'':>11} {'':>8} {measured.peak_mib:>13.0f}")
            continue
        rate = rows_total / measured.seconds
        print(
            f"{name:<34} {measured.seconds:>8.2f} {rate / 1e6:>9.2f} {scan.seconds / measured.seconds:>11.2f} "
            f"{measured.cpu_seconds:>8.1f} {measured.peak_mib:>13.0f}"
        )
    print(f"rows: {rows_total:,} (calls and feedback); x scan rate: the row's rate over the bare scan's, same run")
    print("load average (1, 5, 15 min) at the end: " + ", ".join(f"{load:.1f}" for load in os.getloadavg()))
    if (python_out / "analysis.json").exists() and (default_out / "analysis.json").exists():
        left = json.loads((default_out / "analysis.json").read_text())
        right = json.loads((python_out / "analysis.json").read_text())
        found = differences(left, right)
        print(
            "analysis.json, --archive-engine duckdb against python: "
            + ("equal, field by field" if not found else f"{len(found)} differences, first: {found[:5]}")
        )
    elif (default_out / "analysis.json").exists():
        summary = json.loads((default_out / "analysis.json").read_text())
        calls = summary["calls"]["calls"]
        print(f"analysis.json: {calls:,} calls analysed, no second engine to compare")
    return 0


def spawn_count(directory: Path, kind: str) -> int:
    """Rows of ``kind`` in the archive, from the files' footers (a child: pyarrow stays out of this process)."""
    code = "import sys, pyarrow.dataset as ds; print(ds.dataset(sys.argv[1], format='parquet').count_rows())"
    measured = spawn([sys.executable, "-c", code, str(directory / kind)])
    return int(measured.output.strip().splitlines()[-1])


if __name__ == "__main__":
    raise SystemExit(main())
