"""Tokenizers (bytes, a locally trained Hugging Face BPE) and the ``python -m llm.tokenize`` CLI."""

import json

import numpy as np
import pytest
import torch

from llm.data.batches import BatchIterator, encode, encode_stream, load_documents, truncate_docs
from llm.data.streams import open_stream, open_tokens
from llm.data.tokenizers import (
    DOC_SEPARATOR,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
    spec_of_checkpoint,
)
from llm.tokenize import main as tokenize_main
from tests.llm.data.test_data import check_mapped_batches

tokenizers = pytest.importorskip("tokenizers")

VOCAB = 400
TEXTS = ["", "hello world\n", "naïve café — 日本語 🐟", "def f(x):\n    return x  # ok\n\n"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A directory holding a byte-level BPE (vocabulary 400, special tokens
    <|endoftext|> and <pad>) trained on the pydoc corpus, like a model's tokenizer.json."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator(load_documents("pydoc"), trainer)
    directory = tmp_path_factory.mktemp("bpe")
    bpe.save(str(directory / "tokenizer.json"))
    return directory


@pytest.fixture(scope="module")
def bpe(model_dir) -> HFTokenizer:
    return load_tokenizer(model_dir / "tokenizer.json")


def small_docs(num_docs=4, chars=3000):
    return [doc[:chars] for doc in load_documents()[:num_docs]]


def test_byte_tokenizer_is_todays_encoding():
    tok = load_tokenizer("bytes")
    assert isinstance(tok, ByteTokenizer) and tok.name == "bytes" and tok.vocab_size == 256
    assert tok.eos_id is None and tok.bos_id is None
    for text in TEXTS:
        assert torch.equal(tok.encode(text), encode(text)) and tok.decode(encode(text)) == text
    docs = small_docs()
    stream = encode_stream(docs)
    assert torch.equal(stream, encode("".join(doc + DOC_SEPARATOR for doc in docs)))
    assert torch.equal(stream, torch.cat(tok.encode_documents(docs)))
    assert load_tokenizer(tok) is tok
    tok.check_vocab(256)


def test_hf_roundtrip(bpe, model_dir):
    assert bpe.vocab_size == VOCAB and bpe.name == str(model_dir / "tokenizer.json")
    assert bpe.eos_id == 0 and bpe.bos_id is None  # <|endoftext|> is a usual eos name
    for text in TEXTS + small_docs(2):
        ids = bpe.encode(text)
        assert ids.dtype == torch.int64 and ids.dim() == 1
        assert ids.numel() == 0 or (0 <= ids.min() and ids.max() < VOCAB)
        assert bpe.decode(ids) == text and bpe.decode(ids.tolist()) == text
    doc = small_docs(1)[0]
    assert bpe.encode(doc).numel() < len(doc.encode()) / 1.5  # merges compress the corpus
    assert bpe.decode([bpe.eos_id]) == "<|endoftext|>"  # special tokens are written out


def test_hf_documents_end_with_eos(bpe):
    docs = small_docs()
    stream = encode_stream(docs, bpe)
    expected = torch.cat([torch.cat((bpe.encode(d), torch.tensor([bpe.eos_id]))) for d in docs])
    assert torch.equal(stream, expected)
    assert int((stream == bpe.eos_id).sum()) == len(docs)
    assert all(torch.equal(a, bpe.encode_document(d))
               for a, d in zip(bpe.encode_documents(docs), docs))
    cut = truncate_docs(docs, num_docs=2, seq_len=16, tokenizer=bpe)
    assert [t.tolist() for t in cut] == [bpe.encode(d)[:17].tolist() for d in docs[:2]]


def test_model_directory_lookup(bpe, model_dir, tmp_path):
    by_dir = load_tokenizer(str(model_dir), vocab_size=512)
    assert by_dir.vocab_size == VOCAB and by_dir.name == str(model_dir)
    text = small_docs(1)[0]
    assert torch.equal(by_dir.encode(text), bpe.encode(text))
    # a model directory's tokenizer_config.json names the special tokens
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "<pad>"}, "bos_token": "<|endoftext|>"}))
    named = load_tokenizer(tmp_path)
    assert (named.eos_id, named.bos_id) == (1, 0)
    assert named.encode_document("x")[-1] == 1
    assert HFTokenizer(tmp_path, eos_token="<|endoftext|>").eos_id == 0
    assert named.fingerprint() != bpe.fingerprint()  # another eos: other token streams


