"""A service run by the shared runtime whose long-lived work loses the drain's first cancel, as a loop
around ``asyncio.wait_for`` does on Python 3.11 when the cancel lands just as the awaited call completes
(``wait_for`` then returns the result instead of raising; redis-py runs every command under it). The
race is narrow, so it is made certain here: the first CancelledError is caught and the loop goes on, as
the real one would. Started as a real process by ``tests/test_runtime.py``.

    python -m tests.lost_cancel_service --host 127.0.0.1 --port P --metrics-port M
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from grpc import aio

from splitstream.common.runtime import (
    Runtime,
    ServerDefaults,
    ServerSettings,
    Service,
    add_server_arguments,
    run_service,
)


class LosesTheFirstCancel(Service):
    prog = "lost-cancel-service"

    def register(self, server: aio.Server) -> None:
        """Health and reflection only (the runtime adds them)."""

    async def run(self, runtime: Runtime) -> None:
        await runtime.set_serving(True)
        lost = False
        while True:
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                if lost:
                    raise
                lost = True
                print("lost a cancel", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(prog=LosesTheFirstCancel.prog)
    add_server_arguments(parser, ServerDefaults(port=0, metrics_port=0))
    settings = ServerSettings.from_args(parser.parse_args())
    return run_service(settings, LosesTheFirstCancel, prog=LosesTheFirstCancel.prog)


if __name__ == "__main__":
    sys.exit(main())
