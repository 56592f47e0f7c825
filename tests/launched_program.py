"""A program whose end each test of :mod:`tests.test_launcher` chooses: run exec'd and forked from the zygote,
it must end the same way (exit status, output, threads and ``atexit`` functions)."""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time


def _finish_late() -> None:
    time.sleep(0.2)
    print("thread done", flush=True)


def main(scenario: str) -> None:
    print("out 1")
    print("err 1", file=sys.stderr)
    print("out 2")
    if scenario == "exit":
        sys.exit(int(sys.argv[2]))
    if scenario == "exit-text":
        sys.exit("it went wrong")
    if scenario == "raise":
        raise ValueError("boom")
    if scenario == "interrupt":
        raise KeyboardInterrupt
    if scenario == "thread":  # a non-daemon thread outlives main: the interpreter waits for it
        threading.Thread(target=_finish_late).start()
    if scenario == "atexit":
        atexit.register(print, "atexit ran")
    if scenario == "environment":
        print(os.environ.get("LAUNCHED_SETTING"), os.getcwd(), os.getsid(0) == os.getpid())
    if scenario == "arguments":
        print(ascii(sys.argv[2:]), ascii(os.environ.get("LAUNCHED_SETTING")))
    if scenario == "stdin":
        print(sys.stdin.read().upper())
    if scenario == "wait-for-signal":
        print("waiting", flush=True)
        signal.pause()


if __name__ == "__main__":
    main(sys.argv[1])
