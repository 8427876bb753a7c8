"""Byte tokenizer, offline corpus, document handling, the resumable batch iterator and the
streaming sources of llm.data.streams (token files, JSON lines)."""

import numpy as np
import pytest
import torch

from llm.data.batches import (
    VOCAB_SIZE,
    BatchIterator,
    decode,
    encode,
    encode_stream,
    iter_jsonl,
    load_documents,
    split_documents,
    truncate_docs,
)
from llm.data.streams import iter_documents, open_stream, open_tokens, split_tokens, write_tokens


@pytest.mark.parametrize("text", ["", "hello world\n", "naïve café — 日本語 🐟", "\x00\xff"])
def test_tokenizer_roundtrip(text):
    tokens = encode(text)
    assert tokens.dtype == torch.int64 and tokens.dim() == 1
    assert len(tokens) == len(text.encode("utf-8"))
    assert tokens.numel() == 0 or (0 <= tokens.min() and tokens.max() < VOCAB_SIZE)
    assert decode(tokens) == text
    assert decode(tokens.tolist()) == text


def test_decode_of_a_cut_character_does_not_raise():
    assert decode(encode("é")[:1]) == "\ufffd"


def test_pydoc_corpus():
    docs = load_documents()
    assert 70 <= len(docs) <= 90
    total = sum(len(doc.encode("utf-8")) for doc in docs)
    assert 400_000 <= total <= 550_000
    from pydoc_data.topics import topics

    assert docs == [topics[key] for key in sorted(topics)]
    assert load_documents("pydoc") == docs


