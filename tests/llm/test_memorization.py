"""The memorization protocol with oracle models, a tiny model that memorizes 4 documents
through the trainer and a checkpoint, a stream run scored on its training split only (and told
it saw windows), and the CLI on a Hugging Face model imported with
llm.convert (documents from flags, the model's own tokenizer, ``--device``; the CUDA runs:
tests/llm/test_gpu.py)."""

import json

import pytest
import torch

from llm import checkpoint
from llm.memorization import memorization, split_document
from tests.llm import test_init_hf


class Oracle:
    """Continues each prefix with the true document, except ``wrong`` last tokens."""

    def __init__(self, docs, wrong=0):
        self.docs, self.wrong = docs, wrong

    def generate(self, idx, max_new_tokens):
        rows = []
        for prefix in idx:
            doc = next(d for d in self.docs if torch.equal(d[: len(prefix)], prefix))
            out = doc[: len(prefix) + max_new_tokens].clone()
            if self.wrong:
                out[-self.wrong :] = (out[-self.wrong :] + 1) % 256
            rows.append(out)
        return torch.stack(rows)


def test_protocol_with_oracles():
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(256, (n,), generator=g) for n in (20, 20, 13, 30)]  # mixed lengths
    perfect = memorization(Oracle(docs), docs, suffix_len=8, batch_size=1)
    assert perfect["exact_match"] == 1.0 and perfect["rouge_l"] == 1.0
    assert perfect["num_docs"] == 4 and perfect["exact"] == [True] * 4
    one_off = memorization(Oracle(docs, wrong=1), docs, suffix_len=8)
    assert one_off["exact_match"] == 0.0
    assert one_off["rouge_l"] == pytest.approx(7 / 8)
    prefix, suffix = split_document(docs[0], 8)
    assert torch.equal(torch.cat((prefix, suffix)), docs[0]) and len(suffix) == 8
    with pytest.raises(ValueError, match="no prefix"):
        memorization(Oracle(docs), docs, suffix_len=13)
    with pytest.raises(ValueError, match="suffix-len"):
        split_document(docs[0], 0)


def test_tiny_model_memorizes_four_documents(tmp_path):
    """Standard loss, 4 documents of 33 tokens, 120 epochs: every 8-token suffix recited."""
    from common.run import CheckpointConfig
    from llm.config import DataConfig, GoldfishConfig, OptimConfig, RunConfig
    from llm.data.batches import load_documents, truncate_docs
    from llm.model import GPTConfig
    from llm.trainer import Trainer, run
    from tests.llm.helpers import one_rank

    config = GPTConfig(vocab_size=256, num_layers=2, num_heads=4, d_model=32, d_ff=64,
                       max_seq_len=32)
    trainer = Trainer(config, DataConfig(docs=4, seq_len=32, batch_size=4, eval_batches=0),
                      OptimConfig(lr=1e-2, warmup_steps=10, weight_decay=0.0),
                      GoldfishConfig(), RunConfig(epochs=120), one_rank())
    run(trainer, checkpoint=CheckpointConfig(dir=str(tmp_path)))
    model, _ = checkpoint.load_model(tmp_path)
    docs = truncate_docs(load_documents(), 4, 32)
    assert memorization(model, docs, suffix_len=8)["exact_match"] == 1.0


def test_documents_follow_the_checkpoint_unless_flags_say_otherwise(tmp_path):
    from llm.data.batches import load_documents, truncate_docs
    from llm.data.tokenizers import ByteTokenizer
    from llm.memorization import documents, parse_args

    data = {"source": "pydoc", "paths": [], "docs": 3, "seq_len": 16, "tokenizer": "bytes",
            "val_fraction": 0.1, "seed": 0, "token_cache": None}

    def docs_of(data, *flags):
        args = parse_args(["--checkpoint", "c", *flags])
        return documents(args, {"step": 1, "configs": {"data": data}}, ByteTokenizer())

    docs, seq_len, seen = docs_of(data)
    assert (seq_len, seen) == (16, "documents")
    want = truncate_docs(load_documents(), 3, 16)
    assert [d.tolist() for d in docs] == [d.tolist() for d in want]
    assert all(len(d) == 17 for d in docs)  # seq_len + 1 tokens, as the trainer cuts them
    text = tmp_path / "a.txt"
    text.write_text("one\n\ntwo words\n")
    docs, seq_len, _ = docs_of(data, "--text", str(text), "--text-split", "paragraphs",
                               "--docs", "2", "--seq-len", "4")
    assert (seq_len, [d.tolist() for d in docs]) == (4, [list(b"one"), list(b"two w")])
    with pytest.raises(ValueError, match=r"trained on a stream.*pass --docs N"):
        docs_of({**data, "docs": None})
    with pytest.raises(ValueError, match=r"token file.*pass --text"):
        docs_of({**data, "docs": None, "source": "tokens"}, "--docs", "2")


