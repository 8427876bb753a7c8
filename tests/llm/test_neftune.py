"""NEFTune (llm/neftune.py): the keyed noise, its scale and distribution, when it is on, and
the same noise on every grid (a 4-rank launch against one process)."""

import dataclasses
import math

import numpy as np
import pytest
import torch
from torch.nn.functional import cross_entropy

from common.collectives import all_reduce
from common.grid import AXONN_AXES, ProcessGrid, ceil_div
from llm.loss import token_losses
from llm.model import GPT, GPTConfig
from llm.neftune import NEFTune, hash_key, uniform_noise
from llm.parallel.gpt import ParallelGPT, batch_shard, make_groups
from tests.distributed import run_ranks
from tests.llm.helpers import perplexity_rel

CONFIG = GPTConfig(vocab_size=61, num_layers=2, num_heads=4, num_kv_heads=2, d_model=32,
                   d_ff=45, max_seq_len=16)
ODD_D = {"d_model": 34, "num_heads": 1, "num_kv_heads": 1}  # 34 on col = 4: 9 + 9 + 9 + 7
ALPHA, SEED, STEP, ROW_OFFSET, NOISE_SEED = 5.0, 3, 7, 10, 11


def fmix32_numpy(h):
    """murmur3's finalizer in numpy's wrapping uint32 arithmetic (the reference)."""
    h = h.astype(np.uint32)
    with np.errstate(over="ignore"):
        h ^= h >> np.uint32(16)
        h *= np.uint32(0x85EBCA6B)
        h ^= h >> np.uint32(13)
        h *= np.uint32(0xC2B2AE35)
        h ^= h >> np.uint32(16)
    return h


def test_uniform_noise_is_the_uint32_hash_and_any_block_of_it():
    rows, pos, ch = torch.arange(5, 9), torch.arange(6), torch.arange(2**32 - 7, 2**32)
    key = hash_key(3, 2**40 + 5)
    got = uniform_noise(key, rows, pos, ch)  # [4, 6, 7]
    h = fmix32_numpy(rows.numpy() ^ key)[:, None]
    h = fmix32_numpy(h ^ pos.numpy()[None, :])[..., None]
    h = fmix32_numpy(h ^ ch.numpy().astype(np.uint32))
    want = torch.from_numpy((h >> np.uint32(8)).astype(np.float32) * 2.0**-23 - 1.0)
    assert torch.equal(got, want)
    block = uniform_noise(key, rows[1:3], pos[2:], ch[3:5])
    assert torch.equal(block, got[1:3, 2:, 3:5])
    with pytest.raises(ValueError, match=">= 0"):
        hash_key(-1)


def test_uniform_noise_distribution():
    u = uniform_noise(hash_key(0, 0), torch.arange(64), torch.arange(64), torch.arange(64))
    assert u.min() >= -1.0 and u.max() < 1.0 and u.max() > 0.999 and u.min() < -0.999
    assert abs(u.mean().item()) < 0.01  # 262,144 draws: standard error 0.0011
    assert abs(u.var().item() - 1 / 3) < 0.01
    counts = torch.histc(u, bins=10, min=-1, max=1)  # uniform: 26,214 per bin
    assert (counts - u.numel() / 10).abs().max() < 800
    # neighbouring channels, positions and rows are uncorrelated
    for a, b in ((u[..., 1:], u[..., :-1]), (u[:, 1:], u[:, :-1]), (u[1:], u[:-1])):
        assert abs(torch.corrcoef(torch.stack((a.flatten(), b.flatten())))[0, 1]) < 0.01


def embedding_noise(model, idx, output=False):
    """The noise NEFTune adds to the embedding output of ``idx`` (or, with ``output``, that
    output) and the logits (a forward hook on the GPT's NEFTune layer)."""
    seen = {}
    layer = model.model.neftune if isinstance(model, ParallelGPT) else model.neftune
    handle = layer.register_forward_hook(
        lambda mod, inp, out: seen.update(noise=out - inp[0], out=out))
    try:
        logits = model(idx)
    finally:
        handle.remove()
    return seen["out" if output else "noise"], logits


