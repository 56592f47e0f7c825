"""The archive: recorded calls and outcome events kept as Parquet on a filesystem or object store.

The archiver (``splitstream-archive``) writes it; the replayer and the analysis read it back.
This module is the one place that knows its layout:

- ``<base>/calls/model=<m>/date=<YYYY-MM-DD>/hour=<HH>/<first>_<last>.parquet``: call records,
  partitioned by the time the router *received* each call (UTC), so a receive-time window
  opens only the hours it overlaps. ``<first>``/``<last>`` are the stream ids of the first and
  last entry the file holds: an archiver that crashed before acknowledging a file writes the
  same entries under the same name again, replacing the object rather than adding a copy.
- ``<base>/feedback/model=<m>/date=.../hour=.../<first>_<last>.parquet``: outcome events.

Each call row holds the readable columns (:data:`CALL_SCHEMA`) and ``record``, the serialized
``CallRecord`` with every payload inlined from its blob: a file stands alone once Redis has
forgotten the blobs. Payloads stay bytes (a binary column), never base64. Files are zstd-compressed;
the archive's layout version is in each file's metadata (``splitstream.archive_schema``) like
``CallRecord.schema_version``. Delivery is at least once, so readers de-duplicate by request id.

URLs: a path or ``file:///path`` (a local directory), ``s3://bucket/prefix`` (any S3-compatible
store: ``?endpoint_override=host:port&scheme=http&region=...`` in the URL or an endpoint given
separately; credentials from the usual ``AWS_*`` variables), or any other URI pyarrow's
filesystems understand (``gs://``, ``hdfs://``, ``abfs://``).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import os
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, quote, urlsplit

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

if TYPE_CHECKING:
    # Imported where a read needs it (:func:`_sweep`): it brings pandas, half the CPU of importing this module,
    # which every replayer and archiver start would pay even when it reads no archive.
    import pyarrow.dataset as ds

from splitstream.common.records import StoredRecord, decode_record

#: The archive layout this code writes and reads (file metadata ``splitstream.archive_schema``).
ARCHIVE_SCHEMA_VERSION = 1
SCHEMA_METADATA_KEY = b"splitstream.archive_schema"
CALLS = "calls"
FEEDBACK = "feedback"

#: One row per call. ``model``, ``date`` and ``hour`` come from the partition directories.
CALL_SCHEMA = pa.schema(
    [
        ("request_id", pa.string()),
        ("receive_time", pa.timestamp("ns", tz="UTC")),
        ("version", pa.string()),
        ("arm", pa.string()),
        ("assignment", pa.string()),
        ("phase", pa.string()),
        ("status", pa.string()),
        ("status_code", pa.int32()),
        ("latency_ms", pa.float64()),
        ("routing_key_hmac", pa.string()),
        ("principal", pa.string()),
        ("tags", pa.map_(pa.string(), pa.string())),
        ("streamed", pa.bool_()),
        ("stream_id", pa.string()),
        ("record", pa.binary()),
        # Token streams (null for a unary call, and in files written before these columns existed):
        # time to the first response in ms (null when none came) and the responses received.
        ("ttft_ms", pa.float64()),
        ("tokens", pa.int64()),
        # Tokens in and out of a generation (splitstream.common.token_usage; null where unknown, and in files
        # written before these columns existed).
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
    ],
    metadata={SCHEMA_METADATA_KEY: str(ARCHIVE_SCHEMA_VERSION).encode()},
)

#: One row per outcome event (the fields of :func:`splitstream.common.records.feedback_entry_fields`).
FEEDBACK_SCHEMA = pa.schema(
    [
        ("request_id", pa.string()),
        ("unit", pa.string()),
        ("metric", pa.string()),
        ("value", pa.float64()),
        ("event_time", pa.timestamp("ns", tz="UTC")),
        ("receive_time", pa.timestamp("ns", tz="UTC")),
        ("idempotency_key", pa.string()),
        ("stream_id", pa.string()),
    ],
    metadata={SCHEMA_METADATA_KEY: str(ARCHIVE_SCHEMA_VERSION).encode()},
)


class ArchiveError(Exception):
    """The archive cannot be used: a URL that names no usable filesystem, a bucket that does not exist,
    credentials refused, a store that does not answer. The message is one line for a person."""


@dataclass(frozen=True, slots=True)
class Archive:
    """An archive location: a pyarrow filesystem and the base path inside it (no trailing slash)."""

    url: str
    filesystem: pafs.FileSystem
    base: str
    #: An S3 archive's endpoint (``http(s)://host:port``, empty: AWS) and region, for the calls pyarrow does
    #: not make (:func:`remove_abandoned_writes`).
    s3_endpoint: str = ""
    s3_region: str = ""

    @property
    def is_local(self) -> bool:
        return isinstance(self.filesystem, pafs.LocalFileSystem)

    def path(self, *parts: str) -> str:
        return "/".join([self.base, *parts]) if self.base else "/".join(parts)


def open_archive(url: str, *, endpoint: str = "") -> Archive:
    """The archive at ``url`` (see the module docstring); ``endpoint`` overrides an S3 endpoint
    (``http://host:port``). Raises :class:`ArchiveError` for a URL that names nothing usable; does not
    touch the store (see :func:`check_archive`)."""
    text = url.strip()
    if not text:
        raise ArchiveError("empty archive URL")
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if endpoint and scheme != "s3":  # ignored, the files would go somewhere the user did not mean
        raise ArchiveError(f"an S3 endpoint ({endpoint!r}) applies to s3:// archives only, not to {url!r}")
    if scheme in ("", "file") or (len(scheme) == 1 and os.name == "nt"):
        path = parts.path if scheme == "file" else text
        if scheme == "file" and parts.netloc not in ("", "localhost"):
            raise ArchiveError(f"archive URL {url!r}: file URLs name a local path (file:///dir), not a host")
        if not path:
            raise ArchiveError(f"archive URL {url!r} names no directory")
        return Archive(url, pafs.LocalFileSystem(), os.path.abspath(path).rstrip("/") or "/")
    if scheme == "s3":
        return _open_s3(url, parts.netloc, parts.path, dict(parse_qsl(parts.query)), endpoint)
    try:
        filesystem, path = pafs.FileSystem.from_uri(text)
    except (ValueError, OSError, pa.ArrowException) as error:
        raise ArchiveError(f"archive URL {url!r}: {_one_line(error)}") from None
    return Archive(url, filesystem, path.rstrip("/"))


def _open_s3(url: str, bucket: str, path: str, query: dict[str, str], endpoint: str) -> Archive:
    if not bucket:
        raise ArchiveError(f"archive URL {url!r} names no bucket (expected s3://bucket/prefix)")
    known = {"endpoint_override", "scheme", "region"}
    unknown = sorted(set(query) - known)
    if unknown:
        raise ArchiveError(f"archive URL {url!r}: unknown option {unknown[0]!r} (known: {', '.join(sorted(known))})")
    scheme = query.get("scheme", "https")
    override = query.get("endpoint_override", "")
    if endpoint:
        target = urlsplit(endpoint if "://" in endpoint else f"{scheme}://{endpoint}")
        if target.scheme not in ("http", "https") or not target.netloc:
            raise ArchiveError(f"S3 endpoint {endpoint!r}: expected http://host:port or https://host:port")
        if target.path.strip("/") or target.query or target.fragment:  # pyarrow would drop them silently
            raise ArchiveError(
                f"S3 endpoint {endpoint!r}: an endpoint is http(s)://host:port with no path "
                "(put a prefix in the archive URL: s3://bucket/prefix)"
            )
        scheme, override = target.scheme, target.netloc
    if scheme not in ("http", "https"):
        raise ArchiveError(f"archive URL {url!r}: scheme must be http or https, got {scheme!r}")
    # A custom endpoint (MinIO, Ceph, R2) needs no region lookup; AWS itself resolves the bucket's region.
    region = query.get("region") or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    try:
        filesystem = pafs.S3FileSystem(
            endpoint_override=override or None,
            scheme=scheme,
            region=region,
            connect_timeout=5,
            request_timeout=30,
        )
    except (ValueError, OSError, pa.ArrowException) as error:
        raise ArchiveError(f"archive URL {url!r}: {_one_line(error)}") from None
    endpoint_url = f"{scheme}://{override}" if override else ""
    return Archive(url, filesystem, f"{bucket}{path}".rstrip("/"), s3_endpoint=endpoint_url, s3_region=region)


def check_archive(archive: Archive, *, create: bool) -> None:
    """Raise :class:`ArchiveError` unless the archive can be listed (and, with ``create``, written:
    a local directory is created; a bucket must exist already). Blocking: call it in a thread."""
    try:
        if archive.is_local:
            if create:
                archive.filesystem.create_dir(archive.base, recursive=True)
            info = archive.filesystem.get_file_info(archive.base)
            if info.type != pafs.FileType.Directory:
                raise ArchiveError(f"archive {archive.url!r}: {archive.base} is not a directory")
            if create and not os.access(archive.base, os.W_OK):
                raise ArchiveError(f"archive {archive.url!r}: {archive.base} is not writable")
            return
        bucket = archive.base.split("/", 1)[0]
        info = archive.filesystem.get_file_info(bucket)
        if info.type == pafs.FileType.NotFound:
            raise ArchiveError(f"archive {archive.url!r}: bucket {bucket!r} does not exist")
        archive.filesystem.get_file_info(pafs.FileSelector(archive.base, allow_not_found=True))
    except ArchiveError:
        raise
    except (OSError, pa.ArrowException) as error:
        raise ArchiveError(f"archive {archive.url!r} is not usable: {_one_line(error)}") from None


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text[:300] if text else type(error).__name__


# -- writing -----------------------------------------------------------------------------------


def partition_dir(kind: str, model: str, receive_ns: int) -> str:
    """``calls/model=m/date=2026-11-30/hour=07`` for a call received then (UTC). ``/``, ``%``, ``\\``
    and characters that are not printable in a model name are percent-encoded (:func:`_escape`), so a name
    never escapes its directory nor hides what it is."""
    when = dt.datetime.fromtimestamp(receive_ns / 1e9, tz=dt.UTC)
    return f"{kind}/model={_escape(model)}/date={when:%Y-%m-%d}/hour={when:%H}"


#: The most bytes of a model's directory name after ``model=``: a filesystem takes 255 a name, and a model
#: name may be 200 characters of up to 4 bytes each (or 3 once a ``/`` is escaped).
_MAX_ESCAPED_BYTES = 255 - len("model=")


def model_dirs(archive: Archive, kind: str, model: str) -> list[str]:
    """The directories that may hold ``model``'s files of ``kind``: its own, and for a name cut to fit
    (:func:`_escape`) in an object store, the uncut one the store took before names were cut (a local
    directory never could: asking for it fails, too long)."""
    names = [_escape(model)]
    if not archive.is_local:
        names.append(_escape(model, cut=False))
    # Written before every character that is not printable was escaped (only the ASCII controls were): DEL, C1
    # controls, line separators and format characters went into the name as they were.
    names.append(_escape(model, printable=False))
    return [archive.path(kind, f"model={name}") for name in dict.fromkeys(names)]


def holds_model(archive: Archive, model: str) -> bool:
    """Whether the archive holds calls of ``model`` (a directory of its). Blocking. Raises
    :class:`ArchiveError` when the store cannot be asked."""
    try:
        found = archive.filesystem.get_file_info(model_dirs(archive, CALLS, model))
    except (OSError, pa.ArrowException) as error:
        raise ArchiveError(f"archive {archive.url!r} cannot be listed: {_one_line(error)}") from None
    return any(info.type == pafs.FileType.Directory for info in found)


def _escape(name: str, *, cut: bool = True, printable: bool = True) -> str:
    """The model's name in its partition directory: ``/``, ``%``, ``\\`` and every character that is not
    printable (controls, DEL, C1 controls, line and paragraph separators, format characters such as a
    right-to-left override) percent-encoded as UTF-8 bytes, so a path shown in a terminal or a log is what it
    seems. (``printable`` False: the older rule, which escaped only the ASCII controls, to find what it wrote.)

    One longer than :data:`_MAX_ESCAPED_BYTES` once escaped is cut, and the digest of the whole name added
    after ``%~`` (no escaped name holds ``%`` without two hex digits after it, so it names no other model): a
    filesystem refused it (ENAMETOOLONG), and its file, failing on every retry, held every other model's files
    back with it: the whole archive stalled."""
    pieces = [
        quote(c, safe="", errors="surrogatepass")
        if c in "/%\\" or ord(c) < 32 or (printable and not c.isprintable() and c != " ")
        else c
        for c in name
    ]
    escaped = "".join(pieces) or "%00"
    if not cut or len(escaped.encode()) <= _MAX_ESCAPED_BYTES:
        return escaped
    suffix = "%~" + hashlib.sha256(name.encode()).hexdigest()[:16]
    kept, size = [], len(suffix)
    for piece in pieces:
        size += len(piece.encode())
        if size > _MAX_ESCAPED_BYTES:
            break
        kept.append(piece)
    return "".join(kept) + suffix


def file_name(first_stream_id: str, last_stream_id: str) -> str:
    return f"{first_stream_id}_{last_stream_id}.parquet"


def write_file(archive: Archive, relative_path: str, table: pa.Table, *, row_group_rows: int = 64 * 1024) -> int:
    """Write ``table`` at ``relative_path`` (zstd); returns the bytes written. Blocking.

    An object store makes an object visible only once its upload completed; a local file is
    written under a hidden name (readers skip names starting with ``.``) and renamed, so readers
    never meet half a file either way, and a second write of the same name replaces the first. A
    local write that fails (a full disk, a rename refused) removes its temporary file."""
    final = archive.path(relative_path)
    directory, _, name = final.rpartition("/")
    target = final
    if archive.is_local:
        archive.filesystem.create_dir(directory, recursive=True)
        target = f"{directory}/.{name}.{uuid.uuid4().hex}.tmp"
    try:
        with archive.filesystem.open_output_stream(target) as sink:
            pq.write_table(
                table,
                sink,
                compression="zstd",
                row_group_size=row_group_rows,
                # Serialized records are all distinct: a dictionary is tried and given up, and their min/max
                # statistics say nothing (measured: ~1 µs a row of a call file's write).
                use_dictionary=[name for name in table.column_names if name != "record"],
                write_statistics=[name for name in table.column_names if name != "record"],
            )
            written = sink.tell()
        if target != final:
            archive.filesystem.move(target, final)
    except BaseException:
        if target != final:
            _remove_quietly(target)
        raise
    return int(written)


def _remove_quietly(path: str) -> None:
    """Remove a failed write's temporary file (a full disk, a rename refused): each retry would otherwise leave
    one more, taking the room a full disk has left, until an archiver's start removed them."""
    with contextlib.suppress(OSError):
        os.unlink(path)


def is_temporary_name(name: str) -> bool:
    """A local file :func:`write_file` has not renamed yet: ``.<first>_<last>.parquet.<uuid>.tmp``."""
    return name.startswith(".") and name.endswith(".tmp") and ".parquet." in name


@dataclass(frozen=True, slots=True)
class Abandoned:
    """What :func:`remove_abandoned_writes` removed, and the temporary files it could not remove (path, why)."""

    files: int = 0
    uploads: int = 0
    left: tuple[tuple[str, str], ...] = ()


def remove_abandoned_writes(archive: Archive, *, older_than_s: float) -> Abandoned:
    """Remove what writes that died mid-file left: a directory's hidden temporary files last written more than
    ``older_than_s`` ago, an S3 bucket's multipart uploads under the archive's ``calls/`` and ``feedback/``
    started more than ``older_than_s`` ago (aborted: their parts are kept, and billed, until then). Readers
    skip both; nothing else removes them. Younger ones are left: another archiver may be writing them.
    Other stores (gs://, hdfs://...): nothing. Blocking: call it in a thread. Raises :class:`ArchiveError`."""
    cutoff = time.time() - older_than_s
    try:
        if archive.is_local:
            removed, left = _remove_temporary_files(archive, cutoff)
            return Abandoned(files=removed, left=tuple(left))
        if isinstance(archive.filesystem, pafs.S3FileSystem):
            return Abandoned(uploads=_abort_multipart_uploads(archive, cutoff))
    except ArchiveError:
        raise
    except Exception as error:  # OSError, and botocore's errors (no common base worth importing)
        raise ArchiveError(f"archive {archive.url!r}: abandoned writes not removed: {_one_line(error)}") from None
    return Abandoned()


def _remove_temporary_files(archive: Archive, cutoff: float) -> tuple[int, list[tuple[str, str]]]:
    """How many were removed, and those that could not be (path, the error): one that cannot be removed (its
    directory read-only to this user, an immutable file) is left to a person, and the others are still removed
    (the first such file used to end the cleanup, and the rest stayed)."""
    removed = 0
    left: list[tuple[str, str]] = []
    for kind in (CALLS, FEEDBACK):
        for directory, _, names in os.walk(archive.path(kind)):
            for name in names:
                if not is_temporary_name(name):
                    continue
                path = os.path.join(directory, name)
                try:
                    if os.stat(path).st_mtime < cutoff:
                        os.unlink(path)
                        removed += 1
                except FileNotFoundError:  # renamed or removed meanwhile
                    continue
                except OSError as error:
                    left.append((path, error.strerror or _one_line(error)))
    return removed, left


def _abort_multipart_uploads(archive: Archive, cutoff: float) -> int:
    import boto3  # here: only an S3 archiver needs it, and it takes a while to import
    from botocore.config import Config

    bucket, _, prefix = archive.base.partition("/")
    client = boto3.client(
        "s3",
        endpoint_url=archive.s3_endpoint or None,
        region_name=archive.s3_region or None,
        config=Config(connect_timeout=5, read_timeout=30, retries={"max_attempts": 3}),
    )
    aborted = 0
    for kind in (CALLS, FEEDBACK):
        under = f"{prefix}/{kind}/" if prefix else f"{kind}/"
        for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=under):
            for upload in page.get("Uploads", []):
                if upload["Initiated"].timestamp() < cutoff and upload["Key"].endswith(".parquet"):
                    client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                    aborted += 1
    return aborted


