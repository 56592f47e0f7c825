"""The router's own work to record one passed-through HTTP call, timed in process: no sockets, no load.

What the front door does after a whole answer and before it leaves (``HttpFrontDoor._record``): the
answer's ``usage`` read, the client's headers filtered, the ``HttpCall`` serialized, the log entry
encoded and appended (a real ``writev`` to a log in a temporary directory); and, before routing, the
request body parsed and checked. One bench chat call (``bench/openai_standin.py``'s answer of 16
tokens), the best of ``--repeat`` timings of ``--number`` calls each, so a loaded machine's noise is
mostly left out. The end-to-end figures, where the machine's load counts, are
``bench/http_overhead.py``'s.

    .venv/bin/python bench/http_record_path.py [--number 5000] [--repeat 9]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import timeit
from collections.abc import Callable

import grpc
from multidict import CIMultiDict, CIMultiDictProxy
from prometheus_client import CollectorRegistry

from splitstream.router.core import CallOutcome
from splitstream.router.http.openai_api import parse_body
from splitstream.router.http.recording import HttpExchange, recorded_headers
from splitstream.router.recording import CallLog

REQUEST = json.dumps(
    {"model": "bench", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 16}
).encode()
ANSWER = json.dumps(
    {
        "id": "chatcmpl-0123456789abcdef",
        "object": "chat.completion",
        "created": 1,
        "model": "bench",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": " ".join(["token"] * 16), "refusal": None},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 16, "total_tokens": 21},
    }
).encode()
HEADERS = {
    "Host": "127.0.0.1:8080",
    "User-Agent": "Python/3.11 aiohttp/3.14",
    "Accept": "*/*",
    "Accept-Encoding": "gzip, deflate",
    "Content-Length": str(len(REQUEST)),
    "Content-Type": "application/json",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--number", type=int, default=5000, help="calls per timing")
    parser.add_argument("--repeat", type=int, default=9, help="timings, the best one kept")
    args = parser.parse_args()
    if args.number < 1 or args.repeat < 1:
        parser.error("--number and --repeat must be at least 1")
    with tempfile.TemporaryDirectory(prefix="splitstream-bench-") as directory:
        log = CallLog(
            directory,
            CollectorRegistry(),
            router_id="bench",
            hmac_key=b"bench" * 8,
            max_bytes=1 << 40,
            segment_bytes=64 << 20,
            flush_interval_s=1.0,
        )
        headers = CIMultiDictProxy(CIMultiDict(HEADERS))
        outcome = CallOutcome(
            "0123456789abcdef0123456789abcdef",
            "bench",
            grpc.StatusCode.OK,
            "",
            None,
            version="v2",
            arm="v2",
            endpoint="127.0.0.1:8081",
            receive_unix_ns=1,
            latency_s=0.001,
        )
        exchange = HttpExchange("POST", "/v1/chat/completions", "chat", max_bytes=1 << 20, started_ns=0)
        exchange.received(REQUEST, "application/json", json.loads(REQUEST))
        exchange.answered(ANSWER, "application/json")
        metadata = recorded_headers(headers)
        fields = exchange.serialize(200, str)

        def record() -> None:
            exchange.usage = exchange.reported_usage()
            log.offer_http(outcome, b"", recorded_headers(headers), exchange.serialize(200, str))

        def best(call: Callable[[], object]) -> float:
            return min(timeit.repeat(call, number=args.number, repeat=args.repeat)) / args.number * 1e6

        print(f"µs per call, best of {args.repeat} x {args.number}:")
        print(f"  recording a call, all of it: {best(record):.1f}")
        print(f"    the answer's usage: {best(exchange.reported_usage):.1f}")
        print(f"    the headers filtered: {best(lambda: recorded_headers(headers)):.1f}")
        print(f"    the HttpCall serialized: {best(lambda: exchange.serialize(200, str)):.1f}")
        print(f"    the entry encoded and appended: {best(lambda: log.offer_http(outcome, b'', metadata, fields)):.1f}")
        print(f"  the request body parsed and checked: {best(lambda: parse_body(REQUEST)):.1f}")
        log.writer.close()


if __name__ == "__main__":
    main()
