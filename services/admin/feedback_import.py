"""``splitstream feedback import FILE``: outcome events exported from elsewhere, sent to a router's Feedback/Report.

Outcomes often arrive hours later from a warehouse (a purchase, a rating). This reads them from a
CSV file (a header row) or JSON lines, one event per row, with the fields

    model, request_id, routing_key, metric, value, event_time, idempotency_key

(``model`` may come from ``--model`` instead; ``request_id`` or ``routing_key`` is needed;
``event_time`` is RFC 3339, unix seconds, or unix nanoseconds; empty: when the router gets it).

The whole file is checked before anything is sent, with the rules the router applies (and no
idempotency key twice for one model and metric), so a file with a bad row is refused whole (exit 2,
one line naming ``FILE:LINE`` and the field) and a fixed file can simply be imported again. Events
then go in reports of ``--batch-size``; what the router refuses (a model it does not serve) is
listed, the first ``--show-rejected`` of them, and makes the exit code 1. Give each event an
idempotency key and importing the same file twice counts it once.

Exit codes: 0 every event accepted; 1 some rejected, or the router failed part way (the events
before were accepted: import the file again, with idempotency keys nothing counts twice);
2 usage error or a malformed file (nothing sent).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import grpc
from pydantic import BaseModel, ConfigDict, ValidationError

from splitstream.admin.credentials import credential_metadata, read_credential
from splitstream.admin.feedback_flags import MAX_BATCH as MAX_BATCH
from splitstream.common.addresses import check_address
from splitstream.common.errors import ConfigError
from splitstream.common.feedback import EventProblem, check_event
from splitstream.common.proto.splitstream.v1 import feedback_pb2, feedback_pb2_grpc
from splitstream.common.schema import describe
from splitstream.common.tls import client_tls_from_args

FIELDS = ("model", "request_id", "routing_key", "metric", "value", "event_time", "idempotency_key")
FORMATS = {".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl"}
#: Numbers below this are unix seconds (until the year 5138); at or above NS_FROM, nanoseconds. In between
#: (milliseconds, microseconds) is refused rather than guessed.
SECONDS_BELOW = 10**11
NS_FROM = 10**17
#: Statuses worth sending a report again for (the router's queue is full, or it is briefly away).
_RETRIED = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE})
_RETRIES = 5

EXIT_OK, EXIT_REJECTED, EXIT_USAGE = 0, 1, 2


class BadFile(Exception):
    """A file (or one of its rows) that cannot be imported: the message is ``FILE:LINE: field: problem``."""


class RouterFailed(Exception):
    """The router refused a report whole or could not be reached."""


class _Row(BaseModel):
    """One row as the file has it. Lax types (a CSV cell is text: ``"12.5"`` is a value), closed (a column
    that is not a field is a typo, not something to drop silently), finite."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, protected_namespaces=())

    model: str | None = None
    request_id: str = ""
    routing_key: str = ""
    metric: str
    value: float
    event_time: str | int | float | None = None
    idempotency_key: str = ""


@dataclass(frozen=True, slots=True)
class Row:
    line: int
    event: feedback_pb2.FeedbackEvent


@dataclass(slots=True)
class Outcome:
    read: int = 0
    accepted: int = 0
    rejected: int = 0