# -- reading -----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ArchiveQuery:
    """A receive-time window ``[since_ns, until_ns)`` of one model, with optional filters pushed down to
    the Parquet reader: empty ``versions``/``principals`` and ``status_codes`` None mean "any";
    ``failed_only`` keeps the calls whose status is not OK (a replay's ``--errors-only``)."""

    model: str
    since_ns: int
    until_ns: int
    versions: frozenset[str] = frozenset()
    status_codes: frozenset[int] | None = None
    failed_only: bool = False
    principals: frozenset[str] = frozenset()


#: The receive times a Parquet ``timestamp[ns]`` holds (int64 ns: 1677..2262). A window reaching past them
#: (``--until 9999-12-31T00:00:00Z``, which the time flags accept) is read as cut to them, not left to
#: overflow (a traceback) at the first file.
_FIRST_NS, _LAST_NS = -(2**63), 2**63 - 1
_HOUR_NS = 3600 * 10**9
_DAY_NS = 24 * _HOUR_NS
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def _day_start_ns(name: str) -> int | None:
    """The start of a ``date=YYYY-MM-DD`` partition (UTC), None for a name the archiver never writes."""
    try:
        day = dt.datetime.strptime(name.removeprefix("date="), "%Y-%m-%d").replace(tzinfo=dt.UTC)
    except ValueError:
        return None
    return (day - _EPOCH) // dt.timedelta(seconds=1) * 10**9


