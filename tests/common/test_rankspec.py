"""The progress file a rank writes: `chaos nan-loss`'s order poisons exactly one step report, then is gone."""
from __future__ import annotations

import json
import math

from megascale.common.rankspec import Progress, nan_loss_order


def test_a_nan_loss_order_poisons_the_next_step_report_only(tmp_path):
    path = str(tmp_path / "rank4.progress.jsonl")
    progress = Progress(path)
    progress.write({"step": 1, "loss": 5.0})
    nan_loss_order(path).touch()
    progress.write({"state": "running"})  # no loss in it: the order waits for a step report
    progress.write({"step": 2, "loss": 4.0})
    progress.write({"step": 3, "loss": 3.0})
    progress.close()
    losses = [r.get("loss") for r in map(json.loads, open(path).read().splitlines())]
    assert losses[0] == 5.0 and losses[1] is None and math.isnan(losses[2]) and losses[3] == 3.0
    assert not nan_loss_order(path).exists()
