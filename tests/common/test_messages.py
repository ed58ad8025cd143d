"""The wire schema: round trips, and one-line rejection of anything else."""
from __future__ import annotations

import json

import pytest

from megascale.common import typed
from megascale.common.messages import (
    KINDS,
    SCHEMA_VERSION,
    Ack,
    Command,
    ErrorLine,
    Event,
    Heartbeat,
    MessageError,
    Metric,
    RankStatus,
    Timings,
    WrongKind,
    decode,
    encode,
)

TIMING = {"step": 5, "rank": 3, "tp": 1, "pp": 0, "dp": 1, "start": 10.0, "total": 0.05,
          "segments": {"forward": 0.02, "backward": 0.02, "exposed_dp": 0.001}}


def heartbeat(**over) -> Heartbeat:
    base = dict(job="j", node="n0", host="h", ip="10.0.0.1", boot_id="b1", seq=3, time=1.5, interval_s=5.0,
                phase="running", incarnation=2, step=7, loss=2.5,
                ranks=[RankStatus(rank=0, local_rank=0, state="running", pid=11, step=7, loss=2.5)],
                errors=[ErrorLine(rank=0, kind="oom", line="CUDA out of memory", time=1.0)])
    return Heartbeat(**{**base, **over})


MESSAGES = [
    heartbeat(),
    Metric(job="j", node="n0", rank=3, incarnation=1, step=1, loss=1.0, step_time=0.1, tokens_per_s=10.0, time=2.0),
    Event(job="j", type="state", message="Pending -> Initializing", state="Initializing", detail={"a": 1}),
    Command(job="j", node="n1", seq=4, op="start", args={"ranks": [2, 3]}),
    Ack(job="j", node="n1", seq=4, op="start", ok=True, detail="started"),
    Timings(job="j", node="n1", time=3.0, incarnation=2, dropped=1, records=[TIMING]),
]


@pytest.mark.parametrize("msg", MESSAGES)
def test_round_trip(msg):
    raw = encode(msg)
    obj = json.loads(raw)
    assert obj["v"] == SCHEMA_VERSION and obj["kind"] == msg.kind
    assert decode(raw) == msg


def test_unknown_fields_are_ignored_for_forward_compatibility():
    obj = json.loads(encode(heartbeat()))
    obj["gpu_temperature"] = 71
    obj["ranks"][0]["nvlink"] = "ok"
    assert decode(json.dumps(obj)) == heartbeat()


def mutate(**changes) -> bytes:
    obj = json.loads(encode(heartbeat()))
    for key, value in changes.items():
        if value is None:
            del obj[key]
        else:
            obj[key] = value
    return json.dumps(obj).encode()


@pytest.mark.parametrize("raw, message", [
    (b"\xff\xfe", "not JSON"),
    (b"hello", "not JSON"),
    (b"[1, 2]", "a JSON list, not an object"),
    (b'{"kind": "heartbeat"}', "no schema version 'v'"),
    (b'{"v": 99, "kind": "heartbeat"}', "schema v99 is newer than this reader's v1"),
    (b'{"v": 1, "kind": "gossip"}', "unknown kind 'gossip'"),
    (mutate(node=None), "heartbeat: missing field 'node'"),
    (mutate(seq="3"), "heartbeat.seq='3': expected int"),
    (mutate(seq=True), "heartbeat.seq='True': expected int"),
    (mutate(phase="dancing"), "heartbeat.phase='dancing': not one of idle, running"),
    (mutate(ranks=[{"rank": 0, "local_rank": 0, "state": "zombie"}]), "heartbeat.ranks[0].state='zombie'"),
    (mutate(metrics=[]), "heartbeat.metrics: expected an object"),
])
def test_malformed_records_raise_one_line(raw, message):
    with pytest.raises(MessageError) as info:
        decode(raw)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_expect_rejects_other_kinds():
    with pytest.raises(MessageError, match="a metric, expected a heartbeat"):
        decode(encode(Metric(job="j", node="n", rank=0, incarnation=1, step=1, loss=1.0, step_time=1.0,
                             tokens_per_s=1.0, time=0.0)), expect=Heartbeat)


def test_timings_round_trip_defaults_and_kind_check():
    raw = json.dumps({"v": 1, "kind": "timings", "job": "j", "node": "n0", "time": 1, "records": [TIMING]})
    batch = decode(raw, expect=Timings)
    assert (batch.incarnation, batch.dropped, batch.time, batch.records) == (None, 0, 1.0, [TIMING])
    with pytest.raises(MessageError, match=r"timings.records\[0\]='5': expected dict"):
        decode(raw.replace(json.dumps([TIMING]), "[5]"))
    with pytest.raises(WrongKind):  # the metrics topic carries both kinds: readers skip the other one
        decode(encode(batch), expect=Metric)


CANDIDATES = [0, 7, -1, 2.5, True, None, "running", "x", [], {}, {"a": 1}, [{"rank": 0}], float("nan"), 10**30]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: m.kind)
def test_fast_decode_agrees_with_the_typed_reader(msg):
    """`decode` reads valid records with msgspec; every field set to every candidate value must give what
    typed.read gives on the same JSON: the same object (and value types), or a refusal."""
    kind, base = msg.kind, json.loads(encode(msg))
    fields = [([k], v) for k, v in base.items() if k not in ("v", "kind")]
    if kind == "heartbeat":
        fields += [(["ranks", 0, k], v) for k, v in base["ranks"][0].items()]
    for path, _ in fields:
        for value in CANDIDATES:
            obj = json.loads(json.dumps(base))
            *parents, last = path
            target = obj
            for p in parents:
                target = target[p]
            target[last] = value
            raw = json.dumps(obj).encode()  # NaN as the NaN token, which json.loads takes
            try:
                expected = repr(typed.read(KINDS[kind], json.loads(raw)))
            except typed.Invalid:
                expected = "refused"
            try:
                got = repr(decode(raw))
            except MessageError:
                got = "refused"
            assert got == expected, (kind, path, value)