def test_noise_scale_distribution_and_when_it_is_on():
    model = GPT(CONFIG, seed=SEED, neftune_alpha=ALPHA)
    idx = torch.randint(61, (8, 16), generator=torch.Generator().manual_seed(0))
    model.set_noise(step=STEP, row_offset=ROW_OFFSET, seed=NOISE_SEED)
    noise, _ = embedding_noise(model, idx)  # [8, 16, 32]
    s = ALPHA / math.sqrt(16 * CONFIG.d_model)
    assert noise.abs().max() <= s * (1 + 1e-6) and noise.abs().max() > 0.99 * s
    assert abs(noise.mean().item()) < 0.02 * s  # 4,096 draws of U[-s, s]: standard error 0.009 s
    assert abs(noise.std().item() - s / math.sqrt(3)) < 0.03 * s
    again, _ = embedding_noise(model, idx)
    assert torch.equal(noise, again)  # keyed: the same step draws the same noise
    short, _ = embedding_noise(model, idx[:, :8])  # T = 8: the same draws, scaled by 1/sqrt(8 D)
    torch.testing.assert_close(noise[:, :8], short * math.sqrt(8 / 16), rtol=0, atol=1e-6)
    model.set_noise(step=STEP + 1, row_offset=ROW_OFFSET, seed=NOISE_SEED)
    other, _ = embedding_noise(model, idx)
    assert not torch.isclose(other, noise).any(dim=-1).all()  # a new step: new noise
    assert (other - noise).abs().mean() > 0.5 * s
    model.set_noise(step=STEP, row_offset=ROW_OFFSET + 3, seed=NOISE_SEED)  # rows shift by 3
    assert torch.allclose(embedding_noise(model, idx)[0][:5], noise[3:], rtol=0, atol=1e-6)
    model.eval()  # off in evaluation
    assert embedding_noise(model, idx)[0].abs().max() == 0
    model.train()
    with torch.no_grad():  # off without gradients (generation, the trainer's evaluate)
        assert embedding_noise(model, idx)[0].abs().max() == 0
    plain = GPT(CONFIG, seed=SEED)  # alpha 0: off
    assert embedding_noise(plain, idx)[0].abs().max() == 0


def test_noise_in_bf16_is_added_before_the_cast_and_gradients_flow():
    model = GPT(CONFIG, seed=SEED, neftune_alpha=ALPHA, compute_dtype=torch.bfloat16)
    idx = torch.randint(61, (2, 16), generator=torch.Generator().manual_seed(0))
    noise, logits = embedding_noise(model, idx)
    assert noise.dtype == torch.float32 and noise.abs().max() > 0  # fp32 before the cast
    assert logits.dtype == torch.bfloat16
    logits.float().sum().backward()
    assert model.tok_emb.weight.grad is not None
    with pytest.raises(ValueError, match="neftune_alpha"):
        GPT(CONFIG, neftune_alpha=-1.0)
    with pytest.raises(ValueError, match="set_noise"):
        model.set_noise(step=-1)


def test_noise_is_added_to_the_embedding_output_with_its_scale():
    layer = NEFTune(10.0, d_model=4)
    x = torch.zeros(2, 3, 6)  # 6 channels of which 4 are real: the last two are padding
    out = layer(x)
    assert out[..., 4:].abs().max() == 0 and out[..., :4].abs().max() > 0
    assert out.abs().max() <= 10.0 / math.sqrt(3 * 4)


# ----------------------------------------------------------------------------- 4 ranks

GRIDS = [("2x1x1x2", {}), ("1x2x1x2", {}), ("1x1x2x2", {}), ("1x1x1x4", ODD_D),
         ("4x1x1x1", {})]  # the last: the fast path (plain modules, batch split only)


def batch():
    g = torch.Generator().manual_seed(4)
    x = torch.randint(CONFIG.vocab_size, (5, 16), generator=g)  # 5 rows: padded on data x depth
    return x, torch.randint(CONFIG.vocab_size, (5, 16), generator=g)


