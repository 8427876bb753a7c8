"""QuantSpec (llm/decode/quantspec.py): greedy output equal to GPT.generate, the accounting of
drafts and bytes, the hierarchical KV quantiser's bounds, and int4 weights."""

import pytest
import torch

from common.grid import ceil_div
from llm.decode.kv_cache import KVCache
from llm.decode.quantspec import (
    SCALE_BYTES,
    HierarchicalKVStore,
    build_draft,
    quantize_hierarchical,
    quantize_int4,
    quantspec_generate,
)
from llm.model import GPT, tiny
from tests.llm.helpers import GQA64 as GQA
from tests.llm.helpers import assert_greedy_agrees


def prompt(length, seed):
    return torch.randint(256, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def models():
    return {"tiny": GPT(tiny(), seed=0).eval(), "gqa": GPT(GQA, seed=0).eval(),
            "tiny-bf16": GPT(tiny(), seed=0, compute_dtype=torch.bfloat16).eval()}


def successor_model():
    """A tiny GPT whose greedy next token is (token + 1) % 256 with a wide logit margin.

    The blocks add nothing (o_proj and down_proj are zero, so int4 keeps them zero) and the
    LM head's row u is 8 * embedding[u - 1]: the logit of t + 1 is the embedding's squared
    norm, far above any other row's inner product. The int4 draft must agree.
    """
    model = GPT(tiny(), seed=0).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.o_proj.weight.zero_()
            block.mlp.down_proj.weight.zero_()
        model.lm_head.weight.copy_(8 * torch.roll(model.tok_emb.weight, 1, dims=0))
    return model


@pytest.mark.cross_shape
@pytest.mark.parametrize("gamma", [1, 3, 5])
@pytest.mark.parametrize(("name", "length", "new", "seed"), [
    ("tiny", 7, 24, 1),   # 23 tokens after the prefill: not a multiple of 2, 4 or 6
    ("tiny", 30, 13, 2),  # long prompt: blocks quantised at once
    ("gqa", 1, 31, 3),    # one-token prompt, grouped-query attention
    ("gqa", 12, 20, 4),
    ("tiny-bf16", 10, 30, 0),  # bf16 logits tie more (test_kv_cache.py)
])
def test_tokens_equal_greedy_generate(models, name, length, new, seed, gamma):
    model, idx = models[name], prompt(length, seed)
    got, stats = quantspec_generate(model, idx, new, gamma=gamma, fp_buffer=4, group_size=16)
    # verification passes of gamma + 1 rows against one-row decode steps: equal but at near-ties
    assert_greedy_agrees(model, got, model.generate(idx, new), f"gamma {gamma}")
    assert stats.generated == new == stats.accepted + stats.target_passes
    assert 0 <= stats.accepted <= stats.drafted
    assert 0.0 <= stats.acceptance_rate <= 1.0
    assert stats.target_passes <= new  # one pass never emits less than one token
    assert stats.drafted <= gamma * (stats.target_passes - 1)  # no drafts in the prefill


@pytest.mark.cross_shape
def test_the_buffer_outlasting_the_sequence_is_still_exact(models):
    model, idx = models["tiny"], prompt(5, 7)  # 5 + 20 positions < 2 * 32: nothing quantised
    got, _ = quantspec_generate(model, idx, 20, gamma=4, fp_buffer=32, group_size=64)
    assert_greedy_agrees(model, got, model.generate(idx, 20), "nothing quantised")


@pytest.mark.cross_shape
@pytest.mark.parametrize("gamma", [1, 4, 6])
def test_a_draft_that_must_agree_is_always_accepted(gamma):
    """Exact tokens across shapes and int4 weights: the successor's logit margin (an
    embedding's squared norm) is far beyond rounding (successor_model)."""
    model, idx, new = successor_model(), prompt(9, 5), 30
    got, stats = quantspec_generate(model, idx, new, gamma=gamma, fp_buffer=4, group_size=32)
    want = (idx[0, -1] + torch.arange(1, new + 1)) % 256
    assert torch.equal(got[0, 9:], want) and torch.equal(got, model.generate(idx, new))
    assert stats.acceptance_rate == 1.0 and stats.accepted == stats.drafted > 0
    # the prefill emits one token, each later pass gamma + 1 (the last pass: what remains)
    assert stats.target_passes == 1 + ceil_div(new - 1, gamma + 1)
    summary = stats.summary()
    assert summary["tokens_per_target_pass"] == new / stats.target_passes
    assert summary["bytes_per_accepted_token"] < summary["baseline_bytes_per_token"]


def test_byte_counts_follow_the_storage_formats():
    model, idx, new, gamma = successor_model(), prompt(3, 6), 11, 4  # always accepted
    _, int4 = build_draft(model, group_size=32)
    _, stats = quantspec_generate(model, idx, new, gamma=gamma, fp_buffer=64, group_size=32)
    c = model.config
    linear = sum(m.weight.numel() for n, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear))
    assert sum(w.nbytes for w in int4.values()) == linear // 2 + linear // 32 * SCALE_BYTES
    assert stats.draft_weight_bytes == stats.drafted * (linear // 2 + linear // 32 * SCALE_BYTES)
    assert stats.target_weight_bytes == stats.target_passes * linear * 4  # float32
    per_position = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4  # K and V, float32
    # passes: prefill over 3 positions, then 5-token verifications ending at 8 and 13 (11
    # tokens: 1 + 5 + 5); draft steps at positions 3..6 and 8..11 (nothing quantised)
    assert stats.target_kv_bytes == per_position * (3 + 8 + 13)
    assert stats.draft_kv_bytes == per_position * (4 + 5 + 6 + 7 + 9 + 10 + 11 + 12)
    assert stats.baseline_bytes == new * linear * 4 + per_position * sum(range(3, 3 + new))


def test_hierarchical_codes_bounds():
    x = torch.randn(2, 3, 16, 8) * torch.linspace(0.1, 5, 8)  # channels of different ranges
    for dim in (2, 3):  # keys per channel over tokens, values per token over channels
        codes = quantize_hierarchical(x, dim)
        assert codes.upper.dtype == codes.lower.dtype == torch.uint8
        assert int(codes.upper.max()) <= 15 and int(codes.lower.max()) <= 15
        span = x.amax(dim, keepdim=True) - x.amin(dim, keepdim=True)
        assert torch.allclose(codes.scale, span / 255)
        slack = 1e-5 * x.abs().amax()
        err8 = (codes.dequantize(8) - x).abs()
        err4 = (codes.dequantize(4) - x).abs()
        assert (err8 <= codes.scale / 2 + slack).all()  # half an 8-bit step
        assert (err4 <= 8 * codes.scale + slack).all()  # half a 4-bit step (16 s)
        assert (err4 <= span / 30 + slack).all()  # no worse than round-to-nearest int4
        assert err4.mean() > 4 * err8.mean()  # the lower halves do carry precision
        # the 4-bit view is the 8-bit code with its lower half replaced by the bin centre
        assert torch.equal(16 * codes.upper.int() + codes.lower.int(),
                           ((x - codes.minimum) / codes.scale).round().int())


def test_hierarchical_codes_of_a_constant_are_exact():
    codes = quantize_hierarchical(torch.full((4, 5), 3.25), dim=1)
    assert torch.equal(codes.dequantize(8), torch.full((4, 5), 3.25))
    assert torch.allclose(codes.dequantize(4), torch.full((4, 5), 3.25))
    with pytest.raises(ValueError, match="bits must be 4"):
        codes.dequantize(2)


def test_store_quantises_committed_blocks_and_keeps_the_buffer_exact():
    torch.manual_seed(0)
    batch, kv_heads, heads, length, head_dim, r = 1, 2, 4, 23, 8, 4
    cache = KVCache(2, 32, None)
    store = HierarchicalKVStore(2, fp_buffer=r)
    for layer in cache.layers:
        layer.update(torch.randn(batch, kv_heads, length, head_dim),
                     torch.randn(batch, kv_heads, length, head_dim))
    store.commit(cache)
    assert store.quantized == 16 and r <= length - store.quantized < 2 * r  # 4 blocks, 7 exact
    assert len(store.keys[0]) == 4 and store.keys[0][0].scale.shape == (1, 2, 1, 8)  # per channel
    assert store.values[0][0].scale.shape == (1, 2, 4, 1)  # per token
    for i, layer in enumerate(cache.layers):
        k, v = layer.keys[:, :, :length], layer.values[:, :, :length]
        k4, v4 = store.draft_view(i, k, v)
        assert torch.equal(k4[:, :, 16:], k[:, :, 16:]) and torch.equal(v4[:, :, 16:], v[:, :, 16:])
        for block, (kc, vc) in enumerate(zip(store.keys[i], store.values[i])):
            span = slice(block * r, (block + 1) * r)
            assert torch.equal(k4[:, :, span], kc.dequantize(4))
            assert torch.equal(v4[:, :, span], vc.dequantize(4))
            assert ((k4[:, :, span] - k[:, :, span]).abs() <= 8 * kc.scale + 1e-5).all()
            assert not torch.equal(k4[:, :, span], k[:, :, span])
        # draft mode reads the view, otherwise exact attention over the cache (GQA expanded)
        q = torch.randn(batch, heads, 1, head_dim)
        full = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1))
        assert torch.equal(store(i, q, k, v), full)
        store.drafting = True
        drafted = torch.nn.functional.scaled_dot_product_attention(
            q, k4.repeat_interleave(2, dim=1), v4.repeat_interleave(2, dim=1))
        assert torch.equal(store(i, q, k, v), drafted)
        store.drafting = False
    store.commit(cache)  # nothing new to quantise
    assert store.quantized == 16


