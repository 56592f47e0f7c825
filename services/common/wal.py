"""The router's write-ahead log of finished calls, written by the router and shipped by ``splitstream-shipper``.

Why a log: building, batching and streaming records on the event loop that answers calls
would cost the router, and a killed router would lose what sat in a memory queue. So the
router only appends each finished call to a local log and the shipper, another process,
turns the log into ``CallRecord`` batches for the recorder. An append is one
``os.writev`` of one framed entry to an already-open segment file: no protobuf record, no
network, no fsync. Once the write returns the bytes are in the kernel's page cache, so a
router crash (SIGKILL, OOM, a bug) loses nothing appended; only a machine crash can lose
what the periodic ``fdatasync`` (``--log-flush-interval-s``) had not flushed yet.

Layout of one log directory (one per router process; one shipper may ship several)::

    wal-0000000000000001.log   segments, numbered; a router opening the directory starts a new
    wal-0000000000000002.log   one (it never appends after a tail a crash may have torn)
    wal.cursor                 the shipper's position: two slots (magic, sequence, segment, offset,
                               crc32) written alternately in place, the newer that checks wins
    shipper.lock               held by the shipper shipping this directory (its pid)
    router.lock                held by the router appending to this directory (its pid)

The shipper's spool (``*.seg``, ``cursor.slots``) shares the directory by default, so a spool
left by a router from before the log is shipped too.

A segment is rotated once it holds ``segment_bytes``; the router holds a flock on the segment
it appends to. The shipper reads segments in order, takes a segment for finished only once no
router holds its lock (a file numbered above it proves nothing: it may have been copied in),
deletes a segment once its cursor (written durably first) is past it, and never writes into one.
Entry framing, as the hardened spool has, so that damage costs only the entry it touches::

    magic b"\\xf0WAL" | u32 payload length | u8 kind | 3 zero bytes | u32 crc32(length, kind, payload) | payload

A damaged entry (bad checksum, impossible length) is skipped by scanning for the next
magic whose entry checks, and counted. An incomplete entry at the end of the newest
segment is an append not yet visible: the reader waits. The same at the end of an older
segment is a torn tail (the router was killed mid-append, or the disk filled): skipped
and counted, never shipped as garbage.

Entry kinds and payloads (integers little-endian; a *field* is a u32 length then its bytes):

* ``CALL`` (1) and ``STREAM`` (4, a ModelStreamInfer stream): fixed part
  ``i64 receive_unix_ns | i64 latency_ns | i32 status code | u8 flags | i8 assignment | u8 shadows expected | pad``,
  then 14 u32 lengths, then those 14 fields' bytes: request id, model, version, arm, status
  message, endpoint, router id, principal, routing-key HMAC, serialized ``CallRecord.phase`` field, recorded metadata
  (``key \\0 value \\0`` ...), serialized ``StreamCall`` (STREAM only), request bytes as
  received, response bytes as sent. Flags: 1 fallback, 2 pinned, 4 retried, 8 has response.
* ``SHADOWS`` (2): the outcomes of a call's shadows, appended when they finish (after the
  call's own entry): field request id, u8 count, then per shadow ``i32 status | i64 latency_ns |
  u8 has response`` and the fields version, endpoint, status message, response. The shipper
  joins them to the call by request id within a bounded window; a call whose shadows never
  come is shipped without them.
* ``FEEDBACK`` (3): serialized ``FeedbackEvent`` messages (routing keys already HMACs), each a field.
* ``HTTP`` (5, a call to the router's HTTP front door): the ``STREAM`` layout with a 15th length and field,
  the record's HTTP fields already serialized (``CallRecord.http`` and ``CallRecord.usage``, as a CallRecord
  holding only them: the shipper appends these bytes to the record it builds, as it does the phase's).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import struct
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import structlog

from splitstream.common.files import fsync_directory

log = structlog.get_logger()

MAGIC = b"\xf0WAL"
FRAME = struct.Struct("<4sIB3xI")
_CHECKED = struct.Struct("<IB3x")
CALL = 1
SHADOWS = 2
FEEDBACK = 3
STREAM = 4
HTTP = 5
KINDS = frozenset({CALL, SHADOWS, FEEDBACK, STREAM, HTTP})
#: Largest payload a reader believes (a length past it is damage): the router takes 64 MiB calls, and an
#: entry holds a request and its response.
MAX_ENTRY_BYTES = 512 << 20
_CALL_FIELDS = 14
#: A call entry's fixed part and its fields' lengths (the router packs it itself on its hot path).
CALL_HEAD = struct.Struct(f"<qqiBbBx{_CALL_FIELDS}I")
#: An HTTP call entry's: the call's, with one more field (the record's HTTP fields, serialized).
HTTP_HEAD = struct.Struct(f"<qqiBbBx{_CALL_FIELDS + 1}I")
_SHADOW_FIXED = struct.Struct("<iqB")
_LEN = struct.Struct("<I")
_SUFFIX = ".log"
_PREFIX = "wal-"
CURSOR_FILE = "wal.cursor"
#: Held (flock) by the router appending to the directory, holding its pid.
WRITER_LOCK_FILE = "router.lock"
#: Held (flock) by the shipper shipping the directory, holding its pid.
SHIPPER_LOCK_FILE = "shipper.lock"
#: A cursor slot: magic, sequence (the newer valid slot wins), segment, offset, crc32 of the 28 bytes before it.
CURSOR_SLOT = struct.Struct("<4sQQQI")
_CURSOR_MAGIC = b"\xf0CUR"
FALLBACK, PINNED, RETRIED, HAS_RESPONSE = 1, 2, 4, 8
#: A place in a log: (segment number, byte offset in it).
Position = tuple[int, int]
_CODES = {code.value[0]: code for code in grpc.StatusCode}


def segment_name(number: int) -> str:
    return f"{_PREFIX}{number:016d}{_SUFFIX}"


def segments(directory: Path) -> list[int]:
    """Segment numbers in ``directory``, oldest first. Only regular files named exactly as :func:`segment_name`
    names them count: anything else (``wal-99.log`` copied by hand, a directory, a FIFO) is left alone, since
    taken for a newer segment it would make the shipper skip and delete the one the router appends to, and
    opened it would fail (a directory) or block (a FIFO) on every try."""
    numbers = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(directory):
            name = entry.name
            if name.startswith(_PREFIX) and name.endswith(_SUFFIX):
                with contextlib.suppress(ValueError):
                    number = int(name[len(_PREFIX) : -len(_SUFFIX)])
                    if name == segment_name(number) and entry.is_file():
                        numbers.append(number)
    return sorted(numbers)


def log_bytes(directory: Path) -> int:
    total = 0
    for number in segments(directory):
        with contextlib.suppress(FileNotFoundError):
            total += (directory / segment_name(number)).stat().st_size
    return total


def read_cursor(directory: Path) -> tuple[int, Position] | None:
    """The newer of the cursor file's two slots that check: (sequence, position); None when none does."""
    try:
        data = (directory / CURSOR_FILE).read_bytes()
    except FileNotFoundError:
        return None
    best: tuple[int, int, int] = (-1, 0, 0)
    for at in (0, CURSOR_SLOT.size):
        if len(data) < at + CURSOR_SLOT.size:
            continue
        magic, sequence, segment, offset, crc = CURSOR_SLOT.unpack_from(data, at)
        if magic == _CURSOR_MAGIC and zlib.crc32(data[at : at + CURSOR_SLOT.size - 4]) == crc:
            best = max(best, (sequence, segment, offset))
    return None if best[0] < 0 else (best[0], (best[1], best[2]))


