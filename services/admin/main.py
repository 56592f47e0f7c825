"""``splitstream``: the admin CLI for experiments, versions and rollouts, on either registry backend.

    splitstream --registry consul://127.0.0.1:8500 experiment get resnet
    splitstream --registry file:registry.yaml experiment set resnet --weights v1=90,v2=10
    splitstream --registry consul://127.0.0.1:8500 versions resnet
    splitstream --registry consul://127.0.0.1:8500 rollout resnet v2 --steps 10,50,100 --interval 60s \\
        --max-error-rate 1% --max-p99-ratio 1.5 --metrics router-a:8002 --metrics router-b:8002 \\
        --redis-url redis://127.0.0.1:6379/0 --guard 'click:lift>=-1%' --promote-on-win
    splitstream feedback import outcomes.csv --router router-a:8001 --model resnet
    splitstream credentials reload --router router-a:8001 --router router-b:8001 --api-key-file ops-key
    splitstream analyze resnet --redis-url redis://127.0.0.1:6379/0 --since -1d \\
        --metric click:rate --metric revenue:sum --output-dir ab

Exit codes: 0 done (a rollout promoted, or held at its last step below 100 %);
1 the registry or the routers' metrics could not be read or written, or the
experiment changed meanwhile (``analyze``: Redis could not be read); 2 a usage error or
input the registry refuses (one line on stderr; nothing written); 3 a rollout rolled back (a guard tripped,
metrics became unreadable, or it was interrupted). ``feedback import`` has its own
(:mod:`splitstream.admin.feedback_import`): 0 all accepted, 1 some rejected, 2 a malformed file.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from splitstream.admin import bandit_flags, credentials, feedback_flags, judge_cli, lock, pairwise_flags
from splitstream.admin import keys as keys_cli
from splitstream.admin.arguments import duration_s, fraction
from splitstream.admin.constants import FAILED, GUARD_SYNTAX, QUANTILE_GUARD_SYNTAX, ROLLED_BACK, USAGE
from splitstream.admin.store import (
    AdminError,
    Invalid,
    ModelView,
    Store,
    check_versions_exist,
    open_store,
    weights_text,
)
from splitstream.analysis import flags as analysis_flags
from splitstream.analysis.usage import parse_prices
from splitstream.common.argv_secrets import drop_warnings, give_warnings
from splitstream.common.cli import EnvArgumentParser
from splitstream.common.errors import ConfigError
from splitstream.common.experiment import Experiment
from splitstream.common.names import check_model_name
from splitstream.common.redis_settings import add_redis_security_arguments, redis_security_from_args
from splitstream.common.secrets import redact_text, redact_url
from splitstream.common.timewindow import join_relative_times
from splitstream.common.tls import ClientTls, add_client_tls_arguments, client_tls_from_args

if TYPE_CHECKING:
    from splitstream.admin.outcome_reader import OutcomeReader
    from splitstream.admin.outcomes import Guard
    from splitstream.admin.rollout import RolloutPlan

PROG = "splitstream"
ENV_PREFIX = "SPLITSTREAM_ADMIN_"


def steps(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of percentages: {text!r} (e.g. 10,50,100)") from None


def outcome_guard(text: str) -> Guard:
    # The guards read the analysis's models (numpy, pydantic): imported once a --guard is given.
    from splitstream.admin.outcomes import OutcomeGuard
    from splitstream.admin.quantile_guards import QuantileGuard, is_quantile_guard

    try:
        return QuantileGuard.parse(text) if is_quantile_guard(text) else OutcomeGuard.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


class _AppendGuards(argparse.Action):
    """``--guard`` (repeatable): flags given replace the environment's guard rather than extend it (argparse's
    ``append`` would try to append to the variable's string)."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: str | None = None
    ) -> None:
        current = getattr(namespace, self.dest, None)
        guards = list(current) if isinstance(current, list) else []
        guards.append(values)
        setattr(namespace, self.dest, guards)


def weight_pairs(text: str) -> list[tuple[str, float]]:
    """``v1=90,v2=10`` → [("v1", 90), ("v2", 10)]."""
    pairs = []
    for part in text.split(","):
        version, sep, value = part.strip().partition("=")
        if not sep or not version.strip():
            raise argparse.ArgumentTypeError(f"expected VERSION=WEIGHT pairs like v1=90,v2=10, got {text!r}")
        try:
            number = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"weight of '{version.strip()}' is not a number: {value!r}") from None
        if not math.isfinite(number):  # nan and inf parse as floats but split nothing
            raise argparse.ArgumentTypeError(f"weight of '{version.strip()}' must be a finite number, got {value!r}")
        pairs.append((version.strip(), int(number) if number.is_integer() else number))
    return pairs


