"""Endpoint pools in-process: least-outstanding pick and the circuit breaker."""

from __future__ import annotations

import asyncio

from splitstream.router.pools import Endpoint, Health, VersionPool


def endpoint(address: str, *, eject_after: int = 3, eject_s: float = 0.2) -> Endpoint:
    e = Endpoint(address, channel_options=(), eject_after_failures=eject_after, eject_duration_s=eject_s)
    e.health = Health.SERVING
    return e


async def test_the_endpoint_with_the_fewest_calls_in_flight_is_picked() -> None:
    a, b, c = endpoint("a:1"), endpoint("b:1"), endpoint("c:1")
    a.outstanding, b.outstanding, c.outstanding = 3, 1, 2
    pool = VersionPool("v1", [a, b, c])
    assert {pool.pick() for _ in range(10)} == {b}
    assert pool.pick(exclude=b) is c


async def test_ties_rotate_so_idle_endpoints_share_the_load() -> None:
    endpoints = [endpoint(f"e{i}:1") for i in range(3)]
    pool = VersionPool("v1", endpoints)
    assert {pool.pick() for _ in range(9)} == set(endpoints)


async def test_repeated_failures_eject_an_endpoint_until_its_time_is_up_and_a_success_resets_it() -> None:
    bad, good = endpoint("bad:1"), endpoint("good:1")
    pool = VersionPool("v1", [bad, good])
    assert not bad.failed()
    assert not bad.failed()
    assert bad.failed()  # the third consecutive failure ejects
    assert bad.ejected
    assert {pool.pick() for _ in range(10)} == {good}
    await asyncio.sleep(0.25)
    assert bad.eligible  # half-open: tried again after the ejection time
    bad.succeeded()
    assert bad.consecutive_failures == 0
    assert not bad.failed()


async def test_endpoints_that_are_not_serving_or_unreachable_are_never_picked() -> None:
    draining, down, fresh = endpoint("d:1"), endpoint("u:1"), endpoint("f:1")
    draining.health, down.health, fresh.health = Health.NOT_SERVING, Health.UNREACHABLE, Health.UNKNOWN
    pool = VersionPool("v1", [draining, down, fresh])
    assert {pool.pick() for _ in range(10)} == {fresh}
    assert not VersionPool("v1", [draining, down]).has_eligible()


async def test_eligibility_changes_are_reported_when_an_ejection_starts_runs_out_or_is_cleared() -> None:
    """What ``splitstream_router_arm_spilling`` is set from (never computed at scrape time, so that
    ``--processes`` children export it): an ejection running out is an event too, though nothing happens."""
    changes: list[bool] = []
    loop = asyncio.get_running_loop()
    running_out = loop.create_future()

    def changed() -> None:
        changes.append(e.eligible)
        if len(changes) == 2:
            running_out.set_result(None)

    e = Endpoint("e:1", channel_options=(), eject_after_failures=2, eject_duration_s=0.2, on_eligibility=changed)
    e.health = Health.SERVING
    e.failed()
    assert changes == []
    e.failed()  # ejects
    assert changes == [False]
    await asyncio.wait_for(running_out, 10)
    assert changes == [False, True]  # told when it ran out, and eligible by then
    e.succeeded()  # clears an ejection already over: no change
    assert changes == [False, True]
    e.failed()
    e.failed()  # ejected again; a call sent before that comes back fine and clears it
    e.succeeded()
    assert changes == [False, True, False, True]
    await e.close(drain_timeout_s=0)
