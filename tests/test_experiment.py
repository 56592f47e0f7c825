"""The split contract, checked on the assignment function every router uses."""

from __future__ import annotations

import hashlib

import pytest

from splitstream.common.errors import ConfigError
from splitstream.common.experiment import BUCKETS, Experiment
from splitstream.common.registry import parse_registry

KEYS = [f"user-{i}" for i in range(20_000)]


def two_arms(v2_weight: float, *, salt: str = "salt-1") -> Experiment:
    return Experiment.build(model="m", salt=salt, control="v1", arms=[("v1", 100 - v2_weight), ("v2", v2_weight)])


def test_20000_keys_at_90_10_land_within_one_point_of_90_10() -> None:
    experiment = two_arms(10)
    share_v2 = sum(experiment.assign(key) == "v2" for key in KEYS) / len(KEYS)
    assert abs(share_v2 - 0.10) <= 0.01


def test_raising_v2_weight_never_moves_a_key_off_v2() -> None:
    before = two_arms(10)
    after = two_arms(50)
    on_v2_before = {key for key in KEYS if before.assign(key) == "v2"}
    assert on_v2_before
    assert all(after.assign(key) == "v2" for key in on_v2_before)
    share_v2 = sum(after.assign(key) == "v2" for key in KEYS) / len(KEYS)
    assert abs(share_v2 - 0.50) <= 0.01


def test_lowering_v2_weight_moves_keys_only_from_v2_to_v1() -> None:
    before, after = two_arms(50), two_arms(10)
    assert all(after.assign(key) == "v1" for key in KEYS if before.assign(key) == "v1")


def test_the_layout_does_not_depend_on_the_order_arms_are_written_in() -> None:
    a = Experiment.build(model="m", salt="s", control="v1", arms=[("v1", 60), ("v2", 30), ("v3", 10)])
    b = Experiment.build(model="m", salt="s", control="v1", arms=[("v3", 10), ("v2", 30), ("v1", 60)])
    assert [a.assign(key) for key in KEYS[:2000]] == [b.assign(key) for key in KEYS[:2000]]


def test_the_salt_reshuffles_keys_between_experiments() -> None:
    a, b = two_arms(50, salt="one"), two_arms(50, salt="two")
    moved = sum(a.assign(key) != b.assign(key) for key in KEYS) / len(KEYS)
    assert 0.4 < moved < 0.6


def test_buckets_are_stable_values_of_the_documented_hash() -> None:
    import xxhash

    experiment = two_arms(10)
    key = "user-42"
    assert experiment.bucket(key) == xxhash.xxh3_64_intdigest(b"salt-1\x00user-42") % BUCKETS


def test_no_key_splits_randomly_by_weight() -> None:
    experiment = two_arms(30)
    draws = [experiment.assign(None) for _ in range(20_000)]
    assert abs(draws.count("v2") / len(draws) - 0.30) <= 0.015


@pytest.mark.parametrize(
    ("arms", "control", "message"),
    [
        ([("v1", 90), ("v2", 20)], "v1", "sum to 100"),
        ([("v1", 110), ("v2", -10)], "v1", ">= 0"),
        ([("v1", 100)], "v9", "control 'v9'"),
        ([("v1", 50), ("v1", 50)], "v1", "more than one arm"),
        ([("v1", 99.995), ("v2", 0.005)], "v1", "finer than 0.01"),
        ([], "v1", "at least one arm"),
    ],
)
def test_invalid_experiments_are_rejected_with_the_reason(
    arms: list[tuple[str, float]], control: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        Experiment.build(model="m", salt="s", control=control, arms=arms)


def test_registry_file_errors_name_the_model_and_field() -> None:
    with pytest.raises(ConfigError, match="model 'm'.*2 versions but no experiment"):
        parse_registry({"models": {"m": {"endpoints": {"v1": ["a:1"], "v2": ["b:2"]}}}})
    with pytest.raises(ConfigError, match=r"models\.m\.experimnt: unknown field"):
        parse_registry({"models": {"m": {"endpoints": {"v1": ["a:1"]}, "experimnt": {}}}})
    with pytest.raises(ConfigError, match="whitespace and control characters"):
        parse_registry({"models": {"bad model": {"endpoints": {"v1": ["a:1"]}}}})
    with pytest.raises(ConfigError, match=r"models\.m\.endpoints\.v1\[0\]: Input should be a valid string, got 123"):
        parse_registry({"models": {"m": {"endpoints": {"v1": [123]}}}})


def test_a_model_with_one_version_needs_no_experiment() -> None:
    state = parse_registry({"models": {"m": {"endpoints": {"v1": ["127.0.0.1:1"]}}}})
    assert state.models["m"].experiment.assign("anyone") == "v1"


def test_the_phase_is_the_same_for_the_same_experiment_however_it_is_written() -> None:
    written = Experiment.build(model="m", salt="s", control="v1", arms=[("v1", 90), ("v2", 10)])
    reordered = Experiment.build(model="m", salt="s", control="v1", arms=[("v2", 10.0), ("v1", 90.0)])
    assert written.phase == reordered.phase
    assert len(written.phase.id) == 16
    assert written.phase.weights == (("v1", 90), ("v2", 10))
    # The documented encoding, recomputed by hand: another tool can derive the same id.
    encoded = '["splitstream-phase/1","s","v1",[["v1",9000],["v2",1000]]]'
    assert written.phase.id == hashlib.sha256(encoded.encode()).hexdigest()[:16]


def test_any_change_of_salt_control_arms_or_weights_starts_a_new_phase() -> None:
    base = Experiment.build(model="m", salt="s", control="v1", arms=[("v1", 90), ("v2", 10)])
    changed = [
        Experiment.build(model="m", salt="s2", control="v1", arms=[("v1", 90), ("v2", 10)]),
        Experiment.build(model="m", salt="s", control="v2", arms=[("v1", 90), ("v2", 10)]),
        Experiment.build(model="m", salt="s", control="v1", arms=[("v1", 89.99), ("v2", 10.01)]),
        Experiment.build(model="m", salt="s", control="v1", arms=[("v1", 90), ("v2", 10), ("v3", 0)]),
    ]
    ids = {base.phase.id, *(e.phase.id for e in changed)}
    assert len(ids) == 5
    # Shadows and the routing-key header do not randomize anything: same phase.
    arms = [("v1", 90), ("v2", 10)]
    same = Experiment.build(
        model="m", salt="s", control="v1", arms=arms, shadows=[("v3", 0.5)], routing_key_header="x-u"
    )
    assert same.phase.id == base.phase.id
