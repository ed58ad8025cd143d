"""A real GPT job survives every kind of fault in a row and ends on the uninterrupted loss trajectory.

Real Redis, tansu, driver, executors and GPT ranks (tp2 inside each node, dp2 across 2 nodes,
spare 1), a checkpoint every 4 steps on storage that can be made slow (tests/checkpoint/fsutil.py).
Faults, injected with `megascale chaos` as a user would:

1. a rank is killed while the keepers persist a checkpoint: the restart commits that checkpoint
   and restores it from host memory (no step lost beyond it);
2. a node freezes (heartbeats stop): declared dead after control.dead_after_s, evicted, the spare
   takes its place and reads its shards from storage (its keeper went with the node);
3. a rank is stopped (SIGSTOP) on a node whose self-check will fail: the hang is localised to it,
   the self-checks of it and its group peers evict it and keep the peer, a spare replaces it;
4. while the job is paused, every shard of the newest checkpoint is corrupted and a node is
   killed: on resume the node is replaced, and the restore sees the checksums fail and falls back
   to the checkpoint before.

Self-checks (GEMM) run before every restart, on the suspects and their group peers.

The losses of every step, replayed steps at their latest value, equal those of an uninterrupted
`megascale train` of the same job (fp32, CPU; 1e-5 relative: the two runs may use different
thread counts per rank).
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import yaml

from megascale.cli import main
from megascale.driver.state import JobState, Phase

from control_plane_support import cli, launch

STEPS = 96  # room for the steps a frozen node's ranks train on before it is declared dead
SLOW_FS = "instrumented"  # tests/checkpoint/fsutil.py, installed as a file system plugin by `slow_fs`


@pytest.fixture(autouse=True)
def slow_fs(tmp_path, monkeypatch):
    """The instrumented file system as the plugin SLOW_FS, here and in every process of the job."""
    spec = importlib.util.spec_from_file_location("megascale_test_fsutil", Path(__file__).parents[2] / "checkpoint"
                                                  / "fsutil.py")
    fsutil = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fsutil)
    directory = fsutil.register(tmp_path / "plugins")
    monkeypatch.syspath_prepend(str(directory))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(directory), os.environ.get("PYTHONPATH")])))


def gpt_job(tmp_path: Path, name: str, cluster: bool) -> str:
    config = {
        "name": name,
        "model": {"layers": 2, "hidden": 32, "heads": 2, "ffn": 64, "vocab": 64, "seq": 16},
        "parallelism": {"tp": 2, "dp": 2, "sequence_parallel": True},
        "batch": {"micro": 1, "global": 4},
        "optimizer": {"lr": 0.01, "schedule": {"kind": "constant"}},
        "checkpoint": {"uri": f"file://{tmp_path / name / 'ckpt'}", "every": 4, "keeper_idle_s": 30,
                       "filesystem": SLOW_FS, "memory_every": 0},  # persisted paths; snapshots: test_memory_snapshots
        "train": {"steps": STEPS, "run_dir": str(tmp_path / name)},
    }
    if cluster:
        config["cluster"] = {"nodes": 2, "spares": 1}
        config["control"] = {"heartbeat_s": 0.5, "dead_after_s": 3, "hang_after_s": 6, "selfcheck": True,
                             "selfcheck_budget_s": 10,
                             "max_restarts": 5, "start_timeout_s": 120, "command_timeout_s": 30}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def losses(metrics_file: Path) -> dict[int, float]:
    """Step -> loss; a step replayed after a restart keeps its latest value."""
    return {m["step"]: m["loss"] for m in map(json.loads, metrics_file.read_text().splitlines())}


def persisting(ckpt: Path, besides: frozenset[str] = frozenset()) -> int | None:
    """The step of a checkpoint whose 4 shard files are being written (none committed yet), among
    the step directories not in `besides`."""
    for directory in ckpt.glob("step-*"):
        if directory.name in besides:
            continue
        if len(list(directory.glob("*.safetensors"))) == 4 and not (directory / "manifest.json").exists():
            return int(directory.name[5:])
    return None


def rank_logs(run_dir: Path) -> str:
    """Every rank's training log (rank-<R>.log, appended by each incarnation)."""
    return "".join(p.read_text() for p in sorted(run_dir.glob("rank-*.log")))


