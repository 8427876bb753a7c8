"""GPT maths: shapes, causality, RoPE, grouped-query attention, presets, training, generation."""

import dataclasses

import pytest
import torch
from torch.nn.functional import cross_entropy, linear, silu

from llm.model import (
    GPT,
    PRESETS,
    Attention,
    GPTConfig,
    apply_rope,
    get_preset,
    gpt7b,
    gpt70b,
    rope_cache,
    tiny,
)
from tests.llm.helpers import assert_logits_agree
from tests.rounding import assert_orders_agree


def tiny_model(seed=0, **changes):
    return GPT(dataclasses.replace(tiny(), **changes), seed=seed)


def test_forward_shapes_and_length_check():
    model = tiny_model()
    idx = torch.randint(256, (2, 10))
    assert model(idx).shape == (2, 10, 256)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, tiny().max_seq_len + 1, dtype=torch.int64))


@pytest.mark.parametrize("changes", [{}, {"num_kv_heads": 2}, {"tie_embeddings": True}])
def test_causality(changes):
    model = tiny_model(**changes).eval()
    idx = torch.randint(256, (2, 24))
    changed = idx.clone()
    changed[:, 12] = (changed[:, 12] + 1) % 256
    a, b = model(idx), model(changed)
    assert torch.allclose(a[:, :12], b[:, :12], atol=1e-6)
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_rope_scores_depend_on_relative_position_only():
    head_dim, seq = 16, 40
    cos, sin = rope_cache(head_dim, seq, theta=10000.0)
    assert cos.shape == sin.shape == (seq, head_dim // 2)
    q_vec, k_vec = torch.randn(head_dim), torch.randn(head_dim)
    q = apply_rope(q_vec.expand(1, seq, 1, head_dim), cos, sin)[0, :, 0]  # [T, Dh]
    k = apply_rope(k_vec.expand(1, seq, 1, head_dim), cos, sin)[0, :, 0]
    scores = q @ k.T  # [T, T], scores[m, n] = <rope(q, m), rope(k, n)>
    for shift in (1, 7, 20):
        assert torch.allclose(scores[:-shift, :-shift], scores[shift:, shift:], atol=1e-4)
    assert torch.allclose(q[0], q_vec)  # position 0 is not rotated
    assert torch.allclose(q.norm(dim=-1), q_vec.norm().expand(seq), atol=1e-5)  # a rotation


@pytest.mark.cross_shape
def test_grouped_query_attention_equals_replicated_heads():
    """Query head j reads kv head j // (num_heads / num_kv_heads); the k/v projections of
    another height and the replicated heads' attention: float rounding of the logits."""
    gqa = tiny_model(num_kv_heads=2).eval()
    mha = tiny_model(num_kv_heads=4).eval()
    state = gqa.state_dict()
    head_dim = tiny().head_dim
    for name, value in state.items():
        if name.endswith(("k_proj.weight", "v_proj.weight")):  # [Hkv * Dh, D] -> [H * Dh, D]
            heads = value.view(2, head_dim, -1).repeat_interleave(2, dim=0)
            state[name] = heads.reshape(4 * head_dim, -1)
    mha.load_state_dict(state)
    idx = torch.randint(256, (2, 16))
    assert_logits_agree(gqa(idx), mha(idx), tiny(), seq_len=16, what="GQA against MHA")


@pytest.mark.cross_shape
def test_sharded_out_features_sum_to_the_full_block():
    """What tensor parallelism will do: split q, k, v, gate, up by out_features (whole heads)
    and o, down by in_features; the shards' partial outputs must add up to the full output,
    to float rounding: products of other shapes, o and down summed in two halves. Attention:
    5 sums in turn (q/k/v over D = 64, scores over Dh = 16, softmax and values over 9
    positions, o over 64); MLP: 2 (gate/up over 64, down over F = 192)."""
    block = tiny_model(num_kv_heads=2).blocks[0]
    x = torch.randn(2, 9, 64)
    cos, sin = rope_cache(16, 9)
    attn, mlp = block.attn, block.mlp
    full_attn, full_mlp = attn(x, cos, sin), mlp(x)
    parts_attn, parts_mlp = 0, 0
    for shard in range(2):
        a = Attention(dataclasses.replace(tiny(), num_kv_heads=2))  # then shrunk to one shard
        q_rows = slice(shard * 32, shard * 32 + 32)  # 2 of the 4 query heads
        kv_rows = slice(shard * 16, shard * 16 + 16)  # 1 of the 2 kv heads
        a.q_proj = torch.nn.Linear(64, 32, bias=False)
        a.k_proj = torch.nn.Linear(64, 16, bias=False)
        a.v_proj = torch.nn.Linear(64, 16, bias=False)
        a.o_proj = torch.nn.Linear(32, 64, bias=False)
        with torch.no_grad():
            a.q_proj.weight.copy_(attn.q_proj.weight[q_rows])
            a.k_proj.weight.copy_(attn.k_proj.weight[kv_rows])
            a.v_proj.weight.copy_(attn.v_proj.weight[kv_rows])
            a.o_proj.weight.copy_(attn.o_proj.weight[:, q_rows])
        parts_attn = parts_attn + a(x, cos, sin)
        hidden = slice(shard * 96, shard * 96 + 96)
        gate = linear(x, mlp.gate_proj.weight[hidden])
        up = linear(x, mlp.up_proj.weight[hidden])
        parts_mlp = parts_mlp + linear(silu(gate) * up, mlp.down_proj.weight[:, hidden])
    assert_orders_agree(parts_attn, full_attn, terms=64, products=5, what="attention")
    assert_orders_agree(parts_mlp, full_mlp, terms=192, products=2, what="MLP")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_validate(name):
    config = get_preset(name)
    assert isinstance(config, GPTConfig) and config == PRESETS[name]()
    matmul_params = config.num_params() - config.vocab_size * config.d_model
    assert config.flops_per_token() > 6 * matmul_params


def test_real_sizes():
    assert gpt7b().num_params() == pytest.approx(6.74e9, rel=0.03)  # Llama-2-7B
    assert gpt70b().num_params() == pytest.approx(69e9, rel=0.03)  # Llama-2-70B
    with pytest.raises(ValueError, match="gpt7b"):
        get_preset("gpt-7b")


@pytest.mark.parametrize("changes", [{}, {"num_kv_heads": 1}, {"tie_embeddings": True}])
def test_num_params_is_exact(changes):
    model = tiny_model(**changes)
    assert sum(p.numel() for p in model.parameters()) == model.config.num_params()
    if changes.get("tie_embeddings"):
        assert model.lm_head.weight is model.tok_emb.weight


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"num_heads": 3}, "not divisible"),
        ({"num_heads": 64}, "must be even"),
        ({"num_kv_heads": 3}, "multiple of"),
        ({"num_layers": 0}, "num_layers"),
        ({"norm_eps": 0.0}, "norm_eps"),
    ],
)
def test_config_errors(changes, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(tiny(), **changes)


def test_num_kv_heads_defaults_to_num_heads_and_is_stored():
    config = tiny()
    assert config.num_kv_heads == config.num_heads == 4  # None resolved at construction
    assert GPTConfig(**dataclasses.asdict(config)) == config  # how checkpoints rebuild it
    assert dataclasses.replace(config, num_kv_heads=2).num_kv_heads == 2
    with pytest.raises(TypeError):
        GPTConfig(256, 2, 4)  # keyword-only


def test_init_scales_residual_projections():
    model = GPT(dataclasses.replace(tiny(), num_layers=8, d_model=128, d_ff=256))
    assert model.blocks[0].attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert model.blocks[0].mlp.down_proj.weight.std().item() == pytest.approx(0.005, rel=0.1)
    assert torch.equal(model.norm.weight, torch.ones(128))


def test_tiny_learns_a_repeated_text_and_recites_it():
    """The tiny model learns a short repeated text in 100 steps and recites it."""
    text = b"a goldfish forgets fast; "
    stream = torch.tensor(list(text * 40))
    model = tiny_model(seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(100):
        offsets = torch.randint(len(stream) - 33, (8, 1), generator=generator)
        window = stream[offsets + torch.arange(33)]  # [8, 33]
        logits = model(window[:, :-1])
        loss = cross_entropy(logits.reshape(-1, 256), window[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] > 5.0 and sum(losses[-10:]) / 10 < 0.5
    model.eval()
    out = model.generate(torch.tensor([list(text[:8])]), max_new_tokens=24)
    assert bytes(out[0, 8:].tolist()) == (text * 2)[8:32]


def test_generate_greedy_is_deterministic_and_sampling_is_seeded():
    model = tiny_model().eval()
    prompt = torch.randint(256, (2, 5))
    first = model.generate(prompt, max_new_tokens=8)
    assert first.shape == (2, 13) and torch.equal(first[:, :5], prompt)
    assert torch.equal(first, model.generate(prompt, max_new_tokens=8))
    sample = [model.generate(prompt, 8, temperature=1.0,
                             generator=torch.Generator().manual_seed(3)) for _ in range(2)]
    assert torch.equal(sample[0], sample[1])
    long = model.generate(torch.zeros(1, 126, dtype=torch.int64), max_new_tokens=4)
    assert long.shape == (1, 130)  # the context is cropped to max_seq_len
    with pytest.raises(ValueError, match="temperature"):
        model.generate(prompt, 1, temperature=-1.0)
