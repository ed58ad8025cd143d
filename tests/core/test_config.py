"""Job config: defaults, YAML loading, overrides and one-line errors naming the field."""
from __future__ import annotations

import pytest

from megascale.cli import main
from megascale.config import ConfigError, from_dict, load_config, new_run_dir, with_run_dir


def good(**sections):
    base = {"model": {"layers": 4, "hidden": 64, "heads": 4, "ffn": 128, "vocab": 128, "seq": 32},
            "batch": {"micro": 1, "global": 8}}
    for key, value in sections.items():
        base.setdefault(key, {}).update(value)
    return base


def test_defaults_validate_and_round_trip():
    cfg = from_dict({})
    assert cfg.parallelism.world_size == 1
    assert from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("sections, message", [
    ({"parallelism": {"tp": 3}}, "parallelism.tp=3 does not divide model.heads=4"),
    ({"model": {"heads": 8, "hidden": 64, "ffn": 100}, "parallelism": {"tp": 8}}, "parallelism.tp=8 does not divide "
                                                                                  "model.ffn=100"),
    ({"parallelism": {"pp": 3}}, "model.layers=4 is not divisible by parallelism.pp*vpp=3"),
    ({"parallelism": {"pp": 2, "vpp": 4}}, "model.layers=4 is not divisible by parallelism.pp*vpp=8"),
    ({"parallelism": {"dp": 3}}, "batch.global=8 is not divisible by batch.micro*parallelism.dp=3"),
    ({"parallelism": {"tp": 4, "sequence_parallel": True}, "model": {"seq": 30}}, "parallelism.tp=4 does not divide "
                                                                                  "model.seq=30"),
    ({"model": {"window": 64}}, "model.window=64: must be in 1..model.seq=32"),
    ({"parallelism": {"vpp": 2}}, "parallelism.vpp=2 needs parallelism.pp > 1"),
    ({"parallelism": {"pp": 2, "vpp": 2}, "batch": {"global": 6, "micro": 2}}, "3 microbatches per DP rank "
                                                                               "is not divisible by parallelism.pp=2"),
    ({"model": {"block": "fancy"}}, "model.block='fancy': must be one of serial, parallel"),
    ({"optimizer": {"name": "sgd"}}, "optimizer.name='sgd': must be one of lamb, adamw"),
    ({"model": {"layers": "four"}}, "model.layers='four': must be an integer"),
    ({"model": {"layerz": 4}}, "model.layerz: unknown field"),
    ({"optimizer": {"betas": [0.9]}}, "optimizer.betas=[0.9]: must be a list of 2 numbers"),
    ({"comm": {"env": {"NCCL_DEBUG": ["INFO"]}}}, "comm.env: must be a mapping of names to strings or numbers"),
    ({"optimizer": {"lr": -1}}, "optimizer.lr=-1.0: must be > 0"),
    ({"model": {"hidden": 60, "heads": 4}}, "model.hidden/model.heads=15 must be even"),
    ({"data": {"source": "shards"}}, "data.path: required when data.source=shards"),
    ({"control": {"evict_stragglers": True, "auto_recover": False}}, "control.evict_stragglers: "
                                                                     "needs control.auto_recover"),
    ({"eval": {"split": 1.0}}, "eval.split=1.0: must be in [0, 1)"),
    ({"eval": {"split": 0.01}}, "eval.split: needs data.source text or shards"),
    ({"data": {"source": "text", "path": "x"}, "eval": {"every": 5}}, "eval.every=5: needs held-out data"),
    ({"data": {"source": "text", "path": "x"}, "eval": {"split": 0.1, "data": "y"}}, "eval.split: set either"),
    ({"logging": {"peak_tflops": 0}}, "logging.peak_tflops=0.0: must be > 0"),
    ({"logging": {"jsonl_max_mb": -1}}, "logging.jsonl_max_mb=-1.0: must be >= 0 (0 = never roll over)"),
    ({"logging": {"timings_keep_steps": 0}}, "logging.timings_keep_steps=0: must be > 0"),
    ({"logging": {"timings_keep_days": -2}}, "logging.timings_keep_days=-2.0: must be > 0"),
    ({"services": {"broker_max_mb": 10}}, "services.broker_max_mb=10.0: must be >= 64"),
])
def test_bad_config_names_the_field(sections, message):
    with pytest.raises(ConfigError) as err:
        from_dict(good(**sections))
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_an_empty_section_has_its_defaults_and_env_numbers_are_text():
    cfg = from_dict({"model": None, "comm": {"env": {"NCCL_IB_TIMEOUT": 22}}})
    assert cfg.model == from_dict({}).model and cfg.comm.env == {"NCCL_IB_TIMEOUT": "22"}
    with pytest.raises(ConfigError, match=r"^model: expected a mapping, got list$"):
        from_dict({"model": [4]})


def test_world_size_is_the_product_of_tp_pp_dp():
    cfg = from_dict(good(parallelism={"tp": 2, "pp": 2, "dp": 2}))
    assert cfg.parallelism.world_size == 8


def test_yaml_file_and_overrides(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("name: demo\nmodel: {layers: 4, hidden: 64, heads: 4, ffn: 128, vocab: 128, seq: 32}\n")
    cfg = load_config(path, ["parallelism.tp=2", "model.window=8"])
    assert (cfg.name, cfg.parallelism.tp, cfg.model.window) == ("demo", 2, 8)


def test_invalid_yaml_is_one_line(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        load_config(path)


def test_cli_reports_config_errors_without_traceback(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text("parallelism: {tp: 3}\n")
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ConfigError: parallelism.tp=3 does not divide model.heads=4")
    assert "Traceback" not in err and len(err.splitlines()) == 1


def test_cli_missing_config_file(capsys):
    assert main(["train", "/nonexistent/job.yaml"]) == 2
    assert "no such config file" in capsys.readouterr().err


def test_override_values_that_are_not_yaml_are_text_and_run_dir_resolves(tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text("checkpoint: {every: 2}\n")
    cfg = load_config(config, ["checkpoint.uri={run_dir}/checkpoints", "train.steps=7"])
    assert cfg.checkpoint.uri == "{run_dir}/checkpoints" and cfg.train.steps == 7
    assert with_run_dir(cfg, "/runs/job-1").checkpoint.uri == "/runs/job-1/checkpoints"
    fixed = load_config(config, ["checkpoint.uri=/ckpt"])
    assert with_run_dir(fixed, "/runs/job-1") is fixed


def test_runs_started_in_the_same_second_get_their_own_directories(tmp_path):
    """A second-resolution stamp alone let two quick runs share logs and `{run_dir}` checkpoints."""
    cfg = from_dict({"train": {"run_dir": str(tmp_path)}})
    dirs = [new_run_dir(cfg, "job") for _ in range(3)]
    assert len(set(dirs)) == 3 and all((d / "config.yaml").exists() for d in dirs)
    assert {d.parent for d in dirs} == {tmp_path.resolve()}
