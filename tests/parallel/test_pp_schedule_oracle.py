"""`megascale.parallel.pipeline.schedule` against torch.distributed.pipelining, plus a
message-passing simulation of every rank running its schedule.

torch's `ScheduleInterleaved1F1B.pipeline_order[rank]` is a list of `_Action(stage_index,
computation_type, microbatch_index)` with `None` for idle slots; it is built at construction
from the stages' `num_stages` / `group_size` / `group_rank` only, so stand-in stage objects
need no process group. Our chunk of torch stage s is s // pp.

vpp > 1: our order equals torch's exactly (same warm-up (pp-rank-1)*2 + (vpp-1)*pp, same
groups of pp microbatches per chunk, depth-first).

vpp = 1 differs legitimately: torch's *interleaved* schedule with one local stage warms up
with 2*(pp-rank-1) forwards, Megatron's (and ours, and torch's `Schedule1F1B`) non-interleaved
1F1B with pp-rank-1, which holds half as many activations. There we check what must still hold
(same forward and backward orders, warm-up counts as stated) and compare exactly against
torch's `Schedule1F1B.pipeline_order` for ranks 0..pp-2. Its last rank is skipped: torch 2.13
mislabels that rank's forwards there (F1..F{n} instead of F0..F{n-1}; a torch display bug,
the order it executes is right).
"""
from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import pytest
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleInterleaved1F1B,
    _ComputationType,
)

from megascale.parallel.pipeline import schedule


def _stand_in_stages(pp: int, vpp: int, rank: int = 0) -> list[SimpleNamespace]:
    return [SimpleNamespace(num_stages=pp * vpp, group_size=pp, group_rank=rank, stage_index=c * pp + rank)
            for c in range(vpp)]


