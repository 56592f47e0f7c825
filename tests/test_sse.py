"""The server-sent event reader the router's recording and the replayer share, fed the same stream cut at every
byte: the events come out the same whatever the cuts, CRLF or LF, with other fields and comments skipped."""

from __future__ import annotations

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
