"""Sparse decode-time attention: exact top-k, Loki and SiftAttention, with byte accounting.

Each method is a :class:`llm.kv_cache.DecodeAttention`: pass it to ``KVCache(..., method=)`` or
``GPT.generate(..., method=)`` and every cached single-token decode step calls it with the new
query and the cached keys and values (keys after RoPE, cached position n is position n). The
methods select positions per query head and run exact softmax attention over the selected ones
(design: ../shared/design/llm-inference.md). They simulate the selection densely with a mask, to
measure quality and memory traffic; they are not fast kernels.

Bytes read per call: numbers per kv head of the cache (it stores Hkv heads) as below, summed
over the B rows and Hkv heads, times ``k.element_size()``; U = |union over the G query heads of
the kv head of their kept positions| (the design's per-head formulas, a group sharing one read):

    full:   2 * S * Dh        all keys and values
    top-k:  S * Dh + U * Dh   all keys (to score), the kept values
    Loki:   S * d + U * 2*Dh  the first d PCA coordinates of all keys, full keys and values kept
    Sift:   S * Dh + U * Dh   all keys (to score and threshold), the kept values

``bytes_full`` accumulates the first line for the same calls; ``kept_fraction`` is the mean
fraction of positions kept per query head (the realised budget).

Shapes legend: B batch, H query heads, Hkv key/value heads, G = H / Hkv query heads per kv head,
S cached positions (including the new one), Dh head_dim, d Loki's reduced rank, L layers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from numbers import Integral, Real

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from llm.model import GPT, apply_rope, rope_cache

__all__ = ["METHODS", "FullAttention", "Loki", "LokiBasis", "Sift", "TopK", "budget_count",
           "calibrate_loki", "fit_power_law", "make_method"]

METHODS = ("full", "topk", "loki", "sift")


def _check_budget(budget: float) -> None:
    if isinstance(budget, bool) or not isinstance(budget, Real):
        raise ValueError(f"budget must be a fraction in (0, 1] or a count >= 1, got {budget!r}")
    if isinstance(budget, Integral):
        if budget < 1:
            raise ValueError(f"budget count must be >= 1 position, got {budget}")
    elif not 0 < budget <= 1:
        raise ValueError(f"budget fraction must be in (0, 1], got {budget} (an int is a count)")


def budget_count(budget: float, length: int) -> int:
    """Positions kept of ``length``: ``min(S, count)`` for an int, else
    ``min(S, max(1, ceil(budget * S)))`` (the product less 1e-9, so 0.1 * 30 keeps 3)."""
    if isinstance(budget, Integral):
        return min(length, int(budget))
    return min(length, max(1, math.ceil(budget * length - 1e-9)))


def _scores(q: Tensor, k: Tensor) -> Tensor:
    """``q . k / sqrt(Dh)`` in at least float32; q [B, H, 1, Dh], k [B, Hkv, S, Dh] -> [B, H, S]."""
    b, h, _, dh = q.shape
    dt = torch.promote_types(q.dtype, torch.float32)
    grouped = q.to(dt).reshape(b, k.shape[1], h // k.shape[1], dh)  # [B, Hkv, G, Dh]
    return (grouped @ k.to(dt).transpose(-1, -2)).view(b, h, -1) / math.sqrt(dh)


def _attend(scores: Tensor, v: Tensor, keep: Tensor | None, dtype: torch.dtype) -> Tensor:
    """Softmax over the kept positions, times the values: scores, keep [B, H, S],
    v [B, Hkv, S, Dh] -> [B, H, 1, Dh] in ``dtype``."""
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    b, h, s = scores.shape
    probs = torch.softmax(scores, dim=-1).view(b, v.shape[1], -1, s)  # [B, Hkv, G, S]
    return (probs @ v.to(probs.dtype)).view(b, h, 1, -1).to(dtype)


def _top_mask(scores: Tensor, count: int) -> Tensor:
    """The ``count`` highest scores of each row: [B, H, S] -> bool [B, H, S]."""
    index = scores.topk(count, dim=-1).indices
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, index, True)


class _Accounted:
    """Byte and kept-position counters shared by the methods (module docstring)."""

    bytes_read: int
    bytes_full: int
    kept_positions: int
    total_positions: int

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Zero the counters."""
        self.bytes_read = self.bytes_full = self.kept_positions = self.total_positions = 0

    @property
    def kept_fraction(self) -> float:
        """Mean fraction of positions kept per query head and call (0 before any call)."""
        return self.kept_positions / max(1, self.total_positions)

    def _account(self, k: Tensor, keep: Tensor, key_numbers: int, kept_numbers: int) -> None:
        b, hkv, s, dh = k.shape
        union = int(keep.reshape(b, hkv, -1, s).any(dim=2).sum())  # kept by any head of a group
        self.bytes_read += (b * hkv * s * key_numbers + union * kept_numbers) * k.element_size()
        self.bytes_full += 2 * b * hkv * s * dh * k.element_size()
        self.kept_positions += int(keep.sum())
        self.total_positions += keep.numel()