def parallel_noise(ctx):
    """Per rank and grid: the noisy embedding output block, where it sits, and the loss."""
    out = []
    for grid_text, changes in GRIDS:
        config = dataclasses.replace(CONFIG, **changes)
        groups = make_groups(ProcessGrid.parse(grid_text, AXONN_AXES), ctx.rank, ctx.transport)
        model = ParallelGPT(GPT(config, device="meta", neftune_alpha=ALPHA), groups, seed=SEED)
        model.set_noise(step=STEP, row_offset=ROW_OFFSET, seed=NOISE_SEED)
        x, y = batch()
        emb, logits = embedding_noise(model, batch_shard(x, groups, 0), output=True)
        losses = token_losses(logits, batch_shard(y, groups, -100), vocab_size=config.vocab_size,
                              row=groups["row"])
        loss = all_reduce(losses.sum().detach(), groups["data+depth"]) / y.numel()
        rows = ceil_div(5, groups["data"].size * groups["depth"].size)
        first_row = model.model.neftune.shard_index * rows
        out.append({"emb": emb.detach(), "rows": first_row,
                    "channels": model.model.neftune.channel_offset, "loss": loss.item()})
    return out


@pytest.fixture(scope="module")
def four_rank_noise():
    return run_ranks(parallel_noise, 4, timeout=300)


@pytest.mark.slow
@pytest.mark.cross_shape
@pytest.mark.parametrize("case", range(len(GRIDS)), ids=[g for g, _ in GRIDS])
def test_every_grid_adds_the_serial_noise(four_rank_noise, case):
    """The noisy embeddings: our keyed noise added to copied rows (1e-6: an addition's
    rounding of O(1) values). The loss: the grid's products and sums of other shapes, so to
    float rounding, the mean NLL's move of tests/llm/helpers.py's perplexity_rel."""
    config = dataclasses.replace(CONFIG, **GRIDS[case][1])
    model = GPT(config, seed=SEED, neftune_alpha=ALPHA)
    model.set_noise(step=STEP, row_offset=ROW_OFFSET, seed=NOISE_SEED)
    x, y = batch()
    noise, logits = embedding_noise(model, x)
    assert noise.abs().max() > 0
    want_emb = model.tok_emb(x).detach() + noise  # [5, 16, D]
    want_loss = cross_entropy(logits.reshape(-1, config.vocab_size), y.reshape(-1)).item()
    plain = cross_entropy(GPT(config, seed=SEED)(x).reshape(-1, config.vocab_size),
                          y.reshape(-1)).item()
    assert abs(plain - want_loss) > 1e-4  # the noise changes the loss
    loss_room = math.log1p(perplexity_rel(model, y.numel()))  # the mean NLL's move
    for rank, results in enumerate(four_rank_noise):
        got = results[case]
        emb, r0, c0 = got["emb"], got["rows"], got["channels"]  # [b, 16, D/C]
        real_rows = max(0, min(5 - r0, emb.shape[0]))
        real_ch = min(config.d_model - c0, emb.shape[2])
        torch.testing.assert_close(emb[:real_rows, :, :real_ch],
                                   want_emb[r0 : r0 + real_rows, :, c0 : c0 + real_ch],
                                   rtol=0, atol=1e-6, msg=f"rank {rank}")
        assert not emb[:, :, real_ch:].any()  # padded channels stay zero
        assert got["loss"] == pytest.approx(want_loss, abs=loss_room), rank


def test_trainer_flag_adds_the_noise_in_training_only(tmp_path):
    import json

    from llm.train import main as train_main

    losses = {}
    for alpha in ("0", "5"):
        metrics = tmp_path / f"{alpha}.jsonl"
        assert train_main(["--steps", "2", "--seq-len", "16", "--batch-size", "4",
                           "--grad-accum", "2", "--eval-batches", "1", "--neftune-alpha", alpha,
                           "--metrics", str(metrics)]) == 0
        rows = [json.loads(x) for x in metrics.read_text().splitlines()]
        losses[alpha] = [r["loss"] for r in rows if "loss" in r]
    assert losses["5"][0] != losses["0"][0]  # the first step already sees the noise
    again = tmp_path / "again.jsonl"
    assert train_main(["--steps", "2", "--seq-len", "16", "--batch-size", "4", "--grad-accum",
                       "2", "--eval-batches", "1", "--neftune-alpha", "5", "--metrics",
                       str(again)]) == 0
    rows = [json.loads(x) for x in again.read_text().splitlines()]
    assert [r["loss"] for r in rows if "loss" in r] == losses["5"]  # keyed, not random
