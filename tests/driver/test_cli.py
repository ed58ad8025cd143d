"""Bad input gets one line on stderr and exit status 2, never a traceback."""
from __future__ import annotations

import os

import pytest

from megascale.cli import main
from megascale.driver.services import JobHandle


def one_line_error(capsys, argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and err and "\n" not in err and "Traceback" not in err, (code, err)
    return err


@pytest.mark.parametrize("argv", [["status", "nope"], ["pause", "nope"], ["resume", "nope"], ["stop", "nope"],
                                  ["evict", "nope", "n1"], ["spares", "nope", "1"], ["logs", "nope"]])
def test_unknown_job(capsys, argv):
    assert f"megascale {argv[0]}: no job named 'nope'" in one_line_error(capsys, argv)


def test_bad_configs(capsys, tmp_path):
    assert "no such config file" in one_line_error(capsys, ["run", str(tmp_path / "missing.yaml")])
    bad = tmp_path / "bad.yaml"
    bad.write_text("parallelism: {dp: 4}\nbatch: {micro: 1, global: 4}\ncluster: {nodes: 3}\n")
    assert "cluster.nodes=3 does not divide the world size 4" in one_line_error(capsys, ["launch", str(bad)])
    bad.write_text("control: {heartbeat_s: 5, dead_after_s: 6}\n")
    assert "control.dead_after_s=6.0: must be at least twice" in one_line_error(capsys, ["run", str(bad)])
    assert "must be an integer" in one_line_error(capsys, ["run", str(bad), "--set", "cluster.spares=many"])
    (tmp_path / "ckpt" / "step-00000004").mkdir(parents=True)
    (tmp_path / "ckpt" / "step-00000004" / "manifest.json").write_text("{}")
    bad.write_text(f"checkpoint: {{uri: {tmp_path / 'ckpt'}, every: 2}}\n")
    for verb in ("run", "launch"):
        error = one_line_error(capsys, [verb, str(bad)])
        assert "holds committed checkpoints (newest step 4) of an earlier run" in error


@pytest.mark.parametrize("argv, message", [
    (["evict", "job"], "the following arguments are required: node"),
    (["logs", "job", "--node"], "argument --node: expected one argument"),
    (["run", "x.yaml", "--steps", "ten"], "invalid int value: 'ten'"),
    (["spares", "job", "many"], "argument count: invalid int value: 'many'"),
])
def test_bad_arguments(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and message in err and "\n" not in err


def test_ended_job_and_empty_home(capsys, tmp_path):
    assert main(["status"]) == 0 and "no jobs under" in capsys.readouterr().out
    JobHandle(job="old", redis_url="redis://127.0.0.1:1", kafka="127.0.0.1:1", run_dir=str(tmp_path),
              config_path="x.yaml", supervisor_pid=os.getpid(), final={"state": "Succeeded", "step": 9}).save()
    assert "job 'old' is not running (last state: Succeeded)" in one_line_error(capsys, ["pause", "old"])
    assert "no logs for node 'n5'" in one_line_error(capsys, ["logs", "old", "--node", "n5"])
    assert "count: must be >= 0, got -1" in one_line_error(capsys, ["spares", "old", "-1"])
    assert main(["status", "old"]) == 0
    out = capsys.readouterr().out
    assert "Succeeded" in out and "not running" in out
