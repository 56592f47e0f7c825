"""Secrets on command lines (``ps`` and ``/proc/PID/cmdline`` show them to every local user): the HMAC key
comes from ``--hmac-key-file`` (or the environment) and the Redis password from ``--redis-password-file``;
one given on the command line still works for a release, with a warning that never quotes it. Real
recorder, router, replayer and redis-server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from grpc_health.v1 import health_pb2

from splitstream.common.records import routing_key_hmac, stream_key
from tests.harness import ROOT, InferClient, Stack, free_port, health_status, make_request
from tests.recording_stack import HMAC_KEY, MODEL, RecordingStack
from tests.redis_server import RedisServer

WARNING = "secret on the command line (deprecated)"


def warnings_in(log: str) -> list[str]:
    return [
        event["detail"]
        for line in log.splitlines()
        if line.startswith("{") and (event := json.loads(line)).get("event") == WARNING
    ]


def test_a_key_from_a_file_is_the_key_recorded_and_draws_no_warning(tmp_path: Path) -> None:
    """The recording stack passes --hmac-key-file to its router and recorder (never the key itself)."""
    stack = RecordingStack(tmp_path)
    try:
        assert HMAC_KEY not in " ".join(stack.router._args + stack.recorder._args)
        client = InferClient(stack.router.address)
        client.infer(
            make_request(MODEL, np.ones((1, 4), np.float32)),
            metadata=[("x-request-id", "from-file"), ("x-routing-key", "alice")],
        )
        client.close()
        (record,) = stack.wait_recorded({"from-file"})
        assert record.routing_key_hmac == routing_key_hmac(HMAC_KEY.encode(), "alice")
        assert warnings_in(stack.router.log()) == []
        assert warnings_in(stack.recorder.log()) == []
    finally:
        stack.close()


def test_secrets_on_the_command_line_still_work_with_a_warning_that_never_quotes_them(tmp_path: Path) -> None:
    password, key = "argv-redis-pw-31", "argv-hmac-key-47"
    with RedisServer(tmp_path / "redis", password=password) as redis_server:
        assert password in redis_server.url
        admin = redis_server.client()
        try:  # the model's stream exists, with nothing in the window: the replay has nothing to do, and succeeds
            admin.xadd(stream_key(MODEL), {"request_id": "old"}, id="1-0")
        finally:
            admin.close()
        stack = Stack(tmp_path)
        try:
            port = free_port()
            recorder = stack.service(
                "recorder",
                "splitstream.recorder",
                ["--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0",
                 "--redis-url", redis_server.url, "--hmac-key", key],
                port=port,
            )  # fmt: skip
            assert health_status(recorder.address) == health_pb2.HealthCheckResponse.SERVING  # Redis took the password
            log = recorder.log()
            replay = subprocess.run(  # to the recorder: any gRPC server will do, no call is in the window
                [sys.executable, "-m", "splitstream.replayer", "--redis-url", redis_server.url, "--hmac-key", key,
                 "--model", MODEL, "--target", recorder.address, "--since", "-1m",
                 "--output-dir", str(tmp_path / "replay-out")],
                capture_output=True, text=True, timeout=60, cwd=ROOT, check=False,
            )  # fmt: skip
        finally:
            stack.close()
    details = warnings_in(log)
    assert len(details) == 2, log
    assert any("--hmac-key on the command line" in d for d in details)
    assert any("--redis-url on the command line" in d and "--redis-password-file" in d for d in details)
    assert all("--hmac-key-file" in d for d in details if "--hmac-key " in d)
    assert replay.returncode == 0, replay.stderr
    replay_warnings = [line for line in replay.stderr.splitlines() if "warning: a secret in" in line]
    assert len(replay_warnings) == 2, replay.stderr
    for text in (log, replay.stdout, replay.stderr):
        assert password not in text
        assert key not in text


def test_a_key_file_that_cannot_be_read_or_beside_the_key_is_exit_2_with_one_line(tmp_path: Path) -> None:
    key_file = tmp_path / "hmac-key"
    key_file.write_text("file-key-value-5\n")
    cases = {
        "missing": (["--hmac-key-file", str(tmp_path / "nope")], "--hmac-key-file"),
        "empty": (["--hmac-key-file", str(tmp_path / "empty")], "the file is empty"),
        "both": (["--hmac-key-file", str(key_file), "--hmac-key", "argv-key-6"], "not both"),
    }
    (tmp_path / "empty").write_text("\n")
    for name, (flags, problem) in cases.items():
        done = subprocess.run(
            [sys.executable, "-m", "splitstream.recorder", "--port", "0", "--metrics-port", "0", *flags],
            capture_output=True, text=True, timeout=60, cwd=ROOT, check=False,
        )  # fmt: skip
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2, (name, done.stderr)
        assert len(lines) == 1, (name, done.stderr)
        assert lines[0].startswith("splitstream-recorder: error: --hmac-key-file"), (name, lines)
        assert problem in lines[0], (name, lines)
        assert "file-key-value-5" not in done.stderr
        assert "argv-key-6" not in done.stderr
