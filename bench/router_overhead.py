"""What the router adds to a call, side by side with the direct path and nginx.

One run, same load, same worker: client → worker; client → router → worker;
and, when nginx is installed, client → nginx (grpc_pass, upstream keepalive) →
worker, the reference a user would otherwise pick. With TLS on both sides of the
router (certificates made at start): client →TLS→ worker (``direct-tls``) and
client →TLS→ router →TLS→ worker (``router-tls``), the same model on a second
worker that serves TLS; the last lines give TLS's cost to the router as ratios
against the plaintext router, measured in the same rounds. For 1 and 64 calls in
flight it prints throughput, p50, p99, each path's added latency over direct,
and the proxy's CPU time per forwarded call (from /proc). Paths are measured
in interleaved rounds so machine noise hits them alike; compare ratios.

Last, scale-out: a router of ``--processes 1`` against one of ``--processes 2``
(one port, SO_REUSEPORT) at 64 calls in flight over 8 client connections, in
front of two workers so the worker is less of the bottleneck; calls/s, and the
router's CPU per call summed over the parent and its children. Then the same two
routers with the router the only Python on the path, when nghttp2's tools are
installed (``apt-get install nghttp2-client nghttp2-server``): h2load as the
client (64 in flight over ``--h2load-connections``) and nghttpd answering a fixed
response as the worker, both C, so the routers get the cores; every call is
checked OK in the router's requests_total, and each child's share of the CPU
shows how the kernel spread the connections. ``--processes-only`` runs just
these rows, ``--c-only`` just the h2load + nghttpd ones.

    .venv/bin/python bench/router_overhead.py [--seconds 4] [--rounds 3] [--processes-only | --c-only]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.loadgen import (
    Result,
    Summary,
    cpu_seconds,
    find_nginx,
    grpc_frame,
    h2load_drive,
    infer_request,
    measure,
    rotated,
)
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.common.tls import ClientTls
from tests.certs import Pki
from tests.harness import ServiceProcess, Stack, free_port, metric_samples, scrape_metrics, wait_for, write_registry
from tests.models import add_version

MODEL = "bench"


def start_nginx(tmp: Path, upstream: str) -> tuple[subprocess.Popen[bytes], str, list[int]] | None:
    nginx = find_nginx()
    if nginx is None:
        return None
    port = free_port()
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
  upstream worker {{ server {upstream}; keepalive 64; }}
  server {{
    listen 127.0.0.1:{port} http2;
    location / {{ grpc_pass grpc://worker; }}
  }}
}}
""")
    process = subprocess.Popen([nginx, "-p", str(tmp), "-c", str(conf)], stderr=subprocess.DEVNULL)
    address = f"127.0.0.1:{port}"
    wait_for(lambda: _port_open(port), timeout_s=10, what="nginx")
    time.sleep(0.5)  # the master has forked its worker by now
    children = subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True, text=True).stdout.split()
    return process, address, [process.pid, *map(int, children)]


