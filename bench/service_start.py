"""CPU seconds one start of each service costs: importing its main module, and a real start → serving →
SIGTERM → exit, as the test harness starts it.

The suite starts about 1,500 of these processes; their start-up is most of its CPU, and most of that is
importing. Each figure is the mean over ``--runs`` processes of their user + system time (the children's
rusage, so a router's shipper child would count; these routers record nothing and start none).

    .venv/bin/python bench/service_start.py [--runs 10] [--import-only]
"""

from __future__ import annotations

import argparse
import functools
import resource
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.harness import NO_DRAIN_DELAY, ServiceProcess, clean_env, free_port, listen_args, write_registry
from tests.models import add_version
from tests.redis_server import RedisServer

SERVICES = ("router", "worker", "recorder", "shipper")


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def mean_cpu_s(run_one: Callable[[], None], runs: int) -> float:
    before = children_cpu_s()
    for _ in range(runs):
        run_one()
    return (children_cpu_s() - before) / runs


def run_python(code: str) -> None:
    subprocess.run([sys.executable, "-c", code], env=clean_env(), check=True)


def service_args(service: str, tmp: Path, redis_url: str, port: int) -> list[str]:
    """Each service's flags as the suite's most common start gives them (no TLS, auth, HTTP or Consul)."""
    listen = [*listen_args(port), *NO_DRAIN_DELAY]
    if service == "router":
        return ["--registry", f"file:{tmp / 'registry.yaml'}", *listen]
    if service == "worker":
        return ["--model-repository", str(tmp / "models"), "--model", "m", "--version", "v1", *listen]
    hmac_key = tmp / "hmac.key"
    if service == "recorder":
        return [*listen, "--redis-url", redis_url, "--hmac-key-file", str(hmac_key)]
    return ["--log-dir", str(tmp / "wal"), "--recorder", f"127.0.0.1:{free_port()}", *listen]


def start_stop_once(service: str, tmp: Path, redis_url: str) -> None:
    port = free_port()
    process = ServiceProcess(
        service, f"splitstream.{service}", service_args(service, tmp, redis_url, port), log_dir=tmp, port=port
    )
    process.start(timeout_s=60)
    process.stop()
    if process.process is None or process.process.returncode != 0:
        raise SystemExit(f"{service} did not exit 0:\n{process.log()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--import-only", action="store_true")
    args = parser.parse_args()
    print(f"CPU s per process, mean of {args.runs} (user + system)")
    print(f"{'service':<10} {'import':>8} {'start/stop':>11}")
    with tempfile.TemporaryDirectory() as directory:
        tmp = Path(directory)
        add_version(tmp / "models", "m", "v1", scale=2.0)
        write_registry(tmp / "registry.yaml", {"m": {"endpoints": {"v1": [f"127.0.0.1:{free_port()}"]}}})
        (tmp / "hmac.key").write_bytes(b"k" * 32)
        (tmp / "wal").mkdir()
        with RedisServer(tmp / "redis") as redis:
            for service in SERVICES:
                imported = mean_cpu_s(functools.partial(run_python, f"import splitstream.{service}.main"), args.runs)
                started = functools.partial(start_stop_once, service, tmp, redis.url)
                full = "" if args.import_only else f"{mean_cpu_s(started, args.runs):.3f}"
                print(f"{service:<10} {imported:8.3f} {full:>11}", flush=True)
    bare = mean_cpu_s(functools.partial(run_python, "pass"), args.runs)
    print(f"{'python':<10} {bare:8.3f}")


if __name__ == "__main__":
    main()
