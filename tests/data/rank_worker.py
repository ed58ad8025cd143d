"""One rank of a tp=2 job, as a real process: prints READY <loader pid>, then trains on data forever."""
import sys
import time
from types import SimpleNamespace

from megascale.data import DataError, make_batch_source

dataset, run_dir, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
cfg = SimpleNamespace(source="shards", path=dataset, seed=0, prefetch=2, shuffle_window=2)
try:
    src = make_batch_source(cfg, seq=16, micro=2, microbatches=1, dp_rank=0, dp_size=1, tp_rank=rank, tp_size=2,
                            pp_rank=0, pp_size=1, global_rank=rank, ranks_per_node=2, run_dir=run_dir)
    src.next_batch()
    print("READY", src.loader_pid, flush=True)
    while True:
        src.next_batch()
        time.sleep(0.005)
except DataError as e:
    print(f"DataError: {e}", file=sys.stderr, flush=True)
    sys.exit(3)
