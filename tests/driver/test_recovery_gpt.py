"""A real GPT job recovers from a killed rank and continues exactly where an uninterrupted run goes.

Real Redis, tansu, driver, executors and GPT ranks (tp2 inside each node, dp2 across 2 nodes),
checkpoint every 4 steps. After `megascale chaos kill-rank`, every rank restarts from the newest
committed checkpoint; the losses from the restored step on equal those of an uninterrupted
`megascale train` of the same job (fp32, CPU; 1e-5 relative: the two runs may use different
thread counts per rank).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from megascale.cli import main
from megascale.driver.state import JobState

from .test_control_plane import cli, launch

STEPS = 40


def gpt_job(tmp_path: Path, name: str, cluster: bool) -> str:
    config = {
        "name": name,
        "model": {"layers": 2, "hidden": 32, "heads": 2, "ffn": 64, "vocab": 64, "seq": 16},
        "parallelism": {"tp": 2, "dp": 2, "sequence_parallel": True},
        "batch": {"micro": 1, "global": 4},
        "optimizer": {"lr": 0.01, "schedule": {"kind": "constant"}},
        "checkpoint": {"uri": f"file://{tmp_path / name / 'ckpt'}", "every": 4, "keeper_idle_s": 30},
        "train": {"steps": STEPS, "run_dir": str(tmp_path / name)},
    }
    if cluster:
        config["cluster"] = {"nodes": 2, "spares": 1}
        config["control"] = {"heartbeat_s": 0.5, "dead_after_s": 3, "hang_after_s": 20, "selfcheck": False,
                             "start_timeout_s": 120, "command_timeout_s": 30}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def losses(metrics_file: Path) -> dict[int, float]:
    """Step -> loss; a step replayed after a restart keeps its latest value."""
    return {m["step"]: m["loss"] for m in map(json.loads, metrics_file.read_text().splitlines())}


@pytest.mark.slow
def test_killed_rank_restart_continues_the_uninterrupted_loss_trajectory(tmp_path, capsys, wait, monkeypatch):
    monkeypatch.delenv("MEGASCALE_RANK_ENTRY", raising=False)
    assert main(["train", gpt_job(tmp_path, "gpt-ref", cluster=False), "--quiet"]) == 0
    (reference_file,) = (tmp_path / "gpt-ref").glob("gpt-ref-*/metrics.jsonl")
    reference = losses(reference_file)

    job = launch(capsys, gpt_job(tmp_path, "gpt-rc", cluster=True), "gpt-rc")
    wait(lambda: (job.status().get("step") or 0) >= 6, 120, "training past the step-4 checkpoint")
    cli(capsys, "chaos", "gpt-rc", "kill-rank", "--node", "n1")
    final = wait(job.ended, 180, "the job to recover and finish")
    assert final["state"] == JobState.SUCCEEDED.value and final["step"] == STEPS, final
    assert final["recoveries"] and final["recoveries"][0]["kind"] == "rank_failed", final["recoveries"]

    recovered = losses(Path(job.refresh().run_dir) / "metrics.jsonl")
    assert sorted(recovered) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert recovered[step] == pytest.approx(reference[step], rel=1e-5), step
    job.assert_services_gone()