def _hour_of(name: str) -> int | None:
    """The hour of an ``hour=HH`` partition, None for a name the archiver never writes."""
    hour = name.removeprefix("hour=")
    return int(hour) if hour.isascii() and hour.isdigit() and int(hour) < 24 else None


def _partition_files(archive: Archive, kind: str, model: str, since_ns: int, until_ns: int) -> dict[int, list[str]]:
    """The Parquet files of the hours the window overlaps, by the hour's start: only their directories are
    listed (one listing of the model's dates, then one per date in the window), never the whole archive.
    Partitions are picked by comparing their times with the window's ends, not by naming every hour the
    window spans (a window from 1970 to 9999 is 70 million hours)."""
    files: dict[int, list[str]] = {}
    try:
        day_dirs = [
            day
            for directory in model_dirs(archive, kind, model)
            for day in archive.filesystem.get_file_info(pafs.FileSelector(directory, allow_not_found=True))
        ]
        for day in day_dirs:
            day_ns = _day_start_ns(day.base_name)
            if day.type != pafs.FileType.Directory or day_ns is None or not since_ns - _DAY_NS < day_ns < until_ns:
                continue
            for hour_dir in archive.filesystem.get_file_info(pafs.FileSelector(day.path, allow_not_found=True)):
                hour = _hour_of(hour_dir.base_name)
                if hour_dir.type != pafs.FileType.Directory or hour is None:
                    continue
                hour_ns = day_ns + hour * _HOUR_NS
                if not since_ns - _HOUR_NS < hour_ns < until_ns:
                    continue
                for entry in archive.filesystem.get_file_info(pafs.FileSelector(hour_dir.path)):
                    name = entry.base_name
                    if entry.type == pafs.FileType.File and name.endswith(".parquet") and not name.startswith("."):
                        files.setdefault(hour_ns, []).append(entry.path)
    except (OSError, pa.ArrowException) as error:
        raise ArchiveError(f"archive {archive.url!r} cannot be listed: {_one_line(error)}") from None
    return {key: sorted(paths) for key, paths in sorted(files.items())}


