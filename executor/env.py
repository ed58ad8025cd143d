"""The communication environment every rank starts with: defaults for fault detection, then the job's `comm.env`.

The defaults make a broken link fail fast and loudly instead of hanging a collective forever,
so the driver can see the failure (MegaScale §4): NCCL retries InfiniBand transfers a bounded
number of times, and the PyTorch NCCL watchdog tears a rank down on a collective error or
timeout rather than leaving it blocked. Gloo has no such variables; its timeout is the
`comm.timeout_s` passed to init_process_group.
"""
from __future__ import annotations

DEFAULT_COMM_ENV = {
    "NCCL_IB_TIMEOUT": "22",  # 4.096 us * 2^22 ~ 17 s per InfiniBand retry
    "NCCL_IB_RETRY_CNT": "7",
    "NCCL_DEBUG": "WARN",  # NCCL's own error lines reach the rank log, where the executor scans them
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",  # a failed or timed-out collective ends the process
    "TORCH_NCCL_ENABLE_MONITORING": "1",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    "PYTHONUNBUFFERED": "1",  # rank stderr reaches the log (and the error scanner) at once
}


def comm_env(job_env: dict[str, str], inherited: dict[str, str]) -> dict[str, str]:
    """Variables to add to a rank's environment: defaults < what the executor inherited < the job's config."""
    env = {k: v for k, v in DEFAULT_COMM_ENV.items() if k not in inherited}
    env.update(job_env)
    return env
