"""One `megascale run` per job name, however close together two are started, and a driver that keeps dying
young ends the job with its last line instead of being restarted for ever."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from control_plane_support import job_yaml
from megascale.cli import main
from megascale.config import load_config
from megascale.driver import supervisor
from megascale.driver.services import JobHandle
from megascale.driver.supervisor import Supervisor, SupervisorError

HOLD = "from megascale.driver.supervisor import claimed\nwith claimed('held'):\n    print('held', flush=True)\n" \
       "    input()"


def test_a_second_run_of_a_claimed_job_stops_before_touching_the_first_ones_secrets(tmp_path, capsys):
    """The first run holds the name before it writes anything: the second run, started before the first's
    handle exists, says who holds it and leaves the first run's secrets file as it was; so does `launch`."""
    first = subprocess.Popen([sys.executable, "-c", HOLD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline() == "held\n"
        secrets = JobHandle.secrets_path("held")
        secrets.write_text("the first run's")
        cfg = load_config(job_yaml(tmp_path, "held", steps=5), [])
        with pytest.raises(SupervisorError, match=rf"job 'held' is already being run \(pid {first.pid}\)"):
            Supervisor(cfg, "held.yaml").run()
        assert secrets.read_text() == "the first run's" and JobHandle.load("held") is None
        assert main(["launch", job_yaml(tmp_path, "held", steps=5)]) == 2
        assert capsys.readouterr().err.strip() == f"megascale launch: job 'held' is already being run (pid " \
                                                  f"{first.pid}): `megascale stop held` first, or rename it"
        assert not list((tmp_path / "runs").glob("held-*")), "the second run made a run directory"
    finally:
        first.send_signal(signal.SIGKILL)  # the kernel drops the claim of a killed holder
        first.wait()
    with supervisor.claimed("held"):
        pass


def test_two_runs_of_one_job_started_together_train_one_job_and_refuse_the_other(tmp_path):
    config = job_yaml(tmp_path, "twice", steps=3)
    runs = [subprocess.Popen([sys.executable, "-m", "megascale.cli", "run", config, "--quiet"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outcomes = sorted((run.wait(timeout=120), run.communicate()[1].strip(), run.pid) for run in runs)
    (won, _, winner), (lost, error, _) = outcomes
    assert (won, lost) == (0, 2), outcomes
    assert error == f"megascale run: job 'twice' is already being run (pid {winner}): `megascale stop twice` " \
                    "first, or rename it", error
    handle = JobHandle.load("twice")
    assert handle.supervisor_pid == winner and handle.final["state"] == "Succeeded", handle


def test_a_driver_dying_young_again_and_again_ends_the_run_with_its_last_line(tmp_path, monkeypatch):
    """Each of these drivers lives longer than RESTART_WINDOW_S / DRIVER_RESTARTS, so counting deaths per
    window never gives up (as with a driver Redis refuses, ~13 s of reconnecting each): counted in a row."""
    monkeypatch.setattr(supervisor, "RESTART_WINDOW_S", 4.0)
    dying = tmp_path / "dying-driver"
    dying.write_text("#!/bin/sh\nsleep 1.5\necho 'Redis refuses this job login'\nexit 1\n")
    dying.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(dying))  # the supervisor starts its driver as `sys.executable -m ...`
    cfg = load_config(job_yaml(tmp_path, "dies", steps=5), [])
    with pytest.raises(SupervisorError) as error:
        Supervisor(cfg, "dies.yaml").run()
    assert str(error.value).startswith("driver died 5 times in a row within 4 s of starting, last with: Redis "
                                       "refuses this job login (see "), error.value
    assert os.path.basename(str(error.value)).startswith("driver.log)")
