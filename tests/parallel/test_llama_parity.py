"""N ranks vs 1 rank for the llama arch (RMSNorm, SwiGLU, grouped-query attention with k/v heads
split over TP), with the gpt parity tests' helpers and tolerances (parity_support.py)."""
from __future__ import annotations

import pytest

from parity_support import assert_parity, job

LLAMA = {"arch": "llama", "kv_heads": 2}  # 4 query heads share 2 k/v heads: one k/v head per TP rank at tp=2

CASES = {
    "tp2_sp_overlap_on": ({"tp": 2, "sequence_parallel": True}, {"micro": 2, "overlap": True}),
    "tp2_ptb_window_adamw": ({"tp": 2}, {"block": "parallel", "window": 8, "optimizer": "adamw"}),
    "pp2_vpp2_ptb": ({"pp": 2, "vpp": 2}, {"block": "parallel", "global_batch": 4}),
    "dp2_window_tied": ({"dp": 2}, {"window": 8, "tied": True}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_llama_parity_with_single_rank(name):
    parallelism, model = CASES[name]
    assert_parity(job(parallelism, **LLAMA, **model))


def test_llama_parity_eight_ranks_tp2_pp2_dp2_sp_ptb_window_gqa():
    assert_parity(job({"tp": 2, "pp": 2, "dp": 2, "sequence_parallel": True}, **LLAMA, block="parallel", window=8,
                      global_batch=8, micro=2, overlap=True))
