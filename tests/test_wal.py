"""The write-ahead log's reader against what a disk can hold after crashes and damage: whatever the bytes, it
never raises, never yields an entry that was not appended whole, and finds every intact entry after damage."""

from __future__ import annotations

import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitstream.common import wal
from tests import launcher


def write_segment(directory: Path, number: int, data: bytes) -> None:
    (directory / wal.segment_name(number)).write_bytes(data)


def read_all(directory: Path) -> tuple[list[bytes], list[tuple[str, int]]]:
    damage: list[tuple[str, int]] = []
    reader = wal.WalReader(directory, on_damage=lambda reason, size, where: damage.append((reason, size)))
    payloads: list[bytes] = []
    while entries := reader.read(100):
        payloads.extend(entry.payload for entry in entries)
    return payloads, damage


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    entries=st.lists(st.binary(min_size=0, max_size=200), min_size=1, max_size=8),
    garbage=st.binary(min_size=1, max_size=300),
    at=st.integers(min_value=0, max_value=7),
)
def test_garbage_between_entries_costs_no_intact_entry(entries: list[bytes], garbage: bytes, at: int) -> None:
    frames = [wal.frame(wal.FEEDBACK, payload) for payload in entries]
    at = min(at, len(frames))
    with tempfile.TemporaryDirectory() as name:
        directory = Path(name)
        write_segment(directory, 1, b"".join(frames[:at]) + garbage + b"".join(frames[at:]))
        write_segment(directory, 2, b"")  # a newer segment: nothing in the first is still being written
        payloads, damage = read_all(directory)
    # Every intact entry is read, in order; garbage never comes out as an entry of its own unless it happens to
    # hold a whole entry that checks (then it is one, by construction).
    assert _subsequence(entries, payloads)
    if payloads == entries:
        return
    assert damage or len(payloads) > len(entries)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(min_size=0, max_size=600))
def test_any_bytes_in_a_segment_never_crash_the_reader(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as name:
        directory = Path(name)
        write_segment(directory, 1, data)
        write_segment(directory, 2, wal.frame(wal.CALL, b"after"))
        payloads, _ = read_all(directory)
    assert payloads[-1] == b"after"


def test_a_torn_tail_is_counted_once_the_router_has_moved_on_and_waited_for_before() -> None:
    with tempfile.TemporaryDirectory() as name:
        directory = Path(name)
        whole = wal.frame(wal.FEEDBACK, wal.encode_feedback([b"kept"]))
        torn = wal.frame(wal.FEEDBACK, wal.encode_feedback([b"torn"]))[:20]
        write_segment(directory, 1, whole + torn)
        reader = wal.WalReader(directory, on_damage=lambda reason, size, where: damage.append((reason, size)))
        damage: list[tuple[str, int]] = []
        assert [e.payload for e in reader.read(10)] == [wal.encode_feedback([b"kept"])]
        assert damage == []  # the newest segment: maybe an append still landing
        write_segment(directory, 2, b"")  # a restarted router opens a new segment
        assert reader.read(10) == []
        assert damage == [("torn", 20)]


def test_the_cursor_survives_a_reader_restart_and_segments_behind_it_are_deleted() -> None:
    with tempfile.TemporaryDirectory() as name:
        directory = Path(name)
        writer = wal.WalWriter(directory, max_bytes=1 << 20, segment_bytes=64)
        for i in range(6):
            assert writer.append(wal.FEEDBACK, wal.encode_feedback([b"event-%d" % i]))
        reader = wal.WalReader(directory)
        first = reader.read(3)
        reader.commit(first[-1].end)
        reader.close()
        assert min(wal.segments(directory)) == first[-1].end[0]
        again = wal.WalReader(directory)
        rest = [wal.decode_feedback(e.payload)[0] for e in again.read(10)]
        assert rest == [b"event-3", b"event-4", b"event-5"]


def _subsequence(needles: list[bytes], haystack: list[bytes]) -> bool:
    found = iter(haystack)
    return all(any(item == needle for item in found) for needle in needles)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    entries=st.lists(st.binary(min_size=0, max_size=120), min_size=1, max_size=10),
    flips=st.lists(st.tuples(st.integers(min_value=0), st.integers(min_value=1, max_value=255)), max_size=4),
    cut=st.one_of(st.none(), st.integers(min_value=0)),
    chunk=st.sampled_from([7, 64, 4 << 20]),
)
def test_after_any_damage_exactly_the_undamaged_entries_come_back_in_order(
    entries: list[bytes], flips: list[tuple[int, int]], cut: int | None, chunk: int
) -> None:
    """Bytes flipped anywhere and the segment cut anywhere (a torn tail): every entry none of whose bytes was
    touched is shipped, in order, and nothing else; the damage is reported, with where it starts. Whatever the
    reader's read size: damage across the end of a read was taken for a torn tail, losing the entries after it."""
    frames = [wal.frame(wal.CALL, payload) for payload in entries]
    spans, at = [], 0
    for item in frames:
        spans.append((at, at + len(item)))
        at += len(item)
    original = b"".join(frames)
    data = bytearray(original)
    for where, xor in flips:
        data[where % len(data)] ^= xor
    touched = {i for i, (was, now) in enumerate(zip(original, data, strict=True)) if was != now}
    end = len(data) if cut is None else cut % (len(data) + 1)
    kept = [
        (payload, stop - start)
        for payload, (start, stop) in zip(entries, spans, strict=True)
        if stop <= end and not any(start <= i < stop for i in touched)
    ]
    intact = [payload for payload, _ in kept]
    damage: list[tuple[str, int, wal.Position]] = []
    with tempfile.TemporaryDirectory() as name:
        directory = Path(name)
        write_segment(directory, 1, bytes(data[:end]))
        write_segment(directory, 2, b"")  # a newer segment: nothing in the first is still being written
        reader = wal.WalReader(
            directory, on_damage=lambda reason, size, where: damage.append((reason, size, where)), chunk_bytes=chunk
        )
        payloads: list[bytes] = []
        while batch := reader.read(100):
            payloads.extend(entry.payload for entry in batch)
    assert payloads == intact
    # Every byte is either in an entry shipped or in a range reported as skipped.
    assert sum(size for _, size, _ in damage) == end - sum(size for _, size in kept)
    assert all(where[0] == 1 and 0 <= where[1] < end for _, _, where in damage)