def last_restore(run_dir: Path, rank: int) -> str:
    """What the newest incarnation of `rank` restored, as its log says."""
    return [line for line in (run_dir / f"rank-{rank}.log").read_text().splitlines() if "restored step" in line][-1]


@pytest.mark.slow
def test_every_fault_kind_in_a_row_ends_on_the_uninterrupted_loss_trajectory(tmp_path, capsys, wait, monkeypatch):
    monkeypatch.delenv("MEGASCALE_RANK_ENTRY", raising=False)
    monkeypatch.setenv("MEGASCALE_DIAG_ALLOW_FAULTS", "1")  # executors honour `chaos slow`
    assert main(["train", gpt_job(tmp_path, "gpt-ref", cluster=False), "--quiet"]) == 0
    (reference_file,) = (tmp_path / "gpt-ref").glob("gpt-ref-*/metrics.jsonl")
    reference = losses(reference_file)

    job = launch(capsys, gpt_job(tmp_path, "gpt-rc", cluster=True), "gpt-rc")
    ckpt = tmp_path / "gpt-rc" / "ckpt"
    options = Path(f"{ckpt}.fs.json")  # read by the keepers on every write
    step = lambda: job.status().get("step") or 0  # noqa: E731

    def two_more_steps():
        """Each fault comes two steps after the last recovery, wherever that left training."""
        start = step()
        return lambda: step() >= start + 2

    recovered = lambda n: lambda: len(job.status().get("recoveries", [])) == n  # noqa: E731

    # 1. A rank dies while every keeper is still writing a checkpoint.
    wait(lambda: step() >= 2, 120, "training to start")
    options.write_text(json.dumps({"delay_s": 3}))
    # A checkpoint begun after that write is slow for sure; one begun before may already be committed.
    begun = frozenset(d.name for d in ckpt.glob("step-*"))
    target = wait(lambda: persisting(ckpt, begun), 60, "a checkpoint with all 4 shards being written")
    cli(capsys, "chaos", "gpt-rc", "kill-rank", "--node", "n1")
    options.write_text("{}")
    wait(recovered(1), 120, "recovery from the killed rank")
    run_dir = Path(job.refresh().run_dir)
    logs = rank_logs(run_dir)
    assert f"checkpoint step {target} was persisted by every keeper but not committed" in logs
    assert logs.count(f"restored step {target} (shards from host memory: 1)") == 4, logs[-3000:]

    # 2. Node n0 freezes: heartbeat timeout, eviction, spare n2 takes position 0 and reads storage.
    wait(two_more_steps(), 120, "training to go on")
    cli(capsys, "chaos", "gpt-rc", "freeze-node", "--node", "n0")
    wait(recovered(2), 120, "recovery from the frozen node")
    rec = job.store.load()
    assert rec.slot("n0").role == "evicted" and rec.slot("n2").role == "active", rec.nodes
    # Ranks 0 and 1 now run on n2, whose keeper holds nothing. (n1's may hold a newer, uncommitted
    # snapshot: n0's ranks trained on while frozen, so which source n1 uses depends on timing.)
    assert "(shards from storage: 1)" in last_restore(run_dir, 0) and "storage" in last_restore(run_dir, 1)

    # 3. A rank of n1 stops, and n1's next self-check fails: hang localised, n1 evicted, n2 (its peer) kept.
    wait(two_more_steps(), 120, "training to go on")
    cli(capsys, "chaos", "gpt-rc", "slow", "--node", "n1")
    cli(capsys, "chaos", "gpt-rc", "hang", "--node", "n1", "--rank", "3")
    wait(recovered(3), 120, "recovery from the hang")
    rec = job.store.load()
    assert rec.recovery.fault.node == "n1" and rec.slot("n1").role == "evicted" and rec.slot("n3").role == "active"
    log = (run_dir / "driver.log").read_text()
    assert "self-check of n1 (gemm); self-check of n2 beside the new ranks" in log
    assert "evicted n1 (self-check failed: gemm.flops)" in log
    wait(lambda: "n2 passed its background self-check: kept" in (run_dir / "driver.log").read_text(), 60,
         "n2's self-check beside the new ranks")

    # 4. While the job is paused, the newest checkpoint is corrupted and a node dies; on resume the
    #    node is replaced and the restore sees the checksums fail and falls back one checkpoint.
    advanced = two_more_steps()
    wait(lambda: advanced() and job.state() == JobState.RUNNING, 120, "training to go on")
    cli(capsys, "pause", "gpt-rc")
    wait(job.in_state(JobState.PAUSED, phase=Phase.IDLE), 60, "the ranks to stop")
    corrupted = cli(capsys, "chaos", "gpt-rc", "corrupt-checkpoint")
    bad_step = int(corrupted.split("checkpoint step ")[1].split()[0])
    cli(capsys, "chaos", "gpt-rc", "kill-node", "--node", "n3")
    cli(capsys, "resume", "gpt-rc")

    final = wait(job.ended, 180, "the job to resume on a replacement node and finish")
    assert final["state"] == JobState.SUCCEEDED.value and final["step"] == STEPS, final
    assert final["incarnation"] == 5 and {n["node"]: n["role"] for n in final["nodes"]}["n3"] == "evicted", final
    assert f"checkpoint step {bad_step} cannot be restored; falling back" in rank_logs(run_dir)
    assert f"restored step {bad_step - 4} " in last_restore(run_dir, 2)
    kinds = [r["kind"] for r in final["recoveries"]]
    assert kinds == ["rank_failed", "node_dead", "hang"], final["recoveries"]
    assert final["recoveries"][0]["restored_step"] == target, final["recoveries"]

    recovered_losses = losses(run_dir / "metrics.jsonl")
    assert sorted(recovered_losses) == list(range(1, STEPS + 1))
    for s in range(1, STEPS + 1):
        assert recovered_losses[s] == pytest.approx(reference[s], rel=1e-5), s
    job.assert_services_gone()


