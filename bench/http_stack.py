"""Which Python HTTP stack a pass-through costs least on: the router's (aiohttp serving and calling in one
library on its asyncio loop) against uvicorn + Starlette + httpx and Granian, by measurement.

One run, the same upstream (``bench/openai_standin.py``) and the same client as ``bench/http_overhead.py``:
``direct``, then the bare pass-through of ``bench/http_passthrough.py`` on each stack, in its own process:
``aiohttp`` (the reference: the floor of the overhead table), ``uvicorn-httpx``, ``uvicorn-aiohttp`` (the
server alone changed), ``granian-httpx`` and ``granian-aiohttp`` (Granian's ASGI interface, one worker). The
other stacks run from ``.venv-bench`` (``make bench-http``); a stack that does not start there is left out
with the reason printed. Each server runs on asyncio's loop, as the router's must (its gRPC server is
grpc.aio). Cases as in ``http_overhead.py``: added p50 and CPU per call at 1 and 16 in flight, and the time
to first token of one stream; ratios are to ``aiohttp``'s in the same rounds.

    .venv/bin/python bench/http_stack.py [--seconds 2] [--rounds 3] [--bench-python .venv-bench/bin/python]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.http_load import HttpPath, descendants, load_note
from bench.http_overhead import ROOT, parse_cases, print_tables, run_cases, start_floor, start_standin
from bench.http_passthrough import STACKS
from bench.loadgen import stop_all

DEFAULT_CASES = "unary:1,unary:16,stream:1"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=2.0, help="measuring time per path, round and case")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per case")
    parser.add_argument("--tokens", type=int, default=16, help="tokens of each answer (a stream's events)")
    parser.add_argument("--gap-ms", type=float, default=1.0, help="the stand-in's time between a stream's tokens")
    parser.add_argument("--cases", default=DEFAULT_CASES, help="comma-separated unary:N and stream:N (N in flight)")
    parser.add_argument(
        "--bench-python",
        default=str(ROOT / ".venv-bench" / "bin" / "python"),
        help="the Python with uvicorn, Starlette, httpx and Granian (make bench-http makes .venv-bench)",
    )
    parser.add_argument("--stacks", default=",".join(STACKS), help=f"comma-separated subset of {','.join(STACKS)}")
    args = parser.parse_args()
    try:
        cases = parse_cases(args.cases)
    except ValueError as error:
        parser.error(f"--cases: {error}")
    stacks = [stack for stack in args.stacks.split(",") if stack]
    unknown = set(stacks) - set(STACKS)
    if unknown:
        parser.error(f"--stacks: unknown {', '.join(sorted(unknown))}")

    tmp = Path(tempfile.mkdtemp(prefix="splitstream-bench-"))
    processes: list[subprocess.Popen[bytes]] = []
    skipped: list[str] = []
    try:
        standin, upstream = start_standin(tmp, args.tokens, args.gap_ms)
        processes.append(standin)
        paths = [HttpPath("direct", upstream)]
        for stack in stacks:
            python = sys.executable if stack == "aiohttp" else args.bench_python
            if not Path(python).exists():
                skipped.append(f"{stack}: {python} not found (make bench-http makes .venv-bench)")
                continue
            try:
                process, base_url = start_floor(tmp, upstream, python, stack)
            except (RuntimeError, TimeoutError) as error:
                skipped.append(f"{stack}: did not start ({str(error).strip().splitlines()[-1]})")
                continue
            processes.append(process)
            paths.append(HttpPath(stack, base_url, descendants(process.pid)))  # Granian's worker too
        print(
            f"HTTP stacks, a bare pass-through each: {args.rounds} rounds x {args.seconds:g} s per path and case; "
            f"stand-in answers {args.tokens} tokens, streamed {args.gap_ms:g} ms apart; {load_note()} at start"
        )
        for reason in skipped:
            print(f"left out: {reason}")
        results = run_cases(paths, cases, tokens=args.tokens, seconds=args.seconds, rounds=args.rounds)
        print_tables(results, reference="aiohttp")
        print(f"\n{load_note()} at the end")
    finally:
        stop_all(processes)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
