"""No secret in help texts, logs, errors or metrics, on the real commands.

Secrets reach the processes as flags or environment variables: HMAC keys, and Redis
URLs whose password sits in the userinfo (``redis://:PW@host``) or in the query
(``?password=PW``, which redis-py reads too).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import launcher
from tests.harness import ROOT, ServiceProcess, free_port, scrape_metrics, wait_for
from tests.redis_server import RedisServer

SECRET_ENV = {
    "SPLITSTREAM_HMAC_KEY": "shared-hmac-secret-1",
    "SPLITSTREAM_ROUTER_HMAC_KEY": "router-hmac-secret-2",
    "SPLITSTREAM_RECORDER_HMAC_KEY": "recorder-hmac-secret-3",
    "SPLITSTREAM_RECORDER_REDIS_URL": "redis://:recorder-redis-secret-4@127.0.0.1:6390/0",
    "SPLITSTREAM_REPLAY_HMAC_KEY": "replay-hmac-secret-5",
    "SPLITSTREAM_REPLAY_REDIS_URL": "redis://127.0.0.1:6390/0?password=replay-redis-secret-6",
    "SPLITSTREAM_SERVICE_TOKEN": "shared-service-token-secret-7",
    "SPLITSTREAM_ROUTER_JWT_JWKS": "https://reader:router-jwks-secret-8@issuer.example/jwks.json",
}
SECRETS = [
    "shared-hmac-secret-1",
    "router-hmac-secret-2",
    "recorder-hmac-secret-3",
    "recorder-redis-secret-4",
    "replay-hmac-secret-5",
    "replay-redis-secret-6",
    "shared-service-token-secret-7",
    "router-jwks-secret-8",
]

COMMANDS = {
    "router": ("splitstream.router", ["SPLITSTREAM_ROUTER_HMAC_KEY", "SPLITSTREAM_ROUTER_JWT_JWKS"]),
    "recorder": ("splitstream.recorder", ["SPLITSTREAM_RECORDER_HMAC_KEY", "SPLITSTREAM_RECORDER_REDIS_URL"]),
    "replay": ("splitstream.replayer", ["SPLITSTREAM_REPLAY_HMAC_KEY", "SPLITSTREAM_REPLAY_REDIS_URL"]),
    "worker": ("splitstream.worker", []),
}


def run(module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPLITSTREAM_")}
    return launcher.run(
        [sys.executable, "-m", module, *args],
        env={**clean, **(env or {})},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_says_a_secret_variable_is_set_but_never_shows_its_value(command: str) -> None:
    module, variables = COMMANDS[command]
    result = run(module, "--help", env=SECRET_ENV)
    assert result.returncode == 0, result.stderr
    shown = result.stdout + result.stderr
    for secret in SECRETS:
        assert secret not in shown
    text = " ".join(shown.split())  # argparse wraps lines anywhere
    for variable in variables:
        assert f"[env {variable} set]" in text


def test_a_secret_given_a_bad_value_in_the_environment_is_not_quoted_in_the_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The variable is named (so the operator knows what to fix); its value is not."""
    from splitstream.common.cli import EnvArgumentParser

    monkeypatch.setenv("SPLITSTREAM_SVC_TOKEN_NUMBER", "not-a-number-secret")
    parser = EnvArgumentParser(prog="svc", env_prefix="SPLITSTREAM_SVC_")
    with pytest.raises(SystemExit) as exited:
        parser.add_argument("--token-number", type=int, default=0, help="a numeric token", secret=True)
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "SPLITSTREAM_SVC_TOKEN_NUMBER" in error
    assert "not-a-number-secret" not in error


def test_the_replayer_s_bad_redis_url_error_hides_the_password() -> None:
    result = run(
        "splitstream.replayer",
        "--redis-url", "redis://:replay-pw-secret@localhost:notaport/0",
        "--model", "m", "--target", f"127.0.0.1:{free_port()}", "--since", "-1m",
    )  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "replay-pw-secret" not in result.stderr
    assert "--redis-url" in lines[0]
    assert "***" in lines[0]


def test_the_replayer_s_unreachable_redis_error_hides_a_query_password() -> None:
    result = run(
        "splitstream.replayer",
        "--redis-url", f"redis://127.0.0.1:{free_port()}/0?password=replay-query-secret",
        "--model", "m", "--target", f"127.0.0.1:{free_port()}", "--since", "-1m",
    )  # fmt: skip
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "replay-query-secret" not in result.stderr
    assert "unreachable" in result.stderr


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis", password="redis-requirepass-secret").start()
    yield server
    server.stop()