@pytest.mark.parametrize(("shape", "group_size"), [((6, 64), 16), ((5, 48), 32), ((3, 10), 64)])
def test_int4_weight_error_is_half_a_step_per_group(shape, group_size):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    w[0, 0] = 9.0  # an outlier widens only its own group's step
    q = quantize_int4(w, group_size)
    groups = ceil_div(shape[1], group_size)
    assert q.codes.dtype == torch.int8 and q.scale.shape == (shape[0], groups)
    assert int(q.codes.min()) >= -8 and int(q.codes.max()) <= 7
    step = q.scale.repeat_interleave(group_size, dim=1)[:, : shape[1]]  # s of each element
    group_max = torch.stack([w[:, j * group_size:(j + 1) * group_size].abs().amax(dim=1)
                             for j in range(groups)], dim=1)
    assert torch.allclose(q.scale, 2 * group_max / 15)
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-6).all()
    assert q.nbytes == (w.numel() + 1) // 2 + shape[0] * groups * SCALE_BYTES


def test_draft_quantises_every_block_linear_and_the_head_only(models):
    model = models["gqa"]
    draft, int4 = build_draft(model, group_size=16)
    names = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(int4) == names and len(names) == 7 * GQA.num_layers + 1
    for name, q in int4.items():
        assert torch.equal(draft.get_submodule(name).weight, q.dequantize())
        assert not torch.equal(draft.get_submodule(name).weight, model.get_submodule(name).weight)
    assert torch.equal(draft.tok_emb.weight, model.tok_emb.weight)


