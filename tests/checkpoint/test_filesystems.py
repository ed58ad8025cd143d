"""checkpoint.filesystem names a registered file system, never code: a job spec naming a module or a
file (`os:system`, `evil.py:make`) is refused in one line by the config, by storage (what the operator
polls and the keeper opens) and by the keeper's command line, and the named function never runs.
Built-ins take their options as data; installed plugins are found through their entry points."""
from __future__ import annotations

import sys

import pyarrow.fs as pafs
import pytest

from megascale.checkpoint import keeper
from megascale.checkpoint.storage import CheckpointError, open_storage
from megascale.config import ConfigError, from_dict


@pytest.fixture
def evil(tmp_path, monkeypatch):
    """(specs naming a malicious factory as a module and as a file, the file it would create)."""
    marker = tmp_path / "pwned"
    (tmp_path / "evil_fs.py").write_text(f"import pathlib\n\ndef make(uri, *options):\n"
                                         f"    pathlib.Path({str(marker)!r}).write_text('ran')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return ["os:system", "evil_fs:make", f"{tmp_path / 'evil_fs.py'}:make", "evil_fs"], marker


def test_a_config_naming_code_as_its_filesystem_is_refused_in_one_line(evil, tmp_path):
    specs, marker = evil
    for spec in specs:
        with pytest.raises(ConfigError) as e:
            from_dict({"checkpoint": {"uri": str(tmp_path / "ckpt"), "filesystem": spec}})
        assert str(e.value).startswith(f"checkpoint.filesystem={spec!r}: ") and "\n" not in str(e.value)
    assert not marker.exists()


def test_storage_and_the_keeper_never_import_a_named_module(evil, tmp_path):
    """What the operator's checkpoint poll and a keeper started with --filesystem do with a spec."""
    specs, marker = evil
    for spec in specs:
        with pytest.raises(CheckpointError, match=r"^checkpoint.filesystem="):
            open_storage(str(tmp_path / "ckpt"), spec)
        with pytest.raises(CheckpointError, match=r"^checkpoint.filesystem="):
            keeper.main(["--uri", str(tmp_path / "ckpt"), "--filesystem", spec])
    assert not marker.exists() and "evil_fs" not in sys.modules


def test_builtin_options_are_data_checked_per_file_system(tmp_path):
    cfg = from_dict({"checkpoint": {"uri": "s3://bucket/run", "filesystem": "s3",
                                    "filesystem_options": {"region": "eu-west-1", "anonymous": True}}}).checkpoint
    storage = open_storage(cfg.uri, cfg.filesystem, cfg.filesystem_options)
    assert isinstance(storage.fs, pafs.S3FileSystem) and storage.fs.region == "eu-west-1"
    assert storage.root == "bucket/run"
    assert open_storage(str(tmp_path), "local").root == str(tmp_path)
    bad = [({"filesystem": "s3", "filesystem_options": {"secret_key": "x"}},
            "checkpoint.filesystem_options.secret_key: not an option of checkpoint.filesystem=s3"),
           ({"filesystem": "s3", "filesystem_options": {"anonymous": "maybe"}},
            "checkpoint.filesystem_options.anonymous='maybe': must be true or false"),
           ({"filesystem": "gcs"}, "checkpoint.filesystem=gcs: checkpoint.uri=s3://bucket/run is not gs:// or gcs://"),
           ({"filesystem_options": {"region": "x"}}, "checkpoint.filesystem_options: needs checkpoint.filesystem")]
    for checkpoint, message in bad:
        with pytest.raises(ConfigError) as e:
            from_dict({"checkpoint": {"uri": "s3://bucket/run", **checkpoint}})
        assert str(e.value).startswith(message)


def test_an_installed_plugin_is_found_by_its_entry_point(tmp_path, fs):
    """conftest registered tests/checkpoint/fsutil.py as the plugin `instrumented` (a dist-info on sys.path)."""
    cfg = from_dict({"checkpoint": {"uri": str(tmp_path), "filesystem": fs.SPEC}}).checkpoint
    storage = open_storage(cfg.uri, cfg.filesystem, cfg.filesystem_options)
    assert storage.fs.type_name == "py::instrumented" and storage.root == str(tmp_path)
    with pytest.raises(ConfigError, match=r"^checkpoint.filesystem='uninstalled': no such file system \(known: "
                                          r"local, hdfs, s3, gcs, instrumented;"):
        from_dict({"checkpoint": {"uri": str(tmp_path), "filesystem": "uninstalled"}})
