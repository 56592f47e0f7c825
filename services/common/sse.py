"""Server-sent events read from bytes cut anywhere: what the router records of a stream it relays and what the
replayer reads of a stream it replays, the same way.

An event ends at a blank line; its ``data`` is its ``data:`` lines (one leading space dropped) joined by LF.
Lines may end in LF or CRLF, as the format allows; other fields (``event:``, ``id:``, comments) are skipped.
"""

from __future__ import annotations


class EventData:
    """Feed it chunks as they come; it returns the ``data`` of each event they complete.

    Each byte is looked at a bounded number of times however the stream is cut: an event of megabytes that
    arrives in small chunks costs its length, not its length times the number of chunks (joining and searching
    the whole pending event on every chunk made such a stream take seconds of CPU, minutes at 16 MiB)."""

    def __init__(self) -> None:
        self._pending = bytearray()  # the bytes of an event not ended yet, CRLF already made LF
        self._cr = False  # the last chunk ended in CR: the next one may start with its LF

    def feed(self, chunk: bytes) -> list[bytes]:
        if (
            not self._pending
            and not self._cr
            and chunk.startswith(b"data:")
            and chunk.find(b"\n") == len(chunk) - 2
            and chunk.endswith(b"\n\n")
            and b"\r" not in chunk
        ):  # one event of one data line, as a relay writes each (most chunks): what the search below finds
            return [chunk[5:-2].removeprefix(b" ")]
        if self._cr:
            chunk = b"\r" + chunk
        self._cr = chunk.endswith(b"\r")
        if self._cr:
            chunk = chunk[:-1]
        scanned = max(len(self._pending) - 1, 0)  # a blank line may straddle the cut: its first LF is pending
        self._pending += chunk.replace(b"\r\n", b"\n")
        found: list[bytes] = []
        start = 0
        while (end := self._pending.find(b"\n\n", max(start, scanned))) >= 0:
            if (event := _data(bytes(self._pending[start:end]))) is not None:
                found.append(event)
            start = end + 2
        if start:
            del self._pending[:start]
        return found

    def rest(self) -> bytes | None:
        """The ``data`` of an event the stream ended without its blank line (None: nothing was left)."""
        return _data(bytes(self._pending) + (b"\r" if self._cr else b""))


def _data(block: bytes) -> bytes | None:
    lines = [line[5:].removeprefix(b" ") for line in block.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None
