"""A real GPT job whose rank is killed (kill -9) recovers on the uninterrupted loss trajectory, with the
surviving ranks restarted in their own processes (control.restart: in_process, the default) or as new
processes (control.restart: process); the killed rank starts again in its node's warm standby process
(control.standby_ranks, executor/standby.py).

Real Redis, tansu, driver, executors and GPT ranks: tp2 inside each of 2 nodes, dp2 across them, a
checkpoint every 4 steps. The losses of every step (a replayed step at its latest value) equal those of
an uninterrupted `megascale train` of the same job (fp32, CPU; 1e-5 relative: thread counts may differ).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from megascale.cli import main
from megascale.driver.chaos import rank_procs, standby_pids
from megascale.driver.state import JobState

from control_plane_support import cli, launch

STEPS = 40
MODEL = {"layers": 2, "hidden": 32, "heads": 2, "ffn": 64, "vocab": 64, "seq": 16}


def job_config(tmp_path: Path, name: str, restart: str | None = None) -> str:
    config = {
        "name": name, "model": MODEL,
        "parallelism": {"tp": 2, "dp": 2, "sequence_parallel": True},
        "batch": {"micro": 1, "global": 4},
        "optimizer": {"lr": 0.01, "schedule": {"kind": "constant"}},
        "checkpoint": {"uri": f"file://{tmp_path / name / 'ckpt'}", "every": 4},
        "logging": {"tensorboard": False},
        "train": {"steps": STEPS, "run_dir": str(tmp_path / name)},
    }
    if restart:
        config["cluster"] = {"nodes": 2, "spares": 0}
        config["control"] = {"heartbeat_s": 0.5, "selfcheck": False, "start_timeout_s": 120, "command_timeout_s": 30,
                             "restart": restart}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def losses(metrics_file: Path) -> dict[int, float]:
    """Step -> loss; a step replayed after a restart keeps its latest value."""
    return {m["step"]: m["loss"] for m in map(json.loads, metrics_file.read_text().splitlines())}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, float]:
    tmp_path = tmp_path_factory.mktemp("reference")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MEGASCALE_RANK_ENTRY", raising=False)
        assert main(["train", job_config(tmp_path, "ref"), "--quiet"]) == 0
    (metrics,) = (tmp_path / "ref").glob("ref-*/metrics.jsonl")
    return losses(metrics)


@pytest.mark.slow
@pytest.mark.parametrize("restart", ["in_process", "process"])
def test_a_killed_rank_recovers_on_the_uninterrupted_trajectory(restart, uninterrupted, tmp_path, capsys, wait,
                                                                monkeypatch):
    monkeypatch.delenv("MEGASCALE_RANK_ENTRY", raising=False)
    job = launch(capsys, job_config(tmp_path, "gpt-ip", restart), "gpt-ip")
    pids = lambda: {node: [p.pid for p in rank_procs(job.store, node)] for node in ("n0", "n1")}  # noqa: E731
    wait(lambda: (job.status().get("step") or 0) >= 6, 120, "training to pass step 6")
    (warm,) = wait(lambda: standby_pids(job.store, "n1"), 60, "n1's standby process")
    before = pids()
    cli(capsys, "chaos", "gpt-ip", "kill-rank", "--node", "n1", "--rank", "3")
    wait(lambda: job.status().get("incarnation") == 2 and job.state() == JobState.RUNNING, 120,
         "the restart after the killed rank")
    # A standby is a rank once it has read its order (its log is then the rank's).
    after = wait(lambda: next((found for found in [pids()] if all(len(r) == 2 for r in found.values())), None), 30,
                 "every node's two ranks")

    final = wait(job.ended, 120, "the job to finish")
    assert final["state"] == JobState.SUCCEEDED.value and final["step"] == STEPS, final
    (recovery,) = final["recoveries"]
    # In-memory snapshots (on by default) restore no older a step than the persisted checkpoint every 4 would
    assert recovery["kind"] == "rank_failed" and recovery["step"] - recovery["restored_step"] <= 4, recovery
    if restart == "in_process":  # rank 3, killed, is the only new process
        assert after["n0"] == before["n0"] and after["n1"][0] == before["n1"][0], (before, after)
        assert after["n1"][1] == warm, (before, after, warm)  # the standby became rank 3
        # The surviving ranks restored into the model and optimizer they kept (KeptTrainer); rank 3 built one.
        run_dir = Path(job.refresh().run_dir)
        kept = [rank for rank in range(4)
                if "kept from the last incarnation" in (run_dir / f"rank-{rank}.log").read_text()]
        assert kept == [0, 1, 2], kept
    else:
        assert not set(before["n0"] + before["n1"]) & set(after["n0"] + after["n1"]), (before, after)
        assert warm in after["n1"], (after, warm)  # one of n1's new ranks
    recovered = losses(Path(job.refresh().run_dir) / "metrics.jsonl")
    assert sorted(recovered) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert recovered[step] == pytest.approx(uninterrupted[step], rel=1e-5), step
    job.assert_services_gone()