def test_user_files(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("first para\nstill first\n\n  \nsecond para\n\n\n", encoding="utf-8")
    b.write_text("third\n", encoding="utf-8")
    assert load_documents("files", [a, b]) == [a.read_text(), "third\n"]
    assert load_documents("paragraphs", [str(a), b]) == [
        "first para\nstill first", "second para", "third"]


def test_load_documents_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown text source"):
        load_documents("wiki")
    with pytest.raises(ValueError, match="takes no paths"):
        load_documents("pydoc", ["x.txt"])
    with pytest.raises(ValueError, match="needs paths"):
        load_documents("files")
    with pytest.raises(FileNotFoundError, match=r"missing\.txt"):
        load_documents("files", [tmp_path / "missing.txt"])
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n", encoding="utf-8")
    with pytest.raises(ValueError, match="no text"):
        load_documents("paragraphs", [empty])


def test_truncate_docs():
    docs = ["abcdefghij", "xyz", "0123456789abcdef"]
    out = truncate_docs(docs, num_docs=2, seq_len=4)
    assert [decode(t) for t in out] == ["abcde", "xyz"]  # seq_len + 1 tokens, or fewer
    assert [decode(t) for t in truncate_docs(docs, 3, 100)] == docs
    with pytest.raises(ValueError, match="num_docs"):
        truncate_docs(docs, 4, 4)
    with pytest.raises(ValueError, match="seq_len"):
        truncate_docs(docs, 1, 0)


def test_split_documents():
    docs = [f"doc {i}" for i in range(20)]
    train, val = split_documents(docs, val_fraction=0.1, seed=3)
    assert len(val) == 2 and len(train) == 18
    assert sorted(train + val) == sorted(docs)
    assert train == sorted(train, key=docs.index)  # corpus order kept
    assert (train, val) == split_documents(docs, val_fraction=0.1, seed=3)
    assert split_documents(docs, 0.0) == (docs, [])
    with pytest.raises(ValueError, match="val_fraction"):
        split_documents(docs, 1.0)


def stream_iterator(seed=0):
    return BatchIterator(encode_stream(load_documents()[:5]), batch_size=4, seq_len=32, seed=seed)


def test_stream_batches():
    it = stream_iterator()
    inputs, targets = next(it)
    assert inputs.shape == targets.shape == (4, 32)
    assert inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets are inputs shifted by one
    stream = it.data
    for row in range(4):  # each row is a real window of the stream
        window = torch.cat((inputs[row], targets[row, -1:]))  # [33]
        assert (stream.unfold(0, 33, 1) == window).all(dim=1).any()


def test_stream_is_deterministic_and_seeded():
    a, b, c = stream_iterator(), stream_iterator(), stream_iterator(seed=1)
    for _ in range(3):
        xa, _ = next(a)
        xb, _ = next(b)
        xc, _ = next(c)
        assert torch.equal(xa, xb) and not torch.equal(xa, xc)


@pytest.mark.parametrize("mode", ["stream", "documents"])
def test_exact_resume_mid_epoch(mode):
    docs = truncate_docs(load_documents(), num_docs=10, seq_len=48)
    data = docs if mode == "documents" else encode_stream(load_documents()[:2])[:500]

    def make():
        return BatchIterator(data, batch_size=3, seq_len=48, mode=mode, seed=7)

    it = make()
    for _ in range(2):  # mid-epoch
        next(it)
    state = it.state_dict()
    assert state["epoch"] == 0 and state["position"] == 6
    expected = [next(it) for _ in range(9)]  # runs across epoch boundaries
    resumed = make()
    resumed.load_state_dict(dict(state))
    for x, y in expected:
        rx, ry = next(resumed)
        assert torch.equal(x, rx) and torch.equal(y, ry)
    assert resumed.state_dict() == it.state_dict()
    assert it.epoch >= 2


def test_document_epochs():
    docs = truncate_docs(load_documents(), num_docs=7, seq_len=40)
    docs[3] = docs[3][:10]  # a short document gets padded
    it = BatchIterator(docs, batch_size=3, seq_len=40, mode="documents", ignore_index=-1)
    assert it.steps_per_epoch == 3
    orders = []
    for _epoch in range(2):
        seen = []
        for step in range(3):
            inputs, targets = next(it)
            assert inputs.shape == targets.shape == (3 if step < 2 else 1, 40)
            for x, y in zip(inputs, targets, strict=True):
                n = int((y != -1).sum())
                match = [i for i, d in enumerate(docs) if torch.equal(d[1 : n + 1], y[:n])]
                assert len(match) == 1
                doc = docs[match[0]]
                assert torch.equal(x[:n], doc[:n]) and n == doc.numel() - 1
                assert (y[n:] == -1).all() and (x[n:] == 0).all()
                seen.append(match[0])
        assert sorted(seen) == list(range(7))  # every document once per epoch
        orders.append(seen)
    assert orders[0] != orders[1]  # reshuffled each epoch
    assert it.epoch == 2 and it.position == 0


def test_iterator_errors():
    with pytest.raises(ValueError, match="mode"):
        BatchIterator(torch.arange(100), batch_size=2, seq_len=8, mode="shuffle")
    with pytest.raises(ValueError, match="shorter than one sample"):
        BatchIterator(torch.arange(8), batch_size=2, seq_len=8)
    with pytest.raises(ValueError, match="1-D token tensor"):
        BatchIterator([torch.arange(10)], batch_size=2, seq_len=8)
    with pytest.raises(ValueError, match=">= 2 tokens"):
        BatchIterator([torch.arange(10), torch.arange(1)], batch_size=2, seq_len=8,
                      mode="documents")
    it = BatchIterator(torch.arange(100), batch_size=2, seq_len=8)
    other = BatchIterator(torch.arange(100), batch_size=4, seq_len=8)
    with pytest.raises(ValueError, match="batch_size"):
        other.load_state_dict(it.state_dict())


def test_state_dict_format_is_unchanged():
    it = stream_iterator()
    next(it)
    assert it.state_dict() == {"mode": "stream", "seed": 0, "epoch": 0, "position": 4,
                               "batch_size": 4, "seq_len": 32,
                               "num_samples": it.num_samples}


def write_corpus(tmp_path, docs):
    paths = []
    for i, doc in enumerate(docs):
        paths.append(tmp_path / f"doc{i}.txt")
        paths[-1].write_text(doc, encoding="utf-8")
    return paths


@pytest.mark.parametrize("suffix", [".bin", ".npy"])
def test_token_file_gives_the_in_memory_batches(tmp_path, suffix):
    docs = load_documents()[:3]
    out = tmp_path / f"train{suffix}"
    assert write_tokens(iter_documents(write_corpus(tmp_path, docs)), out) == (
        len(encode_stream(docs)), 3)
    tokens = open_tokens(out, vocab_size=VOCAB_SIZE)
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16
    stream = encode_stream(docs)
    assert np.array_equal(tokens, stream.numpy())
    if suffix == ".npy":
        assert np.array_equal(np.load(out), tokens)  # a standard .npy file

    def make(data):
        return BatchIterator(data, batch_size=3, seq_len=40, seed=5)

    assert make(tokens).num_samples == make(stream).num_samples
    check_mapped_batches(make, tokens, stream, lambda: open_tokens(out))


def check_mapped_batches(make, tokens, stream, reopen, steps=4):
    """Batches drawn from the memory-mapped ``tokens`` equal those from the in-memory
    ``stream``, and a fresh iterator over ``reopen()`` resumed from a state goes on alike."""
    mapped, in_memory = make(tokens), make(stream)
    for _ in range(steps):
        for a, b in zip(next(mapped), next(in_memory)):
            assert a.dtype == torch.int64 and torch.equal(a, b)
    state = mapped.state_dict()
    expected = [next(mapped) for _ in range(steps)]
    resumed = make(reopen())
    resumed.load_state_dict(state)
    for x, y in expected:
        rx, ry = next(resumed)
        assert torch.equal(x, rx) and torch.equal(y, ry)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint16])
