"""Every config of the GPT trainer: the model's :class:`GPTConfig` with its presets and
initial weights' scales, and the run configs (one per component, keyword-only, validated on
construction): :class:`DataConfig`, :class:`OptimConfig` (AdamW with warmup + cosine),
:class:`GoldfishConfig`, :class:`RunConfig` (length, cadence, :class:`Overlap`) and
:class:`PrecisionConfig` (bf16, activation checkpointing).

Pure data (importing it loads no torch): the planners read the shapes without building a
model; :class:`GPTConfig` extends the planner's :class:`common.perf.gpt.GPTShape`, so each size
is declared once. :mod:`llm.model` re-exports the model's names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from common.perf.gpt import GPTShape
from common.precision import PRECISIONS

__all__ = ["DEFAULT_STEPS", "IGNORE", "OVERLAPS", "PRECISIONS", "PRESETS", "STRATEGIES",
           "DataConfig", "GPTConfig", "GoldfishConfig", "OptimConfig", "Overlap",
           "PrecisionConfig", "RunConfig", "get_preset", "gpt1b", "gpt7b", "gpt70b", "init_std",
           "small", "tiny"]


STRATEGIES = ("static", "hash", "hash-ordered")  # goldfish: which targets are dropped
OVERLAPS = ("oar", "ors", "oag")  # AxoNN's communication overlaps
IGNORE = -100  # the target id no loss reads
DEFAULT_STEPS = 200  # when neither steps nor epochs is given


@dataclass(frozen=True, kw_only=True)
class GPTConfig(GPTShape):
    """Sizes of a GPT: the shape the planner reads (:class:`common.perf.gpt.GPTShape`:
    vocab_size, num_layers, num_heads, num_kv_heads, d_model, d_ff, tie_embeddings, each
    documented there) and what only the model needs.

    Attributes:
        max_seq_len: longest sequence the rotary tables cover.
        rope_theta: RoPE base; frequency i is rope_theta ** (-2i / head_dim).
        norm_eps: epsilon of RMSNorm.
    """

    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_seq_len < 1:
            raise ValueError(f"GPTConfig.max_seq_len must be >= 1, got {self.max_seq_len}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim = d_model / num_heads = {self.d_model} / {self.num_heads}"
                             f" = {self.head_dim} must be even for rotary embeddings")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ValueError(f"rope_theta={self.rope_theta} and norm_eps={self.norm_eps} "
                             f"must be > 0")

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
        matmul = sum(i * o * n for i, o, _, n in self.linears())
        return 6 * matmul + 12 * self.num_layers * self.d_model * seq_len


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


# ------------------------------------------------------------------ run configs
@dataclass(kw_only=True)
class DataConfig:
    """Text and batches.

    Attributes:
        source: ``pydoc`` (built in), ``files`` (one document per file; ``.jsonl`` files:
            one per line's ``text``), ``paragraphs``, or ``tokens`` (one pre-tokenised
            ``.bin``/``.npy`` file, memory-mapped: ``python -m llm.tokenize`` writes one).
        paths: text files for ``files`` / ``paragraphs``; the token file for ``tokens``.
        tokenizer: ``bytes`` or a Hugging Face ``tokenizer.json`` (a path or a model
            directory holding one; :func:`llm.data.tokenizers.load_tokenizer`).
        token_cache: stream mode: tokenize the text once into this directory and
            memory-map it (:func:`llm.data.streams.open_stream`) instead of holding it in memory.
        docs: memorization setting: train on the first ``docs`` documents only, each cut to
            ``seq_len + 1`` tokens, one sample per document; held-out text is the rest.
            None: a stream of all training documents (a seeded 10% is held out).
        seq_len: targets per sample (T).
        batch_size: global samples per micro-batch (split over data x depth).
        val_fraction: share of documents held out in stream mode.
        eval_batches: held-out batches per evaluation.
        seed: seeds the batch order, the split and the held-out windows.
    """

    source: str = "pydoc"
    paths: tuple[str, ...] = ()
    tokenizer: str = "bytes"
    token_cache: str | None = None
    docs: int | None = None
    seq_len: int = 128
    batch_size: int = 16
    val_fraction: float = 0.1
    eval_batches: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        self.paths = tuple(str(p) for p in self.paths)
        if self.seq_len < 1 or self.batch_size < 1 or self.eval_batches < 0:
            raise ValueError(f"need seq_len >= 1, batch_size >= 1, eval_batches >= 0; got "
                             f"{self.seq_len}, {self.batch_size}, {self.eval_batches}")
        if self.docs is not None and self.docs < 1:
            raise ValueError(f"--docs must be >= 1, got {self.docs}")
        if self.token_cache and self.docs is not None:
            raise ValueError("--token-cache streams the text as one token sequence, and --docs "
                             "trains on whole documents: give one of them")
        if self.source == "tokens" and (len(self.paths) != 1 or self.docs is not None):
            raise ValueError("a token file is one stream: give exactly one file, and no --docs "
                             "(it has no documents)")


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW with linear warmup and cosine decay to ``min_lr_ratio * lr``; global-norm clip.

    Weight decay applies to matrices (Linears, embedding), not to RMSNorm weights.
    ``neftune_alpha > 0``: NEFTune (Jain et al. 2023), uniform noise scaled by
    ``alpha / sqrt(T d)`` on the token embeddings in training, the same on every grid.
    """

    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    neftune_alpha: float = 0.0

    def __post_init__(self) -> None:
        if not self.lr > 0 or not 0 <= self.min_lr_ratio <= 1 or self.warmup_steps < 0:
            raise ValueError(f"need lr > 0, 0 <= min_lr_ratio <= 1, warmup_steps >= 0; got "
                             f"{self.lr}, {self.min_lr_ratio}, {self.warmup_steps}")
        if self.neftune_alpha < 0:
            raise ValueError(f"--neftune-alpha must be >= 0, got {self.neftune_alpha}")
        # (written so that NaN, which every comparison refuses, fails too)
        if not (self.weight_decay >= 0 and self.grad_clip >= 0 and math.isfinite(
                self.weight_decay + self.grad_clip)):
            raise ValueError(f"--weight-decay and --grad-clip must be finite and >= 0, got "
                             f"{self.weight_decay}, {self.grad_clip}")