def window_files(archive: Archive, kind: str, model: str, since_ns: int, until_ns: int) -> list[str]:
    """The Parquet files of ``kind`` (:data:`CALLS` or :data:`FEEDBACK`) in the hours the receive-time window
    ``[since_ns, until_ns)`` overlaps, for another engine to read (the analysis's DuckDB). Blocking. Raises
    :class:`ArchiveError` when the store cannot be listed."""
    return [path for paths in _partition_files(archive, kind, model, since_ns, until_ns).values() for path in paths]


def _time_filter(since_ns: int, until_ns: int) -> ds.Expression:
    since = pa.scalar(min(max(since_ns, _FIRST_NS), _LAST_NS), type=pa.timestamp("ns", tz="UTC"))
    until = pa.scalar(min(max(until_ns, _FIRST_NS), _LAST_NS), type=pa.timestamp("ns", tz="UTC"))
    return (pc.field("receive_time") >= since) & (pc.field("receive_time") < until)


def read_calls(archive: Archive, query: ArchiveQuery, *, columns: Sequence[str] | None = None) -> pa.Table:
    """The archived calls of ``query``'s window, one row per request id (the earliest stream id kept),
    sorted by receive time. Partition pruning picks the hours; receive time, version, status and principal
    are pushed down to the Parquet reader (row groups whose statistics exclude them are not read).
    Columns: :data:`CALL_SCHEMA`'s (or ``columns``) plus ``model``. Blocking: run it in a thread.
    Raises :class:`ArchiveError` when the store fails. This holds the whole window in memory; a long
    one is better read as it comes (:func:`iter_calls`)."""
    wanted = list(columns) if columns is not None else [field.name for field in CALL_SCHEMA]
    parts = list(iter_calls(archive, query, columns=columns))
    if not parts:
        empty = CALL_SCHEMA.empty_table().select([c for c in wanted if c != "model"])
        return _with_model(empty, query.model).select([*wanted, "model"] if "model" not in wanted else wanted)
    return pa.concat_tables(parts)


