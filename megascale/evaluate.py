"""Validation: the loss on held-out data, forward only, through the training pipeline schedule.

Every rank of the job evaluates at the same steps (it is collective). The loss is the mean over every
held-out token of `eval.steps` batches: each DP rank's last stage sums its token losses, and one reduction
at the end adds them up, so the value does not depend on the layout (tests/parallel/test_eval_parity.py).
"""
from __future__ import annotations

import math
import time
from typing import Callable, Optional

import torch

from megascale.config import JobConfig
from megascale.parallel.comm import all_reduce
from megascale.parallel.pipeline import document_ids_on_every_stage, run_schedule
from megascale.parallel.topology import ParallelContext
from megascale.synthetic import SyntheticSource
from megascale.train import Trainer, split_microbatches

# (input_ids, labels, document ids or None) of validation batch i
EvalBatch = tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]


def make_eval_source(cfg: JobConfig, ctx: ParallelContext) -> Callable[[int], EvalBatch]:
    """Validation batch i for this rank: held-out documents, a held-out dataset, or for synthetic data
    the same generator under a seed no training run uses (data.seed is >= 0)."""
    if cfg.data.source == "synthetic":
        source = SyntheticSource(vocab=cfg.model.vocab, seq=cfg.model.seq, global_batch=cfg.batch.global_,
                                 dp_rank=ctx.dp.rank, dp_size=ctx.dp.size, seed=-1 - cfg.data.seed)

        def synthetic(index: int) -> EvalBatch:
            source.load_state_dict({"step": index})
            return (*source.next_batch(), None)
        return synthetic
    from megascale.data.heldout import make_held_out_source

    held_out = make_held_out_source(cfg.data, cfg.eval, seq=cfg.model.seq, rows=cfg.microbatches * cfg.batch.micro,
                                    dp_rank=ctx.dp.rank, dp_size=ctx.dp.size, pp_rank=ctx.pp.rank,
                                    pp_size=ctx.pp.size, run_dir=cfg.train.run_dir, vocab=cfg.model.vocab)

    def documents(index: int) -> EvalBatch:
        batch = held_out.batch(index)
        return batch.input_ids, batch.labels, batch.document_ids
    return documents


class Evaluator:
    """Runs validation on a Trainer's model chunks; `due(step)` says when (every eval.every steps and
    after the last step)."""

    def __init__(self, trainer: Trainer, source: Callable[[int], EvalBatch]):
        self.trainer, self.cfg, self.ctx, self.source = trainer, trainer.cfg, trainer.ctx, source

    def due(self, step: int) -> bool:
        every = self.cfg.eval.every
        return bool(every) and (step % every == 0 or step == self.cfg.train.steps)

    def evaluate(self) -> dict:
        """{"val_loss", "val_ppl", "val_time"} on every rank."""
        t, cfg, ctx = self.trainer, self.cfg, self.ctx
        started = time.perf_counter()
        rows = cfg.microbatches * cfg.batch.micro
        totals = torch.zeros(2, dtype=torch.float64, device=ctx.device)  # token-loss sum, tokens
        for chunk in t.chunks:
            chunk.train(False)  # dropout off
        try:
            for index in range(cfg.eval.steps):
                input_ids, labels, document_ids = self.source(index)
                inputs, targets = (split_microbatches(x, cfg.microbatches, ctx.device) for x in (input_ids, labels))
                # Weighting each microbatch's mean loss by its token count makes the schedule return a sum.
                counts = [float((lab != -100).sum()) if ctx.is_last_stage else 0.0 for lab in targets]
                documents = None
                if cfg.data.document_mask:
                    shared = document_ids_on_every_stage(document_ids, ctx, (rows, cfg.model.seq))
                    documents = list(shared.chunk(cfg.microbatches))
                loss_sum = run_schedule(t.chunks, ctx, inputs, targets, counts, t.activation_shape, t.dtype,
                                        overlap=cfg.parallelism.overlap.pp, document_ids=documents,
                                        forward_only=True)
                totals[0] += loss_sum.double()
                totals[1] += sum(counts)
        finally:
            for chunk in t.chunks:
                chunk.train(True)
        loss_sum, tokens = all_reduce(all_reduce(totals, ctx.dp), ctx.pp).tolist()
        ctx.timer.collect()  # validation is not part of the next training step's timings
        val_loss = loss_sum / max(tokens, 1.0)
        return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 700.0)),
                "val_time": time.perf_counter() - started}