def test_tokenizer_without_eos_separates_documents_with_a_blank_line(model_dir, tmp_path):
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] != "<|endoftext|>"]
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    plain = load_tokenizer(tmp_path)
    assert plain.eos_id is None
    assert torch.equal(plain.encode_document("abc"), plain.encode("abc" + DOC_SEPARATOR))
    assert torch.equal(encode_stream(["abc", "de"], plain),
                       torch.cat((plain.encode("abc\n\n"), plain.encode("de\n\n"))))


def test_spec_of_checkpoint(model_dir):
    trained = {"step": 5, "configs": {"data": {"source": "pydoc", "tokenizer": str(model_dir)}}}
    assert load_tokenizer(spec_of_checkpoint(trained)).vocab_size == VOCAB
    old = {"step": 5, "configs": {"data": {"source": "pydoc"}}}  # before --tokenizer
    assert spec_of_checkpoint(old) == "bytes"
    converted = {"step": 0, "source": {"hf_dir": "/models/llama", "hf_config": {}}}
    assert spec_of_checkpoint(converted) == "/models/llama"


def test_errors(bpe, model_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nowhere\.json.*'bytes'"):
        load_tokenizer(tmp_path / "nowhere.json")
    with pytest.raises(FileNotFoundError, match=r"has no tokenizer\.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "vocab.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"vocab\.json.*save_pretrained"):
        load_tokenizer(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"not a readable Hugging Face tokenizer\.json"):
        load_tokenizer(bad)
    with pytest.raises(ValueError, match=r"vocabulary of 400 token ids.*vocab_size is 256"):
        load_tokenizer(model_dir, vocab_size=256)
    with pytest.raises(ValueError, match="not in the vocabulary"):
        HFTokenizer(model_dir, eos_token="</s>")


def test_cli_writes_a_token_file(bpe, model_dir, tmp_path, capsys):
    docs = small_docs()
    paths = []
    for i, doc in enumerate(docs):
        paths.append(tmp_path / f"doc{i}.txt")
        paths[-1].write_text(doc, encoding="utf-8")
    out = tmp_path / "out" / "train.bin"
    assert tokenize_main([*map(str, paths), "--tokenizer", str(model_dir),
                          "--out", str(out)]) == 0
    assert "tokens of 4 documents" in capsys.readouterr().out
    tokens = open_tokens(out, vocab_size=VOCAB)
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16
    assert out.stat().st_size == 2 * len(tokens)  # raw uint16, as nanoGPT writes
    stream = encode_stream(load_documents("files", paths), bpe)
    assert np.array_equal(tokens, stream.numpy())

    def make(data):
        return BatchIterator(data, batch_size=4, seq_len=24, seed=3)

    assert make(tokens).data is tokens  # windows are read from the map, the file is not loaded
    check_mapped_batches(make, tokens, stream, lambda: open_tokens(out))


def test_cli_npy_and_jsonl(bpe, model_dir, tmp_path):
    docs = small_docs(3)
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(docs)))
    out = tmp_path / "train.npy"
    assert tokenize_main([str(jsonl), "--field", "body", "--tokenizer", str(model_dir),
                          "--out", str(out)]) == 0
    assert np.array_equal(np.load(out), encode_stream(docs, bpe).numpy())
    assert tokenize_main([str(jsonl), "--out", str(tmp_path / "x.bin")]) == 2  # no "text"
    assert tokenize_main([str(jsonl), "--tokenizer", str(tmp_path / "none"),
                          "--out", str(tmp_path / "x.bin")]) == 2
    assert tokenize_main([str(jsonl), "--tokenizer", str(model_dir), "--vocab-size", "256",
                          "--out", str(tmp_path / "x.bin")]) == 2
    assert not (tmp_path / "x.bin").exists()