def test_npy_of_any_integer_dtype(tmp_path, dtype):
    stream = encode_stream(load_documents()[:1])
    np.save(tmp_path / "t.npy", stream.numpy().astype(dtype))
    tokens = open_tokens(tmp_path / "t.npy", vocab_size=256)
    assert tokens.dtype == dtype
    a = BatchIterator(tokens, batch_size=2, seq_len=16, seed=2)
    b = BatchIterator(stream, batch_size=2, seq_len=16, seed=2)
    assert all(torch.equal(x, y) for x, y in zip(next(a), next(b)))


def test_token_file_errors(tmp_path):
    with pytest.raises(ValueError, match=r"\.bin .* or \.npy"):
        open_tokens(tmp_path / "t.txt")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_tokens(tmp_path / "missing.bin")
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(ValueError, match="3 bytes"):
        open_tokens(tmp_path / "odd.bin")
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="0 bytes"):
        open_tokens(tmp_path / "empty.bin")
    np.save(tmp_path / "grid.npy", np.zeros((2, 3), dtype=np.int64))
    with pytest.raises(ValueError, match=r"shape \(2, 3\)"):
        open_tokens(tmp_path / "grid.npy")
    np.save(tmp_path / "float.npy", np.zeros(5))
    with pytest.raises(ValueError, match="integer"):
        open_tokens(tmp_path / "float.npy")
    (tmp_path / "junk.npy").write_bytes(b"junk")
    with pytest.raises(ValueError, match="not a readable"):
        open_tokens(tmp_path / "junk.npy")
    np.array([3, 300, 7], dtype=np.uint16).tofile(tmp_path / "big.bin")
    with pytest.raises(ValueError, match=r"\[3, 300\].*vocab_size is 256"):
        open_tokens(tmp_path / "big.bin", vocab_size=256)
    with pytest.raises(ValueError, match="must end in"):
        write_tokens(["x"], tmp_path / "t.txt")
    with pytest.raises(ValueError, match="1-D integer array"):
        BatchIterator(np.zeros(100), batch_size=2, seq_len=8)


def test_split_tokens_keeps_the_map(tmp_path):
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "t.bin")
    tokens = open_tokens(tmp_path / "t.bin")
    train, val = split_tokens(tokens, 0.1)
    assert isinstance(train, np.memmap) and isinstance(val, np.memmap)
    assert (len(train), len(val)) == (900, 100) and val[0] == 900
    assert len(split_tokens(tokens, 0.0)[1]) == 0
    with pytest.raises(ValueError, match="val_fraction"):
        split_tokens(tokens, 1.0)


def test_streamed_documents_match_load_documents(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("one\ntwo\n\n \nthree\n\n\nfour", encoding="utf-8")
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_text('{"text": "first"}\n\n{"text": ""}\n{"text": "x\\ny", "n": 2}\n')
    for split in ("files", "paragraphs"):
        assert list(iter_documents([text, jsonl], split)) == load_documents(split, [text, jsonl])
    assert load_documents("files", [jsonl]) == ["first", "x\ny"]
    with pytest.raises(ValueError, match="unknown text split"):
        list(iter_documents([text], "lines"))
    (tmp_path / "x.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="token file"):
        list(iter_documents([tmp_path / "x.bin"]))


def test_jsonl_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not valid JSON"):
        list(iter_jsonl(bad))
    bad.write_text('{"text": "ok"}\n["a"]\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: expected a JSON object"):
        load_documents("files", [bad])
    bad.write_text('{"body": "ok"}\n')
    with pytest.raises(ValueError, match="string 'text' field"):
        list(iter_jsonl(bad))
    assert list(iter_jsonl(bad, field="body")) == ["ok"]


def test_open_stream_caches_text(tmp_path):
    docs = load_documents()[:2]
    paths = write_corpus(tmp_path, docs)
    cache = tmp_path / "cache"
    tokens = open_stream(paths, cache_dir=cache, vocab_size=256)
    assert np.array_equal(tokens, encode_stream(docs).numpy())
    assert open_stream(paths, cache_dir=cache).filename == tokens.filename  # reused
    paragraphs = open_stream(paths, cache_dir=cache, split="paragraphs")
    assert paragraphs.filename != tokens.filename  # another split, another file
    assert np.array_equal(paragraphs, encode_stream(load_documents("paragraphs", paths)).numpy())
    paths[0].write_text("edited", encoding="utf-8")
    edited = open_stream(paths, cache_dir=cache)
    assert edited.filename != tokens.filename and len(edited) < len(tokens)
    bin_file = tmp_path / "t.bin"
    write_tokens(docs, bin_file)
    assert np.array_equal(open_stream([bin_file]), tokens)  # a token file is opened as is
    with pytest.raises(ValueError, match="only input"):
        open_stream([bin_file, paths[0]])
    with pytest.raises(ValueError, match="cache_dir"):
        open_stream(paths)
    (tmp_path / "blank.txt").write_text("", encoding="utf-8")
    with pytest.raises(ValueError, match="no text"):
        open_stream([tmp_path / "blank.txt"], cache_dir=cache)
