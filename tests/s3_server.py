"""A real S3 API server for tests: moto's server mode, started as a process on a free port.

It speaks the S3 HTTP API (pyarrow's S3 client talks to it as to MinIO); its state lives in memory,
so a restart loses its buckets and objects (a test that restarts it creates the bucket again).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pyarrow.fs as pafs

from tests import launcher
from tests.harness import free_port

#: Credentials the tests' processes get through the environment (moto accepts any).
S3_ENV = {"AWS_ACCESS_KEY_ID": "test-key", "AWS_SECRET_ACCESS_KEY": "test-secret", "AWS_REGION": "us-east-1"}


class S3Server:
    def __init__(self, directory: Path, *, port: int | None = None, check_credentials: bool = False) -> None:
        """``check_credentials``: refuse every request whose access key moto's IAM does not know (all of
        them: none is created), as a store refuses wrong credentials."""
        self.check_credentials = check_credentials
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> S3Server:
        with open(self.directory / f"moto-{self.port}.log", "ab") as log:
            self.process = launcher.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={
                    **os.environ,
                    **S3_ENV,
                    **({"INITIAL_NO_AUTH_ACTION_COUNT": "0"} if self.check_credentials else {}),
                },
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"moto server exited with {self.process.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise TimeoutError("moto server did not listen")

    def filesystem(self) -> pafs.S3FileSystem:
        os.environ.update(S3_ENV)
        return pafs.S3FileSystem(
            endpoint_override=f"127.0.0.1:{self.port}", scheme="http", region="us-east-1", allow_bucket_creation=True
        )

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def reset(self) -> None:
        """Forget every bucket and object (moto's reset API), as a restart would, in milliseconds."""
        request = urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST")
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()

    def create_bucket(self, name: str) -> None:
        self.filesystem().create_dir(name)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