class FullAttention(_Accounted):
    """Exact ``softmax(q k^T / sqrt(Dh)) v`` over every cached position (the reference).

    Shapes:
        q: [B, H, 1, Dh], k, v: [B, Hkv, S, Dh] -> returns [B, H, 1, Dh]
    """

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        scores = _scores(q, k)
        self._account(k, torch.ones_like(scores, dtype=torch.bool), k.shape[3], k.shape[3])
        return _attend(scores, v, None, q.dtype)


class TopK(_Accounted):
    """Exact top-k attention (Synk et al., 2025, https://arxiv.org/abs/2502.06766).

    Per query head, ``s = K q / sqrt(Dh)``; keep the k largest scores, ``p = softmax(s_kept)``,
    output ``sum_kept p_j V_j``.

    Args:
        budget: a float in (0, 1]: the fraction of the current context S
            (k = ``min(S, max(1, ceil(budget * S)))``), or an int >= 1: the count k.

    Shapes:
        q: [B, H, 1, Dh], k, v: [B, Hkv, S, Dh] -> returns [B, H, 1, Dh]
    """

    def __init__(self, budget: float) -> None:
        _check_budget(budget)
        self.budget = budget
        super().__init__()

    def select(self, layer: int, q: Tensor, k: Tensor) -> Tensor:
        """The kept positions: bool [B, H, S], exactly ``budget_count(budget, S)`` per head."""
        return _top_mask(_scores(q, k), budget_count(self.budget, k.shape[2]))

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        scores = _scores(q, k)
        keep = _top_mask(scores, budget_count(self.budget, k.shape[2]))
        self._account(k, keep, k.shape[3], k.shape[3])
        return _attend(scores, v, keep, q.dtype)


