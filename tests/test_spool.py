"""Reading a spool an older shipper left: order, restart, torn writes, and damage that costs only what it touches.

The spools are written as an older shipper wrote them (:mod:`tests.spools`): nothing in splitstream writes one."""

from __future__ import annotations

import struct
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitstream.shipper import spool as spool_module
from splitstream.shipper.spool import CURSOR_WRITE_S, HEADER, Damage, Spool
from tests.spools import append, frame


def drain(spool: Spool) -> list[bytes]:
    out = []
    while (entry := spool.peek()) is not None:
        payload, position = entry
        out.append(payload)
        spool.commit(position)
    return out


def test_entries_come_back_in_order_across_segments_and_restarts(tmp_path: Path) -> None:
    batches = [f"batch-{i}".encode() * 5 for i in range(30)]
    for batch in batches:
        append(tmp_path, batch, segment_bytes=100)
    spool = Spool(tmp_path)
    first = spool.peek()
    assert first is not None
    spool.commit(first[1])
    spool.flush()  # as the mirror does at shutdown (the cursor file is otherwise written every 0.1 s)
    reopened = Spool(tmp_path)
    assert drain(reopened) == batches[1:]
    assert reopened.empty()
    assert len(list(tmp_path.glob("*.seg"))) <= 1


def test_after_a_crash_the_cursor_lags_at_most_a_tenth_of_a_second_of_acknowledgements(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [1000.0]  # the spool's clock, moved by the test: five fsync'd appends may take 0.1 s on a busy disk
    monkeypatch.setattr(spool_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    for i in range(5):
        append(tmp_path, b"entry-%d" % i)
    spool = Spool(tmp_path)
    first = spool.peek()
    assert first is not None
    spool.commit(first[1])  # not yet on disk: a crash now resends entry-0 (at least once)
    assert drain(Spool(tmp_path))[0] == b"entry-0"
    now[0] += CURSOR_WRITE_S  # the throttle's period has passed
    second = spool.peek()
    assert second is not None
    spool.commit(second[1])  # more than 0.1 s after the last write: written now
    assert drain(Spool(tmp_path))[0] == b"entry-2"


def test_segments_removed_by_hand_leave_no_cursor_that_hides_new_entries(tmp_path: Path) -> None:
    for i in range(5):
        append(tmp_path, b"entry-%d" % i, segment_bytes=10)
    spool = Spool(tmp_path)
    drain(spool)
    spool.flush()
    for segment in tmp_path.glob("*.seg"):
        segment.unlink()
    append(tmp_path, b"after")  # numbered 1 again, before the cursor's segment 5
    assert drain(Spool(tmp_path)) == [b"after"]


def test_a_torn_last_write_is_skipped_and_appends_after_it_are_delivered(tmp_path: Path) -> None:
    damages: list[Damage] = []
    append(tmp_path, b"complete-1", 3)
    append(tmp_path, b"complete-2", 4)
    (segment,) = tmp_path.glob("*.seg")
    with open(segment, "ab") as file:  # a crash in the middle of the third append
        file.write(frame(b"never-finished", 5)[:26])
    append(tmp_path, b"after-restart")  # the older shipper restarted: its next append lands after the torn one
    reopened = Spool(tmp_path, on_damage=damages.append)
    assert drain(reopened) == [b"complete-1", b"complete-2", b"after-restart"]
    assert [(d.length, d.records) for d in damages] == [(26, 5)]


def test_a_flipped_byte_mid_segment_loses_only_its_entry_and_reports_its_records(tmp_path: Path) -> None:
    damages: list[Damage] = []
    payloads = [bytes([i]) * 100 for i in range(10)]
    for index, payload in enumerate(payloads):
        append(tmp_path, payload, records=index + 1)
    (segment,) = tmp_path.glob("*.seg")
    data = bytearray(segment.read_bytes())
    data[4 * (HEADER.size + 100) + HEADER.size + 50] ^= 0x01  # inside entry 4's payload
    segment.write_bytes(bytes(data))
    recovered = drain(Spool(tmp_path, on_damage=damages.append))
    assert recovered == payloads[:4] + payloads[5:]
    assert [(d.offset, d.records) for d in damages] == [(4 * (HEADER.size + 100), 5)]


def test_a_spool_left_by_the_previous_layout_is_delivered_before_new_entries(tmp_path: Path) -> None:
    legacy = b"".join(struct.pack("<II", len(p), zlib.crc32(p)) + p for p in (b"old-1", b"old-2"))
    (tmp_path / "00000001.spool").write_bytes(legacy)
    append(tmp_path, b"new-1")  # an older shipper appended to a new segment after it, never to it
    assert sorted(path.name for path in tmp_path.iterdir()) == ["00000001.spool", "00000002.seg"]
    spool = Spool(tmp_path)
    assert drain(spool) == [b"old-1", b"old-2", b"new-1"]
    assert not list(tmp_path.glob("*.spool"))


@dataclass(frozen=True)
class Written:
    segment: Path
    start: int
    end: int
    payload: bytes


def written_entries(directory: Path) -> list[Written]:
    """Every entry's place, read from undamaged segment files."""
    entries = []
    for segment in sorted(directory.glob("*.seg")):
        data = segment.read_bytes()
        offset = 0
        while offset < len(data):
            length = HEADER.unpack_from(data, offset)[1]
            end = offset + HEADER.size + length
            entries.append(Written(segment, offset, end, data[offset + HEADER.size : end]))
            offset = end
    return entries


damage_op = st.one_of(
    st.tuples(st.just("flip"), st.floats(0, 1, exclude_max=True), st.floats(0, 1, exclude_max=True), st.integers(0, 7)),
    st.tuples(st.just("truncate"), st.floats(0, 1, exclude_max=True), st.floats(0, 1, exclude_max=True)),
    st.tuples(st.just("torn"), st.integers(1, HEADER.size + 30)),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batches=st.lists(st.tuples(st.binary(min_size=1, max_size=120), st.integers(1, 300)), min_size=1, max_size=25),
    segment_bytes=st.integers(40, 600),
    damage=st.lists(damage_op, min_size=1, max_size=4),
    later=st.lists(st.binary(min_size=1, max_size=60), max_size=3),
)
def test_after_any_damage_exactly_the_undamaged_entries_come_back_in_order(
    batches: list[tuple[bytes, int]], segment_bytes: int, damage: list[tuple], later: list[bytes]
) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        for payload, records in batches:
            append(directory, payload, records, segment_bytes=segment_bytes)
        entries = written_entries(directory)
        records_of = {(e.segment, e.start): r for e, (_, r) in zip(entries, batches, strict=True)}
        segments = sorted(directory.glob("*.seg"))
        # What each segment keeps intact: bytes [0, kept) minus positions whose bits differ now.
        kept = {s: s.stat().st_size for s in segments}
        flipped: dict[Path, dict[int, int]] = {s: {} for s in segments}
        for op in damage:
            if op[0] == "torn":  # a crash during an append to the last segment: a prefix of an entry
                with open(segments[-1], "ab") as file:
                    file.write(frame(b"t" * 40, 7)[: op[1]])
                continue
            segment = segments[int(op[1] * len(segments))]
            data = bytearray(segment.read_bytes())
            if not data:
                continue
            position = int(op[2] * len(data))
            if op[0] == "flip":
                data[position] ^= 1 << op[3]
                flipped[segment][position] = flipped[segment].get(position, 0) ^ (1 << op[3])  # twice mends
            else:
                del data[position:]
                kept[segment] = min(kept[segment], position)
            segment.write_bytes(bytes(data))

        def intact(entry: Written) -> bool:
            return entry.end <= kept[entry.segment] and not any(
                entry.start <= p < entry.end for p, mask in flipped[entry.segment].items() if mask
            )

        damages: list[Damage] = []
        for payload in later:  # the older shipper restarted after the damage and spooled on
            append(directory, payload, segment_bytes=segment_bytes)
        reopened = Spool(directory, on_damage=damages.append)
        expected = [e.payload for e in entries if intact(e)] + later
        assert drain(reopened) == expected
        assert reopened.empty()
        lost = [e for e in entries if not intact(e)]
        reported = sum(d.records or 0 for d in damages)
        assert reported <= sum(records_of[(e.segment, e.start)] for e in lost) + 7 * len(damage)
        if any(e.start < kept[e.segment] for e in lost):  # an entry cut off whole leaves nothing to see
            assert damages
