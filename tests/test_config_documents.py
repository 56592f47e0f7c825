"""Every JSON/YAML type in every field of the registry documents (issue 11: "kept fixed").

For each field of the file registry and of the experiment (the file's ``experiment:`` block and
Consul's KV JSON), each of str, int, float, bool, null, NaN, infinity, list and map is either
accepted with its documented meaning or refused with a ConfigError naming that field. Nothing
else may come out: any other exception is what used to kill a router's registry watch.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitstream.common.errors import ConfigError
from splitstream.common.headers import DEFAULT_ROUTING_KEY_HEADER
from splitstream.common.registry import RegistryState, parse_registry
from splitstream.common.registry.consul import decode_experiment
from splitstream.common.registry.file import parse_registry_file
from tests.fuzzing import all_paths

MODEL = "m"
T = TypeVar("T")

SAMPLES: dict[str, Any] = {
    "str": "v2",
    "int": 50,
    "float": 50.0,
    "bool": True,
    "null": None,
    "nan": math.nan,
    "inf": math.inf,
    "list": [1],
    "map": {"a": 1},
}


def experiment() -> dict[str, Any]:
    return {
        "salt": "s",
        "control": "v1",
        "arms": [{"version": "v1", "weight": 50}, {"version": "v2", "weight": 50}],
        "shadows": [{"version": "v3", "sample_rate": 0.5}],
        "routing_key_header": "x-user",
        "model": MODEL,
    }


def registry() -> dict[str, Any]:
    endpoints = {"v1": ["127.0.0.1:1"], "v2": ["127.0.0.1:2"]}
    return {"models": {MODEL: {"endpoints": endpoints, "experiment": experiment()}}, "remove_models": ["gone"]}


#: Experiment fields: path inside the experiment → the sample types it accepts (docs/configuration.md).
EXPERIMENT_FIELDS: dict[tuple[Any, ...], set[str]] = {
    ("salt",): {"str", "null"},  # null: the model name
    ("control",): {"str"},  # "v2" is an arm
    ("arms",): set(),
    ("arms", 0): set(),
    ("arms", 1, "version"): {"str"},
    ("arms", 0, "weight"): {"int", "float"},  # 50 or 50.0 keeps the sum at 100
    ("shadows",): {"null"},  # null: no shadows
    ("shadows", 0, "version"): set(),  # "v2" takes live traffic: a shadow may not
    ("shadows", 0, "sample_rate"): set(),  # 50 is not within 0..1
    ("routing_key_header",): {"str", "null"},  # null: x-routing-key
    ("model",): {"str", "null"},  # informative only
}

#: File-only fields, from the document's top.
FILE_FIELDS: dict[tuple[Any, ...], set[str]] = {
    ("models",): set(),
    ("models", MODEL): set(),
    ("models", MODEL, "endpoints"): {"null"},  # null: no endpoints (each call then fails UNAVAILABLE)
    ("models", MODEL, "endpoints", "v1"): set(),  # "v2" is no host:port
    ("models", MODEL, "endpoints", "v1", 0): set(),
    ("models", MODEL, "experiment"): set(),  # null: needs exactly one version, this model has two
    ("remove_models",): {"null"},  # null: nothing removed
    ("remove_models", 0): {"str"},  # a model removed on purpose
}


def replaced(document: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    result = copy.deepcopy(document)
    target: Any = result
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value
    return result


def dotted(path: tuple[Any, ...]) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def leaf_name(path: tuple[Any, ...]) -> str:
    return next(str(part) for part in reversed(path) if not isinstance(part, int))


def attempt(parse: Callable[[], T]) -> tuple[T | None, ConfigError | None]:
    """The result, or the ConfigError; any other exception fails the test by escaping."""
    try:
        return parse(), None
    except ConfigError as error:
        return None, error


def assert_names_the_field(error: ConfigError, path: tuple[Any, ...]) -> None:
    """The full path, or (for rules across fields, e.g. "weights must sum to 100") the field's name."""
    message = str(error)
    assert "\n" not in message
    assert dotted(path) in message or leaf_name(path).rstrip("s") in message, (path, message)


@pytest.mark.parametrize("kind", SAMPLES)
@pytest.mark.parametrize("path", EXPERIMENT_FIELDS, ids=dotted)
def test_every_type_in_every_experiment_field_is_accepted_as_documented_or_refused_naming_it(
    path: tuple[Any, ...], kind: str
) -> None:
    value = SAMPLES[kind]
    document = replaced(experiment(), path, value)
    # Consul's KV JSON (json.dumps writes NaN and Infinity, which json.loads reads back) ...
    consul_experiment, consul_error = attempt(lambda: decode_experiment(MODEL, json.dumps(document).encode()))
    # ... and the file's experiment block, where the error carries the whole path from the top.
    file_document = replaced(registry(), ("models", MODEL, "experiment"), document)
    file_state, file_error = attempt(lambda: parse_registry(yaml.safe_load(yaml.safe_dump(file_document))))
    for error in (consul_error, file_error):
        if error is not None:
            assert_names_the_field(error, path)
    outcomes = [consul_experiment, file_state.models[MODEL].experiment if file_state is not None else None]
    accepted = kind in EXPERIMENT_FIELDS[path]
    assert [o is not None for o in outcomes] == [accepted, accepted]
    if accepted:
        consul_experiment, file_experiment = outcomes
        assert consul_experiment == file_experiment
        assert_documented_meaning(consul_experiment, path, value)


