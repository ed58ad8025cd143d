"""A deterministic, learnable synthetic token source (arithmetic progressions mod vocab).

Sample i of step s depends only on (seed, s, i), so any DP layout sees exactly the
samples a single rank would, and resuming at a step reproduces the stream.
"""
from __future__ import annotations

import torch


class SyntheticSource:
    def __init__(self, *, vocab: int, seq: int, global_batch: int, dp_rank: int, dp_size: int, seed: int = 0):
        self.vocab, self.seq, self.seed = vocab, seq, seed
        per_rank = global_batch // dp_size
        self.samples = range(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        self.step = 0

    def _sample(self, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(hash((self.seed, self.step, index)) & 0x7FFFFFFF)
        start = torch.randint(self.vocab, (1,), generator=gen)
        stride = torch.randint(1, 8, (1,), generator=gen)
        return (start + stride * torch.arange(self.seq + 1)) % self.vocab

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.stack([self._sample(i) for i in self.samples])
        self.step += 1
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])

    def close(self) -> None:
        pass