@dataclass(kw_only=True)
class GoldfishConfig:
    """Goldfish loss (docs/design/llm-4d-goldfish.md section 4); ``k = 0`` is the standard loss."""

    k: int = 0
    h: int = 13
    strategy: str = "hash"
    start: int = 0

    def __post_init__(self) -> None:
        if self.k < 0 or self.h < 1 or self.strategy not in STRATEGIES:
            raise ValueError(f"goldfish needs k >= 0 (0 = off), h >= 1 and a strategy in "
                             f"{STRATEGIES}; got k={self.k}, h={self.h}, {self.strategy!r}")



@dataclass(kw_only=True)
class RunConfig:
    """Length and cadence of a run (checkpoint cadence: :class:`common.run.CheckpointConfig`).

    Attributes:
        steps: optimizer steps; or ``epochs`` passes over the training samples (not both;
            neither: ``DEFAULT_STEPS``).
        grad_accum: micro-batches per optimizer step.
        eval_every, log_every: in steps (eval 0: only at the end; log 0: only the first,
            evaluated and checkpointed steps are printed).
        overlap: communication overlap, ``all``, ``none`` or a list of ``oar,ors,oag``.
        peak_tflops: one device's dense peak TFLOP/s for the MFU logged every step (None: from
            :data:`llm.mfu.PEAK_TFLOPS` on a GPU it names, else no MFU).
    """

    steps: int | None = None
    epochs: float | None = None
    grad_accum: int = 1
    eval_every: int = 0
    log_every: int = 10
    overlap: str = "all"
    peak_tflops: float | None = None

    def __post_init__(self) -> None:
        if self.steps is not None and self.epochs is not None:
            raise ValueError("give --steps or --epochs, not both")
        if (self.steps is not None and self.steps < 0) or (
                self.epochs is not None and self.epochs <= 0) or self.grad_accum < 1:
            raise ValueError(f"need steps >= 0, epochs > 0, grad_accum >= 1; got "
                             f"{self.steps}, {self.epochs}, {self.grad_accum}")
        if self.eval_every < 0 or self.log_every < 0:
            raise ValueError(f"need eval_every >= 0 and log_every >= 0; got "
                             f"{self.eval_every}, {self.log_every}")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ValueError(f"--peak-tflops must be > 0, got {self.peak_tflops}")
        Overlap.parse(self.overlap)


@dataclass(kw_only=True)
class PrecisionConfig:
    """Numerics and memory of the forward and backward (:mod:`llm.precision`).

    Attributes:
        precision: ``fp32``, or ``bf16``: bf16 compute and communication, float32 master
            weights, optimizer state, gradients and loss.
        activation_checkpointing: keep only each transformer block's input and recompute the
            block in backward (its collectives included); fp32 results are bit for bit those
            without it.
        compile: ``torch.compile`` each transformer block (in place: parameter names and
            checkpoints unchanged), as torchtitan does; fused kernels round otherwise than
            eager ones, so results agree to rounding, not bit for bit. Grids without tensor
            parallelism only (row = col = depth = 1).
    """

    precision: str = "fp32"
    activation_checkpointing: bool = False
    compile: bool = False

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision {self.precision!r}: choose one of "
                             f"{', '.join(PRECISIONS)}")

    def __str__(self) -> str:
        return self.precision + (", activation checkpointing" if self.activation_checkpointing
                                 else "") + (", compiled blocks" if self.compile else "")


@dataclass(frozen=True, kw_only=True)
class Overlap:
    """Which communications overlap with compute (AxoNN's names).

    Attributes:
        oar: issue the backward dX all-reduce asynchronously and compute dW meanwhile.
        ors: issue the depth reduce-scatter of dW asynchronously; wait when backward ends.
        oag: prefetch the next Linear's depth all-gather (forward and backward).
    """

    oar: bool = True
    ors: bool = True
    oag: bool = True

    @classmethod
    def parse(cls, text: str) -> Overlap:
        """``"all"``, ``"none"`` or a comma list of ``oar``, ``ors``, ``oag``."""
        text = text.strip().lower()
        if text in ("all", ""):
            return cls()
        if text == "none":
            return cls(oar=False, ors=False, oag=False)
        names = [t.strip() for t in text.split(",") if t.strip()]
        bad = [n for n in names if n not in OVERLAPS]
        if bad:
            raise ValueError(f"--overlap {text!r}: unknown {bad}; use all, none or a comma "
                             f"list of {', '.join(OVERLAPS)}")
        return cls(**{n: n in names for n in OVERLAPS})

    def __str__(self) -> str:
        on = [n for n in OVERLAPS if getattr(self, n)]
        return "all" if len(on) == 3 else ",".join(on) or "none"