def test_an_append_landing_while_the_flusher_sizes_the_log_is_counted_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The router's flusher thread re-reads the log's size while the event loop appends: an append landing during
    that scan was counted twice (in the size read and in the appends since), so the log looked one call fuller
    than it was until the next flush. The call that would have filled it was refused as over the cap, and the one
    after the next flush logged in its place: a log at its cap kept a later call instead of the oldest (the cap
    test lost seq-0159 to a later call). The segment appended to counts by the writer's own count."""
    with tempfile.TemporaryDirectory() as name:
        directory = Path(name)

        def event(i: int) -> bytes:
            return wal.encode_feedback([b"event-%02d" % i])

        size = len(wal.frame(wal.FEEDBACK, event(0)))
        writer = wal.WalWriter(directory, max_bytes=10 * size, segment_bytes=1 << 20)
        for i in range(8):
            assert writer.append(wal.FEEDBACK, event(i))
        scan = wal.segments

        def append_meanwhile(path: Path) -> list[int]:  # the event loop appends while the flusher's thread scans
            monkeypatch.setattr(wal, "segments", scan)
            assert writer.append(wal.FEEDBACK, event(8))
            return scan(path)

        monkeypatch.setattr(wal, "segments", append_meanwhile)
        writer.flush()
        assert wal.segments is scan  # the scan ran
        assert writer.unshipped_bytes == 9 * size
        assert writer.append(wal.FEEDBACK, event(9))  # it fits: the log is at its cap only now
        assert not writer.append(wal.FEEDBACK, event(10))
        writer.flush()
        assert not writer.append(wal.FEEDBACK, event(11))  # nothing shipped: still full
        writer.close()
        logged = [wal.decode_feedback(entry.payload)[0] for entry in wal.iter_entries(directory)]
        assert logged == [b"event-%02d" % i for i in range(10)]


@settings(max_examples=50, deadline=None)
@given(parts=st.lists(st.binary(max_size=200), min_size=1, max_size=4))
def test_an_entry_appended_in_parts_is_the_entry_of_the_joined_payload(parts: list[bytes]) -> None:
    """The router hands its request and response bytes to the log as they are (one writev, no joined copy):
    what lands on disk is exactly the one entry of their concatenation, and reads back as it."""
    with tempfile.TemporaryDirectory() as name:
        directory = Path(name)
        writer = wal.WalWriter(directory, max_bytes=1 << 20, segment_bytes=1 << 20)
        assert writer.append_parts(wal.CALL, parts)
        assert writer.unshipped_bytes == len(wal.frame(wal.CALL, b"".join(parts)))
        writer.close()
        (segment,) = wal.segments(directory)
        assert (directory / wal.segment_name(segment)).read_bytes() == wal.frame(wal.CALL, b"".join(parts))
        assert [(e.kind, e.payload) for e in wal.iter_entries(directory)] == [(wal.CALL, b"".join(parts))]


