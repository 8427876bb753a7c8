"""ROUGE-L against a brute-force LCS, the memorization protocol with oracle models, and a tiny
model that memorizes 4 documents through the trainer and a checkpoint."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llm import checkpoint
from llm.memorization import memorization, split_document
from llm.rouge import lcs_length, rouge_l


def brute_lcs(a, b):
    for n in range(min(len(a), len(b)), 0, -1):
        subs = set(itertools.combinations(a, n))
        if any(s in subs for s in itertools.combinations(b, n)):
            return n
    return 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=7), st.lists(st.integers(0, 3), max_size=7))
def test_lcs_matches_brute_force(a, b):
    assert lcs_length(a, b) == lcs_length(b, a) == brute_lcs(a, b)


def test_rouge_l_values():
    assert rouge_l("abcd", "abcd") == 1.0
    assert rouge_l("", "abc") == 0.0 and rouge_l("xyz", "abc") == 0.0
    # LCS("abcde", "ace") = 3: P = 3/5, R = 1, F = 2PR/(P+R) = 0.75
    assert rouge_l("abcde", "ace") == pytest.approx(0.75)
    assert rouge_l([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="beta"):
        rouge_l("a", "a", beta=0)


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
    from common.grid import ProcessGrid
    from llm.data import load_documents, truncate_docs
    from llm.model import GPTConfig
    from llm.parallel import make_groups
    from llm.train import run
    from llm.trainer import DataConfig, GoldfishConfig, OptimConfig, TrainConfig, Trainer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        config = GPTConfig(vocab_size=256, n_layer=2, n_head=4, d_model=32, d_ff=64,
                           max_seq_len=32)
        trainer = Trainer(config, DataConfig(docs=4, seq_len=32, batch_size=4, eval_batches=0),
                          OptimConfig(lr=1e-2, warmup_steps=10, weight_decay=0.0),
                          GoldfishConfig(), TrainConfig(epochs=120),
                          make_groups(ProcessGrid.axonn(1, 1, 1, 1), 0))
        run(trainer, out=str(tmp_path))
        model, _ = checkpoint.load_model(tmp_path)
        docs = truncate_docs(load_documents(), 4, 32)
        assert memorization(model, docs, suffix_len=8)["exact_match"] == 1.0
    finally:
        torch.set_num_threads(threads)
