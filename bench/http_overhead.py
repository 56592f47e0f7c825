"""What an HTTP hop adds to OpenAI chat calls: the router beside the floor, LiteLLM's proxy and nginx.

One run, the same upstream (``bench/openai_standin.py``: whole answers and SSE streams of ``--tokens``
tokens ``--gap-ms`` apart), the same client, side by side:

- ``direct``: client → stand-in;
- ``floor``: client → a bare aiohttp pass-through (``bench/http_passthrough.py``: no routing, metrics or
  recording) → stand-in, the least a Python hop on the router's HTTP stack costs;
- ``router``: client → splitstream-router's HTTP port → stand-in, the stand-in registered as an ``openai``
  upstream of both versions of a 50/50 experiment, every call recorded (the router's log, its child
  shipper, a recorder and a redis-server);
- ``litellm``: client → LiteLLM's proxy (``litellm[proxy]``, ``.venv-litellm``) → stand-in, the same two
  upstreams as two deployments of one model at weight 50 each, a master key, logging off, one worker;
- ``nginx``: client → nginx (``proxy_pass``, upstream keep-alive, ``proxy_buffering off``) → stand-in,
  the C reference; skipped, with the reason printed, when nginx is not installed.

Cases (``--cases``): unary JSON and streamed chat at 1 and 32 calls in flight, and unary at 16 (the
throughput case). At 1 in flight the paths are taken in turn call by call; above, each path is driven
for ``--seconds`` in turn, in an order that rotates each round. "added" is over ``direct`` in the same
rounds; "x floor" is the path's added time (or CPU) over the floor's. CPU is the proxy's processes (and
their children: nginx's worker, the router's shipper) from /proc, per call and, streamed, per token; the
stand-in's, the recorder's and redis-server's are not counted (in production they have hosts of their
own). The machine's load average is printed with the tables: compare ratios within one run.

Targets (issue 26): the router within 1.1x the floor's added p50 and CPU per call at 1 in flight, TTFT
added at one stream within 1.2x the floor's, calls/s at 16 in flight at least 0.9x the floor's.

With ``--baseline-python`` (another checkout's ``.venv/bin/python``) that checkout's router, with and without
recording, runs beside this one's in the same rounds as ``router-base`` and ``router-norec-base``: a change to the
router measured side by side rather than in two runs a load average apart.

    .venv/bin/python bench/http_overhead.py [--seconds 2] [--rounds 3] [--litellm PATH] [--cases unary:1,...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.http_load import HttpPath, HttpSummary, chat_body, descendants, load_note, measure
from bench.loadgen import find_nginx, stop_all
from tests.harness import Stack, free_port, wait_for, write_registry
from tests.redis_server import RedisServer

MODEL = "bench"
#: The key LiteLLM's proxy requires (its master key); every path gets the same header, so every client
#: sends the same bytes.
MASTER_KEY = "sk-bench-0123456789"
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CASES = "unary:1,stream:1,unary:32,stream:32,unary:16"


def started(command: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def answers(base_url: str) -> bool:
    """Whether a chat call through ``base_url`` is answered 200 (the path is up and its upstream healthy)."""
    request = urllib.request.Request(
        base_url + "/chat/completions",
        data=chat_body(MODEL, stream=False),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {MASTER_KEY}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return int(response.status) == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_answering(base_url: str, what: str, timeout_s: float, process: subprocess.Popen[bytes], log: Path) -> None:
    """Until ``base_url`` answers; RuntimeError with the end of ``log`` as soon as ``process`` has exited."""
    deadline = time.monotonic() + timeout_s
    while not answers(base_url):
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited {process.returncode}: {log.read_text(errors='replace')[-2000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not answer within {timeout_s:g} s (see {log})")
        time.sleep(0.1)


def start_standin(tmp: Path, tokens: int, gap_ms: float) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    command = [sys.executable, "bench/openai_standin.py", "--port", str(port), "--tokens", str(tokens)]
    process = started([*command, "--gap-ms", str(gap_ms)], tmp / "standin.log")
    base_url = f"http://127.0.0.1:{port}/v1"
    wait_answering(base_url, "the stand-in", 30, process, tmp / "standin.log")
    return process, base_url


def start_floor(
    tmp: Path, upstream: str, python: str = sys.executable, stack: str = "aiohttp"
) -> tuple[subprocess.Popen[bytes], str]:
    """A bare pass-through of ``stack`` (``bench/http_passthrough.py``) in its own process: (process, base URL)."""
    port = free_port()
    log = tmp / f"passthrough-{stack}.log"
    command = [python, "bench/http_passthrough.py", "--stack", stack, "--port", str(port), "--upstream", upstream]
    process = started(command, log)
    base_url = f"http://127.0.0.1:{port}/v1"
    wait_answering(base_url, f"the {stack} pass-through", 60, process, log)
    return process, base_url


def start_recorder(stack: Stack, tmp: Path) -> str:
    """A recorder writing to a redis-server of its own: its address."""
    redis = RedisServer(tmp / "redis").start()
    stack_cleanup.append(redis.stop)
    recorder_port = free_port()
    recorder = stack.service(
        "recorder",
        "splitstream.recorder",
        [
            *("--host", "127.0.0.1", "--port", str(recorder_port), "--metrics-port", "0"),
            *("--redis-url", redis.url, "--log-level", "WARNING"),
        ],
        port=recorder_port,
    )
    return recorder.address


def start_router(
    stack: Stack, tmp: Path, upstream: str, recorder: str | None, python: str | None = None
) -> tuple[int, str]:
    """A router whose 50/50 experiment has the stand-in as both versions, recording every call to ``recorder``
    (none: recording off), run by ``python`` (another checkout's environment: that checkout's router): (pid, base
    URL)."""
    registry = tmp / "registry.yaml"
    experiment = {
        "salt": "bench",
        "control": "v1",
        "arms": [{"version": "v1", "weight": 50}, {"version": "v2", "weight": 50}],
    }
    write_registry(
        registry,
        {MODEL: {"endpoints": {"v1": {"openai": upstream}, "v2": {"openai": upstream}}, "experiment": experiment}},
    )
    http_port = free_port()
    recording = ("--recorder", recorder, "--hmac-key", "bench", "--log-dir", str(tmp / f"log-{http_port}"))
    router = stack.router(
        registry,
        *("--http-port", str(http_port), "--log-level", "WARNING"),
        *(recording if recorder else ()),
        python=python,
    )
    assert router.process is not None
    base_url = f"http://127.0.0.1:{http_port}/v1"
    wait_for(lambda: answers(base_url), timeout_s=30, what="the router to answer through its upstream")
    return router.process.pid, base_url


#: Teardown of what is not a Stack's process (redis-server), run by main's finally.
stack_cleanup: list[Callable[[], object]] = []


def start_litellm(tmp: Path, litellm: str, upstream: str) -> tuple[subprocess.Popen[bytes], str]:
    """LiteLLM's proxy, the stand-in as two deployments of one model, weight 50 each (its weighted split).
    Logging off as far as its settings go: no database (so no spend logs), message logging off, errors only."""
    deployments = [
        {
            "model_name": MODEL,
            "litellm_params": {"model": f"openai/{version}", "api_base": upstream, "api_key": "unused", "weight": 50},
        }
        for version in ("v1", "v2")
    ]
    config = tmp / "litellm.yaml"
    config.write_text(
        json.dumps(
            {
                "model_list": deployments,
                "router_settings": {"routing_strategy": "simple-shuffle"},
                "litellm_settings": {"turn_off_message_logging": True, "set_verbose": False},
                "general_settings": {"master_key": MASTER_KEY, "disable_spend_logs": True},
            }
        )
    )
    port = free_port()
    # No network here: LiteLLM must not fetch its model price list at start, nor send telemetry.
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False", "LITELLM_LOG": "ERROR"}
    log = tmp / "litellm.log"
    command = [litellm, "--config", str(config), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"]
    process = started(command, log, env)
    base_url = f"http://127.0.0.1:{port}/v1"
    wait_answering(base_url, "LiteLLM's proxy", 240, process, log)
    return process, base_url


def start_nginx(tmp: Path, upstream: str) -> tuple[subprocess.Popen[bytes], str] | str:
    """nginx as a reverse proxy in front of the stand-in; the reason it is left out when it cannot run."""
    nginx = find_nginx()
    if nginx is None:
        return "nginx is not installed (apt-get install nginx)"
    port = free_port()
    upstream_host = upstream.split("//", 1)[1].split("/", 1)[0]
    conf = tmp / "nginx.conf"
    conf.write_text(f"""
worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {tmp}/body; proxy_temp_path {tmp}/proxy;
  fastcgi_temp_path {tmp}/fcgi; uwsgi_temp_path {tmp}/uwsgi; scgi_temp_path {tmp}/scgi;
  upstream standin {{ server {upstream_host}; keepalive 64; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://standin;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }}
  }}
}}
""")
    process = started([nginx, "-p", str(tmp), "-c", str(conf)], tmp / "nginx.log")
    base_url = f"http://127.0.0.1:{port}/v1"
    wait_answering(base_url, "nginx", 10, process, tmp / "nginx-error.log")
    return process, base_url


def _f(value: float, digits: int = 3) -> str:
    return "" if math.isnan(value) else f"{value:.{digits}f}"


def _ratio(value: float, floor: float) -> str:
    return f"{value / floor:.2f}x" if floor > 0 and not math.isnan(value) and not math.isnan(floor) else ""


def report(kind: str, flight: int, summary: dict[str, HttpSummary], reference: str = "floor") -> list[str]:
    """The case's table rows (markdown), each path against direct and against ``reference``."""
    direct, floor = summary["direct"], summary.get(reference)
    rows = []
    for name, x in summary.items():
        hop = name != "direct"
        added50, added99 = x.p50_ms - direct.p50_ms, x.p99_ms - direct.p99_ms
        floor50 = floor.p50_ms - direct.p50_ms if floor else float("nan")
        if kind == "unary":
            cells = [
                f"{x.rate:.0f}",
                _f(x.p50_ms),
                _f(x.p99_ms),
                _f(added50) if hop else "",
                _f(added99) if hop else "",
                _ratio(added50, floor50) if hop and floor else "",
                _f(x.cpu_us_per_call, 0) if hop else "",
                _ratio(x.cpu_us_per_call, floor.cpu_us_per_call) if hop and floor else "",
            ]
        else:
            added_ttft = x.ttft_p50_ms - direct.ttft_p50_ms
            floor_ttft = floor.ttft_p50_ms - direct.ttft_p50_ms if floor else float("nan")
            cells = [
                f"{x.tokens_rate:.0f}",
                _f(x.ttft_p50_ms),
                _f(x.ttft_p99_ms),
                _f(added_ttft) if hop else "",
                _ratio(added_ttft, floor_ttft) if hop and floor else "",
                _f(added50) if hop else "",
                _f(x.cpu_us_per_call, 0) if hop else "",
                _f(x.cpu_us_per_token, 1) if hop else "",
                _ratio(x.cpu_us_per_token, floor.cpu_us_per_token) if hop and floor else "",
            ]
        errors = f" ({x.errors} errors)" if x.errors else ""
        rows.append(f"| {flight} | {name}{errors} | " + " | ".join(cells) + " |")
    return rows


