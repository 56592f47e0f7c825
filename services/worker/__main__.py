"""``python -m splitstream.worker``: the same as the ``splitstream-worker`` command."""

from splitstream.worker.main import main

if __name__ == "__main__":
    raise SystemExit(main())
