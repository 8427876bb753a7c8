"""llm.config: the GPT's sizes are the planner's GPTShape (declared once, in common.perf.gpt)
plus what only the model needs; the constructor, the presets and a checkpoint's round trip
keep working; FLOPs per token against a hand count."""

import dataclasses
import json

import pytest

from common.perf.gpt import MODEL_FIELDS, GPTShape, GPTWorkload
from llm.config import PRESETS, GPTConfig, tiny


def test_the_model_declares_only_what_the_shape_lacks():
    assert issubclass(GPTConfig, GPTShape)
    own = set(GPTConfig.__annotations__)  # the fields this class itself declares
    assert own == {"max_seq_len", "rope_theta", "norm_eps"} and not own & set(MODEL_FIELDS)
    names = [f.name for f in dataclasses.fields(GPTConfig)]
    assert names == [*MODEL_FIELDS, "max_seq_len", "rope_theta", "norm_eps"]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_survive_a_checkpoint_and_read_as_the_planners_shape(name):
    config = PRESETS[name]()
    saved = json.loads(json.dumps(dataclasses.asdict(config)))  # as checkpoints store it
    assert GPTConfig(**saved) == config
    work = GPTWorkload.from_config(config, global_batch=8)
    assert {f: getattr(work, f) for f in MODEL_FIELDS} == {
        f: getattr(config, f) for f in MODEL_FIELDS}
    assert (work.num_params(), work.seq_len) == (config.num_params(), config.max_seq_len)


def test_checks_of_the_shape_and_of_the_model_name_the_config():
    with pytest.raises(ValueError, match=r"GPTConfig\.d_ff must be >= 1, got 0"):
        dataclasses.replace(tiny(), d_ff=0)
    with pytest.raises(ValueError, match=r"GPTConfig\.max_seq_len must be >= 1, got 0"):
        dataclasses.replace(tiny(), max_seq_len=0)
    with pytest.raises(ValueError, match=r"head_dim = d_model / num_heads = 96 / 32 = 3 must"):
        dataclasses.replace(tiny(), num_heads=32, num_kv_heads=32, d_model=96)


def test_flops_per_token_by_hand():
    """tiny(): 2 blocks of d 64, 4 heads (kv 64), d_ff 192; LM head 256 x 64."""
    config = tiny()
    matmul = 2 * (2 * 64 * 64 + 2 * 64 * 64 + 3 * 64 * 192) + 256 * 64
    assert config.flops_per_token() == 6 * matmul + 12 * 2 * 64 * 128
    assert config.flops_per_token(16) == 6 * matmul + 12 * 2 * 64 * 16