def table_header(kind: str, reference: str = "floor") -> str:
    if kind == "unary":
        return (
            "| in flight | path | calls/s | p50 ms | p99 ms | added p50 ms | added p99 ms "
            f"| added p50 x {reference} | CPU µs/call | CPU x {reference} |\n"
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
        )
    return (
        "| in flight | path | tokens/s | TTFT p50 ms | TTFT p99 ms | added TTFT p50 ms "
        f"| added TTFT x {reference} | added p50 ms (whole stream) | CPU µs/call | CPU µs/token "
        f"| CPU/token x {reference} |\n"
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    )


def print_tables(results: dict[tuple[str, int], dict[str, HttpSummary]], reference: str = "floor") -> None:
    for kind in ("unary", "stream"):
        rows = [row for (k, n), summary in results.items() if k == kind for row in report(k, n, summary, reference)]
        if rows:
            print(f"\n{'Unary JSON' if kind == 'unary' else 'Streamed chat (SSE)'}:\n\n{table_header(kind, reference)}")
            print("\n".join(rows))


def parse_cases(text: str) -> list[tuple[str, int]]:
    """``unary:1,stream:32``: (kind, calls in flight) pairs; ValueError naming a case that is not one."""
    cases = []
    for case in text.split(","):
        kind, _, flight = case.strip().partition(":")
        if kind not in ("unary", "stream") or not flight.isdigit() or int(flight) < 1:
            raise ValueError(f"{case!r} is not unary:N or stream:N")
        cases.append((kind, int(flight)))
    return cases


