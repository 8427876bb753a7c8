"""The memorization protocol with oracle models, and a tiny model that memorizes 4 documents
through the trainer and a checkpoint."""

import pytest
import torch

from llm import checkpoint
from llm.memorization import memorization, split_document


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
    from llm.data import load_documents, truncate_docs
    from llm.model import GPTConfig
    from llm.trainer import DataConfig, GoldfishConfig, OptimConfig, RunConfig, Trainer, run
    from tests.llm.helpers import one_rank_groups

    config = GPTConfig(vocab_size=256, num_layers=2, num_heads=4, d_model=32, d_ff=64,
                       max_seq_len=32)
    trainer = Trainer(config, DataConfig(docs=4, seq_len=32, batch_size=4, eval_batches=0),
                      OptimConfig(lr=1e-2, warmup_steps=10, weight_decay=0.0),
                      GoldfishConfig(), RunConfig(epochs=120), one_rank_groups())
    run(trainer, checkpoint=CheckpointConfig(dir=str(tmp_path)))
    model, _ = checkpoint.load_model(tmp_path)
    docs = truncate_docs(load_documents(), 4, 32)
    assert memorization(model, docs, suffix_len=8)["exact_match"] == 1.0
