"""control.no_spare: shrink end to end with real GPT ranks (tp2 inside each of 2 nodes, dp2, no spare): a node is
killed, the job restarts at dp1 on the node left (same global batch: 4 microbatches a rank instead of 2), from
the newest checkpoint; its losses equal those of `megascale train` started at dp1 from that checkpoint. With a
spare added by `megascale spares`, the next restart (pause, resume) grows the job back to dp2 (started, then
stopped: its training is the configured job's).
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from megascale.cli import main
from megascale.driver.state import JobState, Phase

from control_plane_support import cli, launch

STEPS = 40


def gpt_config(tmp_path: Path, name: str) -> dict:
    return {
        "name": name,
        "model": {"layers": 2, "hidden": 32, "heads": 2, "ffn": 64, "vocab": 64, "seq": 16},
        "parallelism": {"tp": 2, "dp": 2, "sequence_parallel": True},
        "batch": {"micro": 1, "global": 4},
        "optimizer": {"lr": 0.01, "schedule": {"kind": "constant"}},
        "checkpoint": {"uri": f"file://{tmp_path / name / 'ckpt'}", "every": 2, "keep": 100,
                       "keeper_idle_s": 30},
        "cluster": {"nodes": 2, "spares": 0},
        "control": {"heartbeat_s": 0.5, "dead_after_s": 3, "hang_after_s": 30, "selfcheck": False,
                    "no_spare": "shrink", "start_timeout_s": 120, "command_timeout_s": 30},
        "train": {"steps": STEPS, "run_dir": str(tmp_path / name)},
        "logging": {"tensorboard": False},
    }


def losses(metrics_file: Path) -> list[dict]:
    """metrics.jsonl's lines, but one being written."""
    text = metrics_file.read_text() if metrics_file.exists() else ""
    return [json.loads(line) for line in text.split("\n")[:-1]]


def trained_from(metrics_file: Path, restored: int) -> dict[int, float]:
    """Step -> loss of the incarnation that restored step `restored`: its lines begin at the newest step
    `restored` + 1 (the one before may have logged up to that step, or past it) and end where the step goes
    back (the next restart)."""
    lines = losses(metrics_file)
    begin = max((i for i, m in enumerate(lines) if m["step"] == restored + 1), default=len(lines))
    run: dict[int, float] = {}
    for m in lines[begin:]:
        if m["step"] <= max(run, default=restored):
            break
        run[m["step"]] = m["loss"]
    return run


def restored_step(run_dir: Path) -> int | None:
    """The step the newest incarnation of rank 0 restored, as its log says."""
    found = re.findall(r"restored step (\d+)", (run_dir / "rank-0.log").read_text())
    return int(found[-1]) if found else None


def committed(ckpt: Path) -> list[int]:
    return sorted(int(d.name[5:]) for d in ckpt.glob("step-*") if (d / "manifest.json").exists())


@pytest.mark.slow
def test_a_lost_node_shrinks_the_job_to_dp1_on_the_loss_trajectory_of_dp1_and_a_spare_grows_it_back(
        tmp_path, capsys, wait, monkeypatch):
    monkeypatch.delenv("MEGASCALE_RANK_ENTRY", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # every rank here and in the reference run: the same sums
    path = tmp_path / "shrink.yaml"
    path.write_text(yaml.safe_dump(gpt_config(tmp_path, "shrink")))
    job = launch(capsys, str(path), "shrink")
    ckpt = tmp_path / "shrink" / "ckpt"
    wait(lambda: committed(ckpt), 120, "a first checkpoint")

    cli(capsys, "chaos", "shrink", "kill-node", "--node", "n0")
    rec = wait(job.in_state(JobState.RUNNING, incarnation=2), 60, "the restart at dp1")
    assert rec.dp == 1 and [(s.node, s.index) for s in rec.slots("active")] == [("n1", 0)], rec.nodes
    assert "at dp=1 of 2 (control.no_spare=shrink" in job.status()["reason"], job.status()
    cli(capsys, "spares", "shrink", "1")  # taken at the next restart, not before
    wait(lambda: any(n["role"] == "spare" and n["alive"] for n in job.status()["nodes"]), 60, "the spare to report")
    run_dir = Path(job.refresh().run_dir)
    restored = wait(lambda: restored_step(run_dir), 60, "the shrunk job to restore a checkpoint")
    # Taken now: the grown-back incarnation may restore the same checkpoint (memory snapshots of another dp do
    # not fit) and log its steps again, after which the newest run from `restored` + 1 is that one's.
    shrunk = wait(lambda: next((run for run in [trained_from(run_dir / "metrics.jsonl", restored)] if len(run) >= 2),
                               None), 60, "the shrunk job to train")

    cli(capsys, "pause", "shrink")
    wait(job.in_state(JobState.PAUSED, phase=Phase.IDLE), 60, "the ranks to stop")
    cli(capsys, "resume", "shrink")
    rec = wait(job.in_state(JobState.RUNNING, incarnation=3), 60, "the job to grow back to dp2")
    assert rec.dp is None and [(s.node, s.index) for s in rec.slots("active")] == [("n1", 0), ("n2", 1)], rec.nodes
    cli(capsys, "stop", "shrink")  # its nodes stop while the reference trains

    # The same checkpoint, trained at dp1 by `megascale train`.
    reference = gpt_config(tmp_path, "ref")
    shutil.copytree(ckpt / f"step-{restored:08d}", tmp_path / "ref" / "ckpt" / f"step-{restored:08d}")
    reference["parallelism"]["dp"], reference["cluster"] = 1, {"nodes": 1}
    reference["checkpoint"].update(every=0, resume=True)
    reference["control"]["no_spare"], reference["train"]["steps"] = "pause", max(shrunk)
    (tmp_path / "ref.yaml").write_text(yaml.safe_dump(reference))
    assert main(["train", str(tmp_path / "ref.yaml"), "--quiet"]) == 0
    expected = {m["step"]: m["loss"] for m in losses(next((tmp_path / "ref").glob("ref-*/metrics.jsonl")))}
    assert sorted(expected) == sorted(shrunk) and len(shrunk) >= 2, (expected, shrunk)
    for step in shrunk:
        assert shrunk[step] == pytest.approx(expected[step], rel=1e-6, abs=0), step
    wait(job.ended, 60, "the job to stop")
    log = (run_dir / "driver.log").read_text()
    assert "shrunk to dp=1: 1 node short" in log and "grew back to dp=2" in log, log[-3000:]
    job.assert_services_gone()
