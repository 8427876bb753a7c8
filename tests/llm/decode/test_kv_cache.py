"""KV-cache decoding (:meth:`llm.model.GPT.generate`) against the no-cache loop.

Bitwise equal logits are not to be had: the no-cache loop itself computes position p a little
differently depending on how many positions follow it (the CPU attention kernel's tails), and
a one-row GEMM rounds differently from a many-row one. So the logits are compared to float
rounding (tests/llm/helpers.py's ``logits_sums``: teacher forcing through the decode path), and
the greedy tokens exactly except where a row meets a near-tie (``assert_greedy_agrees``): they
can only differ where two logits are within rounding of each other. In bf16 (8-bit mantissa
logits) such near-ties happen: small's width with 6 query / 2 key-value heads, 3 prompts, 40
tokens can flip one token in bf16 on a CPU (fp32 is exact there), so the bf16 token checks use
the tiny configs and the bf16 logits check bounds the difference instead.

Devices: decoding allocates on the device of its input ("meta" stands in for a GPU here; the
CUDA runs, a CPU generator with a CUDA model included, are in tests/llm/test_gpu.py).
"""

import dataclasses

import pytest
import torch

from llm.model import GPT, GPTConfig, KVCache, small, tiny
from tests.llm.helpers import assert_greedy_agrees, assert_logits_agree

GQA = GPTConfig(vocab_size=256, num_layers=2, num_heads=4, num_kv_heads=2, d_model=32, d_ff=48,
                max_seq_len=16)  # tests/llm/helpers.py's SMALL: 16-token window


def prompt(batch, length, seed=1):
    return torch.randint(256, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("config", "batch", "length", "new"), [
    (tiny(), 1, 8, 40),
    (tiny(), 3, 5, 30),
    (small(), 2, 16, 16),
    (dataclasses.replace(small(), num_heads=6, num_kv_heads=2), 2, 8, 16),  # GQA at width 384
    (GQA, 3, 5, 30),  # GQA; outgrows the 16-token window after 11 tokens
    (GQA, 2, 20, 4),  # the prompt alone is longer than the window
], ids=["tiny-b1", "tiny-b3", "small-b2", "small-gqa-b2", "gqa-window", "gqa-long-prompt"])
@pytest.mark.cross_shape
def test_greedy_tokens_equal_the_no_cache_loop(config, batch, length, new):
    model = GPT(config, seed=0).eval()
    idx = prompt(batch, length)
    want = model.generate(idx, new, use_cache=False)
    got = model.generate(idx, new)
    assert got.shape == (batch, length + new)
    assert_greedy_agrees(model, got, want, "cache against no cache")  # equal but at near-ties


@pytest.mark.cross_shape
@pytest.mark.parametrize("config", [tiny(), GQA], ids=["tiny", "gqa"])
def test_bf16_greedy_tokens_equal_the_bf16_no_cache_loop(config):
    model = GPT(config, seed=0, compute_dtype=torch.bfloat16).eval()
    idx = prompt(3, 6)
    got, want = model.generate(idx, 24), model.generate(idx, 24, use_cache=False)
    assert_greedy_agrees(model, got, want, "bf16")  # no near-tie in this case: equal


def decode_logits(model, tokens, prefill):
    """Logits of positions prefill-1 .. T-1 through the cache: a prefill, then one token at a
    time (teacher forcing), and the no-cache logits of the same positions."""
    cache = KVCache(model.config.num_layers, model.config.max_seq_len)
    with torch.no_grad():
        rows = [model(tokens[:, :prefill], cache)[:, -1]]
        rows += [model(tokens[:, t : t + 1], cache)[:, -1] for t in range(prefill,
                                                                          tokens.shape[1])]
        full = [model(tokens[:, : t + 1])[:, -1] for t in range(prefill - 1, tokens.shape[1])]
    return torch.stack(rows, 1).float(), torch.stack(full, 1).float()


@pytest.mark.cross_shape
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_decode_logits_match_the_full_forward(num_kv_heads, dtype):
    """Other orders of summation (one-row GEMMs, another attention kernel): fp32 within
    ``logits_sums``'s bound for 40 keys (about 5e-4 of the largest logit; we see ~4e-7); bf16
    within 0.02 of it, 5 bf16 roundings (2^-8 each) of the largest logit (we see ~6e-3, 1.5),
    tighter than ``logits_bound``'s 2 u a product (0.16), which would accept nearly anything."""
    config = dataclasses.replace(tiny(), num_kv_heads=num_kv_heads)
    model = GPT(config, seed=0, compute_dtype=dtype).eval()
    cached, full = decode_logits(model, prompt(2, 40), prefill=7)  # [2, 34, V] each
    if dtype is None:
        assert_logits_agree(cached, full, config, seq_len=40, what="decode against full")
    else:
        assert (cached - full).abs().max() <= 0.02 * full.abs().max()


