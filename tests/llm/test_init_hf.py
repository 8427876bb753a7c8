"""llm.train --init HF_DIR: a Hugging Face Llama with its own BPE tokenizer.json, each rank
reading only its slices; the first step on 8 ranks (1x2x2x2) equals one rank's."""

import json

import pytest
import torch

from llm.hf import llama as hf
from llm.train import main as train_main
from tests.distributed import run_module
from tests.llm.helpers import one_rank
from tests.llm.test_train import _errors

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

VOCAB = 320  # the BPE's vocabulary is the model's
ARGS = ["--steps", "1", "--seq-len", "16", "--batch-size", "4", "--eval-batches", "1",
        "--log-every", "1"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A random LlamaForCausalLM (2 layers, hidden 64, 4 heads, 2 kv heads) saved with a
    byte-level BPE tokenizer.json trained here on the built-in corpus."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from llm.data.batches import load_documents

    directory = tmp_path_factory.mktemp("hf")
    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(load_documents("pydoc"), trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.save(str(directory / "tokenizer.json"))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def test_init_loads_the_weights_into_the_shards(hf_dir):
    from llm.config import DataConfig, GoldfishConfig, OptimConfig, RunConfig
    from llm.trainer import Trainer

    ck = hf.HFCheckpoint(hf_dir)
    trainer = Trainer(ck.config, DataConfig(seq_len=16, batch_size=2, tokenizer=str(
        hf_dir / "tokenizer.json")), OptimConfig(), GoldfishConfig(), RunConfig(steps=1),
        one_rank(), seed=3)
    trainer.init_from(ck)
    from safetensors.torch import load_file

    want = load_file(str(hf_dir / "model.safetensors"))
    for name, p in trainer.model.shards().items():
        assert torch.equal(p, want[hf.to_hf_name(name)]), name


def _loss(path):
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    return next(r for r in rows if "loss" in r)["loss"]


def test_init_trains_with_the_models_tokenizer(hf_dir, tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    assert train_main(["--init", str(hf_dir), *ARGS, "--metrics", str(metrics)]) == 0
    out = capsys.readouterr().out
    assert f"GPT from {hf_dir}" in out and f"tokenizer {hf_dir / 'tokenizer.json'}" in out
    assert 0 < _loss(metrics) < 2 * torch.log(torch.tensor(float(VOCAB)))
    assert "drop --preset" in _errors(["--init", str(hf_dir), "--preset", "tiny", *ARGS],
                                      capsys)
    # a tokenizer larger than the model's vocabulary is refused with both numbers
    assert "vocabulary of 320" in _errors(["--tokenizer", str(hf_dir), *ARGS], capsys)


def test_a_fine_tuned_model_exports_with_its_sources_token_ids(hf_dir, tmp_path, capsys):
    """The checkpoints of a run begun with --init record the model it began from (and a
    resumed run's too), so that llm.convert export writes its bos/eos ids: without them
    transformers' generate() would not stop at the end-of-text token."""
    from llm.convert import main as convert_main

    want = json.loads((hf_dir / "config.json").read_text())
    assert want["bos_token_id"] is not None and want["eos_token_id"] is not None
    ck = tmp_path / "ck"
    assert train_main(["--init", str(hf_dir), *ARGS, "--checkpoint-dir", str(ck)]) == 0
    resumed = [a if a != "1" else "2" for a in ARGS]  # --steps 2
    assert train_main(["--init", str(hf_dir), *resumed, "--checkpoint-dir", str(ck),
                       "--resume"]) == 0
    assert "resumed at step 1" in capsys.readouterr().out
    assert convert_main(["export", str(ck), str(tmp_path / "out")]) == 0
    got = json.loads((tmp_path / "out" / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert got.get(key) == want.get(key), key


@pytest.mark.slow
@pytest.mark.cross_shape  # a grid's sums against one rank's, through training: measured 1e-5
def test_init_on_8_ranks_equals_1_rank(hf_dir, tmp_path):
    one, eight = tmp_path / "1.jsonl", tmp_path / "8.jsonl"
    assert train_main(["--init", str(hf_dir), *ARGS, "--metrics", str(one)]) == 0
    r = run_module("llm.train", ["--init", str(hf_dir), *ARGS, "--grid", "1x2x2x2",
                                 "--metrics", str(eight)], ranks=8, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert _loss(eight) == pytest.approx(_loss(one), rel=1e-5)


def test_token_file_and_token_cache_feed_the_trainer(hf_dir, tmp_path, capsys):
    from llm.tokenize import main as tokenize_main

    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    tokens = tmp_path / "corpus.bin"
    assert tokenize_main([str(text), "--tokenizer", str(hf_dir), "--out", str(tokens)]) == 0
    assert train_main(["--init", str(hf_dir), *ARGS, "--token-file", str(tokens)]) == 0
    assert f"token file {tokens}" in capsys.readouterr().out
    cache = tmp_path / "cache"
    assert train_main(["--init", str(hf_dir), *ARGS, "--text", str(text), "--token-cache",
                       str(cache)]) == 0
    assert list(cache.glob("*.npy"))  # tokenized once into the cache, then memory-mapped
    assert "not both" in _errors(["--init", str(hf_dir), *ARGS, "--text", str(text),
                                  "--token-file", str(tokens)], capsys)
