"""llm.hf.llama and llm.convert: HF Llama <-> our GPT. Logits equal transformers' after import and
after export (GQA or not, tied or not), HF -> ours -> HF is byte-identical, slices read like
our sharded checkpoints, and models GPT cannot represent are refused with nothing written.

No downloads: the HF models are random LlamaForCausalLM built from a LlamaConfig.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open

from common.consolidate import main as consolidate_main
from common.sharded import Slab
from llm import checkpoint
from llm.convert import export_hf, import_hf, main, parse_size
from llm.hf import llama as hf
from llm.model import GPT
from tests.common.test_sharded import local_of
from tests.llm.helpers import SMALL, assert_logits_agree, make_trainer, one_rank, one_rank_groups

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 97, 24  # a prime vocabulary; a few tokens are enough to exercise RoPE


def hf_llama(path, *, kv_heads=4, tie=False, dtype=torch.float32, max_shard_size=None,
             seed=0):
    """A random LlamaForCausalLM (2 layers, hidden 64, 4 heads, vocab 97) saved at ``path``.

    Weights are redrawn larger than HF's init (std 0.02), so attention is far from uniform
    and a wrong RoPE or head layout changes the logits well beyond the tolerance.
    """
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
        rms_norm_eps=1e-5, rope_theta=5000.0, tie_word_embeddings=tie)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.3 / p.shape[-1] ** 0.5 * 4)
    model = model.to(dtype).eval()
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    return model


def hf_tensors(path):
    """Every tensor of a HF directory: name -> tensor (small test models only)."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            out |= {k: st.get_tensor(k) for k in st.keys()}
    return out


def logits_of(model, idx):
    with torch.no_grad():
        out = model(idx)
    return getattr(out, "logits", out).float()


@pytest.fixture(scope="module")
def gqa_dir(tmp_path_factory):
    """A GQA (4 / 2 heads), untied HF model saved in several shards."""
    path = tmp_path_factory.mktemp("hf") / "gqa"
    hf_llama(path, kv_heads=2, max_shard_size="40KB")
    assert len(list(path.glob("model-*.safetensors"))) >= 2
    return path


# ------------------------------------------------------------------------- names and configs


@pytest.mark.parametrize("tie", [False, True])
def test_names_and_shapes_map_both_ways(tie):
    config = dataclasses.replace(SMALL, tie_embeddings=tie)
    ours = {n: tuple(t.shape) for n, t in GPT(config, device="meta").state_dict().items()}
    if tie:  # stored once, as the embedding (checkpoints and save_pretrained alike)
        del ours["lm_head.weight"]
    assert hf.param_shapes(config) == ours
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{
        k: v for k, v in hf.config_to_hf(config).items() if k not in ("torch_dtype",)}))
    theirs = {n: tuple(t.shape) for n, t in llama.state_dict().items()}
    assert {hf.to_hf_name(n): s for n, s in ours.items()} == {
        n: s for n, s in theirs.items() if not (tie and n == "lm_head.weight")}
    assert all(hf.from_hf_name(hf.to_hf_name(n)) == n for n in ours)
    assert hf.config_from_hf(hf.config_to_hf(config)) == config
    with pytest.raises(ValueError, match="not a parameter"):
        hf.to_hf_name("blocks.0.attn.qkv.weight")
    with pytest.raises(ValueError, match="no counterpart"):
        hf.from_hf_name("model.layers.0.self_attn.q_proj.bias")


def test_transformers_4_config_is_read():
    """rope_theta at the top level and rope_scaling null, as transformers 4 writes them."""
    old = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
           "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
           "num_attention_heads": 32, "num_key_value_heads": 4, "rms_norm_eps": 1e-5,
           "max_position_embeddings": 2048, "rope_theta": 10000.0, "rope_scaling": None,
           "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16"}
    from llm.model import gpt1b

    assert hf.config_from_hf(old) == gpt1b()


# ----------------------------------------------------------------------------------- import


