"""The job state machine and its durable record in (real) Redis."""
from __future__ import annotations

import time

import pytest
import redis

from megascale.driver.state import (TERMINAL, TRANSITIONS, JobRecord, JobState, JobStore, NodeSlot, Phase,
                                    TransitionError)
from megascale.common.messages import Ack, acks_key, command_stream, decode, encode


def test_every_state_is_reachable_and_terminal_states_are_final():
    reachable, todo = {JobState.PENDING}, [JobState.PENDING]
    while todo:
        for nxt in TRANSITIONS[todo.pop()] - reachable:
            reachable.add(nxt)
            todo.append(nxt)
    assert reachable == set(JobState)
    assert all(not TRANSITIONS[s] for s in TERMINAL)
    assert all({JobState.FAILED, JobState.STOPPED} <= TRANSITIONS[s] for s in set(JobState) - TERMINAL)


def test_record_moves_only_along_transitions_and_round_trips():
    rec = JobRecord(job="j", config={"name": "j"}, run_dir="/tmp/x", nodes=[NodeSlot("n0", "active", 0)])
    rec.phase, rec.waiting = Phase.START, {"n0": 3}
    assert rec.move(JobState.INITIALIZING, "go") == JobState.PENDING
    assert (rec.phase, rec.waiting) == (Phase.IDLE, {})  # a new state waits on nothing yet
    with pytest.raises(TransitionError):
        rec.move(JobState.SUCCEEDED)
    assert JobRecord.from_json(rec.to_json()) == rec


@pytest.fixture
def store(redis_server):
    return JobStore(redis.Redis.from_url(redis_server.url), "j")


def test_submit_adopts_a_live_job_and_replaces_an_ended_one(store):
    _, new = store.submit(JobRecord(job="j", config={}, run_dir="/a"))
    assert new
    store.set_desired("paused")
    again, new = store.submit(JobRecord(job="j", config={}, run_dir="/b"))
    assert not new and again.run_dir == "/a"
    again.move(JobState.FAILED, "boom")
    store.save(again)
    _, new = store.submit(JobRecord(job="j", config={}, run_dir="/c"))
    assert new and store.load().run_dir == "/c" and store.desired() == "running"


def test_requests_and_commands(store):
    store.request_evict("n1")
    store.request_evict("n1")
    assert store.evict_requests() == ["n1"]
    store.done_evict("n1")
    assert store.evict_requests() == []
    assert [store.send("n0", "stop"), store.send("n0", "exit"), store.send("n1", "stop")] == [1, 2, 1]
    entries = store.r.xrange(command_stream("j", "n0"))
    assert [decode(fields[b"msg"]).op for _, fields in entries] == ["stop", "exit"]
    store.r.hset(acks_key("j"), "n0", encode(Ack(job="j", node="n0", seq=2, op="exit", ok=True)))
    store.r.hset(acks_key("j"), "n9", b"garbage")
    assert {n: a.seq for n, a in store.acks().items()} == {"n0": 2}


def test_one_driver_holds_the_lease_until_it_lapses(store):
    assert store.acquire_lease("a", 0.3)
    assert store.acquire_lease("a", 0.3)  # renewal
    assert not store.acquire_lease("b", 0.3)
    time.sleep(0.4)
    assert store.acquire_lease("b", 0.3) and store.lease_holder() == "b"
    store.release_lease("a")  # not a's any more: no effect
    assert store.lease_holder() == "b"


def test_an_unchanged_record_is_not_written_again_but_one_a_restarted_redis_lost_is(store):
    """Most driver passes change nothing: the record goes to Redis (and its append-only file) only when it differs
    from what Redis holds, as last read or written; a write Redis lost is made again after the next read."""
    def writes() -> int:
        return store.r.info("commandstats").get("cmdstat_set", {}).get("calls", 0)

    store.submit(JobRecord(job="j", config={}, run_dir="/a"))
    rec, before = store.load(), writes()
    store.save(rec)
    store.save(rec)
    assert writes() == before  # the bytes it read
    rec.restarts = 1
    store.save(rec)
    store.save(rec)
    assert writes() == before + 1 and store.load().restarts == 1
    store.r.set(store.k_record, JobRecord(job="j", config={}, run_dir="/a").to_json())  # a restart lost the write
    assert store.load().restarts == 0
    store.save(rec)
    assert store.load().restarts == 1