def iter_calls(archive: Archive, query: ArchiveQuery, *, columns: Sequence[str] | None = None) -> Iterator[pa.Table]:
    """The rows of :func:`read_calls` in parts of at most about a row group (64 Ki rows as the archiver
    writes them) each, in receive-time order, so memory stays bounded by a part however long the window.

    Within an hour partition the files' row groups are read in the order of their smallest receive time
    (the Parquet statistics: a file named by its stream id range holds its rows in stream id order,
    nearly receive-time order, and files of several archivers overlap); after each, the rows received
    before the next row group's smallest receive time can come from nothing still unread: they are
    sorted, de-duplicated and yielded. Copies of a call share its receive time, so they meet in one
    part: de-duplication keeps no state across parts. Each ``next`` blocks: call it in a thread."""
    for parts in _hour_parts(archive, query, columns):
        yield from parts


def _hour_parts(archive: Archive, query: ArchiveQuery, columns: Sequence[str] | None) -> Iterator[Iterator[pa.Table]]:
    wanted = list(columns) if columns is not None else [field.name for field in CALL_SCHEMA]
    read_columns = list(
        dict.fromkeys([c for c in wanted if c != "model"] + ["request_id", "stream_id", "receive_time"])
    )
    selected = [*wanted, "model"] if "model" not in wanted else wanted
    expression = _time_filter(query.since_ns, query.until_ns)
    if query.versions:
        expression &= pc.field("version").isin(sorted(query.versions))
    if query.status_codes is not None:
        expression &= pc.field("status_code").isin(sorted(query.status_codes))
    if query.failed_only:
        expression &= pc.field("status_code") != 0
    if query.principals:
        expression &= pc.field("principal").isin(sorted(query.principals))
    for files in _partition_files(archive, CALLS, query.model, query.since_ns, query.until_ns).values():
        parts = _sweep(archive, files, CALL_SCHEMA, read_columns, expression, "request_id")
        yield (_with_model(part, query.model).select(selected) for part in parts)


