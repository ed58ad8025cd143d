"""When warm standby processes start (executor/standby.py): an idle node's (a spare's) only once the job's
current incarnation trains, so that their imports do not compete with the ranks of a start or restart."""
import time

import redis

from megascale.driver.state import JobStatus, JobStore
from megascale.executor.daemon import Executor
from megascale.executor.standby import JobTraining

HEARTBEAT_S = 0.2


def test_the_driver_says_the_job_trains_only_while_its_current_incarnation_has_made_a_step(redis_server):
    store = JobStore.from_url(redis_server.url, "j")
    trains = JobTraining(store.r, "j", every_s=0.0)
    assert not trains()  # nothing written yet: a job that has not started
    for status, expected in [(JobStatus(job="j", state="Initializing"), False),
                             (JobStatus(job="j", state="Running"), False),  # ranks started, no step yet
                             (JobStatus(job="j", state="Running", step=3), True),
                             (JobStatus(job="j", state="Recovering", step=3), False)]:
        store.write_status(status)
        assert trains() is expected, status


def test_the_key_is_read_at_most_once_a_period_and_an_unreadable_one_keeps_the_last_answer(redis_server):
    store = JobStore.from_url(redis_server.url, "j")
    store.write_status(JobStatus(job="j", state="Running", step=1))
    trains = JobTraining(redis.Redis.from_url(redis_server.url, socket_connect_timeout=1), "j", every_s=30.0)
    assert trains()
    store.write_status(JobStatus(job="j", state="Recovering", step=1))
    assert trains()  # read within the period: the last answer
    trains.read_at -= 31.0
    assert not trains()
    redis_server.stop()
    trains.read_at -= 31.0
    assert not trains()  # Redis is away: no error, the last answer stands


def test_an_idle_nodes_standbys_wait_until_the_jobs_incarnation_trains(redis_server, broker, tmp_path):
    store = JobStore.from_url(redis_server.url, "j")
    executor = Executor("j", "n2", redis_server.url, broker.bootstrap, tmp_path, heartbeat_s=HEARTBEAT_S,
                        standby=1, ranks_per_node=4)
    try:
        states = []
        for status in [None, JobStatus(job="j", state="Running"), JobStatus(job="j", state="Running", step=1),
                       JobStatus(job="j", state="Recovering", step=1)]:
            if status:
                store.write_status(status)
            time.sleep(HEARTBEAT_S)
            states.append(executor._training())
        # None: not steady, no standby starts; False: idle while the job trains, the spare's standbys may start.
        assert states == [None, None, False, None]
        executor.standbys.refill(None)
        assert not executor.standbys.procs
    finally:
        executor.timings.close()
        executor.standbys.close()
