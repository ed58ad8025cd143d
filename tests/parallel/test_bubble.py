"""The measured pipeline bubble of interleaved 1F1B matches (p - 1) / (v * m).

Controlled run: every chunk sleeps 80 ms forward and 160 ms backward. Tolerance: 0.05 absolute
on the bubble fraction (P2P latency and process wake-ups, ~2 ms a hop on a loaded 2-core machine).
"""
from __future__ import annotations

import pytest

from megascale.launch import run_ranks
from megascale.parallel.bubble import measure_bubble
from megascale.parallel.topology import Layout


@pytest.mark.parametrize("pp, vpp, microbatches", [(4, 2, 8), (2, 1, 4)])
def test_measured_bubble_matches_formula(pp, vpp, microbatches):
    results = run_ranks(measure_bubble, Layout(pp=pp, vpp=vpp), microbatches, 0.08, 0.16)
    measured = max(r["measured"] for r in results)
    formula = results[0]["formula"]
    assert measured == pytest.approx(formula, abs=0.05), (measured, formula)


def test_interleaving_shrinks_the_bubble():
    plain = run_ranks(measure_bubble, Layout(pp=4, vpp=1), 8, 0.02, 0.04)
    interleaved = run_ranks(measure_bubble, Layout(pp=4, vpp=2), 8, 0.01, 0.02)
    assert max(r["measured"] for r in interleaved) < max(r["measured"] for r in plain) - 0.1
