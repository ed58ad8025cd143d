"""In-memory snapshots replicated to the next node (checkpoint.memory_every): a lost node's ranks restore
from the replica its successor holds, reading nothing from storage, at a step newer than the last
persisted checkpoint; a replica altered, cut short, stale or rotten is refused and the one held kept; a
snapshot torn by a crash mid-copy is never restored; an interval that would cost more than 2% of a step
is lengthened (a set one is kept), and rank 0 says so with the numbers."""
from __future__ import annotations

import collections
import json
import logging
import os
import re
import signal
import socket
import threading
import time
import mmap
import zlib
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from megascale.checkpoint import Checkpointer, shutdown_keeper
from megascale.checkpoint.keeper import HELLO_WAIT_S, Keeper, Slot
from megascale.checkpoint.memory_snapshots import auto_interval, cost
from megascale.checkpoint.replica import (NONCE, ReplicaError, ReplicaServer, fetch_replica, send_replica,
                                         stat_replica)
from megascale.checkpoint.storage import Storage
from megascale.checkpoint.save_plan import SavePlan
from megascale.launch import run_ranks
from megascale.parallel.topology import single_device_context
from megascale.train import Trainer, checkpoint_parts, layout_of

STEPS = 4  # persisted at 2, in memory at 3, the crash comes during step 4


def on_nodes(*nodes: str):
    """Puts rank r on simulated node nodes[r] (each node its own keeper, as on separate machines)."""
    return lambda rank: os.environ.__setitem__("MEGASCALE_NODE", nodes[rank])


def train_then_crash(ctx, cfg, out: str) -> None:
    trainer = Trainer(cfg, ctx)
    checkpointer = Checkpointer(cfg, ctx, checkpoint_parts(trainer))
    losses = []
    for _ in range(STEPS - 1):
        losses.append(trainer.step().loss)
        checkpointer.after_step(trainer.step_index)
        if trainer.step_index == 2:
            assert checkpointer.flush() == 2  # committed before the next snapshot: the test is deterministic
    checkpointer.memory.settle()  # step 3 is in the peer's keeper
    assert list(checkpointer.memory.taken) == [1, 3]  # none while step 2 persisted from the buffer
    losses.append(trainer.step().loss)  # step 4: the crash comes before its snapshot
    if ctx.rank == 0:
        Path(out).write_text(json.dumps(losses))
    os.kill(os.getpid(), signal.SIGKILL)


def resume(ctx, cfg) -> dict:
    trainer = Trainer(cfg, ctx)
    checkpointer = Checkpointer(cfg, ctx, checkpoint_parts(trainer))
    start = checkpointer.restore()
    losses = [trainer.step().loss for _ in range(start or 0, STEPS)]
    checkpointer.close()
    trainer.close()
    return {"start": start, "losses": losses, "bytes_read": checkpointer.bytes_read,
            "from": checkpointer.restored_from, "fetched": checkpointer.memory.fetched_bytes}


def test_a_lost_node_restores_from_its_successors_replica_without_reading_storage(ckpt_dir, make_job, fs,
                                                                                   monkeypatch):
    cfg = make_job(str(ckpt_dir), {"dp": 2}, steps=STEPS, every=2, memory_every=1)
    out = ckpt_dir.parent / "losses.json"
    try:
        with pytest.raises(RuntimeError, match="without a result"):
            run_ranks(train_then_crash, layout_of(cfg), cfg, str(out), place=on_nodes("n0", "n1"))
        monkeypatch.setenv("MEGASCALE_NODE", "n1")
        assert shutdown_keeper(str(ckpt_dir)) is not None  # node n1 is gone, its memory with it
        Path(f"{ckpt_dir}.reads").unlink(missing_ok=True)
        results = run_ranks(resume, layout_of(cfg), cfg, place=on_nodes("n0", "spare"))  # a spare takes its place
    finally:
        for node in ("n0", "n1", "spare"):
            monkeypatch.setenv("MEGASCALE_NODE", node)
            shutdown_keeper(str(ckpt_dir))
    assert [r["start"] for r in results] == [3, 3]  # newer than committed step 2: one step replayed
    expected = json.loads(out.read_text())
    assert all(r["losses"] == expected[3:] for r in results)
    assert [r["from"] for r in results] == [{"host memory": 1}, {"peer replica": 1}]
    assert results[1]["fetched"] > 0 and all(r["bytes_read"] == 0 for r in results)
    shards = collections.Counter(name for name, _ in fs.reads(ckpt_dir) if name.endswith(".safetensors"))
    assert shards == {}