def assert_documented_meaning(experiment: Any, path: tuple[Any, ...], value: Any) -> None:
    if path == ("salt",):
        assert experiment.salt == (MODEL if value is None else value)
    elif path == ("control",):
        assert experiment.control == value
    elif path == ("arms", 1, "version"):
        assert experiment.versions == ("v1", value)
    elif path == ("arms", 0, "weight"):
        assert [arm.weight for arm in experiment.arms] == [50, 50]
    elif path == ("shadows",):
        assert experiment.shadows == ()
    elif path == ("routing_key_header",):
        assert experiment.routing_key_header == (DEFAULT_ROUTING_KEY_HEADER if value is None else value)
    elif path == ("model",):
        assert experiment.model == MODEL


@pytest.mark.parametrize("kind", SAMPLES)
@pytest.mark.parametrize("path", FILE_FIELDS, ids=dotted)
def test_every_type_in_every_registry_file_field_is_accepted_as_documented_or_refused_naming_it(
    path: tuple[Any, ...], kind: str
) -> None:
    value = SAMPLES[kind]
    document = replaced(registry(), path, value)
    accepted = kind in FILE_FIELDS[path]
    parsed, error = attempt(lambda: parse_registry_file(yaml.safe_load(yaml.safe_dump(document))))
    if error is not None:
        assert not accepted, error
        assert_names_the_field(error, path)
        return
    assert accepted, f"{dotted(path)} = {value!r} was accepted"
    assert parsed is not None
    state, removed = parsed
    assert set(state.models) == {MODEL}
    expected = {"remove_models": set(), "remove_models[0]": {value}}.get(dotted(path), {"gone"})
    assert removed == expected


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "the file is empty"),
        ("# only a comment\n", "the file is empty"),
        ("models:\n", "models: Input should be a valid dictionary"),
        ("- models\n", "Input should be a valid dictionary"),
        ("models: {m: {endpoints: {v1: [a:1]}}}\nmodel: {}\n", "model: unknown field"),
        ("models: {1: {endpoints: {v1: [a:1]}}}\n", "models[1] (key): Input should be a valid string"),
        ("models: {m: {endpoints: {2: [a:1]}}}\n", "models.m.endpoints[2] (key): Input should be a valid string"),
        ("models: {m: {endpoints: {v1: [a:1]}}}\nremove_models: [m]\n", "remove_models names ['m']"),
    ],
)
def test_registry_files_that_are_not_a_registry_are_refused_in_one_line(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_registry(yaml.safe_load(text), source="registry.yaml")
    assert fragment in str(refused.value)
    assert str(refused.value).startswith("registry.yaml: ")


def test_models_with_no_model_is_an_empty_registry_and_one_address_needs_no_list() -> None:
    assert parse_registry({"models": {}}) == RegistryState()
    state = parse_registry({"models": {MODEL: {"endpoints": {"v1": "127.0.0.1:1"}}}})
    assert state.models[MODEL].endpoints == {"v1": ("127.0.0.1:1",)}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8,
)


REGISTRY_PATHS = all_paths(registry())


@pytest.mark.slow
@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(REGISTRY_PATHS), value=json_values)
def test_any_json_value_anywhere_in_a_registry_is_a_state_or_a_config_error(path: tuple[Any, ...], value: Any) -> None:
    document = replaced(registry(), path, value)
    _, error = attempt(lambda: parse_registry(document))
    assert error is None or "\n" not in str(error)
    if path[:3] == ("models", MODEL, "experiment") and len(path) > 3:
        text = json.dumps(replaced(experiment(), path[3:], value)).encode()
        _, error = attempt(lambda: decode_experiment(MODEL, text))
        assert error is None or "\n" not in str(error)


@pytest.mark.parametrize("address", ["bad host:9001", "host:99999", "host:0", "host:80o3", ":9001", "host", "unix:"])
def test_an_endpoint_that_is_no_address_to_dial_is_refused_naming_it(address: str) -> None:
    """Found by probing: ``"bad host:99999"`` was accepted (only a colon was checked) and dialled for ever."""
    document = {"models": {"m": {"endpoints": {"v1": [address]}}}}
    with pytest.raises(ConfigError, match=r"models\.m\.endpoints\.v1\[0\]: .*expected host:port"):
        parse_registry(document)


@pytest.mark.parametrize("address", ["127.0.0.1:9001", "worker-a:9001", "[::1]:9001", "unix:/run/worker.sock"])
def test_addresses_grpc_dials_are_accepted_as_endpoints(address: str) -> None:
    state = parse_registry({"models": {"m": {"endpoints": {"v1": [address]}}}})
    assert state.models["m"].endpoints["v1"] == (address,)
