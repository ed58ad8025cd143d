"""The communication environment of a rank process (NCCL's timeouts and error handling): what the executor adds to
each rank it starts, and `init_rank` to its own process. Apart from megascale.rank, which needs torch: the executor
does not."""
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
    """Variables to add to a rank's environment: defaults < what the process inherited < the job's config."""
    env = {k: v for k, v in DEFAULT_COMM_ENV.items() if k not in inherited}
    env.update(job_env)
    return env