def train_then_crash_before_a_replica_arrives(ctx, cfg, out: str) -> None:
    """Snapshots steps 1-3 unpersisted; the lost node's (rank 1's) replica of step 3 never reaches the
    next node, as when the node dies with it still on the wire."""
    trainer = Trainer(cfg, ctx)
    checkpointer = Checkpointer(cfg, ctx, checkpoint_parts(trainer))
    losses = []
    for _ in range(STEPS - 1):
        losses.append(trainer.step().loss)
        if ctx.rank == 1 and trainer.step_index == 3:
            checkpointer.memory.peer = None
        checkpointer.after_step(trainer.step_index)
    checkpointer.memory.settle()
    losses.append(trainer.step().loss)
    if ctx.rank == 0:
        Path(out).write_text(json.dumps(losses))
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_node_lost_with_its_newest_replica_in_flight_restores_the_step_before_from_the_keepers_copies(
        ckpt_dir, make_job, fs, monkeypatch):
    cfg = make_job(str(ckpt_dir), {"dp": 2}, steps=STEPS, every=100, memory_every=1)
    out = ckpt_dir.parent / "losses.json"
    try:
        with pytest.raises(RuntimeError, match="without a result"):
            run_ranks(train_then_crash_before_a_replica_arrives, layout_of(cfg), cfg, str(out),
                      place=on_nodes("n0", "n1"))
        monkeypatch.setenv("MEGASCALE_NODE", "n1")
        assert shutdown_keeper(str(ckpt_dir)) is not None
        results = run_ranks(resume, layout_of(cfg), cfg, place=on_nodes("n0", "spare"))
    finally:
        for node in ("n0", "n1", "spare"):
            monkeypatch.setenv("MEGASCALE_NODE", node)
            shutdown_keeper(str(ckpt_dir))
    # Rank 0's buffer holds step 3, the replica of rank 1 only step 2: the copy of step 2 on n0 is common ground.
    assert [r["start"] for r in results] == [2, 2]
    expected = json.loads(out.read_text())
    assert all(r["losses"] == expected[2:] for r in results)
    assert [r["from"] for r in results] == [{"host memory": 1}, {"peer replica": 1}]
    assert all(r["bytes_read"] == 0 for r in results)


def test_a_snapshot_torn_by_a_crash_mid_copy_is_not_restored_but_the_keepers_copy_of_it_is(ckpt_dir, make_job,
                                                                                           caplog):
    cfg = make_job(str(ckpt_dir), steps=3, memory_every=1)
    trainer = Trainer(cfg, single_device_context())
    checkpointer = Checkpointer(cfg, trainer.ctx, checkpoint_parts(trainer))
    for _ in range(2):
        trainer.step()
        checkpointer.after_step(trainer.step_index)
    checkpointer.memory.settle()
    checkpointer.buffer.bytes[-64:] += 1  # the next copy began and was cut short: no `hold` followed
    expected = trainer.step().loss  # step 3, from step 2's state
    checkpointer.close()
    trainer.close()
    trainer = Trainer(cfg, single_device_context())
    checkpointer = Checkpointer(cfg, trainer.ctx, checkpoint_parts(trainer))
    with caplog.at_level(logging.INFO, logger="megascale.checkpoint"):
        assert checkpointer.restore() == 2  # nothing committed: the copy the keeper made when it held step 2
    assert trainer.step().loss == expected
    checkpointer.close()
    assert "in-memory snapshot of step 2 fails its checksum" in caplog.text
    assert checkpointer.restored_from == {"host memory": 1} and checkpointer.bytes_read == 0