def unshipped_bytes(directory: Path) -> int:
    """Bytes of the log past the shipper's cursor: what the cap counts. The newest segment is never deleted
    (the router appends to it), so its shipped part must not count, or a log at its cap would stay full."""
    cursor = read_cursor(directory)
    segment, offset = (0, 0) if cursor is None else cursor[1]
    total = 0
    for number in segments(directory):
        if number < segment:
            continue
        with contextlib.suppress(FileNotFoundError):
            size = (directory / segment_name(number)).stat().st_size
            total += max(size - offset, 0) if number == segment else size
    return total


def frame(kind: int, payload: bytes) -> bytes:
    """One entry as the log holds it (what :meth:`WalWriter.append_parts` writes, for tests and tools)."""
    return frame_head(kind, (payload,))[0] + payload


def frame_head(kind: int, parts: Sequence[bytes]) -> tuple[bytes, int]:
    """The frame of an entry whose payload is ``parts`` in order, and the entry's whole size."""
    length = 0
    for part in parts:
        length += len(part)
    checked = _CHECKED.pack(length, kind)
    crc = zlib.crc32(checked)
    for part in parts:
        crc = zlib.crc32(part, crc)
    return FRAME.pack(MAGIC, length, kind, crc), FRAME.size + length


def _field(data: bytes) -> bytes:
    return _LEN.pack(len(data)) + data


