"""llm.checkpoint: the on-disk layout, fallback past a damaged checkpoint, and refusals
(another model, an older format, nothing there)."""

import os

import pytest
import torch

from common.checkpoint import CheckpointError
from llm import checkpoint
from tests.llm.helpers import make_trainer, one_rank_groups


def test_layout_and_plain_model(tmp_path, small_config):
    trainer = make_trainer(one_rank_groups(), steps=3)
    trainer.train_step()
    path = checkpoint.save(trainer.state_dict(), tmp_path / "ck")
    assert path == tmp_path / "ck" / "step-00000001" / "checkpoint.pt"
    assert os.listdir(tmp_path / "ck") == ["step-00000001"]  # no temporary left behind
    for where in (tmp_path / "ck", path.parent, path):  # root, step-N or the file
        assert checkpoint.load(where)["step"] == 1
    model, state = checkpoint.load_model(tmp_path / "ck")
    assert model.config == small_config and state["format"] == checkpoint.FORMAT
    for name, p in trainer.model.shards().items():
        assert torch.equal(model.state_dict()[name], p), name


def test_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path):
    trainer = make_trainer(one_rank_groups(), steps=4)
    trainer.train_step()
    checkpoint.save(trainer.state_dict(), tmp_path)
    trainer.train_step()
    newest = checkpoint.save(trainer.state_dict(), tmp_path)
    newest.write_bytes(newest.read_bytes()[:100])  # truncated, as by a full disk
    assert checkpoint.load(tmp_path)["step"] == 1


def test_checkpoint_mismatch_is_refused():
    state = make_trainer(one_rank_groups(), steps=1).state_dict()
    state["model_config"]["d_model"] = 64
    with pytest.raises(ValueError, match="different model"):
        make_trainer(one_rank_groups()).load_state_dict(state)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        checkpoint.load("/nonexistent/dir")
    assert not checkpoint.has_checkpoint("/nonexistent/dir")


def test_older_format_is_refused_with_the_reason(tmp_path):
    state = make_trainer(one_rank_groups(), steps=1).state_dict()
    config = state["model_config"]
    state["model_config"] = {"n_layer": config.pop("num_layers"),
                             "n_head": config.pop("num_heads"),
                             "n_kv_head": config.pop("num_kv_heads"), **config}
    state["format"] = 1
    checkpoint.save(state, tmp_path)
    for load in (checkpoint.load, checkpoint.load_model):
        with pytest.raises(CheckpointError, match=r"format 1, but this llm reads format 2 "
                                                  r"only \(format 2 renamed the model's n_layer"):
            load(tmp_path)
    with pytest.raises(CheckpointError, match="format 1"):
        make_trainer(one_rank_groups()).load_state_dict(state)
