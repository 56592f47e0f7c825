"""``python -m splitstream.recorder`` and the ``splitstream-recorder`` command."""

from splitstream.common.interrupts import quiet_interrupts

quiet_interrupts()  # first: Ctrl-C during the imports below is a quiet exit 0

from splitstream.recorder.main import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