@pytest.mark.parametrize("form", ["userinfo", "query"])
def test_the_recorder_never_logs_or_exports_its_redis_password(tmp_path: Path, redis: RedisServer, form: str) -> None:
    """Serving proves the password was used; then Redis goes away and comes back (each logged with
    the error redis-py gives), and the recorder stops; the password is in no log line or metric."""
    password = redis.password
    if form == "userinfo":
        url = f"redis://:{password}@127.0.0.1:{redis.port}/0"
    else:
        url = f"redis://127.0.0.1:{redis.port}/0?password={password}"
    port = free_port()
    recorder = ServiceProcess(
        "recorder",
        "splitstream.recorder",
        [
            "--redis-url", url, "--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(free_port()),
            "--health-interval-s", "0.1", "--redis-timeout-s", "0.5",
        ],
        log_dir=tmp_path,
        port=port,
    )  # fmt: skip
    try:
        recorder.start(timeout_s=30)
        metrics = scrape_metrics(recorder.metrics_port)
        redis.stop()
        wait_for(lambda: "redis unreachable" in recorder.log(), timeout_s=15, what="the recorder to see Redis go")
        redis.start()
        wait_for(lambda: "redis reachable" in recorder.log().split("redis unreachable", 1)[1], timeout_s=15)
        recorder.signal(signal.SIGTERM)
        assert recorder.wait(timeout_s=30) == 0
    finally:
        recorder.stop()
    log = recorder.log()
    assert str(redis.port) in log  # the URL is logged, without its password
    assert password not in log
    assert password not in metrics


def test_a_log_line_that_quotes_a_url_or_a_password_pair_is_masked_whatever_logged_it() -> None:
    """Library errors quote URLs that no call site redacted; the last log processor masks them."""
    script = (
        "from splitstream.common.logs import configure_logging\n"
        "log = configure_logging('INFO', service='test')\n"
        "log.info('connecting', url='rediss://user:log-secret-1@h:6380/0', args=['x?password=log-secret-2'])\n"
        "try:\n"
        "    raise ConnectionError('cannot reach redis://:log-secret-3@h:6379/0')\n"
        "except ConnectionError:\n"
        "    log.exception('failed', detail={'dsn': 'h?token=log-secret-4&db=0'})\n"
    )
    result = launcher.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2
    assert "log-secret" not in result.stderr
    assert "rediss://***@h:6380/0" in lines[0]
    assert "redis://***@h:6379/0" in lines[1]


def test_an_unreachable_jwks_url_s_error_hides_its_password(tmp_path: Path) -> None:
    registry = tmp_path / "registry.yaml"
    registry.write_text("models: {}\n")
    principals = tmp_path / "principals.yaml"
    principals.write_text("principals: {}\n")
    result = run(
        "splitstream.router",
        "--registry", f"file:{registry}", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
        "--auth-principals", f"file:{principals}", "--jwt-audience", "a", "--jwt-issuer", "i",
        env={"SPLITSTREAM_ROUTER_JWT_JWKS": f"http://reader:jwks-url-secret@127.0.0.1:{free_port()}/jwks.json"},
    )  # fmt: skip
    assert result.returncode == 2
    assert "jwks-url-secret" not in result.stdout + result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("splitstream-router: error: --jwt-jwks http://reader:***@127.0.0.1:")


@pytest.mark.parametrize("allow", [False, True], ids=["refused", "allowed"])
def test_a_jwks_over_plain_http_from_another_host_is_refused_unless_allowed(tmp_path: Path, allow: bool) -> None:
    """Anyone on the path of an http:// JWKS could serve their own key and mint tokens for any principal: the
    router refuses to start (the URL's password never shown); --allow-insecure-jwks restores the fetch (which
    then fails here on an unreachable documentation address, 192.0.2.1, exactly as an https:// one would)."""
    registry = tmp_path / "registry.yaml"
    registry.write_text("models: {}\n")
    principals = tmp_path / "principals.yaml"
    principals.write_text("principals: {}\n")
    result = run(
        "splitstream.router",
        "--registry", f"file:{registry}", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
        "--auth-principals", f"file:{principals}", "--jwt-audience", "a", "--jwt-issuer", "i",
        "--jwt-jwks", "http://reader:jwks-url-secret@192.0.2.1:8080/jwks.json",
        *(["--allow-insecure-jwks"] if allow else []),
    )  # fmt: skip
    assert result.returncode == 2
    assert "jwks-url-secret" not in result.stdout + result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("splitstream-router: error: --jwt-jwks http://reader:***@192.0.2.1:8080/jwks.json")
    assert ("plain http://" in last) is not allow