def test_prefill_equals_the_plain_forward_and_caches_the_kv_heads():
    model = GPT(GQA, seed=0).eval()
    idx = prompt(3, 9)
    cache = KVCache(GQA.num_layers, GQA.max_seq_len)
    with torch.no_grad():
        assert torch.equal(model(idx, cache), model(idx))  # the same kernels, bitwise
    assert cache.length == 9
    for layer in cache.layers:  # [B, Hkv, max_len, Dh]: not expanded to the query heads
        assert layer.keys.shape == layer.values.shape == (3, 2, 16, GQA.head_dim)


@pytest.mark.cross_shape
def test_a_chunk_after_the_cache_sees_the_cached_positions():
    config = dataclasses.replace(tiny(), num_kv_heads=2)
    model = GPT(config, seed=0).eval()
    idx = prompt(2, 20)
    cache = KVCache(2, 128)
    with torch.no_grad():
        first = model(idx[:, :12], cache)
        rest = model(idx[:, 12:], cache)  # 8 queries at positions 12..19: the masked path
        full = model(idx)
    # products of 12 and 8 rows and a masked attention kernel against 20 rows, causal
    assert_logits_agree(torch.cat((first, rest), 1), full, config, seq_len=20, what="chunks")


def test_the_cache_never_exceeds_the_window():
    model = GPT(GQA, seed=0).eval()
    cache = KVCache(GQA.num_layers, GQA.max_seq_len)
    with torch.no_grad():
        model(prompt(1, 12), cache)
        with pytest.raises(ValueError, match="12 cached \\+ 5 tokens exceeds max_seq_len=16"):
            model(prompt(1, 5), cache)


@pytest.mark.cross_shape
def test_sampling_with_a_seeded_generator_matches_the_no_cache_loop():
    """The same uniform draws through probabilities of other rounding: a token could only
    change where a draw falls within rounding of a cumulative probability (~1e-6 a draw)."""
    model = GPT(tiny(), seed=0).eval()
    idx = prompt(2, 4)

    def sample(use_cache):
        return model.generate(idx, 20, temperature=1.0, use_cache=use_cache,
                              generator=torch.Generator().manual_seed(7))

    assert torch.equal(sample(True), sample(False))


@pytest.mark.cross_shape
def test_llm_sample_prints_the_same_text_with_and_without_the_cache(tmp_path, capsys):
    """Greedy and sampled text, exactly: tokens across the cache's shapes, so a near-tie (none
    in this model) or a draw within rounding of a cumulative probability could flip one."""
    from llm.sample import main
    from tests.llm.helpers import make_trainer, one_rank

    trainer = make_trainer(one_rank(), steps=1)
    trainer.train_step()
    trainer.save(str(tmp_path), keep=1, is_main=True)
    for temperature in ("0", "1.0"):
        args = ["--checkpoint", str(tmp_path), "--prompt", "The ", "--tokens", "30",
                "--temperature", temperature, "--seed", "3", "--device", "cpu"]
        assert main(args) == 0
        cached = capsys.readouterr().out
        assert main([*args, "--no-cache"]) == 0  # 4 + 30 bytes: past the 16-byte window
        assert capsys.readouterr().out == cached


# ----------------------------------------------------------------------------- devices
@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no-cache"])
def test_decoding_allocates_on_the_models_device(use_cache):
    """A model on "meta" (no data; an op mixing in a CPU tensor raises, as it would with CUDA
    inputs) decodes greedily past its 16-token window: the cache, the rotary tables and the
    masks are made on the input's device."""
    model = GPT(GQA, device="meta").eval()
    assert model.device == torch.device("meta")
    idx = torch.zeros(2, 5, dtype=torch.int64, device="meta")
    out = model.generate(idx, 14, use_cache=use_cache)  # 19 tokens: the window slides
    assert out.device == model.device and out.shape == (2, 19)


def test_materialize_without_init_keeps_the_tie_and_leaves_the_values():
    tied = dataclasses.replace(tiny(), tie_embeddings=True)
    model = GPT(tied, device="meta").materialize("cpu", init=False)
    assert model.device == torch.device("cpu")
    assert model.lm_head.weight is model.tok_emb.weight
    seeded = GPT(tied, seed=0)
    model.load_state_dict(seeded.state_dict())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), seeded.parameters()))


def test_sampling_on_the_generators_device_is_torch_multinomial():
    """A generator on the probabilities' device draws directly: the tokens are exactly
    ``torch.multinomial``'s, so CPU runs are bit for bit what they were."""
    from llm.model import _sample

    probs = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(0)), -1)
    want = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(4))
    assert torch.equal(_sample(probs, torch.Generator().manual_seed(4)), want)
    assert _sample(probs, None).shape == (3, 1)
