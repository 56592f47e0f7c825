"""``python -m splitstream.archiver`` and the ``splitstream-archive`` command."""

from splitstream.common.interrupts import quiet_interrupts

if __name__ != "__mp_main__":  # not in a spawned builder process: its pool handles its end
    quiet_interrupts()  # first: Ctrl-C during the imports below is a quiet exit 0

from splitstream.archiver.main import main

if __name__ == "__main__":  # not in a spawned builder process
    raise SystemExit(main())
