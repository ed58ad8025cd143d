"""What the driver process loads and how it allocates: it runs for the whole job, restarts in recoveries, and
shares the node with the ranks, so its start-up time and its memory over weeks are part of the job's cost."""
from __future__ import annotations

import os
import subprocess
import sys


def _python(code: str, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"} | env
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                          env=environ).stdout.strip()


def test_the_driver_does_not_import_torch():
    # torch is ~200 MB of the driver's RSS and over a second of every driver (re)start; the driver needs none of it
    # ... nor when it localises a hang, which needs the job's group membership
    assert _python("import sys, megascale.driver.__main__ as d, megascale.driver.recovery.localization as h; "
                   "h.group_members(2, 2, 2); print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])"
                   ) == "[]"


def test_the_supervisor_and_the_executor_do_not_import_torch():
    # each lives for the whole job (an executor per node): torch was ~150 MB of each one's 230-240 MB; the ranks
    # they start import it themselves. Imported with what they use at run time: the embedded Redis the supervisor
    # restarts, the keeper it shuts down, the communication environment the executor gives its ranks.
    assert _python("import sys, megascale.driver.supervisor, megascale.executor.__main__; "
                   "from megascale.checkpoint import shutdown_keeper; "
                   "from megascale.common.embedded_redis import EmbeddedRedis; "
                   "from megascale.common.comm_env import comm_env; "
                   "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])") == "[]"


def test_the_driver_allocates_from_a_pool_that_returns_freed_pages():
    use = "from megascale.driver.metrics.store import use_returning_memory_pool as u; print(u())"
    assert _python(use) in ("jemalloc", "system")
    assert _python(use, ARROW_DEFAULT_MEMORY_POOL="mimalloc") == "mimalloc"  # the operator's choice stands