def test_jsonl_stream_end_to_end(bpe, tmp_path):
    docs = small_docs()
    jsonl = tmp_path / "corpus.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    cache = tmp_path / "cache"
    tokens = open_stream([jsonl], bpe, cache_dir=cache, vocab_size=VOCAB)
    assert isinstance(tokens, np.memmap)
    assert np.array_equal(tokens, encode_stream(load_documents("files", [jsonl]), bpe).numpy())
    assert len(list(cache.iterdir())) == 1
    again = open_stream([jsonl], bpe, cache_dir=cache)  # cached: the same file
    assert again.filename == tokens.filename
    assert open_stream([jsonl], cache_dir=cache).filename != tokens.filename  # bytes: another
    batches = BatchIterator(tokens, batch_size=2, seq_len=32, seed=1)
    x, y = next(batches)
    assert x.shape == y.shape == (2, 32) and int(x.max()) < VOCAB


class HugeVocab(Tokenizer):
    """Ids beyond uint16: a .bin cannot hold them, a .npy is written as uint32."""

    name, vocab_size, eos_id = "huge", 70_000, 69_999

    def encode(self, text):
        return torch.tensor([65_536 + ord(c) % 1000 for c in text], dtype=torch.int64)

    def decode(self, ids):
        raise NotImplementedError


def test_large_vocabularies_need_npy(tmp_path):
    from llm.data.streams import write_tokens

    with pytest.raises(ValueError, match=r"70000 token ids.*65536.*\.npy"):
        write_tokens(["abc"], tmp_path / "big.bin", HugeVocab())
    assert write_tokens(["abc", "de"], tmp_path / "big.npy", HugeVocab()) == (7, 2)
    tokens = open_tokens(tmp_path / "big.npy", vocab_size=70_000)
    base = 65_536
    assert tokens.dtype == np.uint32
    assert tokens.tolist() == [base + 97, base + 98, base + 99, 69_999, base + 100, base + 101,
                               69_999]


def test_train_memorize_and_sample_with_a_bpe(bpe, model_dir, tmp_path, capsys):
    """llm.train --tokenizer PATH; llm.memorization and llm.sample take the tokenizer from the
    checkpoint's meta: 4 documents of 33 BPE tokens are recited, the prompt continues them."""
    from llm.memorization import main as memorization_main
    from llm.sample import main as sample_main
    from llm.train import main as train_main

    spec, ckpt = str(model_dir / "tokenizer.json"), str(tmp_path / "ckpt")
    assert train_main(["--tokenizer", spec, "--vocab-size", str(VOCAB), "--docs", "4",
                       "--seq-len", "32", "--batch-size", "4", "--epochs", "120", "--lr", "1e-2",
                       "--warmup", "10", "--weight-decay", "0", "--eval-batches", "0",
                       "--log-every", "0", "--checkpoint-dir", ckpt]) == 0
    assert f"tokenizer {spec}" in capsys.readouterr().out
    assert memorization_main(["--checkpoint", ckpt, "--suffix-len", "8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tokenizer"] == spec and result["num_docs"] == 4 and result["seq_len"] == 32
    assert result["exact_match"] == 1.0
    # the same weights read through bytes see other sequences and recite none of them
    assert memorization_main(["--checkpoint", ckpt, "--suffix-len", "8", "--json",
                              "--tokenizer", "bytes"]) == 0
    assert json.loads(capsys.readouterr().out)["exact_match"] == 0.0
    doc = truncate_docs(load_documents(), 1, 32, bpe)[0]  # [33], as training saw it
    prompt = bpe.decode(doc[:16])
    assert torch.equal(bpe.encode(prompt), doc[:16])
    assert sample_main(["--checkpoint", ckpt, "--prompt", prompt, "--tokens", "16",
                        "--temperature", "0"]) == 0
    assert capsys.readouterr().out == bpe.decode(doc[:32]) + "\n"