def _sweep(
    archive: Archive,
    files: list[str],
    schema: pa.Schema,
    columns: list[str],
    expression: ds.Expression,
    key: str,
) -> Iterator[pa.Table]:
    """One hour partition's rows in receive-time order, one per ``key`` (see :func:`_unique_first`), a
    part per row group read."""
    import pyarrow.dataset as ds

    try:
        dataset = ds.dataset(files, schema=schema, filesystem=archive.filesystem, format="parquet")
        _check_versions(archive, dataset)
        # Row groups whose statistics exclude the filter are left out here, without being read.
        groups = [piece for fragment in dataset.get_fragments() for piece in fragment.split_by_row_group(expression)]
    except (OSError, pa.ArrowException) as error:
        raise ArchiveError(f"archive {archive.url!r} cannot be read: {_one_line(error)}") from None
    units = sorted(((_smallest_receive_ns(group), group.path, group.row_groups[0].id), group) for group in groups)
    held: pa.Table | None = None
    for index, (_, group) in enumerate(units):
        try:
            scanner = ds.Scanner.from_fragment(group, schema=schema, columns=columns, filter=expression)
            table = pa.Table.from_batches(scanner.to_batches(), schema=scanner.projected_schema)
        except (OSError, pa.ArrowException) as error:
            raise ArchiveError(f"archive {archive.url!r} cannot be read: {_one_line(error)}") from None
        held = table if held is None else pa.concat_tables([held, table])
        if index + 1 < len(units):
            bound = pa.scalar(units[index + 1][0][0], type=pa.timestamp("ns", tz="UTC"))
            earlier = pc.less(held["receive_time"], bound)
            ready, held = held.filter(earlier), held.filter(pc.invert(earlier))
        else:
            ready, held = held, None
        if ready.num_rows:
            yield _unique_first(ready, key)


