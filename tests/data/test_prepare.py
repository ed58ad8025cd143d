"""`megascale data prepare`: determinism, the manifest/index contents, the shipped corpus, bad inputs."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from megascale.data import DataError
from megascale.data.dataset import Dataset, verify
from megascale.data.prepare import prepare
from megascale.data.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "data" / "corpus" / "python_docs.jsonl"


def files_of(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def test_byte_prepare_is_deterministic_and_consistent(corpus, tmp_path):
    a = prepare([corpus], tmp_path / "a", shard_tokens=1500)
    prepare([corpus], tmp_path / "b", shard_tokens=1500)
    assert files_of(tmp_path / "a") == files_of(tmp_path / "b")  # same input, same bytes

    ds = verify(tmp_path / "a")
    assert ds.documents == a["documents"] == 60 and len(ds.shards) > 3
    index = pq.read_table(tmp_path / "a" / "index.parquet").to_pydict()
    assert index["doc"] == list(range(60)) and sum(index["tokens"]) == a["tokens"]
    tok = load_tokenizer(tmp_path / "a")
    tokens, offsets = ds.read_shard(0)
    first = tokens[offsets[0]:offsets[1]]
    assert first[-1] == tok.eot_id  # every document ends with end-of-text
    assert tok.decode(first) == (corpus / "doc000.txt").read_text()


def test_bpe_prepare_is_deterministic_across_processes(corpus, tmp_path):
    pytest.importorskip("tokenizers")
    code = ("import sys; from megascale.data.prepare import prepare; "
            "prepare([sys.argv[1]], sys.argv[2], tokenizer='bpe', vocab=300, shard_tokens=1000)")
    for name in ("a", "b"):  # separate processes: hash seeds differ, output must not
        subprocess.run([sys.executable, "-c", code, str(corpus), str(tmp_path / name)], check=True, cwd=REPO)
    assert files_of(tmp_path / "a") == files_of(tmp_path / "b")
    ds = verify(tmp_path / "a")
    assert ds.tokenizer_kind == "bpe" and ds.vocab_size <= 300
    tokens, offsets = ds.read_shard(0)
    tok = load_tokenizer(tmp_path / "a")
    assert tok.decode(tokens[offsets[0]:offsets[1]]) == (corpus / "doc000.txt").read_text()


def test_shipped_corpus(tmp_path):
    m = prepare([CORPUS], tmp_path / "py")
    assert m["documents"] == 221 and m["tokens"] > 700_000
    assert m["inputs"][0]["bytes"] == CORPUS.stat().st_size


@pytest.fixture
def run_cli(monkeypatch):
    """The real `megascale` entry point, with this package's commands registered."""
    from megascale import cli

    if "megascale.data.cli" not in cli.COMMAND_MODULES:
        monkeypatch.setattr(cli, "COMMAND_MODULES", [*cli.COMMAND_MODULES, "megascale.data.cli"])
    return lambda *argv: cli.main(list(argv))


def test_cli_prepare_and_verify(corpus, tmp_path, capsys, run_cli):
    out = tmp_path / "ds"
    assert run_cli("data", "prepare", "--input", str(corpus), "--output", str(out), "--shard-tokens", "4000") == 0
    assert "60 documents" in capsys.readouterr().out
    assert run_cli("data", "verify", str(out)) == 0
    assert run_cli("data", "prepare", "--input", str(corpus), "--output", str(out)) == 2  # exists
    assert "already exists" in capsys.readouterr().err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["shard_tokens"] == 4000 and all(len(s["sha256"]) == 64 for s in manifest["shards"])


@pytest.mark.parametrize("setup, error", [
    (lambda d: (d / "a.txt").write_text("  \n"), "empty corpus"),
    (lambda d: (d / "a.jsonl").write_text('{"text": ""}\n\n'), "empty corpus"),
    (lambda d: (d / "b.bin").write_bytes(b"\x00"), "empty corpus: no text files"),
    (lambda d: (d / "a.txt").write_bytes(b"ok \xff\xfe"), "not UTF-8"),
    (lambda d: (d / "a.jsonl").write_text('{"text": "x"}\n{"body": 1}\n'), "a.jsonl:2"),
])
def test_bad_corpus(tmp_path, setup, error):
    src = tmp_path / "in"
    src.mkdir()
    setup(src)
    with pytest.raises(DataError, match=error):
        prepare([src], tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))  # nothing half-written


def test_bad_arguments(corpus, tmp_path):
    with pytest.raises(DataError, match="input not found"):
        prepare([tmp_path / "missing"], tmp_path / "out")
    with pytest.raises(DataError, match="at least 258"):
        prepare([corpus], tmp_path / "out", tokenizer="bpe", vocab=100)
    with pytest.raises(DataError, match="needs --vocab"):
        prepare([corpus], tmp_path / "out", tokenizer="bpe")


def test_verify_catches_damage(dataset, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(dataset, broken)
    shard = broken / "shard-00002.arrow"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different bytes
    shard.write_bytes(bytes(data))
    Dataset(broken)  # size checks pass on open ...
    with pytest.raises(DataError, match="shard-00002.arrow: corrupt shard: checksum"):
        verify(broken)  # ... the checksum does not
    shard.unlink()
    with pytest.raises(DataError, match="shard-00002.arrow: shard missing"):
        Dataset(broken)
    manifest = json.loads((dataset / "manifest.json").read_text())
    manifest["tokens"] += 1
    (broken / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="manifest mismatch"):
        Dataset(broken)
    (broken / "manifest.json").write_text("{not json")
    with pytest.raises(DataError, match="corrupt manifest"):
        Dataset(broken)
    with pytest.raises(DataError, match="no manifest"):
        Dataset(tmp_path / "nowhere")
