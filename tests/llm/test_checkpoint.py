"""llm.checkpoint: the sharded layout, the plain model from it and from its consolidated file,
fallback past a damaged checkpoint, and refusals (another model, an older format, nothing)."""

import json
import os

import pytest
import torch

from common import checkpoint as common_ckpt
from common.checkpoint import CheckpointError
from common.consolidate import consolidate
from common.consolidate import main as consolidate_main
from llm import checkpoint
from tests.llm.helpers import make_trainer, one_rank, one_rank_groups


def test_layout_plain_model_and_consolidated_file(tmp_path, small_config):
    trainer = make_trainer(one_rank(), steps=3)
    trainer.train_step()
    path = trainer.save(str(tmp_path / "ck"), keep=3, is_main=True)
    assert path == str(tmp_path / "ck" / "step-00000001")
    assert os.listdir(tmp_path / "ck") == ["step-00000001"]  # no temporary left behind
    assert sorted(os.listdir(path)) == ["manifest.json", "shard-00000.bin", "state.pt"]
    for where in (tmp_path / "ck", path):  # root or step-N
        assert checkpoint.open_checkpoint(where).step == 1
    model, meta = checkpoint.load_model(tmp_path / "ck")
    assert model.config == small_config and meta["format"] == checkpoint.FORMAT
    for name, p in trainer.model.shards().items():
        assert torch.equal(model.state_dict()[name], p), name
    # one file: the same weights, readable by the safetensors library too
    out = tmp_path / "full.safetensors"
    assert consolidate_main([str(tmp_path / "ck"), str(out)]) == 0
    again, meta2 = checkpoint.load_model(out)
    assert meta2 == meta
    for name, p in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], p), name
    with pytest.raises(FileExistsError, match="--force"):
        consolidate(tmp_path / "ck", out)
    safetensors = pytest.importorskip("safetensors")
    with safetensors.safe_open(str(out), framework="pt") as f:
        moments = [k for k in f.keys() if k.endswith(".exp_avg")]
        assert moments and torch.equal(f.get_tensor("norm.weight"),
                                       model.state_dict()["norm.weight"])
        assert json.loads(f.metadata()["meta"])["step"] == 1


def test_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path):
    trainer = make_trainer(one_rank(), steps=4)
    trainer.train_step()
    trainer.save(str(tmp_path), keep=3, is_main=True)
    trainer.train_step()
    newest = trainer.save(str(tmp_path), keep=3, is_main=True)
    shard = tmp_path / newest / "shard-00000.bin"
    shard.write_bytes(shard.read_bytes()[:100])  # truncated, as by a full disk
    assert checkpoint.open_checkpoint(tmp_path).step == 1
    resumed = make_trainer(one_rank(), steps=4)
    assert resumed.resume(str(tmp_path)) == 1


def test_checkpoint_mismatch_is_refused(tmp_path, small_config):
    import dataclasses

    from llm.parallel.gpt import ParallelGPT

    trainer = make_trainer(one_rank(), steps=1)
    trainer.save(str(tmp_path), keep=1, is_main=True)
    other = make_trainer(one_rank())
    config = dataclasses.replace(small_config, d_model=2 * small_config.d_model)
    from llm.model import GPT

    other.model = ParallelGPT(GPT(config, device="meta"), one_rank_groups(), seed=1)
    with pytest.raises(ValueError, match="different model"):
        other.resume(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        checkpoint.open_checkpoint("/nonexistent/dir")
    assert not checkpoint.has_checkpoint("/nonexistent/dir")


def test_older_format_is_refused_with_the_reason(tmp_path):
    common_ckpt.save(tmp_path, 1, {"checkpoint.pt": b"full tensors"},
                     {"engine": "llm", "step": 1})
    for load in (checkpoint.open_checkpoint, checkpoint.load_model):
        with pytest.raises(CheckpointError, match="older version"):
            load(tmp_path)
