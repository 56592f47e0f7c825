"""The docker-compose stack, checked without a Docker engine.

No engine runs here, so the compose file is checked for what breaks a real
`make up`: every command is a real entry point given flags it accepts, ports
agree between the services that talk to each other, Prometheus scrapes the
ports the services expose metrics on, and every metric the Grafana dashboard
plots is one the running services really export (a live scrape of real
router, worker and recorder processes).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import launcher
from tests.harness import ROOT, scrape_metrics

DEPLOY = ROOT / "deploy"
ENTRY_POINTS = {
    "splitstream-router": "splitstream.router",
    "splitstream-worker": "splitstream.worker",
    "splitstream-recorder": "splitstream.recorder",
    "splitstream-archive": "splitstream.archiver",
}


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    return data


def flags(command: list[str]) -> dict[str, str]:
    parsed = {}
    for part in command[1:]:
        assert part.startswith("--"), f"{command[0]}: argument {part!r} should be --flag=value"
        name, _, value = part.partition("=")
        parsed[name] = value
    return parsed


@pytest.fixture(scope="module")
def help_texts() -> dict[str, str]:
    texts = {}
    for script, module in ENTRY_POINTS.items():
        result = launcher.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        texts[script] = result.stdout
    return texts


def splitstream_services() -> list[tuple[str, list[str]]]:
    return [
        (name, service["command"])
        for name, service in compose()["services"].items()
        if isinstance(service.get("command"), list) and service["command"][0] in ENTRY_POINTS
    ]


@pytest.mark.slow
@pytest.mark.parametrize(("service", "command"), splitstream_services())
def test_every_service_command_is_an_entry_point_given_flags_it_accepts(
    service: str, command: list[str], help_texts: dict[str, str]
) -> None:
    scripts = (ROOT / "pyproject.toml").read_text()
    assert f'{command[0]} = "' in scripts, f"{service}: {command[0]} is not a console script"
    for flag in flags(command):
        assert re.search(rf"\s{re.escape(flag)}[\s=,]", help_texts[command[0]]), (
            f"{service}: {command[0]} has no {flag}"
        )


def test_the_model_training_command_is_a_real_module() -> None:
    command = compose()["services"]["models"]["command"]
    assert command[:3] == ["python", "-m", "demo.train"]
    assert (ROOT / "demo" / "train.py").exists()


def test_ports_agree_between_services() -> None:
    services = dict(splitstream_services())
    router = flags(services["router"])
    recorder = flags(services["recorder"])
    assert router["--recorder"] == f"recorder:{recorder['--port']}"
    assert recorder["--redis-url"].startswith("redis://redis:6379")
    for name in ("worker-v1", "worker-v2"):
        worker = flags(services[name])
        assert worker["--advertise-address"] == f"{name}:{worker['--port']}"
        assert worker["--registry"] == router["--registry"]


def test_prometheus_scrapes_the_metrics_port_of_every_service() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for group in job["static_configs"] for t in group["targets"]}
    expected = {
        f"{name}:{flags(command)['--metrics-port']}"
        for name, command in splitstream_services()
        if compose()["services"][name].get("profiles") is None
    }
    # A router's child shipper serves its own metrics port.
    expected |= {
        f"{name}:{flags(command)['--shipper-metrics-port']}"
        for name, command in splitstream_services()
        if "--shipper-metrics-port" in flags(command)
    }
    assert targets == expected


def dashboard_metrics() -> set[str]:
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "splitstream.json").read_text())
    names = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            names.update(re.findall(r"\bsplitstream_[a-z0-9_]+", target["expr"]))
    return names


@pytest.mark.slow
def test_every_metric_the_dashboard_plots_is_exported_by_a_running_service(tmp_path: Path) -> None:
    import numpy as np

    from tests.harness import InferClient, make_request
    from tests.recording_stack import RecordingStack

    stack = RecordingStack(tmp_path)
    try:
        client = InferClient(stack.router.address)
        client.infer(make_request("affine", np.ones((1, 4), np.float32)), metadata=[("x-request-id", "dash")])
        client.close()
        stack.wait_recorded({"dash"})
        exported = "".join(scrape_metrics(process.metrics_port) for process in stack.stack.processes)
        exported += scrape_metrics(stack.shipper_metrics_port)  # the router's child shipper
    finally:
        stack.close()
    declared = set(re.findall(r"^# TYPE (\S+) ", exported, re.M)) | set(re.findall(r"^# HELP (\S+) ", exported, re.M))
    missing = sorted(name for name in dashboard_metrics() if _family(name) not in declared and name not in declared)
    assert not missing, f"the dashboard queries metrics no service exports: {missing}"


def _family(name: str) -> str:
    """``x_bucket`` / ``x_sum`` / ``x_count`` belong to the histogram family ``x``."""
    return re.sub(r"_(bucket|sum|count)$", "", name)


def test_every_service_command_parses_with_the_services_own_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    """Values too, not only flag names: the parsers validate ports, rules and registry specs."""
    from splitstream.archiver.config import parse_args as archiver_args
    from splitstream.recorder.config import parse_args as recorder_args
    from splitstream.router.config import parse_args as router_args
    from splitstream.router.main import open_registry
    from splitstream.worker.main import build_parser

    monkeypatch.setenv("SPLITSTREAM_HMAC_KEY", "compose-check")
    services = dict(splitstream_services())
    router = router_args(services["router"][1:])
    assert open_registry(router.registry).description.startswith("consul")
    recorder_args(services["recorder"][1:])
    archiver_args(services["archiver"][1:])
    for name in ("worker-v1", "worker-v2", "worker-v2-gpu"):
        build_parser().parse_args(services[name][1:])


def tls_overlay() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((DEPLOY / "docker-compose.tls.yml").read_text())
    return data


def test_the_tls_stack_sets_only_variables_and_flags_its_services_have(
    help_texts: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``make up-tls`` switches TLS on with each service's own SPLITSTREAM_* variables: a misspelt one
    would be ignored silently and that hop would stay plaintext, so every name must be a real flag's."""
    from splitstream.recorder.config import build_parser as recorder_parser

    base = compose()["services"]
    overlay = tls_overlay()["services"]
    for name, service in overlay.items():
        if name not in base:
            continue
        command = service.get("command") or base[name].get("command")
        if not (isinstance(command, list) and command[0] in ENTRY_POINTS):
            continue
        help_text = help_texts[command[0]]
        for variable in service.get("environment", {}):
            if variable.startswith("SPLITSTREAM_HEALTHCHECK_"):
                continue
            assert variable in help_text.replace("\n", " ").replace("  ", ""), f"{name}: {variable} is no flag"
        if "command" in service:
            known = {flag for flag in re.findall(r"--[a-z][a-z0-9-]*", help_text)}
            assert set(flags(service["command"])) <= known, name
    monkeypatch.setenv("SPLITSTREAM_HMAC_KEY", "compose-check")
    recorder = overlay["recorder"]["command"]
    args = recorder_parser().parse_args(recorder[1:])
    assert args.redis_url.startswith("rediss://")