def test_a_draft_built_once_decodes_as_one_built_per_call(models):
    model = models["gqa"]
    draft = build_draft(model, group_size=16)
    for seed in range(3):
        idx = prompt(5 + seed, seed)
        want, want_stats = quantspec_generate(model, idx, 12, gamma=3, fp_buffer=4,
                                              group_size=16)
        got, stats = quantspec_generate(model, idx, 12, gamma=3, fp_buffer=4, draft=draft)
        assert torch.equal(got, want) and stats == want_stats


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"gamma": 0}, "gamma must be >= 1.*got 0"),
    ({"fp_buffer": 0}, "fp_buffer must be >= 1 token, got 0"),
    ({"group_size": 0}, "group_size must be >= 1, got 0"),
])
def test_bad_settings_raise(models, kwargs, match):
    with pytest.raises(ValueError, match=match):
        quantspec_generate(models["gqa"], prompt(4, 0), 5, **kwargs)


@pytest.mark.cross_shape
def test_bad_inputs_raise(models):
    model = models["gqa"]  # max_seq_len 64
    with pytest.raises(ValueError, match="batch size 2"):
        quantspec_generate(model, torch.zeros(2, 4, dtype=torch.long), 5)
    with pytest.raises(ValueError, match=r"prompt 60 \+ max_new_tokens 6 - 1 = 65 .*=64"):
        quantspec_generate(model, prompt(60, 0), 6)
    with pytest.raises(ValueError, match="prompt of 65 tokens exceeds max_seq_len=64"):
        quantspec_generate(model, prompt(65, 0), 0)
    with pytest.raises(ValueError, match="max_new_tokens=-1"):
        quantspec_generate(model, prompt(4, 0), -1)
    fits, stats = quantspec_generate(model, prompt(60, 0), 5)  # 64 positions: just fits
    assert_greedy_agrees(model, fits, model.generate(prompt(60, 0), 5), "64 positions")
    assert stats.generated == 5
    same, stats = quantspec_generate(model, prompt(4, 0), 0)
    assert torch.equal(same, prompt(4, 0)) and stats.generated == 0