def run_cases(
    paths: list[HttpPath], cases: list[tuple[str, int]], *, tokens: int, seconds: float, rounds: int
) -> dict[tuple[str, int], dict[str, HttpSummary]]:
    """Every case on every path, in interleaved rounds."""
    results: dict[tuple[str, int], dict[str, HttpSummary]] = {}
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {MASTER_KEY}"}
    for kind, flight in cases:
        body = chat_body(MODEL, stream=kind == "stream", max_tokens=tokens)
        results[(kind, flight)] = measure(
            paths,
            body,
            headers,
            concurrency=flight,
            seconds=seconds,
            rounds=rounds,
            progress=_progress(f"{kind} {flight} in flight"),
        )
    return results


def verdicts(results: dict[tuple[str, int], dict[str, HttpSummary]]) -> list[str]:
    """The issue's targets for the router, each against the floor measured in the same rounds."""
    lines = []

    def added(s: dict[str, HttpSummary], name: str, ttft: bool = False) -> float:
        if ttft:
            return s[name].ttft_p50_ms - s["direct"].ttft_p50_ms
        return s[name].p50_ms - s["direct"].p50_ms

    unary1, stream1, unary16 = results.get(("unary", 1)), results.get(("stream", 1)), results.get(("unary", 16))
    if unary1 and "router" in unary1 and "floor" in unary1:
        ratio = added(unary1, "router") / added(unary1, "floor")
        cpu = unary1["router"].cpu_us_per_call / unary1["floor"].cpu_us_per_call
        lines.append(
            f"- unary, 1 in flight: router added p50 {ratio:.2f}x the floor's ({_ok(ratio <= 1.1)}, target <= 1.1x), "
            f"CPU per call {cpu:.2f}x ({_ok(cpu <= 1.1)}, target <= 1.1x)"
        )
        if "litellm" in unary1:
            lat = added(unary1, "litellm") / added(unary1, "router")
            cpu_l = unary1["litellm"].cpu_us_per_call / unary1["router"].cpu_us_per_call
            lines.append(
                f"- unary, 1 in flight: LiteLLM's added p50 {lat:.1f}x the router's, its CPU per call {cpu_l:.1f}x"
            )
    if stream1 and "router" in stream1 and "floor" in stream1:
        ratio = added(stream1, "router", ttft=True) / added(stream1, "floor", ttft=True)
        lines.append(
            f"- stream, 1 in flight: router TTFT added {ratio:.2f}x the floor's ({_ok(ratio <= 1.2)}, target <= 1.2x)"
        )
    if unary16 and "router" in unary16 and "floor" in unary16:
        ratio = unary16["router"].rate / unary16["floor"].rate
        lines.append(
            f"- unary, 16 in flight: router calls/s {ratio:.2f}x the floor's ({_ok(ratio >= 0.9)}, target >= 0.9x)"
        )
    return lines


def _progress(case: str) -> Callable[[str], None]:
    """Progress on stderr, so that stdout is the report alone."""
    return lambda note: print(f"  {case}: {note}", file=sys.stderr)


