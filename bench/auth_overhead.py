"""What caller authentication costs the router, side by side in one run.

Three routers in front of one worker: without authentication, with API keys (``x-api-key``:
a SHA-256 and a dict lookup a call), and with JWTs (``authorization: Bearer``: an ES256
signature verified a call). Paths are measured in interleaved, rotated rounds so machine
noise hits them alike; it prints throughput, p50, p99 and the router's CPU time per call,
and each authenticated path's ratio to the unauthenticated one. Compare ratios, not
absolute numbers (machines here differ by up to 3x).

    .venv/bin/python bench/auth_overhead.py [--seconds 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import jwt
import yaml
from cryptography.hazmat.primitives.asymmetric import ec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.loadgen import infer_request, measure
from tests.harness import Stack, write_registry
from tests.models import add_version

MODEL = "bench"
API_KEY = "bench-api-key-" + "0123456789abcdef" * 3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0, help="measuring time per path, round and load")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per load")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="splitstream-bench-"))
    repository = tmp / "models"
    add_version(
        repository, MODEL, "v1", scale=2.0, config={"max_batch_size": 8, "dynamic_batching": {"enabled": False}}
    )
    principals = tmp / "principals.yaml"
    digest = hashlib.sha256(API_KEY.encode()).hexdigest()
    principals.write_text(yaml.safe_dump({"principals": {"bench": {"api_keys_sha256": [digest], "models": [MODEL]}}}))
    key = ec.generate_private_key(ec.SECP256R1())
    jwk = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(key.public_key())) | {"kid": "k1", "alg": "ES256"}
    jwks = tmp / "jwks.json"
    jwks.write_text(json.dumps({"keys": [jwk]}))
    now = int(time.time())
    issuer = "https://issuer.bench"
    claims: dict[str, object] = {"sub": "bench", "aud": "splitstream", "iss": issuer, "exp": now + 3600, "iat": now}
    token = jwt.encode(claims, key, "ES256", {"kid": "k1"})
    stack = Stack(tmp)
    try:
        worker = stack.worker(repository, MODEL, "v1")
        registry = tmp / "registry.yaml"
        write_registry(registry, {MODEL: {"endpoints": {"v1": [worker.address]}}})
        auth = ("--auth-principals", f"file:{principals}")
        jwt_flags = ("--jwt-jwks", f"file:{jwks}", "--jwt-audience", "splitstream", "--jwt-issuer", issuer)
        routers = {
            "no auth": stack.router(registry, "--log-level", "WARNING"),
            "api key": stack.router(registry, "--log-level", "WARNING", *auth),
            "jwt": stack.router(registry, "--log-level", "WARNING", *auth, *jwt_flags),
        }
        paths = {name: (r.address, [r.process.pid]) for name, r in routers.items()}  # type: ignore[union-attr]
        metadata: dict[str, tuple[tuple[str, str], ...]] = {
            "api key": (("x-api-key", API_KEY),),
            "jwt": (("authorization", f"Bearer {token}"),),
        }
        payload = infer_request(MODEL)

        print(f"auth overhead: {args.rounds} rounds x {args.seconds:g} s per path and load; {os.cpu_count()} CPUs\n")
        header = (
            f"{'in flight':>9} {'path':<8} {'calls/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
            f"{'CPU us/call':>12} {'CPU ratio':>10} {'p50 ratio':>10}"
        )
        print(header)
        print("-" * len(header))
        for concurrency in (1, 16):
            summary = measure(
                paths, payload, concurrency=concurrency, seconds=args.seconds, rounds=args.rounds, metadata=metadata
            )
            base = summary["no auth"]
            for name, x in summary.items():
                print(
                    f"{concurrency:>9} {name:<8} {x.rate:9.0f} {x.p50_ms:8.3f} {x.p99_ms:8.3f} "
                    f"{x.cpu_us_per_call:12.0f} {x.cpu_us_per_call / base.cpu_us_per_call:10.2f} "
                    f"{x.p50_ms / base.p50_ms:10.2f}"
                )
            print()
    finally:
        stack.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