def encode_call(
    *,
    kind: int = CALL,
    request_id: str,
    model: str,
    version: str,
    arm: str,
    code: int,
    details: str,
    endpoint: str,
    router_id: str,
    principal: str,
    receive_unix_ns: int,
    latency_ns: int,
    flags: int,
    assignment: int,
    shadows_expected: int,
    routing_key_hmac: str,
    phase: bytes,
    metadata: bytes,
    stream: bytes,
    request: bytes,
    response: bytes | None,
    record_fields: bytes = b"",
) -> bytes:
    """A call entry's payload: one pack of the fixed part and the lengths, one join (measured: the per-field
    length-then-bytes layout cost twice as much, every call). ``record_fields``: an ``HTTP`` entry's 15th field."""
    if response is not None:
        flags |= HAS_RESPONSE
    fields: tuple[bytes, ...] = (
        request_id.encode(),
        model.encode(),
        version.encode(),
        arm.encode(),
        details.encode(),
        endpoint.encode(),
        router_id.encode(),
        principal.encode(),
        routing_key_hmac.encode(),
        phase,
        metadata,
        stream,
        request,
        response or b"",
    )
    if kind == HTTP:
        fields += (record_fields,)
    head = (HTTP_HEAD if kind == HTTP else CALL_HEAD).pack(
        receive_unix_ns, latency_ns, code, flags, assignment, shadows_expected, *[len(f) for f in fields]
    )
    return head + b"".join(fields)


def encode_metadata(pairs: dict[str, str]) -> bytes:
    """Recorded metadata as ``key \\0 value \\0`` pairs (gRPC text metadata holds no NUL)."""
    return "".join(f"{key}\0{value}\0" for key, value in pairs.items()).encode()


def decode_metadata(data: bytes) -> dict[str, str]:
    items = data.decode(errors="replace").split("\0")
    return dict(zip(items[0:-1:2], items[1::2], strict=True))


@dataclass(slots=True)
class ShadowEntry:
    version: str
    endpoint: str
    code: grpc.StatusCode
    details: str
    latency_s: float
    response: bytes | None


def encode_shadows(request_id: str, shadows: Sequence[ShadowEntry]) -> bytes:
    parts = [_field(request_id.encode()), bytes([min(len(shadows), 255)])]
    for shadow in shadows[:255]:
        parts.append(_SHADOW_FIXED.pack(shadow.code.value[0], int(shadow.latency_s * 1e9), shadow.response is not None))
        for data in (
            shadow.version.encode(),
            shadow.endpoint.encode(),
            shadow.details.encode(),
            shadow.response or b"",
        ):
            parts.append(_field(data))
    return b"".join(parts)


def encode_feedback(events: Sequence[bytes]) -> bytes:
    return b"".join(_field(event) for event in events)


class _Cursor:
    """Reads a payload's fields in order; raises ValueError on anything that does not fit."""

    __slots__ = ("at", "data")

    def __init__(self, data: bytes, at: int = 0) -> None:
        self.data = data
        self.at = at

    def fixed(self, layout: struct.Struct) -> tuple:
        if self.at + layout.size > len(self.data):
            raise ValueError("entry shorter than its fixed part")
        values = layout.unpack_from(self.data, self.at)
        self.at += layout.size
        return values

    def field(self) -> bytes:
        (length,) = self.fixed(_LEN)
        end = self.at + length
        if end > len(self.data):
            raise ValueError("field runs past the entry")
        value = self.data[self.at : end]
        self.at = end
        return value

    def text(self) -> str:
        return self.field().decode()


