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


_PARQUET_WORK = """
import sys, tempfile
import pyarrow as pa
from megascale.driver.arrow_pool import pool_in_use
from megascale.driver.metrics.store import ParquetStore
store = ParquetStore(tempfile.mkdtemp(), steps_per_partition=50)
seg = {"compute": 1.0}
for lo in range(0, 200, 10):  # written in pieces, compacted when a range closes, read back: the driver's own work
    store.write("j", [dict(step=s, rank=r, tp=0, pp=0, dp=r, start=0.0, total=1.0, segments=seg)
                      for s in range(lo, lo + 10) for r in range(8)])
    store.compact("j", before_step=lo // 50 * 50)
assert len(store.read("j")) == 1600
print(pool_in_use(), pa.mimalloc_memory_pool().max_memory() if hasattr(pa, "mimalloc_memory_pool") else 0)
"""


def test_the_driver_s_parquet_work_allocates_from_the_pool_its_parent_chose():
    # Arrow's Parquet code allocates from the C++ default pool, fixed when pyarrow loads; pa.set_memory_pool
    # afterwards left every compaction on mimalloc, whose kept pages were the driver's growth in soaks
    from megascale.driver.arrow_pool import driver_environment

    env = {k: v for k, v in driver_environment().items() if k != "PYTHONPATH"}
    assert env["ARROW_DEFAULT_MEMORY_POOL"] == "jemalloc"
    pool, mimalloc_peak = _python(_PARQUET_WORK, **env).split()
    assert (pool, mimalloc_peak) == ("jemalloc", "0")


def test_an_operator_s_pool_choice_stands_and_an_unchosen_pool_is_named(monkeypatch):
    from megascale.driver.arrow_pool import driver_environment

    monkeypatch.setenv("ARROW_DEFAULT_MEMORY_POOL", "system")
    assert driver_environment()["ARROW_DEFAULT_MEMORY_POOL"] == "system"
    unchosen = subprocess.run([sys.executable, "-c", "from megascale.driver.arrow_pool import pool_in_use as p; "
                               "print(p())"], capture_output=True, text=True, check=True, timeout=120,
                              env={k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"})
    assert unchosen.stdout.strip() == "mimalloc"
    assert "start the driver with ARROW_DEFAULT_MEMORY_POOL=jemalloc" in unchosen.stderr