@pytest.mark.cross_shape
@pytest.mark.parametrize("kv_heads, tie", [(4, False), (2, False), (1, True), (4, True)])
def test_import_gives_transformers_logits(tmp_path, gqa_dir, kv_heads, tie):
    if (kv_heads, tie) == (2, False):
        src = gqa_dir  # sharded input
        theirs_model = transformers.LlamaForCausalLM.from_pretrained(src).eval()
    else:
        src = tmp_path / "hf"
        theirs_model = hf_llama(src, kv_heads=kv_heads, tie=tie)
    out = tmp_path / "ours.safetensors"
    assert main(["import", str(src), str(out)]) == 0
    model, meta = checkpoint.load_model(out)
    assert meta["engine"] == "llm" and meta["format"] == checkpoint.FORMAT
    assert meta["step"] == 0 and meta["configs"] == {}
    assert model.config.num_kv_heads == kv_heads and model.config.tie_embeddings == tie
    assert model.config.rope_theta == 5000.0 and model.config.norm_eps == 1e-5
    idx = torch.randint(VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    ours, theirs = logits_of(model, idx), logits_of(theirs_model, idx)
    assert theirs.abs().max() > 1  # not a near-constant model
    # transformers' Llama: the same maths in other kernels and orders (its own RoPE, attention)
    assert_logits_agree(ours, theirs, model.config, seq_len=SEQ, what="ours against HF")


def test_half_precision_weights_widen_exactly(tmp_path):
    theirs = hf_llama(tmp_path / "hf", kv_heads=2, dtype=torch.bfloat16)
    out = tmp_path / "ours.safetensors"
    assert main(["import", str(tmp_path / "hf"), str(out)]) == 0
    model, _ = checkpoint.load_model(out)
    for name, p in model.state_dict().items():
        assert p.dtype == torch.float32
        assert torch.equal(p, theirs.state_dict()[hf.to_hf_name(name)].float()), name


# ----------------------------------------------------------------------------------- export


@pytest.mark.cross_shape
def test_export_of_a_trainer_checkpoint_loads_in_transformers(tmp_path):
    trainer = make_trainer(one_rank(), steps=2)
    trainer.train_step()
    trainer.save(str(tmp_path / "ck"), keep=1, is_main=True)
    ours, _ = checkpoint.load_model(tmp_path / "ck")
    out = tmp_path / "hf"
    assert main(["export", str(tmp_path / "ck"), str(out), "--max-shard-size", "20KB"]) == 0
    index = json.loads((out / hf.INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) >= 2
    assert not any(n.endswith(("exp_avg", "exp_avg_sq")) for n in index["weight_map"])
    theirs = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    idx = torch.randint(SMALL.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    assert_logits_agree(logits_of(theirs, idx), logits_of(ours, idx), SMALL, seq_len=16,
                        what="HF against ours")  # other kernels: float rounding
    # half precision: exactly our weights, rounded
    half = tmp_path / "hf-bf16"
    assert main(["export", str(tmp_path / "ck"), str(half), "--dtype", "bfloat16"]) == 0
    assert sorted(p.name for p in half.iterdir()) == ["config.json", "model.safetensors"]
    got = hf_tensors(half)
    for name, p in ours.state_dict().items():
        assert torch.equal(got[hf.to_hf_name(name)], p.to(torch.bfloat16)), name


@pytest.mark.cross_shape
def test_export_of_a_tied_model_from_a_consolidated_file(tmp_path):
    from llm.parallel.gpt import ParallelGPT

    config = dataclasses.replace(SMALL, tie_embeddings=True)
    model = ParallelGPT(GPT(config, seed=3), one_rank_groups())
    opt = torch.optim.AdamW(model.parameters())
    checkpoint.save(tmp_path / "ck", step=4, model=model, optimizer=opt,
                    meta={"model_config": dataclasses.asdict(config), "configs": {}}, state={})
    assert consolidate_main([str(tmp_path / "ck"), str(tmp_path / "full.safetensors")]) == 0
    assert main(["export", str(tmp_path / "full.safetensors"), str(tmp_path / "hf")]) == 0
    assert "lm_head.weight" not in hf_tensors(tmp_path / "hf")
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert theirs.config.tie_word_embeddings
    ours, _ = checkpoint.load_model(tmp_path / "ck")
    idx = torch.randint(SMALL.vocab_size, (1, 16), generator=torch.Generator().manual_seed(3))
    assert_logits_agree(logits_of(theirs, idx), logits_of(ours, idx), config, seq_len=16,
                        what="HF against ours")  # other kernels: float rounding


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_is_byte_identical(tmp_path, gqa_dir, dtype):
    src = gqa_dir
    if dtype != "float32":
        src = tmp_path / "hf"
        hf_llama(src, tie=True, dtype=getattr(torch, dtype))
    if src == gqa_dir:  # through the functions, in chunks of a few rows
        import_hf(src, tmp_path / "ours.safetensors", chunk_bytes=1000)
        export_hf(tmp_path / "ours.safetensors", tmp_path / "back", max_shard_bytes=40_000,
                  chunk_bytes=1000)
    else:
        assert main(["import", str(src), str(tmp_path / "ours.safetensors")]) == 0
        assert main(["export", str(tmp_path / "ours.safetensors"), str(tmp_path / "back"),
                     "--dtype", dtype]) == 0
    before, after = hf_tensors(src), hf_tensors(tmp_path / "back")
    assert sorted(before) == sorted(after)
    for name, t in before.items():
        assert after[name].dtype == t.dtype, name
        assert after[name].view(torch.uint8).numpy().tobytes() == \
            t.view(torch.uint8).numpy().tobytes(), name
    assert json.loads((tmp_path / "back" / "config.json").read_text())["eos_token_id"] == \
        json.loads((src / "config.json").read_text())["eos_token_id"]


# ------------------------------------------------------------------------------------ slices


def test_slices_read_like_a_sharded_checkpoint(gqa_dir):
    full = {n: t.float() for n, t in hf_tensors(gqa_dir).items()}
    with hf.HFCheckpoint(gqa_dir) as ck:
        emb = full["model.embed_tokens.weight"]  # [97, 64]
        norm = full["model.layers.1.input_layernorm.weight"]  # [64]
        slabs = [(emb, "tok_emb.weight", Slab(tuple(emb.shape), (48, 100), (32, 80))),
                 (emb, "tok_emb.weight", Slab(tuple(emb.shape), (0, 50), (0, 64), (30, 900))),
                 (emb, "tok_emb.weight", Slab(tuple(emb.shape), np.array([96, 3, 120, 7]),
                                              (16, 48))),
                 (norm, "blocks.1.attn_norm.weight", Slab((64,), (0, 1), (32, 72), (8, 40)))]
        for tensor, name, slab in slabs:
            assert torch.equal(ck.read(name, slab), local_of(tensor, slab)), slab
    k = full["model.layers.0.self_attn.k_proj.weight"]
    got = hf.read_slice(gqa_dir, "blocks.0.attn.k_proj.weight", rows=(8, 24), cols=(0, 16))
    assert torch.equal(got, k[8:24, :16])


# ---------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("change, field", [
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}},
     "rope_parameters"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"model_type": "mistral"}, "model_type"),
    ({"architectures": ["LlamaForSequenceClassification"]}, "architectures"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"head_dim": 32}, "head_dim"),
])
def test_unrepresentable_models_are_refused(tmp_path, gqa_dir, capsys, change, field):
    src = tmp_path / "hf"
    shutil.copytree(gqa_dir, src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(config | change))
    out = tmp_path / "ours.safetensors"
    assert main(["import", str(src), str(out)]) == 1
    err = capsys.readouterr().err
    assert f"{field} = {json.dumps(change[field])}" in err and "cannot represent" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no output, no partial file