@dataclass(frozen=True, kw_only=True)
class LokiBasis:
    """Per-layer, per-kv-head PCA bases of the keys (:func:`calibrate_loki`).

    Attributes:
        bases: [L, Hkv, Dh, Dh]; column i of ``bases[l, h]`` is principal direction i
            (orthonormal, by decreasing explained variance).
        explained: [L, Hkv, Dh], the explained-variance ratios (each row sums to 1).
        post_rope: the keys were taken after the rotary rotation (else before it).
        rope_theta: the model's RoPE base (a pre-RoPE basis undoes the rotation with it).
    """

    bases: Tensor
    explained: Tensor
    post_rope: bool = True
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        shape = tuple(self.bases.shape)
        if len(shape) != 4 or shape[2] != shape[3] or tuple(self.explained.shape) != shape[:3]:
            raise ValueError(f"bases must be [L, Hkv, Dh, Dh] and explained [L, Hkv, Dh], got "
                             f"{shape} and {tuple(self.explained.shape)}")

    @property
    def head_dim(self) -> int:
        return self.bases.shape[-1]

    def rank(self, rank_fraction: float) -> int:
        """d = ``max(1, round(rank_fraction * Dh))`` for ``rank_fraction`` in (0, 1]."""
        if isinstance(rank_fraction, bool) or not 0 < rank_fraction <= 1:
            raise ValueError(f"rank_fraction must be in (0, 1], got {rank_fraction}")
        return max(1, round(rank_fraction * self.head_dim))

    def explained_variance(self, rank_fraction: float) -> float:
        """Mean over layers and kv heads of the variance fraction in the first d directions."""
        return self.explained[..., : self.rank(rank_fraction)].sum(-1).mean().item()

    def save(self, path: str) -> None:
        """Write a safetensors file; post_rope, rope_theta and the sizes go in its metadata."""
        num_layers, num_kv_heads, head_dim, _ = self.bases.shape
        meta = {"post_rope": str(self.post_rope), "rope_theta": repr(self.rope_theta),
                "num_layers": str(num_layers), "num_kv_heads": str(num_kv_heads),
                "head_dim": str(head_dim)}
        save_file({"bases": self.bases.contiguous(), "explained": self.explained.contiguous()},
                  path, metadata=meta)

    @classmethod
    def load(cls, path: str) -> LokiBasis:
        """Read a file written by :meth:`save`."""
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            bases, explained = f.get_tensor("bases"), f.get_tensor("explained")
        sizes = tuple(int(meta[key]) for key in ("num_layers", "num_kv_heads", "head_dim"))
        if sizes != tuple(bases.shape[:3]):
            raise ValueError(f"{path}: metadata says [L, Hkv, Dh] = {list(sizes)}, but the bases "
                             f"are {list(bases.shape)}")
        return cls(bases=bases, explained=explained, post_rope=meta["post_rope"] == "True",
                   rope_theta=float(meta["rope_theta"]))


@torch.no_grad()
def calibrate_loki(model: GPT, tokens: Tensor | Iterable[Tensor], *,
                   post_rope: bool = True) -> LokiBasis:
    """PCA of every layer's keys, per kv head, over calibration text (Loki's offline step).

    Runs the model without a cache over each int64 [B, T] batch of ``tokens``, capturing the
    keys with forward hooks on each block's ``attn.k_proj`` (and rotating them with
    :func:`llm.model.apply_rope` at positions 0..T-1 when ``post_rope``). The PCA is centred,
    as in the Loki code (sklearn's PCA, means kept apart): the eigenvectors of the keys'
    covariance, by decreasing eigenvalue. Centring is the right criterion for selection:
    ``q . k_n = q . mu + q . (k_n - mu)`` and ``q . mu`` is the same for every position, so only
    the spread around the mean ranks positions. At decode the basis is applied to the keys as
    they are (not centred), like the Loki code; at full rank this is exact either way.

    Shapes:
        tokens: int64 [B, T] (or an iterable of them) -> bases [L, Hkv, Dh, Dh]
    """
    c, dh = model.config, model.config.head_dim
    batches = [tokens] if isinstance(tokens, Tensor) else list(tokens)
    for batch in batches:
        if batch.dtype != torch.int64 or batch.dim() != 2:
            raise ValueError(f"calibration tokens must be int64 [B, T], got {batch.dtype} "
                             f"{list(batch.shape)}")
    shape = (c.num_layers, c.num_kv_heads or c.num_heads, dh)  # resolved by GPTConfig
    device = next(model.parameters()).device
    sums = torch.zeros(shape, dtype=torch.float64, device=device)  # [L, Hkv, Dh]
    outers = torch.zeros(*shape, dh, dtype=torch.float64, device=device)  # [L, Hkv, Dh, Dh]
    counts = [0] * c.num_layers

    def hook(layer: int) -> Callable[[torch.nn.Module, tuple[Tensor, ...], Tensor], None]:
        def capture(module: torch.nn.Module, inputs: tuple[Tensor, ...], out: Tensor) -> None:
            b, t, _ = out.shape
            keys = out.float().view(b, t, -1, dh)  # [B, T, Hkv, Dh]
            if post_rope:
                keys = apply_rope(keys, *rope_cache(dh, t, c.rope_theta, out.device))
            x = keys.double().permute(2, 0, 1, 3).reshape(keys.shape[2], b * t, dh)
            sums[layer] += x.sum(1)
            outers[layer] += x.transpose(1, 2) @ x
            counts[layer] += b * t
        return capture

    handles = [model.get_submodule(f"blocks.{i}.attn.k_proj").register_forward_hook(hook(i))
               for i in range(c.num_layers)]
    was_training = model.training
    try:
        model.eval()
        for batch in batches:
            model(batch)
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    if counts[0] < 2:
        raise ValueError(f"PCA needs at least 2 keys per head, got {counts[0]} tokens")
    n = torch.tensor(counts, dtype=torch.float64, device=device)[:, None, None]
    mean = sums / n  # [L, Hkv, Dh]
    cov = outers / n[..., None] - mean[..., :, None] * mean[..., None, :]  # [L, Hkv, Dh, Dh]
    values, vectors = torch.linalg.eigh(cov)  # ascending
    values = values.flip(-1).clamp_min(0)
    ratios = values / values.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    return LokiBasis(bases=vectors.flip(-1).float().cpu(), explained=ratios.float().cpu(),
                     post_rope=post_rope, rope_theta=c.rope_theta)


