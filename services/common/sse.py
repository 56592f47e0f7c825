"""Server-sent events read from bytes cut anywhere: what the router records of a stream it relays and what the
replayer reads of a stream it replays, the same way.

An event ends at a blank line; its ``data`` is its ``data:`` lines (one leading space dropped) joined by LF.
Lines may end in LF or CRLF, as the format allows; other fields (``event:``, ``id:``, comments) are skipped.
"""

from __future__ import annotations


class EventData:
    """Feed it chunks as they come; it returns the ``data`` of each event they complete."""

    def __init__(self) -> None:
        self.pending = b""  # the bytes of an event not ended yet

    def feed(self, chunk: bytes) -> list[bytes]:
        data = (self.pending + chunk).replace(b"\r\n", b"\n")
        found: list[bytes] = []
        start = 0
        while (end := data.find(b"\n\n", start)) >= 0:
            if (event := _data(data[start:end])) is not None:
                found.append(event)
            start = end + 2
        self.pending = data[start:]
        return found

    def rest(self) -> bytes | None:
        """The ``data`` of an event the stream ended without its blank line (None: nothing was left)."""
        return _data(self.pending)


def _data(block: bytes) -> bytes | None:
    lines = [line[5:].removeprefix(b" ") for line in block.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None