def relay(target: str, flip_at: int | None = None, cut_at: int | None = None) -> str:
    """A man in the middle for one connection: flips the byte at `flip_at` of what the client sends, or
    cuts the connection after `cut_at` bytes."""
    listener = socket.create_server(("127.0.0.1", 0))

    def pump(src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        seen = 0
        try:
            while data := bytearray(src.recv(1 << 16)):
                if upstream and flip_at is not None and seen <= flip_at < seen + len(data):
                    data[flip_at - seen] ^= 0x01
                if upstream and cut_at is not None and seen + len(data) > cut_at:
                    dst.sendall(data[:cut_at - seen])
                    break
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):  # shut down first: a close alone leaves the other pump's recv blocked (and no FIN)
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def run() -> None:
        client, _ = listener.accept()
        host, port = target.rsplit(":", 1)
        server = socket.create_connection((host, int(port)))
        threading.Thread(target=pump, args=(server, client, False), daemon=True).start()
        pump(client, server, True)
        listener.close()

    threading.Thread(target=run, daemon=True).start()
    return f"127.0.0.1:{listener.getsockname()[1]}"


def test_a_replica_altered_cut_short_stale_or_rotten_is_refused_and_the_held_one_kept():
    key = os.urandom(32)
    server = ReplicaServer("127.0.0.1", 0, lambda: key)
    record = {"step": 5, "key": "pp0-tp0-dp0", "coords": [0, 0, 0], "length": 8192, "version": 2, "digest": "d"}
    good = bytes(range(256)) * 32
    assert send_replica(server.address, key, 0, record, memoryview(good)) == zlib.crc32(good)
    newer = {**record, "step": 6}
    for address, sender_key in [(server.address, os.urandom(32)),  # a stranger's
                                (relay(server.address, flip_at=4000), key),  # altered in transit
                                (relay(server.address, cut_at=4000), key)]:  # cut short
        with pytest.raises(ReplicaError):
            send_replica(address, sender_key, 0, newer, memoryview(good))
    assert stat_replica(server.address, key, 0)["step"] == 5
    with pytest.raises(ReplicaError, match="no replica of rank 0 at step 6"):  # stale: not the step asked for
        fetch_replica(server.address, key, 0, 6, lambda n: memoryview(bytearray(n)))
    held = bytearray(8192)
    assert fetch_replica(server.address, key, 0, 5, lambda n: memoryview(held))["crc32"] == zlib.crc32(good)
    assert bytes(held) == good
    server.replicas[0].view[100] ^= 0x01  # bit rot in the holder's memory
    with pytest.raises(ReplicaError, match="fails its checksum"):
        fetch_replica(server.address, key, 0, 5, lambda n: memoryview(bytearray(n)))


def test_the_interval_is_the_smallest_within_2_percent_of_a_step():
    assert auto_interval(0.41, 0.03, 0.0) == 4 and round(cost(1, 0.41, 0.03, 0.0), 3) == 0.073
    assert auto_interval(0.41, 0.005, 0.0) == 1
    assert auto_interval(0.1, 0.0001, 0.35) == 4  # the keeper needs 3.5 steps to send one


@pytest.mark.parametrize("memory_every", [None, 1])
def test_a_snapshot_costing_over_2_percent_lengthens_an_unset_interval_and_says_so(
        memory_every, ckpt_dir, make_job, monkeypatch, caplog):
    write = SavePlan.write

    def slow_write(self, *args) -> None:  # a copy far slower than a tiny model's step, on any machine
        time.sleep(0.1)
        write(self, *args)

    monkeypatch.setattr(SavePlan, "write", slow_write)
    cfg = make_job(str(ckpt_dir), steps=8, memory_every=memory_every)
    trainer = Trainer(cfg, single_device_context())
    checkpointer = Checkpointer(cfg, trainer.ctx, checkpoint_parts(trainer))
    with caplog.at_level(logging.INFO, logger="megascale.checkpoint"):
        for _ in range(8 if memory_every is None else 5):
            trainer.step()
            checkpointer.after_step(trainer.step_index)
    checkpointer.close()
    if memory_every is None:  # measured on steps 4-6, after 3 steps of warm-up
        found = re.search(r"checkpoint.memory_every: 1 would cost ([\d.]+)% of a ([\d.e-]+) s step; using (\d+)",
                          caplog.text)
        assert found and float(found[1]) > 2 and int(found[3]) > 1, caplog.text
        every = checkpointer.memory.every
        assert every == int(found[3]) and list(checkpointer.memory.taken)[:6] == [1, 2, 3, 4, 5, 6]
        assert all(step % every == 0 for step in list(checkpointer.memory.taken)[6:])
    else:  # set by the user: kept, with a warning
        assert re.search(r"checkpoint.memory_every: 1 costs [\d.]+% of a [\d.e-]+ s step, over the 2% budget "
                         r"\(\d+ would be within it\); kept as set", caplog.text), caplog.text
        assert list(checkpointer.memory.taken) == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("frozen_at", ["reading", "accepting"])