def _torch_ops(pipeline_order: dict, pp: int, rank: int) -> list[tuple[str, int, int]]:
    kinds = {_ComputationType.FORWARD: "F", _ComputationType.FULL_BACKWARD: "B"}
    return [(kinds[a.computation_type], a.microbatch_index, a.stage_index // pp)
            for a in pipeline_order[rank] if a is not None and a.computation_type in kinds]


def _ours(pp: int, vpp: int, microbatches: int, rank: int) -> list[tuple[str, int, int]]:
    return [(op.kind, op.microbatch, op.chunk) for op in schedule(pp, vpp, microbatches, rank)]


def _forwards_before_first_backward(ops: list[tuple[str, int, int]]) -> int:
    """warm-up + 1 (the first steady-state forward), or every forward when warm-up covers them all."""
    return next(i for i, op in enumerate(ops) if op[0] == "B")


@pytest.mark.parametrize("pp,vpp,microbatches", [(2, 2, 4), (4, 2, 8), (2, 3, 6), (4, 4, 8), (3, 2, 6),
                                                  (4, 2, 4), (2, 2, 2)])
def test_interleaved_order_equals_torch_interleaved_1f1b(pp, vpp, microbatches):
    order = ScheduleInterleaved1F1B(_stand_in_stages(pp, vpp), microbatches).pipeline_order
    for rank in range(pp):
        assert _ours(pp, vpp, microbatches, rank) == _torch_ops(order, pp, rank), f"rank {rank}"


@pytest.mark.parametrize("pp,microbatches", [(2, 4), (4, 8), (4, 3)])
def test_plain_1f1b_keeps_torch_orders_with_megatron_warmup_of_pp_minus_rank_minus_1(pp, microbatches):
    interleaved = ScheduleInterleaved1F1B(_stand_in_stages(pp, 1), microbatches).pipeline_order
    for rank in range(pp):
        ours, theirs = _ours(pp, 1, microbatches, rank), _torch_ops(interleaved, pp, rank)
        for kind in "FB":
            assert [op for op in ours if op[0] == kind] == [op for op in theirs if op[0] == kind]
        assert _forwards_before_first_backward(ours) == min(pp - rank - 1 + 1, microbatches)
        assert _forwards_before_first_backward(theirs) == min(2 * (pp - rank - 1) + 1, microbatches)
    if microbatches >= pp:  # Schedule1F1B refuses fewer microbatches than stages
        plain = Schedule1F1B(_stand_in_stages(pp, 1)[0], microbatches).pipeline_order
        for rank in range(pp - 1):
            assert _ours(pp, 1, microbatches, rank) == _torch_ops(plain, pp, rank), f"rank {rank}"


def simulate(pp: int, vpp: int, microbatches: int) -> list[list[tuple[str, int, int]]]:
    """Runs every rank's schedule against the others the way `run_schedule` communicates.

    Sends are asynchronous (never block); a receive blocks until its channel has a message and
    takes the oldest (FIFO per channel, no tags), which must be for the microbatch and virtual stage
    the op expects. Activations go rank p -> p+1 (wrapping to rank 0 for the next chunk), gradients
    the other way. Returns the ops in the global order they ran; raises AssertionError on deadlock
    or a mismatched message.
    """
    last = pp * vpp - 1
    ops = [schedule(pp, vpp, microbatches, r) for r in range(pp)]
    acts = [deque() for _ in range(pp)]  # inbox of rank r on the forward communicator
    grads = [deque() for _ in range(pp)]
    done, cursor, trace = set(), [0] * pp, []
    while any(cursor[r] < len(ops[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            if cursor[r] == len(ops[r]):
                continue
            op = ops[r][cursor[r]]
            v = op.chunk * pp + r
            if op.kind == "F":
                if v != 0:
                    if not acts[r]:
                        continue
                    assert acts[r].popleft() == (op.microbatch, v), f"rank {r} got the wrong activation for {op}"
                    assert ("F", op.microbatch, v - 1) in done
                if v != last:
                    acts[(r + 1) % pp].append((op.microbatch, v + 1))
            else:
                assert ("F", op.microbatch, v) in done, f"rank {r} runs {op} before its forward"
                if v != last:
                    if not grads[r]:
                        continue
                    assert grads[r].popleft() == (op.microbatch, v), f"rank {r} got the wrong gradient for {op}"
                    assert ("B", op.microbatch, v + 1) in done
                if v != 0:
                    grads[(r - 1) % pp].append((op.microbatch, v - 1))
            done.add((op.kind, op.microbatch, v))
            trace.append((op.kind, op.microbatch, v))
            cursor[r] += 1
            progressed = True
        assert progressed, f"deadlock: every rank waits (cursors {cursor})"
    assert not any(acts) and not any(grads), "messages left unreceived"
    return trace


COMBOS = [(pp, vpp, pp * k) for pp in (1, 2, 3, 4, 8) for vpp in (1, 2, 3, 4) for k in (1, 2, 3)]
COMBOS += [(pp, 1, mb) for pp in (2, 3, 4) for mb in (1, 2, 5, 7)]  # plain 1F1B: any microbatch count


def test_every_rank_completes_its_schedule_in_a_message_passing_simulation():
    for pp, vpp, microbatches in COMBOS:
        trace = simulate(pp, vpp, microbatches)
        expected = {(k, mb, v) for k in "FB" for mb in range(microbatches) for v in range(pp * vpp)}
        assert len(trace) == len(expected) and set(trace) == expected, (pp, vpp, microbatches)


def test_each_rank_runs_every_forward_and_backward_once_forward_first():
    for pp, vpp, microbatches in COMBOS:
        for rank in range(pp):
            ops = _ours(pp, vpp, microbatches, rank)
            assert sorted(ops) == sorted((k, mb, c) for k in "FB" for mb in range(microbatches) for c in range(vpp))
            for i, (kind, mb, chunk) in enumerate(ops):
                if kind == "B":
                    assert ("F", mb, chunk) in ops[:i]