def test_bad_inputs_and_outputs_are_refused(tmp_path, gqa_dir, capsys):
    # a HF directory whose tensors do not match its config
    src = tmp_path / "hf"
    shutil.copytree(gqa_dir, src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(config | {"intermediate_size": 128}))
    assert main(["import", str(src), str(tmp_path / "x.safetensors")]) == 1
    assert "mlp.gate_proj.weight (96, 64) (expected (128, 64))" in capsys.readouterr().err
    assert main(["import", str(tmp_path), str(tmp_path / "x.safetensors")]) == 1
    assert "no config.json" in capsys.readouterr().err
    # an existing output is kept
    out = tmp_path / "ours.safetensors"
    out.write_bytes(b"keep")
    assert main(["import", str(gqa_dir), str(out)]) == 1
    assert "--force" in capsys.readouterr().err and out.read_bytes() == b"keep"
    assert main(["import", str(gqa_dir), str(out), "--force"]) == 0
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "README").write_text("mine")
    assert main(["export", str(out), str(tmp_path / "busy")]) == 1
    assert "not an empty directory" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "busy").iterdir()] == ["README"]
    # a HF directory or file is not one of our checkpoints
    assert main(["export", str(next(gqa_dir.glob("model-*.safetensors"))),
                 str(tmp_path / "o")]) == 1
    assert "not a consolidated checkpoint" in capsys.readouterr().err
    assert main(["export", str(gqa_dir), str(tmp_path / "o")]) == 1
    assert "no checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    assert not list(tmp_path.glob(".*partial*"))
    with pytest.raises(SystemExit):
        main(["export", str(out), str(tmp_path / "o"), "--dtype", "int8"])
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 << 30
    with pytest.raises(ValueError, match="size"):
        parse_size("five")
