"""One of two gloo ranks for test_abort_rank_gloo.py: `python gloo_abort_peer.py RANK PORT MODE`.

Rank 1 posts a receive of a 256 MB tensor from rank 0 (in `send` mode: rank 0's send then goes straight onto
the wire) or nothing, then stops itself (SIGSTOP: alive, reading nothing). Rank 0 calls `abort_rank` from a
thread after ABORT_AFTER_S while its main thread sends that tensor to rank 1 (`send`) or receives one from it
(`recv`), and prints how long the operation took to fail."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from megascale.rank import abort_rank

ABORT_AFTER_S = 1.0
GROUP_TIMEOUT_S = 5.0  # well apart from the abort at 1 s, and the send test waits it out
ELEMENTS = (256 << 20) // 4  # more than the two sockets' buffers hold (4 MB + 32 MB at most here)


def main(rank: int, port: int, mode: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    tensor = torch.zeros(ELEMENTS)
    dist.barrier()
    if rank == 1:
        if mode == "send":
            dist.irecv(tensor, src=0)  # rank 0 learns that this rank is ready to receive
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(3600)
    time.sleep(1.0)  # rank 1 has stopped
    threading.Timer(ABORT_AFTER_S, abort_rank).start()
    started = time.monotonic()
    try:
        dist.send(tensor, dst=1) if mode == "send" else dist.recv(tensor, src=1)
        print("completed", flush=True)
    except Exception:  # noqa: BLE001 - the failure is the point; its time is what the test reads
        print(f"failed after {time.monotonic() - started:.2f}", flush=True)
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
