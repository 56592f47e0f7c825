"""The router's spool on a full disk: a failed append leaves nothing to count twice, and the cursor
is still written, so a restart resends nothing already acknowledged."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitstream.shipper.spool import CURSOR_FILE, CURSOR_SLOT, Damage, Spool
from tests.tmpfs import small_tmpfs


def drain(spool: Spool) -> list[bytes]:
    out = []
    while (entry := spool.peek()) is not None:
        payload, position = entry
        out.append(payload)
        spool.commit(position)
    return out


#: Appends 300-byte entries under a 2000-byte file size limit: the kernel then fails writes with EFBIG
#: as a full disk fails them with ENOSPC, part way through an entry, and needs no root. It prints how
#: many appends succeeded and the error of the one that failed, then appends once more, smaller.
FILL_UNDER_FILE_SIZE_LIMIT = textwrap.dedent(
    """
    import resource, sys
    from splitstream.shipper.spool import Spool

    resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))
    spool = Spool(sys.argv[1], max_bytes=1 << 20)
    appended = 0
    try:
        while True:
            spool.append(bytes([appended]) * 300, records=3)
            appended += 1
    except OSError as error:
        print(appended, error.errno)
    try:
        print(spool.append(b"small", records=1))
    except OSError as error:
        print(error)
    """
)


def test_an_append_failing_part_way_on_a_full_disk_leaves_no_torn_entry_to_count_again(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", FILL_UNDER_FILE_SIZE_LIMIT, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    failed, small = done.stdout.split("\n")[:2]
    appended, errno = (int(part) for part in failed.split())
    assert errno == 27  # EFBIG: the write really failed part way
    assert appended == 2000 // (300 + 20)  # entries of 20 bytes of header and 300 of payload
    damages: list[Damage] = []
    reopened = Spool(tmp_path, max_bytes=1 << 20, on_damage=damages.append)
    recovered = drain(reopened)
    assert damages == []  # its records were counted once, when the append failed
    assert recovered[:appended] == [bytes([i]) * 300 for i in range(appended)]
    assert small == "True"  # the space the failed entry took was given back
    assert recovered[appended:] == [b"small"]


def test_on_a_full_disk_the_cursor_is_still_written_so_a_restart_resends_nothing_acknowledged(
    tmp_path: Path,
) -> None:
    with small_tmpfs(tmp_path / "spool", "256k") as directory:
        spool = Spool(directory, max_bytes=1 << 30)  # one segment: nothing is freed by acknowledging
        appended = 0
        try:
            while True:
                spool.append(appended.to_bytes(4, "big") * 250, records=1)
                appended += 1
        except OSError:  # ENOSPC: the disk is full
            pass
        assert appended > 100
        for _ in range(100):  # acknowledged by the recorder
            entry = spool.peek()
            assert entry is not None
            spool.commit(entry[1])
        spool.flush()  # at shutdown
        damages: list[Damage] = []
        reopened = Spool(directory, max_bytes=1 << 30, on_damage=damages.append)
        assert drain(reopened) == [i.to_bytes(4, "big") * 250 for i in range(100, appended)]
        assert damages == []


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(torn_at=st.integers(0, CURSOR_SLOT.size), garbage=st.binary(max_size=CURSOR_SLOT.size))
def test_a_cursor_write_torn_by_a_crash_falls_back_to_the_cursor_written_before(
    tmp_path_factory: pytest.TempPathFactory, torn_at: int, garbage: bytes
) -> None:
    directory = tmp_path_factory.mktemp("spool")
    spool = Spool(directory, max_bytes=1 << 20)
    for i in range(6):
        assert spool.append(b"entry-%d" % i)
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
    resent = drain(Spool(directory, max_bytes=1 << 20))
    if torn == after[changed : changed + CURSOR_SLOT.size]:
        assert resent == [b"entry-%d" % i for i in range(3, 6)]
    else:
        assert resent == [b"entry-%d" % i for i in range(2, 6)]


def test_a_cursor_left_by_an_older_router_is_honoured_then_replaced(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=1 << 20)
    for i in range(3):
        assert spool.append(b"entry-%d" % i)
    (tmp_path / CURSOR_FILE).unlink()
    (tmp_path / "cursor").write_text(f"1 {20 + len(b'entry-0')}\n")  # past entry-0
    reopened = Spool(tmp_path, max_bytes=1 << 20)
    reopened.flush()
    assert not (tmp_path / "cursor").exists()
    assert drain(Spool(tmp_path, max_bytes=1 << 20)) == [b"entry-1", b"entry-2"]