def _ok(met: bool) -> str:
    return "met" if met else "MISSED"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=2.0, help="measuring time per path, round and case")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per case")
    parser.add_argument("--tokens", type=int, default=16, help="tokens of each answer (a stream's events)")
    parser.add_argument("--gap-ms", type=float, default=1.0, help="the stand-in's time between a stream's tokens")
    parser.add_argument("--cases", default=DEFAULT_CASES, help="comma-separated unary:N and stream:N (N in flight)")
    default_litellm = os.environ.get("SPLITSTREAM_LITELLM") or str(ROOT / ".venv-litellm" / "bin" / "litellm")
    parser.add_argument("--litellm", default=default_litellm, help="LiteLLM's CLI (make .venv-litellm/.installed)")
    parser.add_argument(
        "--paths",
        default="",
        help="comma-separated subset of floor,router,litellm,nginx (direct is always measured), and router-norec: "
        "a second router with recording off",
    )
    parser.add_argument(
        "--baseline-python",
        default="",
        help="another checkout's Python (its .venv/bin/python): its router and router-norec run beside this "
        "checkout's as router-base and router-norec-base, in the same rounds (a change measured side by side)",
    )
    args = parser.parse_args()
    try:
        cases = parse_cases(args.cases)
    except ValueError as error:
        parser.error(f"--cases: {error}")
    wanted = set(args.paths.split(",")) if args.paths else {"direct", "floor", "router", "litellm", "nginx"}

    tmp = Path(tempfile.mkdtemp(prefix="splitstream-bench-"))
    stack = Stack(tmp)
    processes: list[subprocess.Popen[bytes]] = []
    skipped: list[str] = []
    try:
        standin, upstream = start_standin(tmp, args.tokens, args.gap_ms)
        processes.append(standin)
        paths = [HttpPath("direct", upstream)]
        if "floor" in wanted:
            floor, floor_url = start_floor(tmp, upstream)
            processes.append(floor)
            paths.append(HttpPath("floor", floor_url, [floor.pid]))
        if "router" in wanted:
            router_pid, router_url = start_router(stack, tmp, upstream, start_recorder(stack, tmp))
            shipper_pids = descendants(router_pid)[1:]
            paths.append(HttpPath("router", router_url, [router_pid], shipper_pids))
        if "router-norec" in wanted:
            plain_pid, plain_url = start_router(stack, tmp, upstream, None)
            paths.append(HttpPath("router-norec", plain_url, [plain_pid]))
        if args.baseline_python:  # the same routers from another checkout, beside these, in the same rounds
            if "router" in wanted:
                recorder = start_recorder(stack, tmp)
                base_pid, base_url = start_router(stack, tmp, upstream, recorder, args.baseline_python)
                paths.append(HttpPath("router-base", base_url, [base_pid], descendants(base_pid)[1:]))
            if "router-norec" in wanted:
                base_pid, base_url = start_router(stack, tmp, upstream, None, args.baseline_python)
                paths.append(HttpPath("router-norec-base", base_url, [base_pid]))
        if "litellm" in wanted:
            if Path(args.litellm).exists():
                litellm, litellm_url = start_litellm(tmp, args.litellm, upstream)
                processes.append(litellm)
                paths.append(HttpPath("litellm", litellm_url, descendants(litellm.pid)))
            else:
                skipped.append(f"litellm: {args.litellm} not found (make .venv-litellm/.installed)")
        if "nginx" in wanted:
            nginx = start_nginx(tmp, upstream)
            if isinstance(nginx, str):
                skipped.append(f"nginx: {nginx}")
            else:
                processes.append(nginx[0])
                paths.append(HttpPath("nginx", nginx[1], descendants(nginx[0].pid)))

        print(
            f"HTTP hop overhead: {args.rounds} rounds x {args.seconds:g} s per path and case; stand-in answers "
            f"{args.tokens} tokens, streamed {args.gap_ms:g} ms apart; {load_note()} at start"
        )
        for reason in skipped:
            print(f"left out: {reason}")
        results = run_cases(paths, cases, tokens=args.tokens, seconds=args.seconds, rounds=args.rounds)
        print_tables(results)
        shipper = [
            f"{k} {n}: {summary['router'].apart_us_per_call:.0f}"
            for (k, n), summary in results.items()
            if "router" in summary
        ]
        if shipper:
            print(
                "\nthe router's CPU counts its child shipper's, which was, in µs per call: "
                + ", ".join(shipper)
                + "; the recorder's and redis-server's are not counted"
            )
        print(f"\ntargets (router against the floor, same rounds; {load_note()} at the end):")
        print("\n".join(verdicts(results)) or "- (no case of the targets was run)")
    finally:
        stop_all(processes)
        stack.close()
        for cleanup in stack_cleanup:
            cleanup()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