def _port_open(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def scale_out(stack: Stack, repository: Path, worker: str, args: argparse.Namespace) -> None:
    """Rows for one router process and two on one port, same load, same two workers."""
    second = stack.worker(repository, MODEL, "v1")
    registry = stack.tmp_path / "registry-processes.yaml"
    write_registry(registry, {MODEL: {"endpoints": {"v1": [worker, second.address]}}})
    paths: dict[str, tuple[str, list[int]]] = {}
    for count in (1, 2):
        router, pid = _router_processes(stack, registry, count)
        paths[f"{count} proc"] = (router.address, [pid, *_children(pid)])
    summary = measure(
        paths, infer_request(MODEL), concurrency=64, seconds=args.seconds, rounds=args.rounds, connections=8
    )
    print("router processes: 64 in flight over 8 connections, two workers; CPU summed over parent and children")
    header = f"{'path':<8} {'calls/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'CPU us/call':>12}"
    print(header)
    print("-" * len(header))
    for name, x in summary.items():
        print(f"{name:<8} {x.rate:9.0f} {x.p50_ms:8.3f} {x.p99_ms:8.3f} {x.cpu_us_per_call:12.0f}")
    one, two = summary["1 proc"], summary["2 proc"]
    print(
        f"2 processes / 1: throughput x{two.rate / one.rate:.2f}, "
        f"CPU per call x{two.cpu_us_per_call / one.cpu_us_per_call:.2f} ({os.cpu_count()} CPUs)\n"
    )


def start_nghttpd(tmp: Path) -> tuple[subprocess.Popen[bytes], str] | None:
    """A worker that costs next to nothing, so that the router is what a scale-out row measures:
    nghttpd (nghttp2's HTTP/2 server, C) serving one fixed ModelInferResponse, gRPC-framed, as a
    static file at ModelInfer's path, with ``grpc-status: 0`` as a trailer. The health Check's path
    serves SERVING the same way; Watch is a 404, which gRPC reads as UNIMPLEMENTED, so the router
    polls Check. nghttpd sets content-type by file extension and these paths have none; grpcio's
    client does not require it. None when nghttpd is not installed."""
    nghttpd = shutil.which("nghttpd") or ("/usr/sbin/nghttpd" if Path("/usr/sbin/nghttpd").exists() else None)
    if nghttpd is None:
        return None
    from grpc_health.v1 import health_pb2

    docs = tmp / "nghttpd"
    answer = oip.ModelInferResponse(model_name=MODEL, model_version="v1")
    output = answer.outputs.add(name="y", datatype="FP32")
    output.shape.extend([1, 4])
    answer.raw_output_contents.append(bytes(16))
    serving = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
    for path, message in (
        ("inference.GRPCInferenceService/ModelInfer", answer.SerializeToString()),
        ("grpc.health.v1.Health/Check", serving.SerializeToString()),
    ):
        (docs / path).parent.mkdir(parents=True, exist_ok=True)
        (docs / path).write_bytes(grpc_frame(message))
    port = free_port()
    process = subprocess.Popen(
        [nghttpd, "--no-tls", "-a", "127.0.0.1", "-d", str(docs), "--trailer", "grpc-status: 0", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for(lambda: _port_open(port), timeout_s=10, what="nghttpd")
    return process, f"127.0.0.1:{port}"


def _answered(metrics_port: int) -> dict[str, float]:
    """The router's calls answered so far, by gRPC status (all children: the parent's scrape merges them)."""
    counts: dict[str, float] = {}
    for labels, value in metric_samples(scrape_metrics(metrics_port), "splitstream_router_requests_total"):
        counts[labels["status"]] = counts.get(labels["status"], 0.0) + value
    return counts


def scale_out_c(stack: Stack, args: argparse.Namespace) -> None:
    """Rows for 1 and 2 router processes with the router the only Python on the path: h2load as
    the client and nghttpd as the worker (both C, a few µs of CPU per call each), so the routers
    get the cores instead of a Python client and Python workers. Every call is checked to have
    succeeded (the router's requests_total by status: h2load sees only HTTP 200s), and CPU per
    call is the routers' CPU over each run divided by the calls they answered in it. For 2
    processes, each child's share of that CPU shows how the kernel spread the connections."""
    if shutil.which("h2load") is None:
        print("h2load + nghttpd rows skipped: h2load is not installed (apt-get install nghttp2-client nghttp2-server)")
        return
    started = start_nghttpd(stack.tmp_path)
    if started is None:
        print("h2load + nghttpd rows skipped: nghttpd is not installed (apt-get install nghttp2-server)")
        return
    nghttpd, worker = started
    try:
        registry = stack.tmp_path / "registry-nghttpd.yaml"
        write_registry(registry, {MODEL: {"endpoints": {"v1": [worker]}}})
        routers: dict[str, tuple[str, int, int]] = {}  # name -> (address, parent pid, metrics port)
        for count in (1, 2):
            router, pid = _router_processes(stack, registry, count)
            routers[f"{count} proc"] = (router.address, pid, router.metrics_port)
        flight, connections = 64, args.h2load_connections

        def run(name: str, seconds: float) -> Run:
            address, pid, metrics_port = routers[name]
            children = _children(pid)
            before, child_before = _answered(metrics_port), {c: cpu_seconds([c]) for c in children}
            worker_before, client_before = cpu_seconds([nghttpd.pid]), _children_cpu_s()
            started = time.perf_counter()
            result = h2load_drive(
                address,
                infer_request(MODEL),
                concurrency=flight,
                connections=connections,
                seconds=seconds,
                pids=[pid, *children],
                workdir=stack.tmp_path,
            )
            wall_s = time.perf_counter() - started
            client_s, worker_s = _children_cpu_s() - client_before, cpu_seconds([nghttpd.pid]) - worker_before
            child_cpu = {c: cpu_seconds([c]) - child_before[c] for c in children}
            after = _answered(metrics_port)
            delta = {status: after.get(status, 0.0) - before.get(status, 0.0) for status in after}
            # h2load resets the streams still in flight when its time is up: the router counts those
            # CANCELLED. Anything else not OK is a failure the HTTP statuses did not show.
            failed = {status: n for status, n in delta.items() if status not in ("OK", "CANCELLED") and n}
            if failed or delta.get("CANCELLED", 0.0) > flight or delta.get("OK", 0.0) < len(result.latencies_s):
                raise RuntimeError(f"{name}: calls did not all succeed: {delta} for {len(result.latencies_s)} sent")
            return Run(result, delta["OK"], child_cpu, wall_s, client_s, worker_s)

        for name in routers:
            run(name, 1.0)  # warm-up: connections, the router's upstream channel, Python's caches
        runs: dict[str, list[Run]] = {name: [] for name in routers}
        for round_index in range(args.rounds):
            for name in rotated(list(routers), round_index):
                runs[name].append(run(name, args.seconds))
        summary = {name: Summary.of([r.result for r in done]) for name, done in runs.items()}
        calls = {name: sum(r.answered for r in done) for name, done in runs.items()}
        cpu = {name: sum(r.result.cpu_s for r in done) / calls[name] * 1e6 for name, done in runs.items()}
        # Cores the routers got: their CPU over the runs' wall time (more than 1 for one process, as
        # gRPC's own threads work beside Python's).
        cores = {name: sum(r.result.cpu_s for r in done) / sum(r.wall_s for r in done) for name, done in runs.items()}
        all_runs = [r for done in runs.values() for r in done]
        answered = sum(r.answered for r in all_runs)
        client_us = sum(r.client_s for r in all_runs) / answered * 1e6
        worker_us = sum(r.worker_s for r in all_runs) / answered * 1e6
        shares: dict[int, float] = {}
        for r in runs["2 proc"]:
            for child, used in r.child_cpu.items():
                shares[child] = shares.get(child, 0.0) + used
        print(
            f"router processes, the router the only Python on the path: client h2load ({connections} connections "
            f"x {flight // connections} streams = {flight} in flight), worker nghttpd (a fixed response); "
            "every call checked OK in the router's requests_total; CPU summed over parent and children"
        )
        # The best round too: others' load on a shared machine only ever takes cores away from the routers.
        best = {name: max(len(r.result.latencies_s) / r.result.wall_s for r in done) for name, done in runs.items()}
        header = (
            f"{'path':<8} {'calls/s':>9} {'best rnd':>9} {'p50 ms':>8} {'p99 ms':>8} {'CPU us/call':>12} "
            f"{'cores used':>11}"
        )
        print(header)
        print("-" * len(header))
        for name, x in summary.items():
            print(
                f"{name:<8} {x.rate:9.0f} {best[name]:9.0f} {x.p50_ms:8.3f} {x.p99_ms:8.3f} {cpu[name]:12.0f} "
                f"{cores[name]:11.2f}"
            )
        one, two = summary["1 proc"], summary["2 proc"]
        total = sum(shares.values()) or 1.0
        cpu_ratio, best_ratio = cpu["2 proc"] / cpu["1 proc"], best["2 proc"] / best["1 proc"]
        print(
            f"2 processes / 1: throughput x{two.rate / one.rate:.2f} (best rounds x{best_ratio:.2f}), "
            f"CPU per call x{cpu_ratio:.2f}, "
            f"cores the routers got x{cores['2 proc'] / cores['1 proc']:.2f} ({os.cpu_count()} CPUs, load average "
            f"{os.getloadavg()[0]:.2f}); the 2 children's shares of their CPU: "
            + " / ".join(f"{used / total:.0%}" for used in shares.values())
            + f"; CPU per call of h2load {client_us:.0f} us, of nghttpd {worker_us:.0f} us\n"
        )
    finally:
        nghttpd.terminate()
        nghttpd.wait(timeout=10)


@dataclass
class Run:
    """One h2load run against one router: what it measured and what each party's CPU was."""

    result: Result
    answered: float  # calls the router answered OK during the run (its requests_total)
    child_cpu: dict[int, float]  # CPU seconds of each router child
    wall_s: float
    client_s: float  # h2load's CPU seconds
    worker_s: float  # nghttpd's CPU seconds


def _children_cpu_s() -> float:
    """CPU seconds of this process's waited-for children (h2load, once its run has ended)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _router_processes(stack: Stack, registry: Path, count: int) -> tuple[ServiceProcess, int]:
    """A router of ``--processes count`` once its children serve, and its (parent's) pid."""
    router = stack.router(registry, "--log-level", "WARNING", "--processes", str(count))
    pid = router.process.pid  # type: ignore[union-attr]
    if count > 1:
        wait_for(lambda: len(_children(pid)) == count, timeout_s=30, what="the router's children")
        time.sleep(3)  # both have started serving by now (the health check reaches one)
    return router, pid


def _children(pid: int) -> list[int]:
    return [int(p) for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0, help="measuring time per path, round and load")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per load")
    parser.add_argument("--processes-only", action="store_true", help="only the --processes 1 vs 2 rows")
    parser.add_argument(
        "--h2load-connections",
        type=int,
        default=16,
        help="h2load's TCP connections for the 64 calls in flight of the h2load + nghttpd rows (a divisor of 64)",
    )
    parser.add_argument("--c-only", action="store_true", help="only the h2load + nghttpd rows of --processes-only")
    args = parser.parse_args()
    if args.h2load_connections < 1 or 64 % args.h2load_connections:
        parser.error(f"--h2load-connections must divide the 64 calls in flight, not {args.h2load_connections}")

    tmp = Path(tempfile.mkdtemp(prefix="splitstream-bench-"))
    repository = tmp / "models"
    add_version(
        repository, MODEL, "v1", scale=2.0, config={"max_batch_size": 8, "dynamic_batching": {"enabled": False}}
    )
    stack = Stack(tmp)
    nginx = None
    try:
        worker = stack.worker(repository, MODEL, "v1")
        registry = tmp / "registry.yaml"
        write_registry(registry, {MODEL: {"endpoints": {"v1": [worker.address]}}})
        if args.processes_only or args.c_only:
            if not args.c_only:
                scale_out(stack, repository, worker.address, args)
            scale_out_c(stack, args)
            return 0
        router = stack.router(registry, "--log-level", "WARNING")
        pki = Pki(tmp / "pki")
        client_tls = ClientTls(enabled=True, ca_file=str(pki.ca))
        worker_cert, router_cert = pki.issue("worker"), pki.issue("router")
        tls_worker = stack.worker(
            repository,
            MODEL,
            "v1",
            *("--grpc-use-ssl", "--grpc-server-cert", str(worker_cert.cert), "--grpc-server-key", str(worker_cert.key)),
            tls=client_tls,
        )
        tls_registry = tmp / "registry-tls.yaml"
        write_registry(tls_registry, {MODEL: {"endpoints": {"v1": [tls_worker.address]}}})
        tls_router = stack.router(
            tls_registry,
            "--log-level",
            "WARNING",
            *("--grpc-use-ssl", "--grpc-server-cert", str(router_cert.cert), "--grpc-server-key", str(router_cert.key)),
            *("--upstream-tls-ca", str(pki.ca)),
            tls=client_tls,
        )
        paths: dict[str, tuple[str, list[int]]] = {
            "direct": (worker.address, []),
            "router": (router.address, [router.process.pid]),  # type: ignore[union-attr]
            "direct-tls": (tls_worker.address, []),
            "router-tls": (tls_router.address, [tls_router.process.pid]),  # type: ignore[union-attr]
        }
        tls = {"direct-tls": client_tls, "router-tls": client_tls}
        nginx = start_nginx(tmp, worker.address)
        if nginx is not None:
            paths["nginx"] = (nginx[1], nginx[2])

        payload = infer_request(MODEL)

        print(
            f"router overhead: {args.rounds} rounds x {args.seconds:g} s per path and load; "
            f"{os.cpu_count()} CPUs; nginx {'on' if nginx else 'not installed'}\n"
        )
        header = (
            f"{'in flight':>9} {'path':<10} {'calls/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
            f"{'+p50 ms':>8} {'+p99 ms':>8} {'CPU us/call':>12}"
        )
        print(header)
        print("-" * len(header))
        for concurrency in (1, 64):
            summary = measure(
                paths, payload, concurrency=concurrency, seconds=args.seconds, rounds=args.rounds, tls=tls
            )
            for name, x in summary.items():
                direct = summary["direct-tls" if name.endswith("-tls") else "direct"]  # TLS paths against TLS
                first_hop = name.startswith("direct")
                added50 = "" if first_hop else f"{x.p50_ms - direct.p50_ms:8.3f}"
                added99 = "" if first_hop else f"{x.p99_ms - direct.p99_ms:8.3f}"
                cpu = "" if first_hop else f"{x.cpu_us_per_call:12.0f}"
                print(
                    f"{concurrency:>9} {name:<10} {x.rate:9.0f} {x.p50_ms:8.3f} {x.p99_ms:8.3f} "
                    f"{added50:>8} {added99:>8} {cpu:>12}"
                )
            spread = {n: statistics.pstdev(x.round_p50s_ms) for n, x in summary.items()}
            print(f"{'':>9} p50 spread across rounds (ms): " + ", ".join(f"{n} {v:.3f}" for n, v in spread.items()))
            plain, secure = summary["router"], summary["router-tls"]
            added_plain = plain.p50_ms - summary["direct"].p50_ms
            added_tls = secure.p50_ms - summary["direct-tls"].p50_ms
            print(
                f"{'':>9} TLS on both sides of the router / plaintext: CPU per call x"
                f"{secure.cpu_us_per_call / plain.cpu_us_per_call:.2f}, added p50 x"
                f"{added_tls / added_plain if added_plain > 0 else float('nan'):.2f}, "
                f"end-to-end p50 x{secure.p50_ms / plain.p50_ms:.2f}"
            )
            print()
        scale_out(stack, repository, worker.address, args)
        scale_out_c(stack, args)
    finally:
        if nginx is not None:
            nginx[0].terminate()
            nginx[0].wait(timeout=10)
        stack.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