def test_a_stream_run_is_scored_on_its_training_split_only():
    """A stream run held out a seeded share of the documents: none of them is scored, and the
    documents are the training split's first N, not the corpus's."""
    from llm.data.batches import load_documents, split_documents, truncate_docs
    from llm.data.tokenizers import ByteTokenizer
    from llm.memorization import documents, parse_args

    data = {"source": "pydoc", "paths": [], "docs": None, "seq_len": 16, "tokenizer": "bytes",
            "val_fraction": 0.5, "seed": 3, "token_cache": None}

    def docs_of(data, *flags):
        args = parse_args(["--checkpoint", "c", *flags])
        return documents(args, {"step": 1, "configs": {"data": data}}, ByteTokenizer())

    corpus = load_documents()
    train, held = split_documents(corpus, 0.5, 3)
    assert train[:8] != corpus[:8]  # the split reaches into the first documents
    docs, seq_len, seen = docs_of(data, "--docs", "8")
    assert (seq_len, seen) == (16, "windows")
    want = truncate_docs(train, 8, 16)
    assert [d.tolist() for d in docs] == [d.tolist() for d in want]
    held_cut = {tuple(d.tolist()) for d in truncate_docs(held, len(held), 16)}
    assert not held_cut & {tuple(d.tolist()) for d in docs}
    with pytest.raises(ValueError, match=f"training split holds {len(train)} documents"):
        docs_of(data, "--docs", str(len(train) + 1))
    with pytest.raises(ValueError, match=r"token cache.*pass --text"):
        docs_of({**data, "token_cache": "cache"}, "--docs", "2")


def test_cli_on_a_stream_run_says_it_saw_windows(tmp_path, capsys):
    from llm.memorization import main
    from tests.llm.helpers import make_trainer, one_rank

    trainer = make_trainer(one_rank(), steps=1)  # a stream run (no --docs)
    trainer.save(str(tmp_path), keep=1, is_main=True)
    base = ["--checkpoint", str(tmp_path), "--device", "cpu", "--suffix-len", "4"]
    assert main(base) == 2
    assert "pass --docs N" in capsys.readouterr().err
    assert main([*base, "--docs", "3"]) == 0
    out = capsys.readouterr().out
    assert "random windows of a token stream, not whole documents" in out
    assert "the first 3 documents of its training split" in out
    assert main([*base, "--docs", "3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["trained_on"], result["num_docs"]) == ("windows", 3)


# ------------------------------------------------- a Hugging Face model imported with llm.convert

hf_dir = test_init_hf.hf_dir  # the fixture: a random HF Llama with a BPE tokenizer.json


@pytest.fixture(scope="module")
def imported(hf_dir, tmp_path_factory):
    """``hf_dir`` through ``python -m llm.convert import``: a meta without training configs."""
    from llm.convert import main as convert_main

    out = tmp_path_factory.mktemp("imported") / "llama.safetensors"
    assert convert_main(["import", str(hf_dir), str(out)]) == 0
    return out


def test_imported_checkpoint_needs_the_documents_and_uses_its_tokenizer(imported, hf_dir,
                                                                       tmp_path, capsys):
    from llm.data.batches import load_documents, truncate_docs
    from llm.data.tokenizers import load_tokenizer
    from llm.memorization import main

    texts = [doc[:2000] for doc in load_documents()[:2]]
    files = []
    for i, text in enumerate(texts):
        files.append(str(tmp_path / f"doc{i}.txt"))
        (tmp_path / f"doc{i}.txt").write_text(text, encoding="utf-8")
    base = ["--checkpoint", str(imported), "--suffix-len", "8"]
    assert main(base) == 2
    err = capsys.readouterr().err
    assert "has no training configs" in err and "missing --text, --docs, --seq-len" in err
    assert main([*base, "--text", *files, "--docs", "2"]) == 2
    assert "missing --seq-len" in capsys.readouterr().err
    assert main([*base, "--text", *files, "--docs", "2", "--seq-len", "24", "--json",
                 "--device", "cpu"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tokenizer"] == str(hf_dir.resolve())  # the directory it was imported from
    assert (result["num_docs"], result["seq_len"], result["step"]) == (2, 24, 0)
    assert result["goldfish"] is None
    # the documents were cut from the BPE's tokens, not the bytes
    model, _ = checkpoint.load_model(imported)
    docs = truncate_docs(texts, 2, 24, load_tokenizer(hf_dir))
    want = memorization(model, docs, suffix_len=8)
    assert (result["exact"], result["rouge"]) == (want["exact"], want["rouge"])
    assert main([*base, "--text", *files, "--docs", "2", "--seq-len", "24",
                 "--tokenizer", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_cli_device_cuda_without_a_gpu_is_refused_by_name(imported, capsys):
    from llm.memorization import main

    assert main(["--checkpoint", str(imported), "--device", "cuda"]) == 2
    assert "--device cuda was asked for, but torch sees no CUDA device" in \
        capsys.readouterr().err
