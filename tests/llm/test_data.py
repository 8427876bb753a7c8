"""Byte tokenizer, offline corpus, document handling and the resumable batch iterator."""

import pytest
import torch

from llm.data import (
    VOCAB_SIZE,
    BatchIterator,
    decode,
    encode,
    encode_stream,
    load_documents,
    split_documents,
    truncate_docs,
)


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
