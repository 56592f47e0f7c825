"""The recorder's settings are one pydantic schema: any value it refuses is exit 2 and one line naming the flag.

NaN and infinity used to pass every hand-written bound (``nan <= 0`` is false): a recorder given
``--redis-timeout-s nan`` started and then waited on Redis for ever. Huge finite values passed too: a
``--retention-maxlen`` past int64 and a WAIT for more replicas or longer than Redis takes had every batch
refused, and routers dropped the records.
"""

from __future__ import annotations

import os
import sys

import pytest

from tests import launcher
from tests.harness import ROOT


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["--redis-timeout-s", "nan"], "--redis-timeout-s: Input should be a finite number, got nan"),
        (["--health-interval-s", "inf"], "--health-interval-s: Input should be a finite number, got inf"),
        (["--shutdown-grace-s", "nan"], "--shutdown-grace-s: must be a number of seconds within 0..3600, got nan"),
        (["--drain-delay-s", "1e300"], "--drain-delay-s: must be a number of seconds within 0..3600, got 1e+300"),
        (["--retention-age-s=-inf"], "--retention-age-s: Input should be a finite number, got -inf"),
        (["--port", "70000"], "--port: must be within 0..65535, got 70000"),
        (["--redis-timeout-s", "0"], "--redis-timeout-s: Input should be greater than or equal to 0.001, got 0.0"),
        (["--redis-timeout-s", "1e300"], "--redis-timeout-s: Input should be less than or equal to 3600, got 1e+300"),
        (["--health-interval-s", "1e-300"], "--health-interval-s: Input should be greater than or equal to 0.001"),
        (["--redis-wait-replicas", "100000000000"], "--redis-wait-replicas: Input should be less than or equal to 100"),
        (["--redis-wait-replicas", "1e11"], "argument --redis-wait-replicas: invalid int value: '1e11'"),
        (
            ["--retention-maxlen", "1" + "0" * 22],
            "--retention-maxlen: Input should be less than or equal to 9223372036854775807",
        ),
        (["--blob-threshold-bytes", "1" + "0" * 22], "--blob-threshold-bytes: Input should be less than or equal to"),
        (["--redact-input", ":mask"], "--redact-input rule ':mask' names nothing"),
        # Past int64 ms of expiry: Redis refused every batch with a blob (the blob TTL follows the retention).
        (["--retention-age-s", "1e16"], "--retention-age-s: Input should be less than or equal to 1000000000000"),
        (["--blob-ttl-s", "10000000000000000"], "--blob-ttl-s: Input should be less than or equal to 1000000000000"),
    ],
)
def test_a_recorder_given_a_value_its_schema_refuses_exits_2_naming_the_flag(args: list[str], problem: str) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPLITSTREAM_")}
    result = launcher.run(
        [sys.executable, "-m", "splitstream.recorder", "--redis-url", "redis://127.0.0.1:1/0", "--port", "0", *args],
        env={**clean, "SPLITSTREAM_RECORDER_METRICS_PORT": "0"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines == [f"splitstream-recorder: error: {lines[0].split('error: ', 1)[1]}"]
    assert problem in lines[0]
