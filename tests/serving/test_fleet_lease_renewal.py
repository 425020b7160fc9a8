"""A fleet's compile leases are short and renewed by their holder, over one real Redis: a live
holder keeps its lease past the time to live; one that stops renewing (a host killed) loses it
within the time to live and another host takes it; a renewal never extends another holder's
lease (a compare-and-set on the value its own take set)."""

from __future__ import annotations

import time

import _fleet_hosts as fleet

from kvnotes.serving.learning.fleet import request_path_settings
from kvnotes.serving.learning.fleet_leases import StoreCompileLeases
from kvnotes.serving.learning.store_gate import FleetStats, StoreGate
from kvnotes.serving.store.redis_store import RedisStore

redis_server = fleet.redis_server  # a redis-server of each test's own
TTL_S = 1.0
JOB = b"\x01\x02"


def leases(url: str, renew_s: float) -> StoreCompileLeases:
    gate = StoreGate(RedisStore.connect(url, settings=request_path_settings()), 0.2,
                     FleetStats())
    return StoreCompileLeases(gate, "m", TTL_S, renew_s=renew_s)


def test_a_live_holder_keeps_its_lease_past_the_time_to_live(redis_server):
    a, b = leases(redis_server.url, 0.2), leases(redis_server.url, 0.2)
    assert a.take(JOB)
    time.sleep(3 * TTL_S)  # renewed every 0.2 s meanwhile
    assert not b.take(JOB)
    assert a.held == 1 and a.lost == 0
    a.give_back(JOB)
    assert b.take(JOB)


def test_a_holder_that_stops_renewing_loses_its_lease_within_the_time_to_live(redis_server):
    dead = leases(redis_server.url, 3600.0)  # its renewing thread never wakes: a killed host
    other = leases(redis_server.url, 0.2)
    assert dead.take(JOB)
    assert not other.take(JOB)
    taken_at = time.monotonic()
    while not other.take(JOB):
        assert time.monotonic() - taken_at < TTL_S + 0.5, "the dead holder's lease stayed"
        time.sleep(0.05)
    # the old holder's renewal finds another's value: it lets go and leaves the lease alone
    probe = redis_server.client()
    key = next(iter(probe.scan_iter("*lease:compile:m:*")))
    assert dead.renew() == 0 and dead.lost == 1 and dead.held == 0
    assert 0 < probe.pttl(key) <= TTL_S * 1000
    time.sleep(2 * TTL_S)
    assert not dead.take(JOB)  # the live holder renewed it
    probe.close()
