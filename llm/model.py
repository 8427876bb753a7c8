"""A decoder-only GPT in the Llama style: maths only, no communication.

Block: ``x + Attn(RMSNorm(x))`` then ``x + SwiGLU(RMSNorm(x))``; rotary positions (RoPE,
Su et al. https://arxiv.org/abs/2104.09864); SwiGLU MLP (Shazeer, https://arxiv.org/abs/2002.05202);
grouped-query attention when ``num_kv_heads < num_heads`` (Ainslie et al.,
https://arxiv.org/abs/2305.13245); final RMSNorm and an LM head.

Tensor parallelism is applied later by a separate function that swaps every ``nn.Linear`` for a
3D tensor-parallel Linear (:mod:`llm.parallel.layers`) holding a row x col block of W,
flat-sharded over depth. So: q, k, v, o and gate, up, down are
separate Linears without bias; attention takes its number of (local) heads from the tensor
shapes, never from the config; SwiGLU is elementwise on the two projections.

Embeddings are untied by default (``tie_embeddings=False``): the Llama-2 sizes this models are
untied, and in the 4D layout the embedding table (looked up by row) and the LM head (a Linear
sharded by out_features) are sharded differently, so a tie would have to be rebuilt by hand
after parallelization. Tying is kept as a flag for small single-process models, where it saves
``V * d_model`` parameters.

Initial weights are keyed by (seed, parameter name) (:mod:`llm.parallel.keyed_init`), so a grid can
draw just its shards of them (:func:`llm.parallel.gpt.init_shards`) and hold this model exactly.

Mixed precision (``compute_dtype=torch.bfloat16``): the parameters stay float32 (the master
weights the optimizer updates); the embedding output is cast to the compute dtype and every
layer follows the dtype of its input, casting its weight at use (autograd casts the
gradient back to float32). RMSNorm statistics and the rotary rotation run in float32;
logits come out in the compute dtype (the loss upcasts them). Activation checkpointing
(``activation_checkpointing=True``) keeps only each block's input during a forward with
gradients and reruns the block in backward (``torch.utils.checkpoint``, non-reentrant).

NEFTune (``neftune_alpha > 0``, :mod:`llm.neftune`): in training, keyed uniform noise is added to
the embedding output before anything else (before the cast to the compute dtype).

Decoding (:meth:`GPT.generate`) keeps a :class:`KVCache`: the prompt is run once (prefill),
then each step runs only the new token against the cached keys and values of every layer.

Shapes legend:
    B: batch, T: sequence length, V: vocabulary, D: d_model, F: d_ff, Dh: head_dim,
    H: query heads, Hkv: key/value heads (both local to this process after sharding).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.functional import linear, scaled_dot_product_attention, silu
from torch.utils.checkpoint import checkpoint

from llm.config import (
    PRESETS,
    GPTConfig,
    get_preset,
    gpt1b,
    gpt7b,
    gpt70b,
    init_std,
    small,
    tiny,
)
from llm.decode.kv_cache import DecodeAttention, KVCache, LayerCache
from llm.neftune import NEFTune
from llm.parallel.keyed_init import fill_normal_

__all__ = [
    "GPT",
    "PRESETS",
    "GPTConfig",
    "KVCache",
    "Linear",
    "apply_rope",
    "get_preset",
    "gpt1b",
    "gpt7b",
    "gpt70b",
    "init_std",
    "rope_cache",
    "small",
    "tiny",
]


def rope_cache(
    head_dim: int, seq_len: int, theta: float = 10000.0, device: torch.device | str | None = None
) -> tuple[Tensor, Tensor]:
    """Cosines and sines of the rotary angles ``pos * theta ** (-2i / head_dim)``.

    Computed in float64 and returned in float32, on ``device``.

    Shapes:
        returns: cos [seq_len, Dh / 2], sin [seq_len, Dh / 2]
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim
    positions = torch.arange(seq_len, dtype=torch.float64, device=device)  # [T]
    angles = torch.outer(positions, theta**-exponents)  # [T, Dh/2]
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate each pair (x[i], x[i + Dh/2]) by its position's angle ("rotate half" layout).

    The score ``<rope(q, m), rope(k, n)>`` then depends on positions only through m - n.

    Shapes:
        x: [B, T, H, Dh], cos: [T, Dh / 2], sin: [T, Dh / 2] -> returns [B, T, H, Dh]
    """
    x1, x2 = x.float().chunk(2, dim=-1)  # [B, T, H, Dh/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, Dh/2]
    rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.type_as(x)


class Linear(nn.Linear):
    """``nn.Linear`` (no bias here) whose weight is cast to the input's dtype at use.

    Shapes:
        x: [..., in] -> returns [..., out]
    """

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight.to(x.dtype), None if self.bias is None else
                      self.bias.to(x.dtype))


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``, the statistics in float32, the output in the
    dtype of ``x``.

    Shapes:
        x: [..., D] -> returns [..., D]
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight.to(x.dtype)


class Attention(nn.Module):
    """Causal self-attention with RoPE; heads counted from the projections' output shapes.

    With a ``cache``, ``x`` holds the positions after the cached ones (``cos``, ``sin`` are
    theirs) and attends to the cached keys and values too.

    Shapes:
        x: [B, T, D], cos, sin: [T, Dh / 2] -> returns [B, T, D]
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d, kv = config.d_model, config.num_kv_heads * config.head_dim
        self.head_dim = config.head_dim
        self.q_proj = Linear(d, d, bias=False)
        self.k_proj = Linear(d, kv, bias=False)
        self.v_proj = Linear(d, kv, bias=False)
        self.o_proj = Linear(d, d, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor,
                cache: LayerCache | None = None) -> Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, -1, self.head_dim)  # [B, T, H, Dh]
        k = self.k_proj(x).view(batch, seq, -1, self.head_dim)  # [B, T, Hkv, Dh]
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim)  # [B, T, Hkv, Dh]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H or Hkv, T, Dh]
        start = 0
        if cache is not None:  # the Hkv heads are cached, before the grouped expansion
            start = cache.length
            k, v = cache.update(k, v)  # [B, Hkv, start + T, Dh]
            if seq == 1 and start > 0 and cache.method is not None:  # decode-time method
                y = cache.method(cache.index, q, k, v)  # [B, H, 1, Dh]
                return self.o_proj(y.transpose(1, 2).reshape(batch, seq, -1))
        groups = q.shape[1] // k.shape[1]
        if groups > 1:  # grouped-query attention: query head j reads kv head j // groups
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if start == 0:
            y = scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, Dh]
        elif seq == 1:  # one new token sees every cached position
            y = scaled_dot_product_attention(q, k, v)
        else:  # query i is position start + i: it sees keys 0 .. start + i
            keys = torch.arange(start + seq, device=x.device)
            mask = keys <= torch.arange(start, start + seq, device=x.device)[:, None]
            y = scaled_dot_product_attention(q, k, v, attn_mask=mask)  # mask [T, start + T]
        return self.o_proj(y.transpose(1, 2).reshape(batch, seq, -1))  # [B, T, D]


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``.

    Shapes:
        x: [B, T, D] -> hidden [B, T, F] -> returns [B, T, D]
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(config.d_model, config.d_ff, bias=False)
        self.up_proj = Linear(config.d_model, config.d_ff, bias=False)
        self.down_proj = Linear(config.d_ff, config.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm transformer block. Shapes: x [B, T, D] -> [B, T, D]."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor,
                cache: LayerCache | None = None) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, cache)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Decoder-only language model; see the module docstring.

    Args:
        config: sizes.
        seed: key of the initial weights (:meth:`reset_parameters`); None: drawn from torch's
            default generator.
        device: where the parameters live; ``"meta"``: shapes only, nothing allocated or
            initialised (for :class:`llm.parallel.gpt.ParallelGPT`, or :meth:`materialize`).
        compute_dtype: dtype of the activations and GEMMs (module docstring); None: the
            parameters' dtype. Also read by :class:`~llm.parallel.gpt.ParallelGPT`.
        activation_checkpointing: recompute each block in backward instead of keeping its
            activations.
        neftune_alpha: NEFTune noise scale on the embeddings in training (:mod:`llm.neftune`;
            key it each step with :meth:`set_noise`); 0: off.

    Shapes:
        idx: int64 [B, T] with T (plus the cached positions) <= max_seq_len -> logits [B, T, V]
    """

    def __init__(self, config: GPTConfig, *, seed: int | None = None,
                 device: torch.device | str | None = None,
                 compute_dtype: torch.dtype | None = None,
                 activation_checkpointing: bool = False, neftune_alpha: float = 0.0) -> None:
        super().__init__()
        self.config = config
        self.compute_dtype, self.activation_checkpointing = compute_dtype, activation_checkpointing
        self.neftune = NEFTune(neftune_alpha, config.d_model)  # no parameters
        with torch.device("meta"):  # no memory and no throw-away default init
            # _weight skips Embedding's normal_, whose meta kernel imports hundreds of modules
            self.tok_emb = nn.Embedding(config.vocab_size, config.d_model,
                                        _weight=torch.empty(config.vocab_size, config.d_model))
            self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
            self.norm = RMSNorm(config.d_model, config.norm_eps)
            self.lm_head = Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        device = torch.device("cpu" if device is None else device)
        if device.type != "meta":
            self.materialize(device, seed)

    def materialize(self, device: torch.device | str, seed: int | None = None, *,
                    init: bool = True) -> GPT:
        """Allocate the parameters on ``device`` and initialise them (:meth:`reset_parameters`).

        For a model built with ``device="meta"``; returns the model. ``init=False`` leaves the
        memory uninitialised, for a caller that loads every parameter next
        (:func:`llm.checkpoint.load_model`).
        """
        self.to_empty(device=device)
        if self.config.tie_embeddings:  # to_empty allocates each module's tensor apart
            self.lm_head.weight = self.tok_emb.weight
        if init:
            self.reset_parameters(seed)
        return self

    @property
    def device(self) -> torch.device:
        """Where the parameters live (inputs of :meth:`forward` and :meth:`generate` belong
        there too)."""
        return self.tok_emb.weight.device

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """Initialise like GPT-2 / nanoGPT (:func:`init_std`), keyed by ``(seed, name)``.

        Each weight is drawn by :func:`llm.parallel.keyed_init.fill_normal_`, so a grid's shards of
        it (:func:`llm.parallel.gpt.init_shards`) hold exactly these values. ``seed`` None draws one
        from torch's default generator (so ``torch.manual_seed`` governs it, as it does
        ``nn.init``). Called by the constructor unless the model is built on the meta device.
        """
        if seed is None:
            seed = int(torch.randint(2**62, ()).item())
        for name, p in self.named_parameters():  # a tied weight once, as tok_emb.weight
            std = init_std(self.config, name)
            if std is None:
                p.fill_(1.0)
            else:
                fill_normal_(p.view(-1), seed=seed, name=name, shape=p.shape, std=std)

    def compile_blocks(self) -> None:
        """``torch.compile`` each transformer block in place (``nn.Module.compile``), as
        torchtitan compiles: every block has the same code, so one compilation serves them
        all, and the embedding, head and loss stay eager; parameter names, checkpoints and an
        optimizer's view of the parameters do not change."""
        for block in self.blocks:
            block.compile()

    def set_noise(self, *, step: int, row_offset: int = 0, seed: int = 0) -> None:
        """Key the NEFTune noise of the next training forwards (:meth:`NEFTune.set_noise`):
        call before each micro-batch's forward when ``neftune_alpha > 0``."""
        self.neftune.set_noise(step=step, row_offset=row_offset, seed=seed)

    def forward(self, idx: Tensor, cache: KVCache | None = None) -> Tensor:
        """Logits of every position of ``idx``; with a ``cache``, ``idx`` continues the cached
        positions (which it attends to) and its keys and values are appended to the cache."""
        seq, start = idx.shape[1], 0 if cache is None else cache.length
        if start + seq > self.config.max_seq_len:
            raise ValueError(f"sequence of {start} cached + {seq} tokens exceeds max_seq_len="
                             f"{self.config.max_seq_len}")
        # recomputed each call (negligible next to the blocks) rather than kept as a buffer,
        # which model.to(bfloat16) would round
        c = self.config
        cos, sin = rope_cache(c.head_dim, start + seq, c.rope_theta, idx.device)
        cos, sin = cos[start:], sin[start:]  # [T, Dh/2] each: the positions of idx
        x = self.neftune(self.tok_emb(idx))  # [B, T, D]; NEFTune noise in training only
        if self.compute_dtype is not None:
            x = x.to(self.compute_dtype)  # every later layer follows the dtype of its input
        for i, block in enumerate(self.blocks):
            if cache is not None:
                x = block(x, cos, sin, cache.layers[i])
            elif self.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                x = block(x, cos, sin)
        return self.lm_head(self.norm(x))  # [B, T, V]

    @torch.no_grad()
    def generate(
        self, idx: Tensor, max_new_tokens: int, temperature: float = 0.0,
        generator: torch.Generator | None = None, *, use_cache: bool = True,
        method: DecodeAttention | None = None,
    ) -> Tensor:
        """Append ``max_new_tokens`` sampled tokens (greedy when temperature is 0, or below
        1e-6, where sampling would differ from greedy only between logits tied within
        rounding).

        With ``use_cache`` (default) the prompt is run once into a :class:`KVCache`, then each
        step runs only the newest token. The model sees at most ``max_seq_len`` tokens: once
        the sequence is longer, each step reruns the last ``max_seq_len`` tokens without a
        cache (the window slides, so every cached position would move), as ``use_cache=False``
        does at every step. Both give the same tokens unless two logits are within rounding of
        each other: the logits are not bitwise equal (a decode step computes one row alone, and
        the no-cache loop's values of a position vary with the window's length in the CPU
        attention kernel's last bits), and bf16 logits (8-bit mantissa) tie more often.

        ``idx`` lives on the model's :attr:`device`; ``generator`` may live elsewhere: a CPU
        generator with a CUDA model draws on the CPU (:func:`_sample`).

        A decode-time attention ``method`` (:class:`llm.decode.kv_cache.DecodeAttention`) replaces
        full attention in the cached single-token steps; the prefill and window-sliding steps
        stay exact.

        Shapes:
            idx: int64 [B, T0] -> returns int64 [B, T0 + max_new_tokens]
        """
        if not 0 <= temperature < float("inf"):  # nan fails every comparison
            raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got "
                             f"{temperature}")
        # below 1e-6 sampling is greedy but for near-ties: a logit 1e-5 under the largest (the
        # float32 rounding of a logit near 100) is already e^-10 as likely; and a temperature
        # far below it makes logits / temperature overflow float32 to inf, whose softmax is nan
        greedy = temperature < 1e-6
        window = self.config.max_seq_len
        cache = None
        for _ in range(max_new_tokens):
            if not use_cache or idx.shape[1] > window:
                logits = self(idx[:, -window:])  # [B, T, V]
            elif cache is None:  # prefill: the whole prompt
                cache = KVCache(self.config.num_layers, window, method)
                logits = self(idx, cache)
            else:  # the newest token against the cache
                logits = self(idx[:, -1:], cache)  # [B, 1, V]
            logits = logits[:, -1, :].float()  # [B, V]
            if greedy:
                nxt = logits.argmax(dim=-1, keepdim=True)  # [B, 1]
            else:
                nxt = _sample(torch.softmax(logits / temperature, dim=-1), generator)  # [B, 1]
            idx = torch.cat((idx, nxt), dim=1)
        return idx


def _sample(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One token per row of ``probs`` [B, V] -> [B, 1], on the device of ``probs``.

    Drawn where the generator lives: a CPU generator with a CUDA model copies the
    probabilities to the CPU and the tokens back, so a seed draws the same tokens on either
    device (up to rounding of the probabilities), and CPU runs are unchanged.
    """
    if generator is None or generator.device == probs.device:
        return torch.multinomial(probs, 1, generator=generator)
    return torch.multinomial(probs.to(generator.device), 1, generator=generator).to(probs.device)