@dataclass(slots=True)
class CallEntry:
    """A call as the log holds it, shaped like the router's ``CallOutcome`` where the shipper needs it."""

    kind: int
    request_id: str
    model: str
    version: str
    arm: str
    code: grpc.StatusCode | int
    details: str
    endpoint: str
    router_id: str
    principal: str
    receive_unix_ns: int
    latency_ns: int
    flags: int
    assignment: int
    shadows_expected: int
    routing_key_hmac: str
    phase: bytes
    metadata: dict[str, str]
    stream: bytes
    request: bytes
    response: bytes | None
    shadows: list[ShadowEntry] = field(default_factory=list)
    #: Serialized CallRecord fields the router built itself (an HTTP call's ``http`` and ``usage``): appended
    #: to the record as they are.
    record_fields: bytes = b""
    #: Where the shipper read it (its log's position before the entry): what it may commit once shipped.
    position: object = None


def decode_call(kind: int, payload: bytes) -> CallEntry:
    head = HTTP_HEAD if kind == HTTP else CALL_HEAD
    if len(payload) < head.size:
        raise ValueError("entry shorter than its fixed part")
    receive_ns, latency_ns, code, flags, assignment, expected, *lengths = head.unpack_from(payload)
    if head.size + sum(lengths) != len(payload):
        raise ValueError("the call entry's field lengths do not add up to its size")
    values = []
    at = head.size
    for length in lengths:
        values.append(payload[at : at + length])
        at += length
    texts = [value.decode() for value in values[:9]]
    phase, metadata, stream, request, response = values[9:14]
    return CallEntry(
        kind=kind,
        request_id=texts[0],
        model=texts[1],
        version=texts[2],
        arm=texts[3],
        code=_CODES.get(code, code),
        details=texts[4],
        endpoint=texts[5],
        router_id=texts[6],
        principal=texts[7],
        receive_unix_ns=receive_ns,
        latency_ns=latency_ns,
        flags=flags,
        assignment=assignment,
        shadows_expected=expected,
        routing_key_hmac=texts[8],
        phase=phase,
        metadata=decode_metadata(metadata),
        stream=stream,
        request=request,
        response=response if flags & HAS_RESPONSE else None,
        record_fields=values[14] if kind == HTTP else b"",
    )


def decode_shadows(payload: bytes) -> tuple[str, list[ShadowEntry]]:
    reader = _Cursor(payload)
    request_id = reader.text()
    if reader.at >= len(payload):
        raise ValueError("shadow entry without its count")
    count = payload[reader.at]
    reader.at += 1
    shadows = []
    for _ in range(count):
        code, latency_ns, has_response = reader.fixed(_SHADOW_FIXED)
        version, endpoint, details = reader.text(), reader.text(), reader.text()
        response = reader.field()
        shadows.append(
            ShadowEntry(
                version,
                endpoint,
                _CODES.get(code, grpc.StatusCode.UNKNOWN),
                details,
                latency_ns / 1e9,
                response if has_response else None,
            )
        )
    return request_id, shadows


def decode_feedback(payload: bytes) -> list[bytes]:
    reader = _Cursor(payload)
    events = []
    while reader.at < len(payload):
        events.append(reader.field())
    return events


# -- writing (the router) ----------------------------------------------------------------------


