"""The newest validation (eval.every) in `megascale status`, the job list and a run directory's status."""
from __future__ import annotations

import json

import yaml
from rich.console import Console

from megascale.driver.display import headline, jobs_table
from megascale.driver.metrics.sources import RunDirSource

STATUS = {"state": "Running", "step": 12, "total_steps": 20, "loss": 2.5, "tokens_per_s": 900.0,
          "val_step": 10, "val_loss": 2.61803, "val_ppl": 13.71}


def _text(renderable) -> str:
    console = Console(width=200, record=True)
    console.print(renderable)
    return console.export_text()


def test_status_shows_the_newest_validation_and_nothing_without_one():
    assert "val_loss 2.6180  val_ppl 13.71  at step 10" in headline("demo", STATUS).plain
    assert "val_loss" not in headline("demo", {**STATUS, "val_loss": None}).plain
    table = _text(jobs_table([("demo", STATUS)]))
    assert "val_loss" in table.splitlines()[0] and "2.6180" in table


def test_a_run_directory_reports_its_newest_validation(tmp_path):
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"name": "demo", "train": {"steps": 20},
                                                          "eval": {"every": 5}}))
    lines = [{"step": s, "loss": 3.0, **({"val_loss": 2.0 + s, "val_ppl": 9.0} if s % 5 == 0 else {})}
             for s in range(1, 13)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    status = RunDirSource(tmp_path).status()
    assert (status["step"], status["val_step"], status["val_loss"], status["val_ppl"]) == (12, 10, 12.0, 9.0)