def _smallest_receive_ns(group: ds.ParquetFileFragment) -> int:
    """The row group's smallest receive time by its statistics; -1 without them (read it first: a
    lower bound all the same)."""
    stats = group.row_groups[0].statistics.get("receive_time") or {}
    smallest = stats.get("min")
    if smallest is None:
        return -1
    if hasattr(smallest, "value"):  # pandas' Timestamp (pyarrow gives one when pandas is installed)
        return int(smallest.value)
    if isinstance(smallest, dt.datetime):  # µs precision: floored, still a lower bound
        if smallest.tzinfo is None:
            smallest = smallest.replace(tzinfo=dt.UTC)
        return (smallest - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)) // dt.timedelta(microseconds=1) * 1000
    return int(smallest)


def _check_versions(archive: Archive, dataset: ds.FileSystemDataset) -> None:
    """Refuse files a newer splitstream wrote (their layout may mean something else), as records of a
    newer ``schema_version`` are refused. Reads each file's footer, which the scan then reuses."""
    for fragment in dataset.get_fragments():
        metadata = fragment.physical_schema.metadata or {}
        version = int(metadata.get(SCHEMA_METADATA_KEY, b"0") or 0)
        if version > ARCHIVE_SCHEMA_VERSION:
            raise ArchiveError(
                f"archive {archive.url!r}: {fragment.path} has archive schema {version}; "
                f"this reader knows up to {ARCHIVE_SCHEMA_VERSION}"
            )


def _with_model(table: pa.Table, model: str) -> pa.Table:
    return table.append_column("model", pa.array([model] * table.num_rows, type=pa.string()))


def _unique_first(table: pa.Table, key: str = "request_id") -> pa.Table:
    """One row per ``key``, the one with the earliest stream id, then sorted by receive time. The order
    is worked out on the key columns alone and the table taken once (a part's records are its bulk)."""
    stream_ids = table["stream_id"]
    parts = pc.split_pattern(stream_ids, "-")
    keys = pa.table(
        {
            "key": table[key],
            "receive_time": table["receive_time"],
            "stream_id": stream_ids,
            "_ms": pc.cast(pc.list_element(parts, 0), pa.int64()),
            "_seq": pc.cast(pc.list_element(parts, 1), pa.int64()),
            "_row": pa.array(range(table.num_rows), type=pa.int64()),
        }
    )
    by_id = keys.sort_by([("_ms", "ascending"), ("_seq", "ascending")])
    firsts = by_id.group_by("key", use_threads=False).aggregate([("_row", "first")])["_row_first"]
    kept = keys.take(firsts).sort_by([("receive_time", "ascending"), ("stream_id", "ascending")])
    return table.take(kept["_row"])


