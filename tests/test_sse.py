"""The server-sent event reader the router's recording and the replayer share, fed the same stream cut at every
byte: the events come out the same whatever the cuts, CRLF or LF, with other fields and comments skipped."""

from __future__ import annotations

import time

import pytest

from splitstream.common.sse import EventData

STREAM = (
    b": a comment\r\n"
    b'data: {"a":1}\r\n\r\n'
    b"event: message\nid: 7\ndata: line one\ndata:line two\n\n"
    b"retry: 10\n\n"  # no data: no event
    b"data: [DONE]\n\n"
    b"data: cut off"
)


@pytest.mark.parametrize("size", [1, 2, 3, 7, len(STREAM)])
def test_events_are_the_same_however_the_stream_is_cut(size: int) -> None:
    reader = EventData()
    found = [event for start in range(0, len(STREAM), size) for event in reader.feed(STREAM[start : start + size])]
    assert found == [b'{"a":1}', b"line one\nline two", b"[DONE]"]
    assert reader.rest() == b"cut off"


def test_nothing_left_is_no_event() -> None:
    reader = EventData()
    assert reader.feed(b"data: x\n\n") == [b"x"]
    assert reader.rest() is None


def test_a_carriage_return_cut_from_its_line_feed_is_read_as_in_one_piece() -> None:
    """``\\r\\r\\n``: a CR as data, then a CRLF. Cut after the first CR, the old reader joined the pending bytes
    (already made LF) and made ``\\r\\n`` of what was ``\\r`` + ``\\r\\n`` a second time."""
    stream = b"data: a\r\r\ndata: b\n\n"
    whole = EventData().feed(stream)
    assert whole == [b"a\r\nb"]
    for cut in range(1, len(stream)):
        reader = EventData()
        assert reader.feed(stream[:cut]) + reader.feed(stream[cut:]) == whole, cut


def test_a_large_event_in_small_chunks_costs_its_length_not_its_length_squared() -> None:
    """16 MiB of one event arriving 16 KiB at a time (a relay passes chunks as they come): joining and searching
    the whole pending event per chunk took about a minute of CPU; read once, it is well under a second."""
    body = b"data: " + b"x" * (16 << 20) + b"\r\n\r\n"
    reader = EventData()
    started = time.process_time()
    found = [
        event for start in range(0, len(body), 16 << 10) for event in reader.feed(body[start : start + (16 << 10)])
    ]
    spent = time.process_time() - started
    assert [len(event) for event in found] == [16 << 20]
    assert reader.rest() is None
    assert spent < 10, f"{spent:.1f}s of CPU for one 16 MiB event"
