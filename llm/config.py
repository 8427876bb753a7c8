"""The GPT's configuration: :class:`GPTConfig`, the presets and the initial weights' scales.

Pure data (no torch): ``common.perf.gpt`` and the planners read the shapes without building a
model. :mod:`llm.model` re-exports every name here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["PRESETS", "GPTConfig", "get_preset", "gpt1b", "gpt7b", "gpt70b", "init_std",
           "small", "tiny"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Sizes of a GPT.

    Attributes:
        vocab_size: number of token ids (V).
        num_layers: number of transformer blocks.
        num_heads: query heads (H).
        num_kv_heads: key/value heads (Hkv); None in the constructor means ``num_heads``
            (plain multi-head attention) and is stored resolved, so the attribute is an int.
            ``dataclasses.replace(config, num_heads=...)`` keeps the resolved value: pass
            ``num_kv_heads`` too when changing the heads.
        d_model: residual width (D); head_dim = d_model / num_heads.
        d_ff: hidden width of the SwiGLU MLP (F).
        max_seq_len: longest sequence the rotary tables cover.
        rope_theta: RoPE base; frequency i is rope_theta ** (-2i / head_dim).
        tie_embeddings: share the token embedding with the LM head.
        norm_eps: epsilon of RMSNorm.
    """

    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int | None = None  # resolved to an int by __post_init__
    d_model: int
    d_ff: int
    max_seq_len: int
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.num_kv_heads is None:  # frozen: set through object.__setattr__
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        for name in ("vocab_size", "num_layers", "num_heads", "d_model", "d_ff", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by num_heads="
                             f"{self.num_heads} ({self.d_model} % {self.num_heads} = "
                             f"{self.d_model % self.num_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim = d_model / num_heads = {self.d_model} / {self.num_heads}"
                             f" = {self.head_dim} must be even for rotary embeddings")
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads} (grouped-query attention)")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ValueError(f"rope_theta={self.rope_theta} and norm_eps={self.norm_eps} "
                             f"must be > 0")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    def num_params(self) -> int:
        """Exact number of parameters of :class:`GPT` (tied weights counted once)."""
        d, kv = self.d_model, self.num_kv_heads * self.head_dim
        attn = 2 * d * d + 2 * d * kv  # q, o: D x D; k, v: D x (Hkv * Dh)
        mlp = 3 * d * self.d_ff  # gate, up, down
        per_layer = attn + mlp + 2 * d  # + two RMSNorm weights
        embed = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.num_layers * per_layer + d + embed

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token (forward + backward), as in PaLM's MFU definition.

        ``6 * N_matmul + 12 * num_layers * d_model * seq_len``: 2 FLOPs per multiply-add, 3x for
        forward and backward, every Linear including the LM head (the embedding lookup is not a
        matmul), plus the attention score and value products without a causal discount.
        Forward only is one third of this.

        Args:
            seq_len: context length; defaults to ``max_seq_len``.
        """
        seq_len = self.max_seq_len if seq_len is None else seq_len
        d, kv = self.d_model, self.num_kv_heads * self.head_dim
        matmul = self.num_layers * (2 * d * d + 2 * d * kv + 3 * d * self.d_ff)
        matmul += self.vocab_size * d  # LM head
        return 6 * matmul + 12 * self.num_layers * d * seq_len


def tiny() -> GPTConfig:
    """Two layers, d_model 64, bytes: trains in seconds on a 2-core CPU (tests, quick start)."""
    return GPTConfig(vocab_size=256, num_layers=2, num_heads=4, d_model=64, d_ff=192,
                     max_seq_len=128)


def small() -> GPTConfig:
    """About 14M parameters on bytes (nanoGPT's character-level shape): one GPU or a patient CPU."""
    return GPTConfig(vocab_size=256, num_layers=6, num_heads=6, d_model=384, d_ff=1536,
                     max_seq_len=256)


def gpt1b() -> GPTConfig:
    """1.1B parameters, the TinyLlama-1.1B shape (22 layers, GQA 32/4 heads, vocab 32000)."""
    return GPTConfig(vocab_size=32000, num_layers=22, num_heads=32, num_kv_heads=4,
                     d_model=2048, d_ff=5632, max_seq_len=2048)


def gpt7b() -> GPTConfig:
    """6.7B parameters, the Llama-2-7B shape (the goldfish paper's model)."""
    return GPTConfig(vocab_size=32000, num_layers=32, num_heads=32, d_model=4096, d_ff=11008,
                     max_seq_len=4096)


def gpt70b() -> GPTConfig:
    """69B parameters, the Llama-2-70B shape (80 layers, GQA 64/8 heads)."""
    return GPTConfig(vocab_size=32000, num_layers=80, num_heads=64, num_kv_heads=8,
                     d_model=8192, d_ff=28672, max_seq_len=4096)


PRESETS = {"tiny": tiny, "small": small, "gpt1b": gpt1b, "gpt7b": gpt7b, "gpt70b": gpt70b}


def get_preset(name: str) -> GPTConfig:
    """The preset config called ``name``; ValueError listing the names otherwise."""
    if name not in PRESETS:
        raise ValueError(f"unknown GPT preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]()


def init_std(config: GPTConfig, name: str) -> float | None:
    """Standard deviation of the ``Normal(0, std)`` init of parameter ``name``; None: ones.

    GPT-2 / nanoGPT: 0.02 for the Linears and the embedding; the residual outputs (o_proj,
    down_proj) use ``0.02 / sqrt(2 * num_layers)`` so that the residual stream's variance does
    not grow with depth; RMSNorm weights start at 1.
    """
    if name.endswith("norm.weight"):
        return None
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return 0.02 / math.sqrt(2 * config.num_layers)
    return 0.02