class WalWriter:
    """Appends framed entries to the newest segment of one log directory.

    :meth:`append_parts` runs on the router's event loop: one ``os.writev``, and a failure (a full disk, a
    file-size limit) truncates the segment back to where the entry began and returns False, so the
    caller counts the call as dropped and answers it all the same. ``max_bytes`` caps the directory
    (what is past the shipper's cursor): past it appends are refused, never blocking, so the oldest
    entries are the ones kept. The size is the other segments' as :meth:`flush` last read it (a thread, every
    ``--log-flush-interval-s``, which also ``fdatasync``\\ s, bounding what a machine crash can lose), so the
    shipper's deletions count, plus the segment appended to by this writer's own count (no syscall per
    append)."""

    def __init__(self, directory: str | os.PathLike[str], *, max_bytes: int, segment_bytes: int) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = _lock_for_writing(self.directory)
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self._lock = threading.Lock()
        existing = segments(self.directory)
        # Past the shipper's cursor too: segments deleted by hand leave a cursor whose offset would skip the
        # start of a new segment numbered as its segment was.
        cursor = read_cursor(self.directory)
        self._number = max(existing[-1] if existing else 0, cursor[1][0] if cursor else 0) + 1
        self._fd = self._open(self._number)
        self._offset = 0
        #: The unshipped bytes of every segment but the one appended to, and the bytes of that one before the
        #: shipper's cursor, at the last size check: one tuple, replaced whole (by :meth:`flush`'s thread, or at a
        #: rotation), so the appender never reads half of an update.
        self._checked = _unshipped_besides(self.directory, self._number)
        self._dirty = False

    def _open(self, number: int) -> int:
        """The segment, locked (flock) for as long as this writer appends to it: a segment numbered above it
        (copied in by hand) made the shipper take this one for finished and delete it while calls were still
        appended, so the shipper asks the lock, not the numbering, whether a segment is finished. Blocking: a
        shipper only tests the lock for an instant."""
        fd = os.open(self.directory / segment_name(number), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            os.close(fd)
            raise
        fsync_directory(self.directory)
        return fd

    def append(self, kind: int, payload: bytes) -> bool:
        return self.append_parts(kind, (payload,))

    def append_parts(self, kind: int, parts: Sequence[bytes]) -> bool:
        """Append one entry whose payload is ``parts`` in order: one ``writev`` of the frame and the parts as they
        are, so a call's request and response bytes (up to 64 MiB each) are never copied into a joined payload
        first. False (nothing written) when the log is at its cap."""
        head, size = frame_head(kind, parts)
        others, shipped = self._checked  # unshipped_bytes, inlined: this runs on the answering path
        past = self._offset - shipped
        if others + (past if past > 0 else 0) + size > self.max_bytes:
            return False
        try:
            written = os.writev(self._fd, (head, *parts))
            if written != size:
                raise OSError(f"short write ({written} of {size} bytes)")
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._offset)
            raise
        self._offset += written
        self._dirty = True
        if self._offset >= self.segment_bytes:
            self._rotate()
        return True

    def _rotate(self) -> None:
        # The next segment is opened (and locked) before the old one is closed, so that one of them is always
        # locked; numbered past any segment copied in meanwhile, which is then shipped as a finished one.
        with self._lock:
            old = self._fd
            existing = segments(self.directory)
            number = max(self._number, existing[-1] if existing else 0) + 1
            self._fd = self._open(number)
            others, shipped = self._checked
            self._checked = (others + max(self._offset - shipped, 0), 0)  # the old segment is one of the others
            self._number = number
            self._offset = 0
        with contextlib.suppress(OSError):
            os.fdatasync(old)
        os.close(old)

    def flush(self) -> None:
        """fdatasync what was appended and re-read the directory's size (run in a thread)."""
        with self._lock:
            if self._dirty:
                self._dirty = False
                os.fdatasync(self._fd)
            number = self._number
        # The segment appended to is not sized here: an append landing during the scan would be counted in the size
        # read and again in the appends since, the log one call fuller than it is until the next flush, and the
        # call that filled it refused while a later one is logged after that flush.
        checked = _unshipped_besides(self.directory, number)
        with self._lock:
            if self._number == number:  # else rotated meanwhile: the next flush sizes the log again
                self._checked = checked

    @property
    def unshipped_bytes(self) -> int:
        """The log's size as the cap sees it: the other segments' at the last size check plus what of the one
        appended to is past the shipper's cursor."""
        others, shipped = self._checked
        return others + max(self._offset - shipped, 0)

    def close(self) -> None:
        with self._lock:
            with contextlib.suppress(OSError):
                os.fdatasync(self._fd)
            os.close(self._fd)
            self._fd = -1
        os.close(self._lock_fd)  # the next router may start here