def run(args: argparse.Namespace, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """``feedback import``: the exit code (see the module docstring). ``out``/``err``: sys.stdout/stderr
    as they are when it runs (not when it was defined: a test or a wrapper may have replaced them)."""
    out = out or sys.stdout
    err = err or sys.stderr
    prog = "splitstream feedback import"
    try:
        check_address(args.router)
    except ValueError as error:
        print(f"{prog}: error: --router: {error}", file=err)
        return EXIT_USAGE
    if not 1 <= args.batch_size <= MAX_BATCH:
        print(f"{prog}: error: --batch-size: must be within 1..{MAX_BATCH}, got {args.batch_size}", file=err)
        return EXIT_USAGE
    if not (math.isfinite(args.timeout_s) and args.timeout_s > 0):
        # 0, negative or nan would fail every report as DEADLINE_EXCEEDED, said as the router failing part way.
        print(f"{prog}: error: --timeout-s: must be a finite number of seconds > 0, got {args.timeout_s}", file=err)
        return EXIT_USAGE
    if args.show_rejected < 0:
        print(f"{prog}: error: --show-rejected: must not be negative, got {args.show_rejected}", file=err)
        return EXIT_USAGE
    try:
        tls = client_tls_from_args(args, flag="--tls")  # the admin CLI's shared --tls* flags
        metadata = credential_metadata(read_credential(args.api_key_file))
    except (ConfigError, ValueError) as error:
        print(f"{prog}: error: {error}", file=err)
        return EXIT_USAGE
    path = Path(args.file)
    try:
        fmt = file_format(path, args.format)
        count = sum(1 for _ in read_rows(path, fmt, args.model, time.time_ns()))  # the whole file, checked
    except BadFile as error:
        print(f"{prog}: error: {error}", file=err)
        return EXIT_USAGE
    outcome = Outcome(read=count)
    shown = 0
    try:
        with tls.channel(args.router) as channel:
            stub = feedback_pb2_grpc.FeedbackStub(channel)
            for batch in _batches(read_rows(path, fmt, args.model, time.time_ns()), args.batch_size):
                reply = _report(stub, batch, args.timeout_s, metadata)
                outcome.accepted += reply.accepted
                outcome.rejected += len(reply.rejected)
                for rejection in reply.rejected:
                    if shown < args.show_rejected:
                        print(f"{path}:{batch[rejection.index].line}: rejected: {rejection.reason}", file=err)
                        shown += 1
    except BadFile as error:  # the file changed between the check and the send
        print(f"{prog}: error: {error}", file=err)
        return EXIT_USAGE
    except RouterFailed as error:
        print(
            f"{prog}: error: router {args.router}: {error} ({outcome.accepted} of {count} events accepted before; "
            "import the file again: events with an idempotency key count once)",
            file=err,
        )
        return EXIT_REJECTED
    if outcome.rejected > shown:
        print(f"... and {outcome.rejected - shown} more rejected", file=err)
    print(f"{path}: {count} events read, {outcome.accepted} accepted, {outcome.rejected} rejected", file=out)
    return EXIT_REJECTED if outcome.rejected else EXIT_OK


def file_format(path: Path, given: str | None) -> str:
    if given:
        return given
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise BadFile(f"{path}: cannot tell the format from the extension: give --format csv or --format jsonl")
    return fmt


def read_rows(path: Path, fmt: str, default_model: str, now_ns: int) -> Iterator[Row]:
    """Each event of the file with its line number, checked as the router would (but for the model
    being served there); raises :class:`BadFile` at the first row that is not an event."""
    try:
        with path.open(encoding="utf-8-sig", newline="") as file:
            line = 0
            #: (model, metric, idempotency key) → the line that has it: the recorder writes a key once per model
            #: and metric, so a second row with it would be "accepted" and silently never written.
            keys: dict[tuple[str, str, str], int] = {}
            try:
                for line, fields in _csv_rows(file, path) if fmt == "csv" else _json_rows(file, path):
                    event = _event(fields, default_model, now_ns, f"{path}:{line}")
                    if event.idempotency_key:
                        first = keys.setdefault((event.model, event.metric, event.idempotency_key), line)
                        if first != line:
                            raise BadFile(
                                f"{path}:{line}: idempotency_key: {event.idempotency_key!r} is on line {first} too "
                                "(same model and metric): this one would never be written"
                            )
                    yield Row(line, event)
            except UnicodeDecodeError:
                raise BadFile(f"{path}:{_first_line_not_utf8(path, line + 1)}: not UTF-8 text") from None
    except OSError as error:
        raise BadFile(f"{path}: {error.strerror or error}") from None


def _first_line_not_utf8(path: Path, fallback: int) -> int:
    """The number of the first line that is not UTF-8: the decoder reads kilobytes ahead, so the line being
    parsed when it failed is not the one holding the bytes (a line break is never inside a UTF-8 character,
    so lines decode alone)."""
    with path.open("rb") as file:
        for number, data in enumerate(file, start=1):
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                return number
    return fallback


def _csv_rows(file: TextIO, path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    reader = csv.DictReader(file, strict=True)
    try:
        header = reader.fieldnames
        if not header:
            raise BadFile(f"{path}:1: no header row (expected some of {', '.join(FIELDS)})")
        unknown = [name for name in header if name not in FIELDS]
        if unknown:
            raise BadFile(f"{path}:1: {unknown[0]!r}: unknown column (expected some of {', '.join(FIELDS)})")
        twice = [name for name in header if header.count(name) > 1]
        if twice:  # the last cell would win, silently
            raise BadFile(f"{path}:1: {twice[0]!r}: named twice in the header")
        for cells in reader:
            if None in cells:  # more cells than the header names
                raise BadFile(f"{path}:{reader.line_num}: more cells than the header has columns")
            # An empty cell is an absent field: its default applies.
            yield reader.line_num, {name: value for name, value in cells.items() if value not in ("", None)}
    except csv.Error as error:
        # The line after the last whole record: where the one that failed starts (DictReader's line_num is only
        # moved by a whole record; an unclosed quote is found at the end of the file).
        raise BadFile(f"{path}:{reader.line_num + 1}: not CSV: {error}") from None


def _json_rows(file: TextIO, path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    for number, text in enumerate(file, start=1):
        if not text.strip():
            continue
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as error:
            raise BadFile(f"{path}:{number}: not JSON: {error.msg} (column {error.colno})") from None
        except ValueError as error:  # an integer of more digits than Python converts
            raise BadFile(f"{path}:{number}: not JSON: {str(error).split(';')[0]}") from None
        if not isinstance(fields, dict):
            raise BadFile(f"{path}:{number}: not a JSON object, one event a line")
        yield number, {name: value for name, value in fields.items() if value is not None}


def _event(fields: dict[str, Any], default_model: str, now_ns: int, where: str) -> feedback_pb2.FeedbackEvent:
    try:
        row = _Row.model_validate(fields)
    except ValidationError as error:
        raise BadFile(f"{where}: {describe(error)}") from None
    model = row.model or default_model
    if not model:
        raise BadFile(f"{where}: model: is required (no model field, and no --model)")
    event = feedback_pb2.FeedbackEvent(
        model=model,
        request_id=row.request_id,
        routing_key=row.routing_key,
        metric=row.metric,
        value=row.value,
        event_unix_ns=event_time_ns(row.event_time, where),
        idempotency_key=row.idempotency_key,
    )
    try:
        check_event(event, receive_unix_ns=now_ns)
    except EventProblem as problem:
        raise BadFile(f"{where}: {problem}") from None
    return event


def event_time_ns(value: str | int | float | None, where: str) -> int:
    """RFC 3339 (``2026-11-30T21:00:00Z``, an offset is required), unix seconds (fractions allowed) or unix
    nanoseconds → unix ns; None → 0 (the router's receive time)."""
    if value is None:
        return 0
    if isinstance(value, str):
        text = value.strip()
        try:
            number: float = float(text)
        except ValueError:
            return _rfc3339_ns(text, where)
    else:
        number = value
    if not math.isfinite(number) or number < 0:
        raise BadFile(f"{where}: event_time: {value!r} is not a time")
    if number < SECONDS_BELOW:
        return round(number * 10**9)
    if number >= NS_FROM:
        ns = int(text) if isinstance(value, str) and text.isdigit() else int(number)
        return _in_range(ns, value, where)
    raise BadFile(
        f"{where}: event_time: {value!r} looks like milliseconds or microseconds: give unix seconds, "
        "unix nanoseconds or RFC 3339"
    )


def _rfc3339_ns(text: str, where: str) -> int:
    try:
        moment = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise BadFile(
            f"{where}: event_time: {text!r} is not RFC 3339 (e.g. 2026-11-30T21:00:00Z) or unix time"
        ) from None
    if moment.tzinfo is None:
        raise BadFile(f"{where}: event_time: {text!r} has no time zone (add Z or +HH:MM)")
    delta = moment - datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
    return _in_range((delta.days * 86_400 + delta.seconds) * 10**9 + delta.microseconds * 1000, text, where)


def _in_range(ns: int, value: object, where: str) -> int:
    """``ns`` if an event's int64 field holds it (1970 to 2262); else the row is refused, not a traceback."""
    if not 0 <= ns < 2**63:
        raise BadFile(f"{where}: event_time: {value!r} is out of range (1970 to 2262)")
    return ns


def _batches(rows: Iterator[Row], size: int) -> Iterator[list[Row]]:
    batch: list[Row] = []
    for row in rows:
        batch.append(row)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _report(
    stub: feedback_pb2_grpc.FeedbackStub,
    batch: Sequence[Row],
    timeout_s: float,
    metadata: Sequence[tuple[str, str]] = (),
) -> feedback_pb2.FeedbackReply:
    """Send one report; a full queue or a router briefly away is tried again, with backoff."""
    request = feedback_pb2.FeedbackReport(events=[row.event for row in batch])
    delay_s = 0.5
    for attempt in range(_RETRIES + 1):
        try:
            reply: feedback_pb2.FeedbackReply = stub.Report(request, timeout=timeout_s, metadata=metadata)
            return reply
        except grpc.RpcError as error:
            code = error.code() if isinstance(error, grpc.Call) else grpc.StatusCode.UNKNOWN
            details = error.details() if isinstance(error, grpc.Call) else str(error)
            if code not in _RETRIED or attempt == _RETRIES:
                raise RouterFailed(f"{code.name}: {details}") from None
            time.sleep(delay_s)
            delay_s = min(delay_s * 2, 4.0)
    raise AssertionError("unreachable: the last attempt returns or raises")