def test_a_restarted_ranks_hello_cuts_short_a_replica_send_to_a_frozen_peer(frozen_at, tmp_path):
    """A frozen next node: the send of the replica blocks, holding the buffer, either once the socket buffers fill
    (the peer froze after it took the connection and sent its nonce) or at once (it froze before: its kernel
    accepts the connection, its nonce never comes; 53 s of a restart in `bench recovery --real`). A rank
    restarting meanwhile gets its snapshot within seconds, not after the send's 60 s timeout; the snapshot still
    counts on this node."""
    frozen = socket.create_server(("127.0.0.1", 0))
    accepted = []

    def accept_and_stop_reading() -> None:
        conn, _ = frozen.accept()
        accepted.append(conn)  # kept open: a frozen process's sockets stay
        conn.sendall(os.urandom(NONCE))

    if frozen_at == "reading":
        threading.Thread(target=accept_and_stop_reading, daemon=True).start()
    keeper = Keeper(Storage(pafs.LocalFileSystem(), str(tmp_path), f"file://{tmp_path}"), "unused", idle_s=60)
    keeper.replica_key = os.urandom(32)
    size = 64 << 20  # far more than the kernel buffers a stopped reader
    fd = os.memfd_create("snapshot")
    os.ftruncate(fd, size)
    keeper.slots[0] = slot = Slot(fd, size, mmap.mmap(fd, size, prot=mmap.PROT_READ))
    hold = {"op": "hold", "rank": 0, "step": 7, "key": "pp0-tp0-dp0", "coords": [0, 0, 0], "length": size,
            "version": 2, "digest": "d", "peer": f"127.0.0.1:{frozen.getsockname()[1]}"}
    held = []
    threading.Thread(target=lambda: held.append(keeper._handle(hold, [])[0]), daemon=True).start()
    deadline = time.monotonic() + 10
    while slot.sending is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert slot.sending is not None, "the replica send never started"
    started = time.monotonic()
    reply, fds = keeper._handle({"op": "hello", "rank": 0}, [])
    assert time.monotonic() - started < HELLO_WAIT_S + 3 and fds[0] == fd
    assert reply["snapshot"]["step"] == 7 and reply["snapshot"]["state"] == "held", reply
    assert [c["step"] for c in reply["copies"]] == [7] and len(fds) == 2  # the keeper's copy of it, in its memfd
    assert held and held[0]["replicated"] is None and held[0]["error"], held  # cut short: not replicated
    frozen.close()


def test_a_nodes_ranks_asking_at_once_get_one_replica_server(tmp_path, monkeypatch):
    """Every rank of a node hands its keeper the replica key at the same moment (an incarnation's start), each
    on its own connection's thread. They must all get the one server's address: with one server each, the ring
    of keepers ran through a node's own servers and a lost node took its replicas with it."""
    import megascale.checkpoint.keeper as keeper_module

    class SlowToStart(ReplicaServer):  # widens the window a real start leaves open
        def __init__(self, *args):
            time.sleep(0.05)
            super().__init__(*args)

    monkeypatch.setattr(keeper_module, "ReplicaServer", SlowToStart)
    keeper = Keeper(Storage(pafs.LocalFileSystem(), str(tmp_path), f"file://{tmp_path}"), "unused", idle_s=60)
    replies: list[dict] = []
    listen = {"op": "listen", "bind": "127.0.0.1", "port": 0, "key": os.urandom(32).hex()}
    ranks = [threading.Thread(target=lambda rank=rank: replies.append(keeper._handle({**listen, "rank": rank}, [])[0]))
             for rank in range(8)]
    for thread in ranks:
        thread.start()
    for thread in ranks:
        thread.join()
    assert {reply["address"] for reply in replies} == {keeper.replicas.address}, replies
