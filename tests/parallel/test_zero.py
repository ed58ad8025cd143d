"""parallelism.zero: ZeRO-1 (a full gradient buffer per rank, one reduce-scatter per step) matches one
rank as ZeRO-2 does (the other parity tests run ZeRO-2, the default), across microbatches, the
eager per-bucket reduce-scatter and the tied embedding's cross-stage sum."""
from parity_support import assert_parity, job


def test_zero1_parity_with_single_rank():
    assert_parity(job({"pp": 2, "dp": 2, "zero": 1}, tied=True, global_batch=4, overlap=True))
