"""`megascale run / launch / train` refuse a job that cannot run before starting anything."""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import yaml

from megascale.cli import main
from megascale.config import ConfigError, from_dict
from megascale.preflight import preflight

JOB = {"name": "pre", "model": {"layers": 2, "hidden": 32, "heads": 2, "ffn": 64, "vocab": 320, "seq": 16},
       "batch": {"micro": 1, "global": 2}, "data": {"source": "text", "path": "corpus/docs.jsonl"},
       "train": {"steps": 2}}


def test_missing_data_fails_in_one_line_before_any_service_starts(tmp_path, capsys, monkeypatch):
    """Before: every incarnation's ranks died on it, control.max_restarts times over (90 s for the main example)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MEGASCALE_HOME", str(tmp_path / "home"))
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(JOB))
    for command in ("train", "run", "launch"):
        began = time.monotonic()
        assert main([command, "job.yaml", "--quiet"] if command != "launch" else [command, "job.yaml"]) == 2
        err = capsys.readouterr().err.strip()
        assert f"data.path={tmp_path}/corpus/docs.jsonl: not found" in err, (command, err)  # from the file's directory
        assert "\n" not in err and "Traceback" not in err and time.monotonic() - began < 5
    assert not (tmp_path / "runs").exists() and not (tmp_path / "home" / "jobs").exists()


def test_data_the_ranks_could_not_use_is_refused_up_front(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "notes.bin").write_bytes(b"\0")
    text = {**JOB, "data": {"source": "text", "path": "corpus"}}
    with pytest.raises(ConfigError, match=r"^data.path=corpus: empty corpus: no text files"):
        preflight(from_dict(text))
    with pytest.raises(ConfigError, match=r"^data.path=corpus: .*no manifest; make one with `megascale data prepare`"):
        preflight(from_dict({**JOB, "data": {"source": "shards", "path": "corpus"}}))
    (tmp_path / "corpus" / "docs.txt").write_text("hello")
    with pytest.raises(ConfigError, match=r"^model.vocab=200 is below the 257 token ids of data.path=corpus"):
        preflight(from_dict({**text, "model": {**JOB["model"], "vocab": 200}}))
    assert preflight(from_dict(text)).data.path == str(tmp_path.resolve() / "corpus")


def test_a_relative_data_path_is_made_absolute_for_ranks_that_run_elsewhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "docs.jsonl").write_text('{"text": "hello"}\n')
    cfg = preflight(from_dict(JOB))
    assert cfg.data.path == str(tmp_path.resolve() / "corpus" / "docs.jsonl")
    synthetic = from_dict({**JOB, "data": {"source": "synthetic"}})
    assert preflight(synthetic) == synthetic


def test_a_fresh_start_on_another_runs_checkpoints_is_a_config_error(tmp_path):
    (tmp_path / "ckpt" / "step-00000003").mkdir(parents=True)
    (tmp_path / "ckpt" / "step-00000003" / "manifest.json").write_text("{}")
    cfg = from_dict({**JOB, "data": {"source": "synthetic"}, "checkpoint": {"uri": str(tmp_path / "ckpt")}})
    with pytest.raises(ConfigError, match=r"already holds committed checkpoints \(newest step 3\)"):
        preflight(cfg)
    resumed = from_dict({**JOB, "data": {"source": "synthetic"},
                         "checkpoint": {"uri": str(tmp_path / "ckpt"), "resume": True}})
    assert preflight(resumed) == resumed


SHIPPED_TOKENIZER = Path(__file__).resolve().parents[2] / "data" / "corpus" / "tokenizer.json"


def test_a_relative_tokenizer_path_is_checked_and_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "docs.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "tok").mkdir()
    shutil.copy(SHIPPED_TOKENIZER, tmp_path / "tok" / "tokenizer.json")
    job = {**JOB, "model": {**JOB["model"], "vocab": 512}}
    for given in ("tok", "tok/tokenizer.json"):
        cfg = preflight(from_dict({**job, "data": {**job["data"], "tokenizer": given}}))
        assert cfg.data.tokenizer == str(tmp_path.resolve() / given)
    byte = preflight(from_dict(job))
    assert byte.data.tokenizer == "byte"


@pytest.mark.parametrize("tokenizer, vocab, message", [
    ("tok.json", 512, r"data.tokenizer=tok.json: not found \(relative paths are from the current directory, "),
    ("bad.json", 512, r"data.tokenizer=bad.json: .*bad.json: not a tokenizer file"),
    ("empty", 512, r"data.tokenizer=empty: .*empty: holds neither tokenizer.json nor GPT-2 vocab.json \+ merges.txt"),
    ("tok/tokenizer.json", 320, r"^model.vocab=320 is below the 512 token ids of data.tokenizer=tok/tokenizer.json$"),
])
def test_a_tokenizer_the_ranks_could_not_use_is_refused_in_one_line(tmp_path, monkeypatch, tokenizer, vocab, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "docs.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "bad.json").write_text("[1, 2]")
    (tmp_path / "empty").mkdir()
    (tmp_path / "tok").mkdir()
    shutil.copy(SHIPPED_TOKENIZER, tmp_path / "tok" / "tokenizer.json")
    cfg = from_dict({**JOB, "model": {**JOB["model"], "vocab": vocab}, "data": {**JOB["data"], "tokenizer": tokenizer}})
    with pytest.raises(ConfigError, match=message) as e:
        preflight(cfg)
    assert "\n" not in str(e.value)


def test_shards_with_a_tokenizer_path_must_have_been_prepared_with_it(tmp_path):
    from megascale.data.prepare import prepare

    (tmp_path / "docs.txt").write_text("hello world")
    prepare([tmp_path / "docs.txt"], tmp_path / "ds", tokenizer=str(SHIPPED_TOKENIZER))
    job = {**JOB, "model": {**JOB["model"], "vocab": 512},
           "data": {"source": "shards", "path": str(tmp_path / "ds"), "tokenizer": str(SHIPPED_TOKENIZER)}}
    assert preflight(from_dict(job)).data.tokenizer == str(SHIPPED_TOKENIZER)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "tokenizer.json").write_text(SHIPPED_TOKENIZER.read_text().replace('"fuse_unk": false',
                                                                                              '"fuse_unk": true'))
    with pytest.raises(ConfigError, match=r"^data.tokenizer=.*other: not the tokenizer data.path=.*ds was prepared "
                                          r"with \(its manifest.json records another\)$"):
        preflight(from_dict({**job, "data": {**job["data"], "tokenizer": str(tmp_path / "other")}}))


def test_input_paths_in_a_config_file_are_from_its_directory_and_set_ones_from_here(tmp_path, monkeypatch):
    """`megascale run /abs/examples/job.yaml` from anywhere reads what the file names; `--set` is the shell's."""
    from megascale.config import load_config

    (tmp_path / "repo" / "corpus").mkdir(parents=True)
    (tmp_path / "repo" / "corpus" / "docs.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "repo" / "examples").mkdir()
    job = {**JOB, "data": {"source": "text", "path": "../corpus/docs.jsonl", "tokenizer": "byte"},
           "eval": {"data": "../corpus/docs.jsonl"}, "checkpoint": {"uri": "ckpt"}}
    (tmp_path / "repo" / "examples" / "job.yaml").write_text(yaml.safe_dump(job))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    cfg = preflight(load_config(tmp_path / "repo" / "examples" / "job.yaml"))
    assert cfg.data.path == str(tmp_path / "repo" / "corpus" / "docs.jsonl") and cfg.eval.data == cfg.data.path
    assert cfg.data.tokenizer == "byte" and cfg.checkpoint.uri == "ckpt"  # a name, and an output: untouched
    (tmp_path / "elsewhere" / "mine.jsonl").write_text('{"text": "hi"}\n')
    given = load_config(tmp_path / "repo" / "examples" / "job.yaml", ["data.path=mine.jsonl"])
    assert preflight(given).data.path == str(tmp_path / "elsewhere" / "mine.jsonl")
    assert main(["train", str(tmp_path / "repo" / "examples" / "job.yaml"), "--set", "data.path=gone.jsonl",
                 "--quiet"]) == 2  # --set stays relative to the current directory
