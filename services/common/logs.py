"""structlog configured for one JSON object per line on stderr.

Per-request events are logged at DEBUG only; at production request rates the
metrics carry the per-request signal.

Every string in every event (the rendered exception included) passes through
:func:`~splitstream.common.secrets.redact_text` last: a URL with a password, or
``password=...``, can reach a log line from a library's error message that no
call site knew would quote it.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any, TextIO, cast

import structlog
from structlog.typing import EventDict, WrappedLogger

from splitstream.common.secrets import redact_text

#: Cheap tests before the regular expressions: most log strings contain neither.
_MAYBE_SECRET = ("@", "=")


def redact_secrets(_logger: WrappedLogger, _method: str, event: EventDict) -> EventDict:
    """A structlog processor: credentials in URLs and ``password=``-style pairs become ``***``."""
    for key, value in event.items():
        event[key] = _scrubbed(value)
    return event


def _scrubbed(value: Any) -> Any:
    if isinstance(value, str):
        return redact_text(value) if any(mark in value for mark in _MAYBE_SECRET) else value
    if isinstance(value, list | tuple):
        return [_scrubbed(item) for item in value]
    if isinstance(value, dict):
        return {key: _scrubbed(item) for key, item in value.items()}
    return value


class _StderrThatMayGoAway:
    """``sys.stderr`` for log lines, dropping a line it cannot write.

    stderr is often a pipe (``| head``, a log collector). Once its reader is gone every write raised
    BrokenPipeError in whatever task was logging: a ``--processes`` parent's restart task ended at its
    "starting it again" line, and its signal handler raised at its "signal received" line before it
    set its stop flag, so the parent lived on without children and ignored SIGTERM. A lost log line
    costs less than a service that no longer restarts or stops."""

    def write(self, text: str) -> int:
        try:
            return sys.stderr.write(text)
        except (OSError, ValueError):  # a broken pipe, a closed stream
            return 0

    def flush(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()


#: One object, so structlog's per-file lock is one lock for every logger.
_LOG_STREAM = _StderrThatMayGoAway()


#: Whether DEBUG lines are written (until :func:`configure_logging` says otherwise, structlog's default writes
#: them): a line logged on every call is built only when it is (``debug_enabled``).
_debug = True


def debug_enabled() -> bool:
    """Whether a DEBUG line would be written. A per-call ``log.debug(...)`` that is filtered out still costs its
    arguments and structlog's lookups, about 3 µs on a router's answering path."""
    return _debug


def configure_logging(level: str = "INFO", *, service: str) -> structlog.stdlib.BoundLogger:
    """Set up JSON logging for ``service`` and return its logger."""
    global _debug
    numeric = logging.getLevelNamesMapping().get(level.upper())
    if numeric is None:
        raise ValueError(f"unknown log level {level!r} (use DEBUG, INFO, WARNING or ERROR)")
    _debug = numeric <= logging.DEBUG
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            redact_secrets,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.WriteLoggerFactory(
            file=cast(TextIO, _LOG_STREAM)
        ),  # one write() per line: processes share stderr
        cache_logger_on_first_use=True,
    )
    logger: structlog.stdlib.BoundLogger = structlog.get_logger().bind(service=service)
    return logger