def build_parser() -> EnvArgumentParser:
    parser = EnvArgumentParser(
        prog=PROG,
        env_prefix=ENV_PREFIX,
        description="Inspect and change splitstream experiments, list versions, and roll out new versions.",
        epilog=(
            "Exit codes: 0 done (rollout promoted or held); 1 registry or metrics unreadable/unwritable, or the "
            "experiment changed meanwhile; 2 usage error or refused input (nothing written); 3 rollout rolled back."
        ),
    )
    parser.add_argument(
        "--registry",
        default=None,
        help="file:PATH (the routers' YAML file) or consul://HOST:PORT (ACL token from CONSUL_HTTP_TOKEN); "
        "needed by experiment, versions and rollout (not by analyze or feedback import)",
    )
    # One TLS group for every command that dials a splitstream process (health probes of workers
    # today; commands that call routers or the recorder reuse it through admin_tls()).
    add_client_tls_arguments(
        parser.add_argument_group("TLS to splitstream processes (workers' health, routers, the recorder)"),
        flag="--tls",
        what="splitstream's servers",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    experiment = commands.add_parser("experiment", env_prefix=ENV_PREFIX, help="show or change a model's experiment")
    actions = experiment.add_subparsers(dest="action", required=True, metavar="ACTION")
    get = actions.add_parser("get", env_prefix=ENV_PREFIX, help="print the experiment routers follow, as JSON")
    get.add_argument("model")
    put = actions.add_parser(
        "set",
        env_prefix=ENV_PREFIX,
        help="change the experiment; fields not given keep their value",
        description=(
            "Validate, then write in one step: weights >= 0 summing to 100, exactly one control among the arms, "
            "and every version taking traffic (and the control and shadows) registered."
        ),
    )
    put.add_argument("model")
    put.add_argument("--weights", type=weight_pairs, help="VERSION=PERCENT,... e.g. v1=90,v2=10 (replaces all arms)")
    put.add_argument("--control", help="the control version (default: the current one)")
    put.add_argument("--salt", help="hash salt; changing it reshuffles every key")
    put.add_argument("--shadow", action="append", default=None, metavar="VERSION=RATE", help="shadow copies (repeat)")
    put.add_argument("--no-shadows", action="store_true", help="remove every shadow")
    put.add_argument("--routing-key-header", help="header carrying the sticky key (default x-routing-key)")
    put.add_argument(
        "--json", dest="json_text", metavar="JSON|@FILE|-", help="the whole experiment as JSON (replaces it)"
    )

    versions = commands.add_parser(
        "versions", env_prefix=ENV_PREFIX, help="each version's endpoints, health and engine tag"
    )
    versions.add_argument("model")
    versions.add_argument("--json", action="store_true", help="print JSON instead of a table")

    rollout = commands.add_parser(
        "rollout",
        env_prefix=ENV_PREFIX,
        help="ramp a version up step by step; roll back when a guard trips",
        description=(
            "Between steps, read every router's /metrics and compare the new version with the control over the "
            "step's interval; promote when the guards hold, set the new version back to 0 % when one trips."
        ),
    )
    rollout.add_argument("model")
    rollout.add_argument("version")
    rollout.add_argument("--steps", type=steps, default=(10.0, 50.0, 100.0), help="percentages, e.g. 10,50,100")
    rollout.add_argument("--interval", type=duration_s, default=60.0, help="time per step, e.g. 60s or 2m")
    rollout.add_argument("--max-error-rate", type=fraction, default=0.01, help="e.g. 0.01 or 1%%")
    rollout.add_argument("--max-p99-ratio", type=float, default=1.5, help="new p99 / control p99 at most this")
    rollout.add_argument(
        "--max-ttft-p99-ratio",
        type=float,
        default=None,
        help="token streams: new / control p99 time to first token at most this (default: not judged)",
    )
    rollout.add_argument(
        "--max-itl-p99-ratio",
        type=float,
        default=None,
        help="token streams: new / control p99 gap between tokens at most this (default: not judged)",
    )
    rollout.add_argument(
        "--metrics",
        action="append",
        default=[],
        metavar="URL",
        help="a router's /metrics (host:port or URL; repeat for every router; a router named twice, even "
        "spelt otherwise: host case, a trailing slash, a default port, is read once)",
    )
    rollout.add_argument("--min-calls", type=int, default=20, help="calls of the new version a step needs")
    rollout.add_argument("--check-every", type=duration_s, default=1.0, help="how often metrics are read in a step")
    outcomes = rollout.add_argument_group(
        "outcome guards (business metrics from the recorder's Redis, judged at every check; see docs/rollouts.md)"
    )
    outcomes.add_argument(
        "--guard",
        action=_AppendGuards,
        type=outcome_guard,
        default=None,
        metavar="GUARD",
        help=GUARD_SYNTAX.replace("%", "%%")
        + f", or {QUANTILE_GUARD_SYNTAX}; e.g. 'click:lift>=-1%%', 'latency:p99:ratio<=1.10' "
        + "(repeat; significant harm rolls back)",
    )
    outcomes.add_argument(
        "--promote-on-win",
        action="store_true",
        help="end a step early when every --guard shows a significantly positive lift",
    )
    outcomes.add_argument(
        "--redis-url", default=None, secret=True, help="the recorder's Redis, where calls and feedback are read"
    )
    outcomes.add_argument(
        "--price",
        action=analysis_flags.AppendPrices,
        default=None,
        metavar="PRICE",
        help="VERSION=IN/1M-in,OUT/1M-out (repeat per version): the price per million tokens that a guard on cost "
        "(e.g. 'cost:lift<=10%%') reads, as analyze --price",
    )
    outcomes.add_argument(
        "--guard-min-units", type=int, default=30, help="units each arm needs in a step before a guard is judged"
    )
    outcomes.add_argument(
        "--guard-alpha", type=float, default=0.05, help="1 - confidence of the guards' always-valid intervals"
    )
    add_redis_security_arguments(outcomes)
    judge_cli.add_arguments(rollout)
    feedback_flags.add_parser(commands, env_prefix=ENV_PREFIX)
    analysis_flags.add_command(commands, ENV_PREFIX)
    bandit_flags.add_parser(commands, ENV_PREFIX)
    keys_cli.add_parser(commands, env_prefix=ENV_PREFIX)
    pairwise_flags.add_parser(commands, env_prefix=ENV_PREFIX)
    credentials.add_parser(commands, env_prefix=ENV_PREFIX)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    code = _run(parser, argv)
    # A password in --redis-url (or --hmac-key) on the command line: the deprecation warning, held by the parse,
    # once the command has done its work. A usage error or a failure keeps its one error line the only one,
    # as the replayer's; a rollout or a bandit gave it already, when Redis first answered.
    if code in (FAILED, USAGE):
        drop_warnings()
    else:
        give_warnings()
    return code


def _run(parser: EnvArgumentParser, argv: Sequence[str] | None) -> int:
    args = parser.parse_args(
        join_relative_times(sys.argv[1:] if argv is None else list(argv), analysis_flags.TIME_FLAGS)
    )
    # The commands that read the analysis (scipy, pyarrow, duckdb) or call HTTP (aiohttp) import it now, not at
    # every start: the other commands, and every usage error, start in about a quarter of the time.
    if args.command == "analyze":
        from splitstream.analysis import cli as analysis_cli

        return _frozen(lambda: analysis_cli.run(args, parser))
    if args.command == "judge":
        from splitstream.admin import pairwise_cli

        return _frozen(lambda: pairwise_cli.run(args))
    gc.freeze()
    if args.command == "feedback":
        from splitstream.admin import feedback_import

        return feedback_import.run(args)
    if args.command == "keys":
        return keys_cli.run(args)
    if args.command == "credentials":
        return credentials.run(args)
    if args.registry is None:
        parser.error("the following arguments are required: --registry")
    try:
        check_names(args)
        store = open_store(args.registry, tls=admin_tls(args))
        if args.command == "experiment" and args.action == "get":
            return experiment_get(store, args.model)
        if args.command == "experiment":
            return experiment_set(store, args)
        if args.command == "versions":
            return list_versions(store, args.model, as_json=args.json)
        if args.command == "bandit":
            from splitstream.admin import bandit

            return _frozen(lambda: bandit.run(store, args, env_prefix=ENV_PREFIX, say=_say))
        return run_rollout(store, args)
    except Invalid as error:
        return _fail(USAGE, error)
    except AdminError as error:
        return _fail(FAILED, error)


def _frozen(run: Callable[[], int]) -> int:
    """``run()`` once everything it needs is imported: what exists then lives as long as the process. Frozen,
    the cyclic collector no longer walks it at every full collection, which the lists redis-py makes of every
    page of a stream set off: about 40 % of an analysis's CPU, and more than half a bare read's
    (docs/benchmarks.md, A/B analysis)."""
    gc.freeze()
    return run()


def check_names(args: argparse.Namespace) -> None:
    """Invalid (exit 2, one line) for a model name no registry can hold (empty, blank, a character that does
    not show: a zero-width space pasted in), and for such a rollout version. Such a name was looked up all
    the same, and the registry's answer (``model '' is not in ...``, ``no endpoint of version(s)  ...``) did
    not say what was wrong with it. Names are shown with repr, so an invisible character shows as its escape."""
    model = getattr(args, "model", None)
    if model is not None:
        try:
            check_model_name(model)
        except ValueError as error:
            raise Invalid(str(error) if model else "the model name is empty ('')") from None
    version = getattr(args, "version", None) if args.command == "rollout" else None
    if version is None:
        return
    if not version.strip():
        raise Invalid(f"the version name is {'empty' if not version else 'only whitespace'} ({version!r})")
    hidden = next((ch for ch in version if not ch.isprintable()), None)
    if hidden is not None:
        raise Invalid(f"version {version!r} contains {hidden!r} (U+{ord(hidden):04X}), a character that does not show")
    if version != version.strip():
        raise Invalid(f"version {version!r} starts or ends with whitespace")


def admin_tls(args: argparse.Namespace) -> ClientTls:
    """The TLS the shared ``--tls*`` flags describe; Invalid (exit 2) for a file that cannot be used."""
    try:
        return client_tls_from_args(args, flag="--tls")
    except ConfigError as error:
        raise Invalid(str(error)) from None


def _fail(code: int, error: Exception) -> int:
    print(f"{PROG}: error: {error}", file=sys.stderr)
    return code


def experiment_get(store: Store, model: str) -> int:
    view = store.read(model)
    if view.problem:
        raise AdminError(view.problem)
    if view.effective is None:
        raise AdminError(f"model '{model}' has no experiment and no passing instance to default to")
    if view.stored is None:
        print(
            f"# no experiment stored for '{model}'; routers use the default: all traffic to the control",
            file=sys.stderr,
        )
    print(json.dumps({"model": model, **view.effective.to_mapping()}, indent=2))
    return 0


def experiment_set(store: Store, args: argparse.Namespace) -> int:
    view = store.read(args.model)
    experiment = new_experiment(view, args)
    check_versions_exist(view, experiment)
    store.write(args.model, experiment, view.revision)
    print(f"{args.model}: {weights_text(experiment)} written to {store.description}")
    return 0


def new_experiment(view: ModelView, args: argparse.Namespace) -> Experiment:
    """The experiment ``set`` would write; raises Invalid naming the problem."""
    model = view.model
    if args.json_text is not None:
        if any(v is not None for v in (args.weights, args.control, args.salt, args.shadow, args.routing_key_header)):
            raise Invalid("--json replaces the whole experiment; give no other field with it")
        data = _load_json(args.json_text)
        if isinstance(data, dict) and data.get("model", model) != model:
            raise Invalid(f"the JSON is for model '{data['model']}', not '{model}'")
        if isinstance(data, dict) and not isinstance(data.get("control", ""), str):
            raise Invalid("'control' must be one version name")
        return _build(lambda: Experiment.from_mapping(model, data))
    base = view.stored or view.effective
    if base is None and (args.weights is None):
        raise Invalid(f"model '{model}' has no experiment yet: give --weights")
    mapping: dict[str, Any] = base.to_mapping() if base is not None else {"salt": model}
    if args.weights is not None:
        mapping["arms"] = [{"version": v, "weight": w} for v, w in args.weights]
        if args.control is None and mapping.get("control") not in {v for v, _ in args.weights}:
            mapping["control"] = args.weights[0][0]
    if args.control is not None:
        mapping["control"] = args.control
    if args.salt is not None:
        mapping["salt"] = args.salt
    if args.no_shadows:
        mapping["shadows"] = []
    if args.shadow:
        mapping["shadows"] = [{"version": v, "sample_rate": r} for v, r in map(_shadow_pair, args.shadow)]
    if args.routing_key_header is not None:
        mapping["routing_key_header"] = args.routing_key_header
    return _build(lambda: Experiment.from_mapping(model, mapping))


def _build(make: Any) -> Experiment:
    try:
        experiment: Experiment = make()
    except ConfigError as error:
        raise Invalid(str(error)) from None
    return experiment


def _shadow_pair(text: str) -> tuple[str, float]:
    version, sep, rate = text.partition("=")
    try:
        return version.strip(), float(rate) if sep else 1.0
    except ValueError:
        raise Invalid(f"--shadow: expected VERSION=RATE, got {text!r}") from None


def _load_json(source: str) -> Any:
    if source == "-":
        text = sys.stdin.read()
    elif source.startswith("@"):
        try:
            text = Path(source[1:]).read_text()
        except OSError as error:
            raise Invalid(f"--json: {source[1:]}: {error.strerror or error}") from None
    else:
        text = source
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise Invalid(f"--json: not valid JSON: {error}") from None


def list_versions(store: Store, model: str, *, as_json: bool) -> int:
    view = store.read(model, probe_health=True)
    weights = {a.version: a.weight for a in view.effective.arms} if view.effective is not None else {}
    control = view.effective.control if view.effective is not None else ""
    rows = [
        {
            "version": e.version,
            "endpoint": e.address,
            "health": e.health or "unknown",
            "engine_tag": e.engine_tag,
            "backend": e.backend,
            "precision": e.precision,
            "weight": weights.get(e.version, 0),
            "control": e.version == control,
        }
        for e in view.endpoints
    ]
    for version in sorted(set(weights) - set(view.versions)):  # in the experiment, no endpoint registered
        rows.append(
            {
                "version": version,
                "endpoint": "",
                "health": "no endpoint",
                "engine_tag": "",
                "backend": "",
                "precision": "",
                "weight": weights[version],
                "control": version == control,
            }
        )
    if as_json:
        print(json.dumps({"model": model, "problem": view.problem, "versions": rows}, indent=2))
        return 0
    header = ("VERSION", "WEIGHT", "ENDPOINT", "HEALTH", "ENGINE TAG", "BACKEND", "PRECISION")
    table = [header] + [
        (
            r["version"] + (" (control)" if r["control"] else ""),
            f"{r['weight']:g} %",
            r["endpoint"] or "-",
            r["health"],
            r["engine_tag"] or "-",
            r["backend"] or "-",
            r["precision"] or "-",
        )
        for r in rows
    ]
    widths = [max(len(str(row[i])) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    if view.problem:
        print(f"warning: {view.problem}", file=sys.stderr)
    return 0


def outcome_reader(args: argparse.Namespace, plan: RolloutPlan) -> OutcomeReader:
    """The reader of the guards' analysis; Invalid (exit 2) for a missing or bad --redis-url or TLS file,
    AdminError (exit 1, nothing changed) when Redis cannot be reached."""
    if not args.redis_url:
        raise Invalid("--guard needs --redis-url, the recorder's Redis (calls and feedback are read there)")
    try:
        security = redis_security_from_args(args, url=args.redis_url, env_prefix=ENV_PREFIX)
    except ConfigError as error:
        raise Invalid(str(error)) from None
    try:
        prices = parse_prices([args.price] if isinstance(args.price, str) else list(args.price or ()))
    except ValueError as error:
        raise Invalid(str(error)) from None
    from splitstream.admin.outcome_reader import OutcomeReader  # the analysis: only a rollout with guards reads it
    from splitstream.admin.outcomes import OutcomeGuard
    from splitstream.analysis.model import MetricSpec

    outcome_guards = [g for g in plan.guards if isinstance(g, OutcomeGuard)]
    if any(g.metric.name == "cost" for g in outcome_guards) and plan.version not in prices:
        raise Invalid(
            f"--guard on cost needs --price for {plan.version} (and for the control): a call's cost is its tokens "
            "at its version's price"
        )
    metrics_by_name = {g.metric.name: g.metric for g in outcome_guards}
    if not metrics_by_name:  # the analysis wants a metric; quantile guards read the quantiles every phase has
        metrics_by_name = {"ttft_ms": MetricSpec.parse("ttft_ms")}
    gc.freeze()  # what it imported lives as long as the process, as in _frozen
    reader = OutcomeReader(
        args.redis_url,
        model=plan.model,
        metrics=tuple(metrics_by_name.values()),
        alpha=plan.guard_alpha,
        security=security,
        prices=prices,
        quantiles=len(outcome_guards) < len(plan.guards),  # the others are quantile guards
    )
    try:
        reader.check_reachable()
    except ValueError as error:
        raise Invalid(f"bad --redis-url {redact_url(args.redis_url)!r}: {redact_text(str(error))}") from None
    except OSError as error:
        raise AdminError(f"{error}; nothing changed") from None
    warn_of_secrets()
    return reader


def warn_of_secrets() -> None:
    """The held warnings of secrets on the command line, on stderr: once a long command (a rollout, a bandit)
    has found its configuration usable, rather than when it ends hours later."""
    give_warnings(lambda line: _say(line, stream=sys.stderr))


def metrics_urls(flags: Sequence[str]) -> tuple[str, ...]:
    """Each router once: one named twice (the same URL, or one that differs in case, a trailing slash or a
    default port) had its calls and errors counted twice. A note on stderr says which flag was dropped."""
    from splitstream.admin import metrics  # prometheus_client's parser: a rollout's

    try:
        urls = [metrics.metrics_url(url) for url in flags]
    except ValueError as error:
        raise Invalid(str(error)) from None
    distinct, dropped = metrics.distinct_routers(urls)
    for url, kept in dropped:
        _say(f"{PROG}: note: --metrics {url} names the router of --metrics {kept}; it is read once", stream=sys.stderr)
    return distinct


def run_rollout(store: Store, args: argparse.Namespace) -> int:
    # The rollout's machinery (its judge, guards and their analysis: numpy, pydantic) is imported by the command
    # that uses it, and here before the signal handlers are installed.
    from splitstream.admin.outcomes import OutcomeGuard
    from splitstream.admin.quantile_guards import QuantileGuard
    from splitstream.admin.rollout import Interrupts, Rollout, RolloutPlan, interrupted_before_start

    # From the environment, argparse converts the variable's one guard; from flags, a list.
    guards = (args.guard,) if isinstance(args.guard, OutcomeGuard | QuantileGuard) else tuple(args.guard or ())
    try:
        judge = judge_cli.config_from_args(args)
    except ValueError as error:
        raise Invalid(str(error)) from None
    plan = RolloutPlan(
        model=args.model,
        version=args.version,
        steps=args.steps,
        interval_s=args.interval,
        max_error_rate=args.max_error_rate,
        max_p99_ratio=args.max_p99_ratio,
        max_ttft_p99_ratio=args.max_ttft_p99_ratio,
        max_itl_p99_ratio=args.max_itl_p99_ratio,
        metrics_urls=metrics_urls(args.metrics),
        min_calls=args.min_calls,
        check_every_s=args.check_every,
        guards=guards,
        promote_on_win=args.promote_on_win,
        guard_min_units=args.guard_min_units,
        guard_alpha=args.guard_alpha,
        judge=judge,
    )
    if judge is not None or guards:
        # What the judge and the guards compute with, loaded now: scipy loads its submodules on first use,
        # and a SIGINT landing in that first load ended the process (-2) after the rollback it had done.
        import scipy.optimize
        import scipy.stats  # noqa: F401
    # SIGTERM (a CI job cancelled) and SIGHUP (a terminal closed) roll back like Ctrl-C does.
    interrupts = Interrupts()
    interrupts.install()
    try:
        # One rollout per model: a second one fought the first over its weights (Invalid if one holds it).
        with lock.held(store, plan.model, plan.version) as held:
            try:
                reader = outcome_reader(args, plan) if guards else None
            except KeyboardInterrupt:
                verdict = interrupted_before_start(plan.model)
            else:
                verdict = Rollout(
                    store,
                    plan,
                    out=_say,
                    outcomes=reader.read if reader else None,
                    interrupts=interrupts,
                    lock_lost=held.lost,
                ).run()
    except KeyboardInterrupt:  # while the lock was being taken
        verdict = interrupted_before_start(plan.model)
    _say(verdict.message, stream=sys.stdout if verdict.code in (0, ROLLED_BACK) else sys.stderr)
    return verdict.code


def _say(line: str, *, stream: Any = None) -> None:
    """Print a rollout's line; where its terminal is gone (a closed ssh session), print nothing more rather
    than fail: a print raising in a rollback stopped it before its write."""
    stream = stream or sys.stdout
    try:
        print(line, file=stream, flush=True)
    except OSError:
        with contextlib.suppress(OSError):  # the rest of the run, and the flush at exit, write nowhere
            os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
