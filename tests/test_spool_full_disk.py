"""A spool an older shipper left, read on a full disk: the cursor is still written, so a restart resends
nothing already acknowledged; and a torn or older cursor file is read as it should be."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitstream.shipper.spool import CURSOR_FILE, CURSOR_SLOT, Damage, Spool
from tests.spools import append
from tests.tmpfs import small_tmpfs


def drain(spool: Spool) -> list[bytes]:
    out = []
    while (entry := spool.peek()) is not None:
        payload, position = entry
        out.append(payload)
        spool.commit(position)
    return out


def test_on_a_full_disk_the_cursor_is_still_written_so_a_restart_resends_nothing_acknowledged(
    tmp_path: Path,
) -> None:
    with small_tmpfs(tmp_path / "spool", "256k") as directory:
        Spool(directory)  # the older shipper opened its spool (allocating the cursor file) before it spooled
        appended = 0
        try:
            while True:  # one segment: nothing is freed by acknowledging
                append(directory, appended.to_bytes(4, "big") * 250, records=1)
                appended += 1
        except OSError:  # ENOSPC: the disk is full
            pass
        assert appended > 100
        spool = Spool(directory)
        for _ in range(100):  # acknowledged by the recorder
            entry = spool.peek()
            assert entry is not None
            spool.commit(entry[1])
        spool.flush()  # at shutdown
        damages: list[Damage] = []
        reopened = Spool(directory, on_damage=damages.append)
        assert drain(reopened) == [i.to_bytes(4, "big") * 250 for i in range(100, appended)]
        assert damages == []


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(torn_at=st.integers(0, CURSOR_SLOT.size), garbage=st.binary(max_size=CURSOR_SLOT.size))
def test_a_cursor_write_torn_by_a_crash_falls_back_to_the_cursor_written_before(
    tmp_path_factory: pytest.TempPathFactory, torn_at: int, garbage: bytes
) -> None:
    directory = tmp_path_factory.mktemp("spool")
    for i in range(6):
        append(directory, b"entry-%d" % i)
    spool = Spool(directory)
    for _ in range(2):
        entry = spool.peek()
        assert entry is not None
        spool.commit(entry[1])
        spool.flush()
    before = (directory / CURSOR_FILE).read_bytes()
    entry = spool.peek()
    assert entry is not None
    spool.commit(entry[1])
    spool.flush()
    after = (directory / CURSOR_FILE).read_bytes()
    # The crash: the slot being written holds a prefix of the new slot, then what the disk had
    # (the old slot, or garbage where the write left sectors undefined).
    (changed,) = [
        s for s in (0, CURSOR_SLOT.size) if before[s : s + CURSOR_SLOT.size] != after[s : s + CURSOR_SLOT.size]
    ]
    old_rest = (garbage + before[changed : changed + CURSOR_SLOT.size])[: CURSOR_SLOT.size]
    torn = after[changed : changed + torn_at] + old_rest[torn_at:]
    (directory / CURSOR_FILE).write_bytes(before[:changed] + torn + before[changed + CURSOR_SLOT.size :])
    resent = drain(Spool(directory))
    if torn == after[changed : changed + CURSOR_SLOT.size]:
        assert resent == [b"entry-%d" % i for i in range(3, 6)]
    else:
        assert resent == [b"entry-%d" % i for i in range(2, 6)]


def test_a_cursor_left_by_an_older_router_is_honoured_then_replaced(tmp_path: Path) -> None:
    for i in range(3):
        append(tmp_path, b"entry-%d" % i)
    (tmp_path / "cursor").write_text(f"1 {20 + len(b'entry-0')}\n")  # past entry-0
    reopened = Spool(tmp_path)
    reopened.flush()
    assert not (tmp_path / "cursor").exists()
    assert drain(Spool(tmp_path)) == [b"entry-1", b"entry-2"]