def _unshipped_besides(directory: Path, number: int) -> tuple[int, int]:
    """The unshipped bytes of every segment but ``number`` (the one a writer appends to, which it sizes itself),
    and the bytes of ``number`` before the shipper's cursor."""
    cursor = read_cursor(directory)
    segment, offset = (0, 0) if cursor is None else cursor[1]
    total = 0
    for other in segments(directory):
        if other < segment or other == number:
            continue
        with contextlib.suppress(FileNotFoundError):
            size = (directory / segment_name(other)).stat().st_size
            total += max(size - offset, 0) if other == segment else size
    return total, offset if segment == number else 0


def being_written(directory: Path, number: int) -> bool:
    """Whether a router holds the segment's lock (it appends to it). Asked before a segment is read: one whose lock
    is free was closed by its router, every append of it already visible."""
    try:
        fd = os.open(directory / segment_name(number), os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _held_by_live_process(lock: Path) -> bool:
    """Whether the pid a lock file holds is alive. Read, never locked: a lock taken even for an instant could
    refuse a router or shipper starting on that directory just then."""
    try:
        text = lock.read_text(errors="replace").strip()
    except OSError:
        return False
    if not text.isdigit():
        return False
    try:
        os.kill(int(text), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def stranded_logs(directory: Path, *, also: Sequence[Path] = (), limit: int = 1000) -> list[tuple[Path, int]]:
    """Logs beside ``directory`` (its siblings, their ``proc-*``, and ``also``) that hold unshipped calls while
    neither a router nor a shipper is at them: what a router restarted with another ``--log-dir`` left behind,
    which nothing would ship. (directory, unshipped bytes) each; at most ``limit`` siblings are looked at."""
    own = directory.resolve()
    candidates: list[Path] = [path.resolve() for path in also]
    with contextlib.suppress(OSError), os.scandir(own.parent) as entries:
        for count, entry in enumerate(entries):
            if count >= limit:
                break
            if entry.is_dir(follow_symlinks=False):
                candidates.append(Path(entry.path))
    found = []
    seen = {own}
    for top in candidates:
        try:
            logs = [top, *sorted(p for p in top.glob("proc-*") if p.is_dir())]
        except OSError:
            continue
        for log_dir in logs:
            if log_dir in seen or own in log_dir.parents:
                continue
            seen.add(log_dir)
            if not segments(log_dir):
                continue
            if any(_held_by_live_process(log_dir / name) for name in (WRITER_LOCK_FILE, SHIPPER_LOCK_FILE)):
                continue
            pending = unshipped_bytes(log_dir)
            if pending:
                found.append((log_dir, pending))
    return found


def _lock_for_writing(directory: Path) -> int:
    """Take ``router.lock`` or raise: two routers appending to one directory (``--log-dir`` left at its default
    for both, say) each wrote a segment, and the shipper, reading the older as finished, deleted it while its
    router still appended: every call that router answered after that was lost. The kernel frees the lock when
    the router exits however it exits."""
    fd = os.open(directory / WRITER_LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise OSError(errno.EBUSY, f"in use by another router (pid {holder}): give each router its own") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


# -- reading (the shipper) ---------------------------------------------------------------------


@dataclass(slots=True)
class Entry:
    kind: int
    payload: bytes
    start: Position
    end: Position


class WalReader:
    """Reads one log directory's entries from its cursor on; :meth:`commit` moves the cursor (durably)
    and deletes the segments wholly behind it. Blocking file I/O: call from a thread."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        on_damage: Callable[[str, int, Position], None] | None = None,
        chunk_bytes: int = 4 << 20,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        #: Told of each skipped range: its reason, its size in bytes and where it starts (segment, offset).
        self.on_damage = on_damage or (lambda reason, size, where: None)
        self.chunk_bytes = chunk_bytes
        self._sequence = 0
        self._cursor_fd = -1
        #: The directory's mtime when the last read began (-1: unknown): see :meth:`peek`.
        self._scanned_mtime_ns = -1
        self.committed = self._read_cursor()
        self.position = self.committed
        try:  # now, while the disk has room: the log may fill it while the recorder is away
            self._cursor_fd = self._open_cursor()
        except OSError as error:
            log.error("log cursor not allocated; retried at the first commit", error=str(error)[:300])

    def _read_cursor(self) -> Position:
        """The newer of the cursor file's two slots that check ((0, 0): none, ship from the oldest segment)."""
        path = self.directory / CURSOR_FILE
        cursor = read_cursor(self.directory)
        if cursor is None:
            if path.exists() and path.read_bytes().strip(b"\0"):  # zeros: allocated, never written
                log.error("log cursor unreadable; shipping from the oldest segment", path=str(path))
            return 0, 0
        self._sequence = cursor[0]
        return cursor[1]

    def _open_cursor(self) -> int:
        """The cursor file, allocated once (two slots) and from then on overwritten in place: on a full disk a
        write needing no new block still succeeds, so the shipper's position is kept when it matters most."""
        path = self.directory / CURSOR_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        if os.fstat(fd).st_size < 2 * CURSOR_SLOT.size:
            os.pwrite(fd, bytes(2 * CURSOR_SLOT.size - os.fstat(fd).st_size), os.fstat(fd).st_size)
            os.fsync(fd)
            fsync_directory(self.directory)
        return fd

    def rewind(self) -> None:
        self.position = self.committed

    def peek(self) -> int | None:
        """The bytes appended to the position's segment past the position, found by two stats and no read; None
        when only a read can tell (a segment was created or deleted since the last read began, or the position's
        segment is gone). Cheap enough to ask every poll, where a read opens the segment and scans the
        directory. A segment created within the filesystem's timestamp tick of a read's start can leave the
        directory's mtime as it was: a caller must still read now and then without asking."""
        try:
            directory = os.stat(self.directory).st_mtime_ns
            size = os.stat(self.directory / segment_name(self.position[0])).st_size
        except FileNotFoundError:
            return None
        if directory != self._scanned_mtime_ns:
            return None
        return max(size - self.position[1], 0)

    def read(self, max_entries: int) -> list[Entry]:
        """Up to ``max_entries`` whole entries from the current position ([] when caught up)."""
        entries: list[Entry] = []
        try:  # before the scan: a segment created during it changes the mtime after this, and the next peek reads
            self._scanned_mtime_ns = os.stat(self.directory).st_mtime_ns
        except FileNotFoundError:
            self._scanned_mtime_ns = -1
        while len(entries) < max_entries:
            numbers = segments(self.directory)
            numbers = [n for n in numbers if n >= self.position[0]]
            if not numbers:
                return entries
            if numbers[0] != self.position[0]:  # the cursor's segment is gone (deleted, or never existed)
                self.position = (numbers[0], 0)
            newest = numbers[-1] == self.position[0] or being_written(self.directory, self.position[0])
            if not self._read_segment(entries, max_entries, newest):
                if newest:
                    return entries
                self.position = (numbers[1], 0)
        return entries

    def _read_segment(self, entries: list[Entry], max_entries: int, newest: bool) -> bool:
        """Append entries from the current segment; False when the segment has no more to give."""
        number, offset = self.position
        path = self.directory / segment_name(number)
        try:
            with open(path, "rb") as file:
                file.seek(offset)
                data = file.read(self.chunk_bytes)
                at = 0
                progressed = False
                #: Where the damaged range being skipped began (it may span several reads), None when in none.
                damaged_from: int | None = None
                while len(entries) < max_entries:
                    if len(data) - at < FRAME.size:
                        more = file.read(self.chunk_bytes)
                        if not more:
                            break
                        data, at = data[at:] + more, 0
                        continue
                    magic, length, kind, crc = FRAME.unpack_from(data, at)
                    end = at + FRAME.size + length
                    good = magic == MAGIC and length <= MAX_ENTRY_BYTES and kind in KINDS
                    if good:
                        while len(data) < end:
                            more = file.read(max(end - len(data), self.chunk_bytes))
                            if not more:
                                break
                            data += more
                        if len(data) < end and newest:
                            break  # an incomplete entry at the tail: an append not visible yet
                        good = len(data) >= end
                        if good and zlib.crc32(data[at + FRAME.size : end], zlib.crc32(data[at + 4 : at + 12])) != crc:
                            # Nothing past it in the file (asked of its size: a read would take a byte from what
                            # is read next): perhaps an append still landing, look again later.
                            if newest and end == len(data) and os.fstat(file.fileno()).st_size <= offset + end - at:
                                break
                            good = False
                    if not good:
                        found = data.find(MAGIC, at + 1)
                        if found < 0:
                            more = file.read(self.chunk_bytes)
                            if not more:
                                break  # the rest is waited for (newest segment) or torn (counted below)
                            # The next entry may start past what was read (taking it for a torn tail would lose
                            # the rest of the segment): skip what was searched but a magic's first bytes, and
                            # read on; the range is told once, whole, where it ends.
                            keep = max(len(data) - len(MAGIC) + 1, at + 1)
                            damaged_from = offset if damaged_from is None else damaged_from
                            offset += keep - at
                            data, at = data[keep:] + more, 0
                            self.position = (number, offset)
                            progressed = True
                            continue
                        damaged_from = offset if damaged_from is None else damaged_from
                        offset += found - at
                        self.on_damage("damaged", offset - damaged_from, (number, damaged_from))
                        damaged_from = None
                        at = found
                        self.position = (number, offset)
                        progressed = True
                        continue
                    if damaged_from is not None:  # a damaged range ended just where a read did
                        self.on_damage("damaged", offset - damaged_from, (number, damaged_from))
                        damaged_from = None
                    payload = data[at + FRAME.size : end]
                    start = (number, offset)
                    offset += end - at
                    self.position = (number, offset)
                    entries.append(Entry(kind, payload, start, self.position))
                    at = end
                    progressed = True
                if damaged_from is not None:
                    self.on_damage("damaged", offset - damaged_from, (number, damaged_from))
                if len(entries) >= max_entries:
                    return True
                rest = max(os.fstat(file.fileno()).st_size - offset, 0)  # not read: it may be gigabytes
        except FileNotFoundError:
            return False
        if rest and not newest:
            self.on_damage("torn", rest, (number, offset))  # the router died mid-append: never shipped as garbage
        return progressed and newest

    def commit(self, position: Position) -> None:
        """Write the cursor durably (the older slot, so a torn write leaves the newer), then delete every
        segment wholly before it."""
        if position <= self.committed:
            return
        if self._cursor_fd < 0:
            self._cursor_fd = self._open_cursor()
        self._sequence += 1
        head = struct.pack("<4sQQQ", _CURSOR_MAGIC, self._sequence, *position)
        os.pwrite(self._cursor_fd, head + _LEN.pack(zlib.crc32(head)), (self._sequence % 2) * CURSOR_SLOT.size)
        os.fdatasync(self._cursor_fd)
        self.committed = position
        for number in segments(self.directory):
            if number >= position[0]:
                break
            with contextlib.suppress(FileNotFoundError):
                (self.directory / segment_name(number)).unlink()

    def close(self) -> None:
        if self._cursor_fd >= 0:
            os.close(self._cursor_fd)
            self._cursor_fd = -1

    def pending_bytes(self) -> int:
        total = 0
        for number in segments(self.directory):
            if number < self.committed[0]:
                continue
            with contextlib.suppress(FileNotFoundError):
                size = (self.directory / segment_name(number)).stat().st_size
                total += size - (self.committed[1] if number == self.committed[0] else 0)
        return max(total, 0)


def iter_entries(directory: Path) -> Iterator[Entry]:
    """Every readable entry of a directory from its cursor (for tests and tools)."""
    reader = WalReader(directory)
    try:
        while batch := reader.read(1024):
            yield from batch
    finally:
        reader.close()