class Loki(_Accounted):
    """Loki (Singhania et al., NeurIPS 2024, https://arxiv.org/abs/2406.02542).

    With the PCA basis P of the layer and kv head, ``q . k = (P^T q) . (P^T k)``; the
    approximate score keeps the first d coordinates, ``s~ = (P_d^T q) . (P_d^T k) / sqrt(Dh)``,
    selects the top-k positions by s~, then runs exact attention over them with full keys and
    values (as :class:`TopK`). d = ``max(1, round(rank_fraction * Dh))``.

    A pre-RoPE basis (``basis.post_rope`` False) describes the unrotated keys k0, and the
    cached key at position n is ``R_n k0``. Truncating k0, ``q . R_n P_d P_d^T k0 =
    (P_d^T R_n^T q) . (P_d^T k0)``: the reduced key ``P_d^T k0`` is what a cache would store
    (here recovered by undoing the rotation of the cached key), and the query is rotated back
    by each position's angle before the projection. So the approximation lies in the pre-RoPE
    subspace, as the basis was fitted, and at d = Dh it is exact (the Loki code instead applies
    whichever basis to the rotated keys).

    Args:
        basis: the PCA bases of the model (:func:`calibrate_loki`).
        budget: kept positions, as :class:`TopK`'s.
        rank_fraction: d / Dh, in (0, 1].

    Shapes:
        q: [B, H, 1, Dh], k, v: [B, Hkv, S, Dh] -> returns [B, H, 1, Dh]
    """

    def __init__(self, basis: LokiBasis, budget: float, rank_fraction: float) -> None:
        _check_budget(budget)
        self.basis, self.budget, self.rank = basis, budget, basis.rank(rank_fraction)
        super().__init__()

    def approximate_scores(self, layer: int, q: Tensor, k: Tensor) -> Tensor:
        """``(P_d^T q) . (P_d^T k) / sqrt(Dh)``: [B, H, S] (class docstring for pre-RoPE)."""
        b, h, _, dh = q.shape
        hkv, s = k.shape[1], k.shape[2]
        num_layers, basis_hkv, basis_dh = self.basis.bases.shape[:3]
        if not 0 <= layer < num_layers or (basis_hkv, basis_dh) != (hkv, dh):
            raise ValueError(f"the basis has L={num_layers}, Hkv={basis_hkv}, Dh={basis_dh}; "
                             f"called for layer {layer} of a cache with Hkv={hkv}, Dh={dh}")
        dt = torch.promote_types(q.dtype, torch.float32)
        p = self.basis.bases[layer, :, :, : self.rank].to(k.device, dt)  # [Hkv, Dh, d]
        qg = q.to(dt).reshape(b, hkv, h // hkv, dh)  # [B, Hkv, G, Dh]
        if self.basis.post_rope:
            approx = (qg @ p) @ (k.to(dt) @ p).transpose(-1, -2)  # [B, Hkv, G, S]
        else:
            cos, sin = rope_cache(dh, s, self.basis.rope_theta, k.device)  # [S, Dh/2]
            k0 = apply_rope(k.to(dt).transpose(1, 2), cos, -sin)  # R_n^T k: [B, S, Hkv, Dh]
            reduced = k0.transpose(1, 2) @ p  # [B, Hkv, S, d]
            qn = apply_rope(q.to(dt).transpose(1, 2).expand(b, s, h, dh), cos, -sin)
            qn = qn.permute(0, 2, 1, 3).reshape(b, hkv, h // hkv, s, dh)  # R_n^T q per n
            approx = ((qn @ p[:, None]) * reduced[:, :, None]).sum(-1)  # [B, Hkv, G, S]
        return approx.reshape(b, h, s) / math.sqrt(dh)

    def select(self, layer: int, q: Tensor, k: Tensor) -> Tensor:
        """The kept positions by approximate score: bool [B, H, S]."""
        count = budget_count(self.budget, k.shape[2])
        return _top_mask(self.approximate_scores(layer, q, k), count)

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        keep = self.select(layer, q, k)
        self._account(k, keep, self.rank, 2 * k.shape[3])
        return _attend(_scores(q, k), v, keep, q.dtype)


def fit_power_law(n: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """Least squares in log-log: ``log y = log a + b log n``; returns (a, b).

    Shapes:
        n: [M] (M >= 2 distinct, > 0), y: [M, ...] (> 0) -> a, b: [...]
    """
    x = n.to(torch.float64).log().view(-1, *[1] * (y.dim() - 1))  # [M, 1, ...]
    ly = y.to(torch.float64).log()
    dx, dy = x - x.mean(0), ly - ly.mean(0)
    b = (dx * dy).sum(0) / (dx * dx).sum(0).clamp_min(1e-300)
    return (ly.mean(0) - b * x.mean(0)).exp(), b


@dataclass
class _SiftState:
    """One layer's SiftAttention state for the current sequence; tensors are [B, H]."""

    length: int  # S of the last call
    shape: tuple[int, int]  # (B, H)
    steps: int = 0  # decode calls so far
    ns: list[int] = field(default_factory=list)  # n = S of each measured step
    quantiles: list[Tensor] = field(default_factory=list)  # the exact quantiles measured
    a: Tensor | None = None
    b: Tensor | None = None


class Sift(_Accounted):
    """SiftAttention (Power Law Guided Dynamic Sifting, 2025, https://arxiv.org/abs/2506.05300).

    Keep position j when its attention probability ``p_j = softmax(q K^T / sqrt(Dh))_j`` is at
    least a threshold t, t estimating the ``1 - budget`` quantile of this step's probabilities;
    then softmax over the kept scores (renormalised) times their values. As in the paper the
    quantile is of the softmax probabilities (positive, so a power law fits them; roughly
    ``1/S`` for spread-out attention). t = ``a * n^b`` with n = S the step's context length
    (the paper's step index S, whose keys are ``K_{:S}``), fitted by :func:`fit_power_law`
    per (layer, batch row, query head) over the exact quantiles of earlier steps of the same
    sequence. The first ``warmup`` (>= 2) decode steps run full attention and measure the
    quantile (the paper's warm-up); afterwards every ``refit_every``-th step measures it again,
    sifts with that exact value and refits. At least one position (the largest) is always kept;
    ``budget = 1`` keeps everything (t = 0).

    A layer starts a new sequence when a call's S is not its previous call's S + 1 (or B, H
    change); :meth:`new_sequence` forces it, :meth:`reset` also zeroes the counters.

    Args:
        budget: the fraction of positions to keep, in (0, 1].
        warmup: full-attention decode steps measured before the first fit.
        refit_every: steps between later measurements; None: never after the warm-up.

    Shapes:
        q: [B, H, 1, Dh], k, v: [B, Hkv, S, Dh] -> returns [B, H, 1, Dh]
    """

    def __init__(self, budget: float, *, warmup: int = 8, refit_every: int | None = 16) -> None:
        if isinstance(budget, Integral) or not isinstance(budget, Real):
            raise ValueError(f"Sift's budget is a fraction in (0, 1] of the context, got "
                             f"{budget!r}")
        _check_budget(budget)
        if warmup < 2 or (refit_every is not None and refit_every < 1):
            raise ValueError(f"Sift needs warmup >= 2 steps to fit a power law and refit_every "
                             f">= 1 (or None), got warmup={warmup}, refit_every={refit_every}")
        self.budget: float = budget
        self.warmup: int = warmup
        self.refit_every: int | None = refit_every
        self._states: dict[int, _SiftState] = {}
        super().__init__()

    def reset(self) -> None:
        """Zero the counters and forget every sequence's state."""
        super().reset()
        self.new_sequence()

    def new_sequence(self) -> None:
        """Forget the power-law state (the next calls start a sequence); counters continue."""
        self._states = {}

    def _state(self, layer: int, length: int, shape: tuple[int, int]) -> _SiftState:
        state = self._states.get(layer)
        if state is None or length != state.length + 1 or shape != state.shape:
            state = self._states[layer] = _SiftState(length - 1, shape)
        state.length = length
        return state

    def _measure(self, state: _SiftState, probs: Tensor) -> Tensor:
        """Record this step's exact quantile [B, H] and refit a, b."""
        quantile = torch.quantile(probs, 1 - self.budget, dim=-1)  # [B, H]
        state.ns.append(probs.shape[-1])
        state.quantiles.append(quantile.clamp_min(torch.finfo(probs.dtype).tiny))
        if len(state.ns) >= 2:
            state.a, state.b = fit_power_law(torch.tensor(state.ns), torch.stack(state.quantiles))
        return quantile

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        scores = _scores(q, k)
        probs = torch.softmax(scores, dim=-1)  # [B, H, S]
        b, h, s = probs.shape
        state = self._state(layer, s, (b, h))
        step, state.steps = state.steps, state.steps + 1
        refit = (self.refit_every is not None and step >= self.warmup
                 and (step - self.warmup + 1) % self.refit_every == 0)
        if self.budget >= 1:
            threshold = probs.new_zeros(b, h)
        elif step < self.warmup:
            self._measure(state, probs)
            threshold = probs.new_zeros(b, h)  # warm-up: full attention
        elif refit:
            threshold = self._measure(state, probs)
        else:
            assert state.a is not None and state.b is not None, "fitted during the warm-up"
            threshold = (state.a * float(s) ** state.b).to(probs.dtype)
        keep = probs >= threshold[..., None]
        keep |= _top_mask(scores, 1)  # at least the largest
        self._account(k, keep, k.shape[3], k.shape[3])
        return _attend(scores, v, keep, q.dtype)


def make_method(name: str, *, budget: float = 0.25, rank_fraction: float = 0.25,
                basis: LokiBasis | None = None) -> FullAttention | TopK | Loki | Sift:
    """The method called ``name`` (one of :data:`METHODS`) at this budget."""
    if name == "full":
        return FullAttention()
    if name == "topk":
        return TopK(budget)
    if name == "loki":
        if basis is None:
            raise ValueError("loki needs a basis: basis = calibrate_loki(model, tokens) (or "
                             "LokiBasis.load(path) of one saved with LokiBasis.save)")
        return Loki(basis, budget, rank_fraction)
    if name == "sift":
        return Sift(budget)
    raise ValueError(f"unknown method {name!r}; choose one of {list(METHODS)}")