@pytest.mark.slow
def test_training_blocked_on_a_slow_checkpoint_persist_is_not_a_hang(tmp_path, capsys, wait, monkeypatch):
    """Storage slower than checkpoint.every: each save waits for the previous persist longer than
    hang_after_s. The ranks say so in their heartbeats and the driver waits (up to
    checkpoint.persist_timeout_s) instead of restarting a healthy job."""
    monkeypatch.delenv("MEGASCALE_RANK_ENTRY", raising=False)
    path = Path(gpt_job(tmp_path, "gpt-slowfs", cluster=True))
    config = yaml.safe_load(path.read_text())
    config["checkpoint"].update(every=2, persist_timeout_s=60)
    config["control"].update(hang_after_s=2, selfcheck=False)
    config["train"]["steps"] = 8
    path.write_text(yaml.safe_dump(config))
    (tmp_path / "gpt-slowfs").mkdir()
    Path(f"{tmp_path / 'gpt-slowfs' / 'ckpt'}.fs.json").write_text(json.dumps({"delay_s": 3}))

    job = launch(capsys, str(path), "gpt-slowfs")
    waiting = wait(lambda: [n["waiting"] for n in job.status().get("nodes", []) if n.get("waiting")], 90,
                   "`megascale status` to show a node waiting for a checkpoint")
    assert "to persist (" in waiting[0] and waiting[0].startswith("checkpoint step "), waiting
    final = wait(job.ended, 180, "the job to finish")
    assert final["state"] == JobState.SUCCEEDED.value and final["step"] == 8, final
    assert final["recoveries"] == [] and final["restarts"] == 0, final
    log = (Path(job.handle.run_dir) / "driver.log").read_text()
    assert "training waits for checkpoint step 2 to persist on n" in log, log[-2000:]
    assert "not a hang until checkpoint.persist_timeout_s=60 s" in log
    job.assert_services_gone()
