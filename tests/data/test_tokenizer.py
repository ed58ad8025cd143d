"""Pretrained tokenizers: the shipped tokenizer.json and a GPT-2 vocab.json + merges.txt pair give the
token ids their own libraries give (oracle: `tokenizers`, and transformers where installed), documents
are separated by the tokenizer's EOS (or BOS), and the tokenizer is copied beside the shards."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from megascale.data import DataError
from megascale.data.dataset import Dataset, sha256_file, verify
from megascale.data.prepare import iter_documents, list_inputs, prepare, prepare_cached
from megascale.data.tokenizer import load_tokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tokenizers.implementations import ByteLevelBPETokenizer

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "data" / "corpus" / "python_docs.jsonl"
SHIPPED = REPO / "data" / "corpus" / "tokenizer.json"


def documents(path) -> list[str]:
    return [text for _, text in iter_documents(list_inputs([path]))]


def all_documents(root) -> list[list[int]]:
    """Every document's token ids, in document order, straight from the shards."""
    ds, out = Dataset(root), []
    for i in range(len(ds.shards)):
        tokens, offsets = ds.read_shard(i)
        out += [tokens[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]
    assert len(out) == ds.documents
    return out


def test_shipped_tokenizer_round_trips_the_corpus_and_the_shards_hold_its_ids(tmp_path):
    oracle = Tokenizer.from_file(str(SHIPPED))
    texts = documents(CORPUS)
    encoded = [e.ids for e in oracle.encode_batch(texts)]
    assert all(oracle.decode(ids) == text for ids, text in zip(encoded, texts))  # lossless on the corpus

    m = prepare([CORPUS], tmp_path / "ds", tokenizer=str(SHIPPED), shard_tokens=50_000)
    eos = oracle.token_to_id("<|endoftext|>")
    assert len(m["shards"]) > 3 and m["tokenizer"]["vocab_size"] == oracle.get_vocab_size() == 512
    assert all_documents(tmp_path / "ds") == [ids + [eos] for ids in encoded]
    assert m["tokens"] < CORPUS.stat().st_size / 2  # a BPE, not bytes

    # The tokenizer travels with its tokens: a byte-identical copy, named and checksummed in the manifest.
    verify(tmp_path / "ds")
    assert (tmp_path / "ds" / "tokenizer.json").read_bytes() == SHIPPED.read_bytes()
    assert m["tokenizer"] | {"vocab_size": 0} == {
        "kind": "pretrained", "vocab_size": 0, "eot_id": eos, "eot_token": "<|endoftext|>", "eot_first": False,
        "file": "tokenizer.json", "sha256": sha256_file(SHIPPED), "source": str(SHIPPED)}
    tok = load_tokenizer(tmp_path / "ds")
    assert tok.decode(all_documents(tmp_path / "ds")[7]) == texts[7]


def gpt2_pair(corpus, folder):
    """vocab.json + merges.txt in GPT-2's format, from a byte-level BPE trained here."""
    bpe = ByteLevelBPETokenizer()
    bpe.train([str(p) for p in sorted(corpus.iterdir())], vocab_size=300, special_tokens=["<|endoftext|>"],
              show_progress=False)
    folder.mkdir()
    bpe.save_model(str(folder))
    return folder


def test_gpt2_vocab_and_merges_give_the_ids_of_the_tokenizers_gpt2_loader(corpus, tmp_path):
    pair = gpt2_pair(corpus, tmp_path / "gpt2")
    texts = documents(corpus)
    oracle = ByteLevelBPETokenizer(str(pair / "vocab.json"), str(pair / "merges.txt"))
    eos = oracle.token_to_id("<|endoftext|>")
    m = prepare([corpus], tmp_path / "ds", tokenizer=str(pair), shard_tokens=1000)
    assert all_documents(tmp_path / "ds") == [e.ids + [eos] for e in oracle.encode_batch(texts)]
    assert m["tokenizer"]["eot_id"] == eos and m["tokenizer"]["vocab_size"] == 300
    # Stored as a tokenizer.json that loads without the pair and decodes what it encoded.
    shutil.rmtree(pair)
    tok = load_tokenizer(tmp_path / "ds")
    assert tok.decode(all_documents(tmp_path / "ds")[3]) == texts[3]


def test_gpt2_pair_matches_transformers(corpus, tmp_path):
    transformers = pytest.importorskip("transformers")
    pair = gpt2_pair(corpus, tmp_path / "gpt2")
    texts = documents(corpus) + ["two documents<|endoftext|>in one text"]  # GPT-2 keeps its EOS whole
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    oracle = transformers.GPT2Tokenizer(str(pair / "vocab.json"), str(pair / "merges.txt"))
    prepare([tmp_path / "in.jsonl"], tmp_path / "ds", tokenizer=str(pair))
    assert all_documents(tmp_path / "ds") == [oracle(t)["input_ids"] + [oracle.eos_token_id] for t in texts]


def save(tok: Tokenizer, folder, config: dict | None = None):
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def word_bpe(specials: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["alpha beta gamma delta epsilon"] * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return tok


def test_the_separator_is_the_eos_after_a_document_or_else_the_bos_before_it(corpus, tmp_path):
    texts = documents(corpus)

    def docs_with(tok: Tokenizer, folder, config=None) -> list[list[int]]:
        out = tmp_path / f"{folder}-ds"
        prepare([corpus], out, tokenizer=str(save(tok, tmp_path / folder, config)))
        return all_documents(out)

    # Llama style: the file's post-processor adds <s>; </s> ends a document once, not twice.
    llama = word_bpe(["<unk>", "<s>", "</s>"])
    llama.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    assert docs_with(llama, "llama") == [e.ids + [2] for e in llama.encode_batch(texts)]
    assert all(d[0] == 1 and d[-1] == 2 and 2 not in d[:-1] for d in docs_with(llama, "llama2"))
    # Only a begin-of-text token: it goes before each document.
    bos_only = word_bpe(["<|begin_of_text|>"])
    assert docs_with(bos_only, "bos") == [[0] + e.ids for e in bos_only.encode_batch(texts)]
    # tokenizer_config.json names the EOS (here a token no built-in list knows).
    chat = word_bpe(["<s>", "<|im_end|>"])
    assert docs_with(chat, "chat", {"eos_token": {"content": "<|im_end|>"}}) == \
        [e.ids + [1] for e in chat.encode_batch(texts)]


def write(folder, files: dict[str, str]) -> None:
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)


@pytest.mark.parametrize("setup, error", [
    (lambda d: save(word_bpe(["<pad>"]), d), "no end-of-text or begin-of-text special token"),
    (lambda d: save(word_bpe(["</s>"]), d, {"eos_token": "<eos>"}), "eos_token '<eos>' from .* is not in the vocab"),
    (lambda d: write(d, {"tokenizer.json": '{"version": "1.0"}'}), "not a tokenizer file"),
    (lambda d: write(d, {"vocab.json": "{}"}), "holds neither tokenizer.json nor GPT-2"),
    (lambda d: write(d, {"vocab.json": "{}", "merges.txt": "a b\n"}), "not a GPT-2 vocab.json \\+ merges.txt pair"),
])
def test_a_tokenizer_that_cannot_separate_documents_or_is_not_one_is_refused(corpus, tmp_path, setup, error):
    setup(tmp_path / "tok")
    with pytest.raises(DataError, match=error):
        prepare([corpus], tmp_path / "out", tokenizer=str(tmp_path / "tok"))
    assert not (tmp_path / "out").exists()


def test_a_lone_vocab_json_and_a_missing_path_say_what_to_give(corpus, tmp_path):
    pair = gpt2_pair(corpus, tmp_path / "gpt2")
    with pytest.raises(DataError, match="a GPT-2 vocab.json needs its merges.txt: give the folder holding both"):
        prepare([corpus], tmp_path / "out", tokenizer=str(pair / "vocab.json"))
    with pytest.raises(DataError, match="tokenizer nowhere.json: not found \\(byte, bpe, or a path"):
        prepare([corpus], tmp_path / "out", tokenizer="nowhere.json")


def test_text_source_prepares_with_the_pretrained_tokenizer_once_per_content(tmp_path, sources):
    run = tmp_path / "run"
    (rank,) = sources(CORPUS, source="text", tokenizer=str(SHIPPED), run_dir=run, vocab=512, seq=256)
    boundaries = 0
    for _ in range(4):
        b = rank.next_sample()
        crosses = b.document_ids[:, 1:] != b.document_ids[:, :-1]
        assert b.input_ids.max() < 512 and (b.input_ids[:, :-1][crosses] == 0).all()  # <|endoftext|> = 0 ends one
        boundaries += int(crosses.sum())
    assert boundaries > 0
    (prepared,) = (run / "data").glob("text-*")
    assert load_tokenizer(prepared).kind == "pretrained"
    edited = tmp_path / "edited"
    edited.mkdir()
    json.dump({**json.loads(SHIPPED.read_text()), "normalizer": {"type": "Lowercase"}},
              (edited / "tokenizer.json").open("w"))
    assert prepare_cached(CORPUS, run, tokenizer=str(edited)) != prepared  # another tokenizer, other tokens
    with pytest.raises(DataError, match="tokenizer vocab_size=512 exceeds model.vocab=300"):
        sources(CORPUS, source="text", tokenizer=str(SHIPPED), run_dir=tmp_path / "run2", vocab=300)


def test_cli_prepare_with_a_tokenizer_path(tmp_path, capsys, monkeypatch):
    from megascale import cli

    if "megascale.data.cli" not in cli.COMMAND_MODULES:
        monkeypatch.setattr(cli, "COMMAND_MODULES", [*cli.COMMAND_MODULES, "megascale.data.cli"])
    argv = ["data", "prepare", "--input", str(CORPUS), "--output", str(tmp_path / "ds"), "--tokenizer"]
    assert cli.main([*argv, str(SHIPPED.parent)]) == 0  # the folder holding tokenizer.json
    assert "221 documents" in capsys.readouterr().out
    assert Dataset(tmp_path / "ds").tokenizer_kind == "pretrained"
    assert cli.main([*argv, str(SHIPPED), "--vocab", "300", "--force"]) == 2
    assert "--vocab applies to --tokenizer bpe only" in capsys.readouterr().err