def test_make_certs_makes_a_ca_and_per_service_certificates_the_services_accept(tmp_path: Path) -> None:
    from cryptography import x509

    from splitstream.common.tls import ClientTls, ServerTls

    overlay = tls_overlay()["services"]["certs"]["command"]
    services = [part.split("=", 1)[1] for part in overlay if part.startswith("--service=")]
    out = tmp_path / "certs"
    done = launcher.run(
        [sys.executable, "scripts/make_certs.py", f"--out={out}", *(f"--service={s}" for s in services)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    for service in services:
        cert, key = str(out / f"{service}.pem"), str(out / f"{service}-key.pem")
        ServerTls(cert_file=cert, key_file=key, client_ca_file=str(out / "ca.pem"), mutual=True).check()
        ClientTls(enabled=True, ca_file=str(out / "ca.pem"), cert_file=cert, key_file=key).check()
        names = x509.load_pem_x509_certificate(Path(cert).read_bytes()).extensions.get_extension_for_class(
            x509.SubjectAlternativeName
        )
        assert service in names.value.get_values_for_type(x509.DNSName)  # the name other containers dial
    before = (out / "router.pem").read_bytes()
    launcher.run([sys.executable, "scripts/make_certs.py", f"--out={out}", "--service=router"], cwd=ROOT, check=True)
    assert (out / "router.pem").read_bytes() == before  # kept across restarts of the certs container
