"""QuantSpec: self-speculative greedy decoding with a hierarchical 4-bit KV cache and 4-bit weights.

Tiwari et al., 2025, "QuantSpec: Self-Speculative Decoding with Hierarchical Quantized KV
Cache", https://arxiv.org/abs/2502.10424 (public code: github.com/rishabh-16/QuantSpec).

The draft is the target model itself with every Linear of the blocks and the LM head
quantised to int4 (:func:`quantize_int4`) and reading a 4-bit view of the KV cache
(:class:`HierarchicalKVStore`). Each round the draft proposes ``gamma`` tokens one at a time;
the target then runs ``[last, d_1 .. d_gamma]`` in ONE forward through the full-precision cache
and keeps the longest prefix of drafts equal to its own argmax, plus its own next token (the
correction, or a bonus token when every draft was accepted). The output is therefore greedy
decoding of the target (:meth:`llm.model.GPT.generate`), token for token.

Hierarchical cache (:func:`quantize_hierarchical`): every cached key and value is quantised
once to a uniform asymmetric 8-bit code ``c = round((x - min) / s)``, ``s = (max - min) / 255``,
stored as two 4-bit planes, ``upper = c >> 4`` and ``lower = c & 15``. Upper + lower is the
8-bit dequantisation ``min + s * c`` (error <= s / 2); upper alone is a 4-bit quantiser with
step ``16 s`` read at its bin midpoints, ``min + s * (16 * upper + 7.5)`` (error <= 8 s, i.e.
half a 4-bit step; plain round-to-nearest 4-bit gives (max - min) / 30 = 8.5 s). Grouping as
in KIVI and the paper: keys per channel over blocks of ``fp_buffer`` tokens (key outliers sit
in channels), values per token over the head's Dh channels. The most recent ``fp_buffer`` ..
``2 fp_buffer - 1`` committed tokens stay in full precision (the paper's double buffer): once
``2 fp_buffer`` are unquantised, the oldest ``fp_buffer`` are quantised as one key block, so
drafted (possibly rejected) tokens are never quantised and rolling back needs no requantising.

Where we differ from the paper (and its code):

* The target reads the full-precision cache, not the 8-bit (upper + lower) one: the issue
  asks for output equal to plain greedy decoding. So we keep the full-precision cache next to
  the codes (more memory, where the paper needs none beyond the codes), the lower planes are
  stored and tested but not read, and the target's bytes are full precision.
* The paper's code rounds the upper half to nearest 4-bit (scale (max - min) / 15) and
  quantises the residual into a signed lower half at scale / 16; ours splits one uniform 8-bit
  code bitwise (same storage and reads, slightly tighter bounds, a uniform 8-bit grid).
* Weights: round-to-nearest symmetric int4 per group of ``group_size`` input features (the
  grid of GPTQ's symmetric mode / Marlin), without calibration; on CPU the draft is a deep copy
  of the model holding the dequantised weights; bytes are counted as a kernel reading the codes
  would read them. The embedding table and RMSNorm weights stay full precision (one row / O(D)
  per token) and are left out of the byte counts.
* Batch size 1 only (rows would accept different numbers of drafts); no sliding window.

Bytes (:class:`QuantSpecStats`): every forward reads the weights once and the keys and values
of every position it attends to; 4-bit codes count 0.5 byte per element, each scale and
minimum :data:`SCALE_BYTES` (fp16); full precision counts the tensors' element size.

Shapes legend:
    B: batch (1), T: tokens in one forward, V: vocabulary, D: d_model, H: query heads,
    Hkv: key/value heads, Dh: head_dim, S: cached positions, Q: quantised positions (a
    multiple of R), R: fp_buffer, N: out_features, K: in_features, G: weight group size.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn
from torch.nn.functional import scaled_dot_product_attention

from common.grid import ceil_div
from llm.decode.kv_cache import KVCache
from llm.model import GPT

__all__ = ["SCALE_BYTES", "HierarchicalCodes", "HierarchicalKVStore", "Int4Weight",
           "QuantSpecStats", "build_draft", "quantize_hierarchical", "quantize_int4",
           "quantspec_generate"]

SCALE_BYTES = 2  # each scale / minimum as a kernel stores it (fp16)


@dataclass(frozen=True)
class HierarchicalCodes:
    """8-bit codes ``c = 16 * upper + lower`` of a tensor, with the statistics of their groups.

    Attributes:
        upper, lower: uint8 in [0, 15], the shape of the quantised tensor.
        scale: float32 ``(max - min) / 255`` of each group (size 1 along the reduced dim).
        minimum: float32 minimum of each group.
    """

    upper: Tensor
    lower: Tensor
    scale: Tensor
    minimum: Tensor

    def dequantize(self, bits: int = 8) -> Tensor:
        """``min + s * (16 upper + lower)`` (bits 8) or ``min + s * (16 upper + 7.5)`` (bits 4).

        Shapes:
            returns: float32, the shape of ``upper``
        """
        if bits not in (4, 8):
            raise ValueError(f"bits must be 4 (upper halves) or 8 (both), got {bits}")
        upper = 16 * self.upper.float()
        code = upper + (self.lower.float() if bits == 8 else 7.5)
        return self.minimum + self.scale * code

    def nbytes(self, bits: int = 4) -> int:
        """Bytes a kernel reads: ``bits / 8`` per element (one or both planes) plus statistics."""
        return self.upper.numel() * bits // 8 + (self.scale.numel() + self.minimum.numel()) * \
            SCALE_BYTES


def quantize_hierarchical(x: Tensor, dim: int) -> HierarchicalCodes:
    """Asymmetric 8-bit quantisation of ``x`` with one (scale, min) per slice along ``dim``.

    ``c = round((x - min) / s)``, ``s = (max - min) / 255`` over ``dim``, split into
    ``upper = c // 16`` and ``lower = c % 16``. Bounds: ``|x - deq8| <= s / 2`` and
    ``|x - deq4| <= 8 s`` (module docstring); a constant slice is exact at 8 bits.

    Shapes:
        x: any, e.g. keys [B, Hkv, R, Dh] with dim=2 (per channel) or values with dim=3
        (per token) -> codes of x's shape, scale and minimum with size 1 along ``dim``
    """
    xf = x.float()
    minimum = xf.amin(dim=dim, keepdim=True)
    scale = ((xf.amax(dim=dim, keepdim=True) - minimum) / 255).clamp_min(
        torch.finfo(torch.float32).tiny)  # a constant slice: all codes 0
    code = ((xf - minimum) / scale).round().clamp(0, 255).to(torch.uint8)
    return HierarchicalCodes(code >> 4, code & 15, scale, minimum)


@dataclass(frozen=True)
class Int4Weight:
    """Symmetric int4 weight: ``w ~= scale[n, j] * codes[n, k]`` for k in group j.

    Attributes:
        codes: int8 in [-8, 7], [N, K].
        scale: float32 ``2 * max|w| / 15`` per group, [N, ceil(K / G)].
        group_size: G, input features per scale (the last group may be shorter).
    """

    codes: Tensor
    scale: Tensor
    group_size: int

    def dequantize(self) -> Tensor:
        """Shapes: returns float32 [N, K]."""
        scale = self.scale.repeat_interleave(self.group_size, dim=1)  # [N, groups * G]
        return self.codes.float() * scale[:, : self.codes.shape[1]]

    @property
    def nbytes(self) -> int:
        """Bytes a kernel reads: half a byte per code plus one fp16 scale per group."""
        return (self.codes.numel() + 1) // 2 + self.scale.numel() * SCALE_BYTES


def quantize_int4(w: Tensor, group_size: int = 128) -> Int4Weight:
    """Round-to-nearest symmetric int4 per group of ``group_size`` input features.

    ``s = 2 max|w| / 15`` per group and ``codes = clamp(round(w / s), -8, 7)``: the 16 levels
    ``-8 s .. 7 s`` cover ``[-max|w|, max|w|]``, so ``|w - s * codes| <= s / 2`` (max|w| itself
    rounds to 7.5 s and clamps to 7 s, still s / 2 away). A ragged last group is zero-padded,
    which leaves its max|w| unchanged.

    Shapes:
        w: [N, K] -> codes [N, K], scale [N, ceil(K / G)]
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    rows, cols = w.shape
    groups = ceil_div(cols, group_size)
    padded = torch.zeros(rows, groups * group_size, dtype=torch.float32, device=w.device)
    padded[:, :cols] = w.float()
    grouped = padded.view(rows, groups, group_size)  # [N, groups, G]
    scale = (grouped.abs().amax(dim=2) * 2 / 15).clamp_min(torch.finfo(torch.float32).tiny)
    codes = (grouped / scale[:, :, None]).round().clamp(-8, 7).to(torch.int8)
    return Int4Weight(codes.view(rows, -1)[:, :cols].contiguous(), scale, group_size)