def stored_records(table: pa.Table) -> list[StoredRecord]:
    """The rows of :func:`read_calls` (``record`` and ``stream_id`` columns) as the Redis reader's
    :class:`StoredRecord`\\ s, in the table's order."""
    return [
        StoredRecord(stream_id, decode_record(data))
        for stream_id, data in zip(table["stream_id"].to_pylist(), table["record"].to_pylist(), strict=True)
    ]


def read_feedback(archive: Archive, model: str, since_ns: int, until_ns: int) -> pa.Table:
    """The archived outcome events of ``model`` received in ``[since_ns, until_ns)``, de-duplicated by
    stream id (an event is written once per id; a re-archived file repeats ids), by receive time.
    Columns: :data:`FEEDBACK_SCHEMA`'s plus ``model``. Blocking. This holds the whole window in memory; a
    long one is better read as it comes (:func:`iter_feedback`)."""
    parts = list(iter_feedback(archive, model, since_ns, until_ns))
    return pa.concat_tables(parts) if parts else _with_model(FEEDBACK_SCHEMA.empty_table(), model)


def iter_feedback(archive: Archive, model: str, since_ns: int, until_ns: int) -> Iterator[pa.Table]:
    """The rows of :func:`read_feedback` in parts of at most about a row group each, in receive-time order,
    as :func:`iter_calls` reads calls (a copy of an event shares its stream id and receive time, so copies
    meet in one part). Each ``next`` blocks: call it in a thread. Raises :class:`ArchiveError`."""
    expression = _time_filter(since_ns, until_ns)
    for files in _partition_files(archive, FEEDBACK, model, since_ns, until_ns).values():
        for part in _sweep(archive, files, FEEDBACK_SCHEMA, FEEDBACK_SCHEMA.names, expression, "stream_id"):
            yield _with_model(part, model)


#: The readable fields of a call stream entry (:func:`splitstream.common.records.entry_fields`), as columns.
ENTRY_COLUMNS = (
    "request_id",
    "time_ns",
    "model",
    "version",
    "status",
    "latency_ms",
    "arm",
    "assignment",
    "phase",
    "unit",
    "ttft_ms",
    "tokens",
    "prompt_tokens",
    "completion_tokens",
)


def readable_calls(archive: Archive, query: ArchiveQuery) -> pa.Table:
    """The archived calls of ``query`` as the columns a call stream entry has (:data:`ENTRY_COLUMNS`:
    ``time_ns`` an int64, ``unit`` the routing-key HMAC) plus ``principal``: what an analysis that reads
    Redis column by column gets, so it can read the archive the same way. One row per request id
    (``ttft_ms``/``tokens`` null for unary calls and in files older than those columns). Blocking."""
    columns = ["request_id", "receive_time", "version", "status", "latency_ms", "arm", "assignment", "phase"]
    usage = ["ttft_ms", "tokens", "prompt_tokens", "completion_tokens"]
    table = read_calls(archive, query, columns=[*columns, "routing_key_hmac", "principal", *usage])
    return pa.table(
        {
            "request_id": table["request_id"],
            "time_ns": table["receive_time"].cast(pa.int64()),
            "model": table["model"],
            "version": table["version"],
            "status": table["status"],
            "latency_ms": table["latency_ms"],
            "arm": table["arm"],
            "assignment": table["assignment"],
            "phase": table["phase"],
            "unit": table["routing_key_hmac"],
            "ttft_ms": table["ttft_ms"],
            "tokens": table["tokens"],
            "prompt_tokens": table["prompt_tokens"],
            "completion_tokens": table["completion_tokens"],
            "principal": table["principal"],
        }
    )


def readable_feedback(archive: Archive, model: str, since_ns: int, until_ns: int) -> pa.Table:
    """The archived outcome events as the columns a feedback stream entry has
    (:func:`splitstream.common.records.feedback_entry_fields`; times as int64 ns, ``value`` a float). Blocking."""
    table = read_feedback(archive, model, since_ns, until_ns)
    return pa.table(
        {
            "request_id": table["request_id"],
            "unit": table["unit"],
            "metric": table["metric"],
            "value": table["value"],
            "event_ns": table["event_time"].cast(pa.int64()),
            "receive_ns": table["receive_time"].cast(pa.int64()),
            "idempotency_key": table["idempotency_key"],
            "model": table["model"],
        }
    )
