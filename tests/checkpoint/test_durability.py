"""A checkpoint is durable before it is committed, and older ones go only after that: shards, manifest
and their directories are fsynced before the commit rename, retention deletes after it (keep: 1 never
leaves nothing restorable). A shard whose checksum matches but whose header is malformed is a corrupt
shard: restore falls back to the previous checkpoint."""
from __future__ import annotations

import json
import logging
import mmap
import os
import zlib

import pyarrow.fs as pafs

from megascale.checkpoint import Checkpointer, RngState, shutdown_keeper
from megascale.checkpoint.keeper import Keeper, Slot
from megascale.checkpoint.storage import Storage, new_manifest, shard_file, step_dir
from megascale.parallel.topology import single_device_context
from megascale.train import Trainer


def recording_storage(root, fs, events: list) -> Storage:
    """Local storage through a file system that records each write, rename and delete in `events`."""

    class Recording(fs.Handler):
        def open_output_stream(self, path, metadata):
            events.append(("write", path))
            return super().open_output_stream(path, metadata)

        def move(self, src, dest):
            events.append(("rename", dest))
            super().move(src, dest)

        def delete_dir(self, path):
            events.append(("delete", path))
            super().delete_dir(path)

    return Storage(pafs.PyFileSystem(Recording(str(root))), str(root), str(root), local=True)


def test_shards_manifest_and_directories_are_synced_before_the_commit_and_deletion_comes_after(
        tmp_path, fs, monkeypatch):
    events: list = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd)))
    root = tmp_path / "ckpt"
    root.mkdir()
    keeper = Keeper(recording_storage(root, fs, events), "unused", idle_s=60)
    fd = os.memfd_create("snapshot")
    os.write(fd, b"shard bytes" * 100)
    slot = Slot(fd, 1100, mmap.mmap(fd, 1100, prot=mmap.PROT_READ))
    layout = {"tp": 1, "pp": 1, "dp": 1, "vpp": 1}
    for step in (1, 2):
        events.clear()
        done = keeper._persist(slot, {"step": step, "key": "pp0-tp0-dp0", "coords": [0, 0, 0], "offset": 0,
                                      "length": 1100, "version": 2, "dir": step_dir(step),
                                      "file": shard_file("pp0-tp0-dp0")})
        manifest = new_manifest(step, layout, {}, {"pp0-tp0-dp0": {"file": shard_file("pp0-tp0-dp0"),
                                                                     "bytes": 1100, "crc32": done["crc32"]}})
        assert keeper._commit({"step": step, "manifest": manifest, "keep": 1})["op"] == "committed"
    slot.close()
    directory = str(root / step_dir(2))
    shard, manifest = f"{directory}/{shard_file('pp0-tp0-dp0')}", f"{directory}/manifest.json"
    order = [("write", shard), ("fsync", shard), ("write", manifest + ".tmp"), ("fsync", manifest + ".tmp"),
             ("fsync", directory), ("fsync", str(root)), ("rename", manifest), ("fsync", directory),
             ("delete", str(root / step_dir(1)))]
    assert [e for e in events if e in order] == order, events
    assert not (root / step_dir(1)).exists() and (root / step_dir(2) / "manifest.json").exists()


def malform_header(path, manifest_path) -> None:
    """Drops the id of the shard's first $sharded entry, keeping every byte offset, and records the new
    checksum in the manifest: the checksum matches, the header does not hold a parts tree."""
    data = bytearray(path.read_bytes())
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    meta = json.loads(header["__metadata__"]["megascale"])
    meta["parts"]["optimizer"] = json.loads(json.dumps(meta["parts"]["optimizer"]).replace('"id":', '"di":', 1))
    header["__metadata__"]["megascale"] = json.dumps(meta)
    data[8:8 + length] = json.dumps(header).encode().ljust(length)
    path.write_bytes(data)
    manifest = json.loads(manifest_path.read_text())
    manifest["shards"]["pp0-tp0-dp0"]["crc32"] = zlib.crc32(data)
    manifest_path.write_text(json.dumps(manifest))


def test_a_shard_with_a_matching_checksum_and_a_malformed_header_falls_back(ckpt_dir, make_job, caplog):
    cfg = make_job(str(ckpt_dir), steps=4)

    def start() -> tuple[Trainer, Checkpointer]:
        trainer = Trainer(cfg, single_device_context())
        return trainer, Checkpointer(cfg, trainer.ctx, {"train": trainer, "optimizer": trainer.optimizer,
                                                        "data": trainer.source, "rng": RngState(trainer.ctx.device)})

    trainer, checkpointer = start()
    losses = []
    for _ in range(4):
        losses.append(trainer.step().loss)
        if trainer.step_index % 2 == 0:
            checkpointer.save(trainer.step_index)
            assert checkpointer.flush() == trainer.step_index
    checkpointer.close()
    malform_header(ckpt_dir / step_dir(4) / shard_file("pp0-tp0-dp0"), ckpt_dir / step_dir(4) / "manifest.json")
    shutdown_keeper(str(ckpt_dir))  # its host snapshot of step 4 is intact: force storage
    trainer, checkpointer = start()
    with caplog.at_level(logging.INFO, logger="megascale.checkpoint"):
        assert checkpointer.restore() == 2
    assert [trainer.step().loss for _ in range(2)] == losses[2:4]
    checkpointer.close()
    assert "malformed $sharded entry in the shard header" in caplog.text
    assert "falling back to the previous committed one" in caplog.text