def _quantised_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The Linears the draft quantises: every one in the blocks, and the LM head."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)
            and (name.startswith("blocks.") or name == "lm_head")]


def build_draft(model: GPT, group_size: int = 128) -> tuple[GPT, dict[str, Int4Weight]]:
    """A copy of ``model`` whose block Linears and LM head hold int4-dequantised weights.

    A tied LM head is untied in the draft only (the draft's embedding stays exact).

    Returns:
        the draft module (eval mode) and the int4 weights by module name.
    """
    draft = copy.deepcopy(model).eval()
    weights: dict[str, Int4Weight] = {}
    for name, module in _quantised_linears(draft):
        q = quantize_int4(module.weight.detach(), group_size)
        module.weight = nn.Parameter(q.dequantize().to(module.weight.dtype), requires_grad=False)
        weights[name] = q
    return draft, weights


class HierarchicalKVStore:
    """Hierarchical 4/8-bit codes of a :class:`KVCache`'s committed positions, and the
    draft's attention over them (a :class:`llm.decode.kv_cache.DecodeAttention`).

    Positions ``0 .. Q-1`` are quantised in blocks of R (:meth:`commit`); the rest of the
    cache is the full-precision buffer. While ``drafting``, a single-token step attends to the
    4-bit view (upper halves) of the quantised positions and to the buffer as cached (the
    drafted tokens' own keys included); otherwise it is exact full attention, computed as
    :class:`llm.model.Attention` does.

    Shapes:
        q: [B, H, 1, Dh], k, v: [B, Hkv, S, Dh] -> returns [B, H, 1, Dh]
    """

    def __init__(self, num_layers: int, fp_buffer: int) -> None:
        if fp_buffer < 1:
            raise ValueError(f"fp_buffer must be >= 1 token, got {fp_buffer}")
        self.fp_buffer, self.quantized, self.drafting = fp_buffer, 0, False
        self.keys: list[list[HierarchicalCodes]] = [[] for _ in range(num_layers)]
        self.values: list[list[HierarchicalCodes]] = [[] for _ in range(num_layers)]
        self._views: list[tuple[Tensor, Tensor] | None] = [None] * num_layers  # 4-bit K, V
        self.quantized_bytes = 0  # what the draft reads of the codes (4-bit), all layers

    def commit(self, cache: KVCache) -> None:
        """Quantise the oldest R buffered positions while ``2 R`` or more are buffered.

        Call with only committed (target-verified) positions in ``cache``.
        """
        r = self.fp_buffer
        while cache.length - self.quantized >= 2 * r:
            lo, hi = self.quantized, self.quantized + r
            for i, layer in enumerate(cache.layers):
                assert layer.keys is not None and layer.values is not None
                kc = quantize_hierarchical(layer.keys[:, :, lo:hi], dim=2)  # per channel
                vc = quantize_hierarchical(layer.values[:, :, lo:hi], dim=3)  # per token
                self.keys[i].append(kc)
                self.values[i].append(vc)
                self.quantized_bytes += kc.nbytes(4) + vc.nbytes(4)
                k4 = kc.dequantize(4).to(layer.keys.dtype)  # [B, Hkv, R, Dh]
                v4 = vc.dequantize(4).to(layer.values.dtype)
                view = self._views[i]
                self._views[i] = (k4, v4) if view is None else (
                    torch.cat((view[0], k4), dim=2), torch.cat((view[1], v4), dim=2))
            self.quantized = hi

    def draft_view(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values the draft reads: 4-bit for the first Q positions, then ``k``, ``v``.

        Shapes:
            k, v: [B, Hkv, S, Dh] with S >= Q -> two [B, Hkv, S, Dh]
        """
        view = self._views[layer]
        if view is None:
            return k, v
        q_len = self.quantized
        return (torch.cat((view[0], k[:, :, q_len:]), dim=2),
                torch.cat((view[1], v[:, :, q_len:]), dim=2))

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if self.drafting:
            k, v = self.draft_view(layer, k, v)
        groups = q.shape[1] // k.shape[1]
        if groups > 1:  # grouped-query attention: query head j reads kv head j // groups
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return scaled_dot_product_attention(q, k, v)  # [B, H, 1, Dh]

    def draft_read_bytes(self, cache: KVCache) -> int:
        """KV bytes of one draft step over ``cache.length`` positions: 4-bit codes and their
        statistics for the first Q, full precision for the buffer."""
        return self.quantized_bytes + _kv_bytes(cache, cache.length - self.quantized)


def _kv_bytes(cache: KVCache, positions: int) -> int:
    """Bytes of the full-precision keys and values of ``positions`` positions, all layers."""
    keys = cache.layers[0].keys
    assert keys is not None
    batch, kv_heads, _, head_dim = keys.shape
    per_position = 2 * batch * kv_heads * head_dim * keys.element_size()
    return len(cache.layers) * positions * per_position


@dataclass
class QuantSpecStats:
    """Counts of one :func:`quantspec_generate` call.

    The prefill counts as one target pass that emits one token and no drafts, so
    ``generated = accepted + target_passes = max_new_tokens``. Bytes (module docstring) include
    the prefill; ``baseline_bytes`` is what plain greedy decoding with a KV cache reads for the
    same tokens (a prefill, then one full-precision step per further token).

    Attributes:
        gamma: drafts per round (fewer in the last rounds, never past max_new_tokens).
        drafted: draft tokens proposed; accepted: those the target kept.
        target_passes: target forwards (prefill, verifications, and a final plain step).
        draft_weight_bytes, draft_kv_bytes: read by the draft steps (int4 weights, 4-bit view).
        target_weight_bytes, target_kv_bytes: read by the target passes (full precision).
        baseline_bytes: read by plain greedy decoding for the same tokens.
    """

    gamma: int
    drafted: int = 0
    accepted: int = 0
    target_passes: int = 0
    draft_weight_bytes: int = 0
    draft_kv_bytes: int = 0
    target_weight_bytes: int = 0
    target_kv_bytes: int = 0
    baseline_bytes: int = 0

    @property
    def generated(self) -> int:
        return self.accepted + self.target_passes

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_target_pass(self) -> float:
        return self.generated / self.target_passes if self.target_passes else 0.0

    @property
    def bytes_read(self) -> int:
        return (self.draft_weight_bytes + self.draft_kv_bytes + self.target_weight_bytes
                + self.target_kv_bytes)

    @property
    def bytes_per_accepted_token(self) -> float:
        """All bytes read (draft and target) per token emitted."""
        return self.bytes_read / self.generated if self.generated else 0.0

    @property
    def baseline_bytes_per_token(self) -> float:
        return self.baseline_bytes / self.generated if self.generated else 0.0

    def summary(self) -> dict[str, float | int]:
        """Every count and ratio, for JSON."""
        names = ("generated", "acceptance_rate", "tokens_per_target_pass", "bytes_read",
                 "bytes_per_accepted_token", "baseline_bytes_per_token")
        return {**asdict(self), **{name: getattr(self, name) for name in names}}


@torch.no_grad()
def quantspec_generate(
    model: GPT, idx: Tensor, max_new_tokens: int, *, gamma: int = 4, fp_buffer: int = 128,
    group_size: int = 128, draft: tuple[GPT, dict[str, Int4Weight]] | None = None,
) -> tuple[Tensor, QuantSpecStats]:
    """Greedy decoding of ``model`` accelerated by QuantSpec self-speculation.

    Equals ``model.generate(idx, max_new_tokens)`` token for token, up to rounding: a
    verification forward of gamma + 1 tokens rounds differently from single-token steps in the
    last bits, so a token could differ only where two logits tie within rounding (none did on
    the tests' prompts, float32 and bfloat16).

    Args:
        model: the target.
        idx: the prompt, one row.
        max_new_tokens: tokens to append; prompt + max_new_tokens - 1 must fit max_seq_len
            (the window does not slide).
        gamma: tokens drafted per target pass.
        fp_buffer: R, the full-precision buffer and the key block length (module docstring).
        group_size: input features per int4 weight scale.
        draft: ``build_draft(model, group_size)`` made once for many calls, so that the
            model's copy and quantisation are not repeated for every prompt (nor timed with
            its decoding); None: built here (``group_size`` is then used, else the draft's
            own). It should be ``model``'s own draft: one of other weights still gives
            greedy tokens, since the target verifies every draft, but accepts fewer.

    Shapes:
        idx: int64 [1, T0] -> returns int64 [1, T0 + max_new_tokens], and the stats
    """
    batch, prompt_len = idx.shape
    window = model.config.max_seq_len
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1 drafted token per target pass, got {gamma}")
    if batch != 1:
        raise ValueError(f"quantspec_generate decodes one sequence; got batch size {batch}")
    if max_new_tokens < 0 or prompt_len < 1:
        raise ValueError(f"need a non-empty prompt and max_new_tokens >= 0, got prompt length "
                         f"{prompt_len} and max_new_tokens={max_new_tokens}")
    positions = prompt_len + max(max_new_tokens - 1, 0)  # the last token is never run
    if positions > window:
        raise ValueError(f"prompt {prompt_len} + max_new_tokens {max_new_tokens} - 1 = "
                         f"{positions} positions exceed max_seq_len={window}; QuantSpec does "
                         f"not slide the window" if max_new_tokens else
                         f"prompt of {prompt_len} tokens exceeds max_seq_len={window}")
    stats = QuantSpecStats(gamma=gamma)
    if max_new_tokens == 0:
        return idx.clone(), stats
    draft_model, int4 = build_draft(model, group_size) if draft is None else draft
    target_weights = sum(m.weight.numel() * m.weight.element_size()
                         for _, m in _quantised_linears(model))
    draft_weights = sum(q.nbytes for q in int4.values())
    store = HierarchicalKVStore(model.config.num_layers, fp_buffer)
    cache = KVCache(model.config.num_layers, window, store)

    def target(tokens: Tensor) -> Tensor:  # [1, T] -> greedy tokens [T]
        out = model(tokens, cache)[0].float().argmax(dim=-1)  # [T]
        stats.target_passes += 1
        stats.target_weight_bytes += target_weights
        stats.target_kv_bytes += _kv_bytes(cache, cache.length)
        return out

    out = [int(target(idx)[-1])]  # prefill
    stats.baseline_bytes = target_weights + _kv_bytes(cache, prompt_len)
    store.commit(cache)
    while len(out) < max_new_tokens:
        start = cache.length  # the position of out[-1], not yet run
        # never past max_new_tokens; 0 for a last token: a plain single-token target step,
        # which the store (not drafting) computes as exact full attention
        num_drafts = min(gamma, max_new_tokens - len(out) - 1)
        drafts: list[int] = []
        store.drafting = True
        for _ in range(num_drafts):  # each step writes its keys at start, start + 1, ...
            last = drafts[-1] if drafts else out[-1]
            logits = draft_model(torch.tensor([[last]], device=idx.device), cache)  # [1, 1, V]
            drafts.append(int(logits[0, -1].float().argmax()))
            stats.draft_weight_bytes += draft_weights
            stats.draft_kv_bytes += store.draft_read_bytes(cache)
        store.drafting = False
        cache.truncate(start)  # the target recomputes these positions
        verify = torch.tensor([[out[-1], *drafts]], device=idx.device)  # [1, num_drafts + 1]
        greedy = target(verify).tolist()  # greedy[i]: the target's token after verify[:, i]
        accepted = 0
        while accepted < num_drafts and drafts[accepted] == greedy[accepted]:
            accepted += 1
        out += [*drafts[:accepted], greedy[accepted]]
        stats.drafted += num_drafts
        stats.accepted += accepted
        cache.truncate(start + accepted + 1)  # out[-1] (the new token) stays unrun
        store.commit(cache)
    for step in range(1, max_new_tokens):  # plain decoding's step over prompt_len + step
        stats.baseline_bytes += target_weights + _kv_bytes(cache, prompt_len + step)
    new = torch.tensor([out], dtype=idx.dtype, device=idx.device)  # [1, max_new_tokens]
    return torch.cat((idx, new), dim=1), stats