#: Appends 300-byte entries in three parts under a 2000-byte file size limit, so that one writev fails part
#: way (the kernel writes what fits, as on a full disk); prints the appends that succeeded and the failure,
#: then appends once more, smaller.
FILL_WAL_UNDER_FILE_SIZE_LIMIT = textwrap.dedent(
    """
    import resource, sys
    from splitstream.common import wal

    resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))
    writer = wal.WalWriter(sys.argv[1], max_bytes=1 << 20, segment_bytes=1 << 20)
    appended = 0
    try:
        while True:
            writer.append_parts(wal.FEEDBACK, (bytes([appended]) * 100, b"r" * 100, b"s" * 100))
            appended += 1
    except OSError as error:
        print(appended, error.errno or 0, error)
    print(writer.append(wal.FEEDBACK, b"small"))
    writer.close()
    """
)


def test_a_parted_append_failing_part_way_leaves_no_torn_entry_and_gives_its_space_back(tmp_path: Path) -> None:
    done = launcher.run(
        [sys.executable, "-c", FILL_WAL_UNDER_FILE_SIZE_LIMIT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    failed, small = done.stdout.split("\n")[:2]
    count, errno, message = failed.split(" ", 2)
    appended = int(count)
    # The kernel wrote what fitted and said so (a short writev), or refused with EFBIG: part way either way.
    assert message.startswith("short write") or errno == "27", failed
    assert appended == 2000 // (300 + wal.FRAME.size)
    assert small == "True"
    damage: list[tuple[str, int]] = []
    reader = wal.WalReader(tmp_path, on_damage=lambda reason, size, where: damage.append((reason, size)))
    payloads = [e.payload for e in reader.read(100)]
    reader.close()
    assert damage == []
    assert payloads == [bytes([i]) * 100 + b"r" * 100 + b"s" * 100 for i in range(appended)] + [b"small"]


def test_an_http_entry_carries_the_records_http_fields_and_a_call_entry_read_as_one_does_not_parse() -> None:
    fields = dict(
        request_id="r-1",
        model="writer",
        version="v1",
        arm="v1",
        code=1,
        details="the client went away",
        endpoint="127.0.0.1:9000",
        router_id="router-a",
        principal="",
        receive_unix_ns=1,
        latency_ns=2,
        flags=0,
        assignment=1,
        shadows_expected=0,
        routing_key_hmac="ab" * 32,
        phase=b"",
        metadata=wal.encode_metadata({"user-agent": "OpenAI/Python"}),
        stream=b"",
        request=b"worker request",
        response=None,
    )
    payload = wal.encode_call(kind=wal.HTTP, record_fields=b"\xd2\x01\x02\x18\x63", **fields)  # type: ignore[arg-type]
    entry = wal.decode_call(wal.HTTP, payload)
    assert (entry.kind, entry.request_id, entry.request, entry.response) == (wal.HTTP, "r-1", b"worker request", None)
    assert entry.metadata == {"user-agent": "OpenAI/Python"}
    assert entry.record_fields == b"\xd2\x01\x02\x18\x63"
    assert wal.decode_call(wal.STREAM, wal.encode_call(kind=wal.STREAM, **fields)).record_fields == b""  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="do not add up"):
        wal.decode_call(wal.HTTP, wal.encode_call(kind=wal.CALL, **fields))  # type: ignore[arg-type]


def test_a_peek_sees_appends_and_asks_for_a_read_once_a_segment_is_created(tmp_path: Path) -> None:
    """The shipper reads only once a peek (two stats) saw something to read: a peek that missed an append or a
    new segment would leave calls unshipped until the next read made regardless."""
    writer = wal.WalWriter(tmp_path, max_bytes=1 << 20, segment_bytes=1 << 20)
    reader = wal.WalReader(tmp_path)
    try:
        assert reader.peek() is None  # nothing read yet: only a read knows where the log starts
        assert reader.read(10) == []
        assert reader.peek() == 0
        assert writer.append(wal.CALL, b"x" * 100)
        assert reader.peek() == wal.FRAME.size + 100
        assert [entry.payload for entry in reader.read(10)] == [b"x" * 100]
        assert reader.peek() == 0
        (tmp_path / wal.segment_name(99)).write_bytes(wal.frame(wal.CALL, b"copied in"))
        assert reader.peek() is None  # a segment appeared: a read must look
    finally:
        writer.close()
        reader.close()
