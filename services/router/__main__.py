"""``python -m splitstream.router`` and the ``splitstream-router`` command."""

from splitstream.common.interrupts import quiet_interrupts

quiet_interrupts()  # first: Ctrl-C during the imports below is a quiet exit 0

from splitstream.router.main import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
