"""``python -m splitstream.archiver`` and the ``splitstream-archive`` command."""

from splitstream.common.interrupts import quiet_interrupts

quiet_interrupts()  # first: Ctrl-C during the imports below is a quiet exit 0

from splitstream.archiver.main import main  # noqa: E402  (after quiet_interrupts, on purpose)

if __name__ == "__main__":
    raise SystemExit(main())
