"""The router's on-disk spool: order, cap, restart, torn writes."""

from __future__ import annotations

from pathlib import Path

from splitstream.router.spool import Spool


def drain(spool: Spool) -> list[bytes]:
    out = []
    while (entry := spool.peek()) is not None:
        payload, position = entry
        out.append(payload)
        spool.commit(position)
    return out


def test_entries_come_back_in_order_across_segments_and_restarts(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=1 << 20, segment_bytes=100)
    batches = [f"batch-{i}".encode() * 5 for i in range(30)]
    for batch in batches[:20]:
        assert spool.append(batch)
    first = spool.peek()
    assert first is not None
    spool.commit(first[1])
    reopened = Spool(tmp_path, max_bytes=1 << 20, segment_bytes=100)
    for batch in batches[20:]:
        assert reopened.append(batch)
    assert drain(reopened) == batches[1:]
    assert reopened.empty()
    assert len(list(tmp_path.glob("*.spool"))) <= 1


def test_a_full_spool_refuses_without_writing_and_frees_space_when_drained(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=100, segment_bytes=1000)
    assert spool.append(b"x" * 40)
    assert spool.append(b"y" * 40)
    assert not spool.append(b"z" * 40)
    assert spool.pending_bytes == 96
    entry = spool.peek()
    assert entry is not None
    spool.commit(entry[1])
    assert spool.append(b"z" * 40)
    assert drain(spool) == [b"y" * 40, b"z" * 40]


def test_a_torn_last_write_is_detected_and_skipped(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=1 << 20)
    assert spool.append(b"complete-1")
    assert spool.append(b"complete-2")
    (segment,) = tmp_path.glob("*.spool")
    with open(segment, "ab") as file:  # a crash in the middle of the third append
        file.write(b"\x40\x00\x00\x00\x12\x34")
    reopened = Spool(tmp_path, max_bytes=1 << 20)
    assert reopened.append(b"after-restart")
    assert drain(reopened) == [b"complete-1", b"complete-2", b"after-restart"]


def test_a_corrupted_tail_payload_is_cut_not_delivered(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=1 << 20)
    assert spool.append(b"good")
    assert spool.append(b"will-be-damaged")
    (segment,) = tmp_path.glob("*.spool")
    data = bytearray(segment.read_bytes())
    data[-3] ^= 0xFF
    segment.write_bytes(bytes(data))
    assert drain(Spool(tmp_path, max_bytes=1 << 20)) == [b"good"]
