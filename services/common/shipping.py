"""What a router and a shipper share about shipping records to the recorder: the record-batch flags, their
limits and checks, and the check of a recorder's address.

The shipper batches what a router logged; a router takes the same flags and hands them to its child shipper
(``--shipper child``), so both refuse the same values with the same line (exit 2): a value the child would
refuse is refused by the router itself, once, rather than by a child started again and again.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

from splitstream.common.addresses import check_address
from splitstream.common.errors import ConfigError
from splitstream.common.records import MAX_BATCH_ITEMS

#: The largest ``--record-batch-size``: a batch carries up to that many records and as many events, so a full
#: one stays within :data:`~splitstream.common.records.MAX_BATCH_ITEMS`.
MAX_RECORD_BATCH_SIZE = MAX_BATCH_ITEMS // 2
#: The longest ``--record-batch-interval-ms``: a record waits at most this long for its batch to fill. A finite
#: value is not enough: 1e300 would hold a quiet router's calls until a batch filled.
MAX_RECORD_BATCH_INTERVAL_MS = 60_000.0
#: The smallest ``--record-batch-max-bytes``, and the floor of a cap learned from the recorder's refusals:
#: below it every record is too large even without its payloads, so each call would be dropped. A recorder
#: taking less is misconfigured, not a batch problem.
MIN_BATCH_BYTES = 64 << 10


@dataclass(frozen=True, kw_only=True)
class RecordBatchSettings:
    """``--record-batch-size``, ``--record-batch-interval-ms``, ``--record-queue-size`` and
    ``--record-batch-max-bytes``, validated (ConfigError naming the flag)."""

    size: int = 256
    interval_ms: float = 200.0
    queue_size: int = 100_000
    #: Half the recorder's default receive limit (its ``--max-message-bytes``, 128 MiB), which refuses a
    #: larger batch whole.
    max_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        for flag, value in (
            ("--record-batch-size", self.size),
            ("--record-queue-size", self.queue_size),
            ("--record-batch-max-bytes", self.max_bytes),
            ("--record-batch-interval-ms", self.interval_ms),
        ):
            if not value > 0:  # nan too
                raise ConfigError(f"{flag}: must be positive, got {value}")
        if self.size > MAX_RECORD_BATCH_SIZE:
            # The recorder refuses a batch of more than MAX_BATCH_ITEMS records and events, unparsed.
            raise ConfigError(
                f"--record-batch-size: at most {MAX_RECORD_BATCH_SIZE} (a batch carries as many events; the "
                f"recorder takes {MAX_BATCH_ITEMS} a batch), got {self.size}"
            )
        if not math.isfinite(self.interval_ms):  # inf would hold records (or a SIGTERM's drain) for ever
            raise ConfigError(f"--record-batch-interval-ms: must be a finite number, got {self.interval_ms}")
        if self.interval_ms > MAX_RECORD_BATCH_INTERVAL_MS:
            raise ConfigError(
                f"--record-batch-interval-ms: at most {MAX_RECORD_BATCH_INTERVAL_MS:.0f} (a minute), "
                f"got {self.interval_ms}"
            )
        if self.max_bytes < MIN_BATCH_BYTES:
            raise ConfigError(
                f"--record-batch-max-bytes: must be at least {MIN_BATCH_BYTES} (64 KiB), got {self.max_bytes}"
            )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RecordBatchSettings:
        """The settings from flags added by :func:`add_record_batch_arguments`; ConfigError when refused."""
        return cls(
            size=args.record_batch_size,
            interval_ms=args.record_batch_interval_ms,
            queue_size=args.record_queue_size,
            max_bytes=args.record_batch_max_bytes,
        )

    def flags(self) -> tuple[str, ...]:
        """The flags that give a shipper these settings."""
        return (
            "--record-batch-size", str(self.size),
            "--record-batch-interval-ms", str(self.interval_ms),
            "--record-queue-size", str(self.queue_size),
            "--record-batch-max-bytes", str(self.max_bytes),
        )  # fmt: skip


def add_record_batch_arguments(group: Any, *, passed: str = "") -> None:
    """Add the record-batch flags to ``group`` (a parser or one of its groups); ``passed`` ends each help
    (a router says it passes them to its child shipper)."""
    defaults = RecordBatchSettings()
    group.add_argument(
        "--record-batch-size",
        type=int,
        default=defaults.size,
        help=f"records per batch, at most {MAX_RECORD_BATCH_SIZE}{passed}",
    )
    group.add_argument(
        "--record-batch-interval-ms",
        type=float,
        default=defaults.interval_ms,
        help=f"longest a record waits for its batch to fill, at most {MAX_RECORD_BATCH_INTERVAL_MS:.0f}{passed}",
    )
    group.add_argument(
        "--record-queue-size",
        type=int,
        default=defaults.queue_size,
        help=f"feedback events the shipper holds in memory at most (calls wait in the log){passed}",
    )
    group.add_argument(
        "--record-batch-max-bytes",
        type=int,
        default=defaults.max_bytes,
        help="largest record batch sent to the recorder; keep it below the recorder's --max-message-bytes "
        "(128 MiB); a call whose record is larger alone is recorded without its largest payloads "
        f"(tag splitstream.payload-dropped){passed}",
    )


def check_recorder_address(address: str) -> None:
    """ConfigError naming ``--recorder`` unless ``address`` is a usable ``host:port``: a typo (``recorder:80o3``)
    would otherwise be taken, every call logged and never shipped, and only an unreachable recorder said."""
    try:
        check_address(address)
    except ValueError as error:
        raise ConfigError(f"--recorder: {error}") from None
