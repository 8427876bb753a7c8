"""Sparse decode-time attention: exact top-k, Loki and SiftAttention, with byte accounting.

Each method is a :class:`llm.decode.kv_cache.DecodeAttention`: pass it to ``KVCache(..., method=)``
or ``GPT.generate(..., method=)`` and every cached single-token decode step calls it with the new
query and the cached keys and values (keys after RoPE, cached position n is position n). The
methods select positions per query head and run exact softmax attention over the selected ones
(design: docs/design/llm-inference.md). They simulate the selection densely with a mask, to
measure quality and memory traffic; they are not fast kernels.

* :class:`TopK` keeps the k highest scores.
* :class:`Loki` ranks positions by scores in the first d directions of a PCA basis of the keys
  (the basis and its calibration: :mod:`llm.decode.loki`; re-exported here).
* :class:`Sift` keeps the probabilities above a threshold a * n^b / S: a power law in the
  decode step n = 1, 2, 3, ... of the sequence (not in the context length S: after a long
  prompt the warm-up's S are too close in log space to fit a slope), over uniform attention's
  1/S, fitted in log-log space to quantiles measured exactly at the warm-up steps and
  periodically afterwards (the class docstring says why).

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
from dataclasses import dataclass, field
from numbers import Integral, Real

import torch
from torch import Tensor

from llm.decode.loki import LokiBasis, calibrate_loki
from llm.model import apply_rope, rope_cache

__all__ = ["METHODS", "SIFT_REFIT_EVERY", "SIFT_WARMUP", "FullAttention", "Loki", "LokiBasis",
           "Sift", "TopK", "budget_count", "calibrate_loki", "fit_power_law", "make_method"]

METHODS = ("full", "topk", "loki", "sift")
SIFT_WARMUP = 8  # Sift's default full-attention decode steps before the first fit
SIFT_REFIT_EVERY = 16  # and its default steps between later measurements


def _check_budget(budget: float) -> None:
    if isinstance(budget, bool) or not isinstance(budget, Real):
        raise ValueError(f"budget must be a fraction in (0, 1] or a count >= 1, got {budget!r}")
    if isinstance(budget, Integral):
        if budget < 1:
            raise ValueError(f"budget count must be >= 1 position, got {budget}")
    elif not 0 < budget <= 1:
        raise ValueError(f"budget fraction must be in (0, 1], got {budget} (an int is a count)")


def _is_count(value: object, least: int) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool) and int(value) >= least


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


def _fit_log(log_n: Tensor, log_y: Tensor) -> tuple[Tensor, Tensor]:
    """(log a, b) of the least-squares line ``log y = log a + b log n``, in float64. The slope
    comes from centred sums (``sum dx dy / sum dx^2``), not the raw normal equations in
    ``[1, log n]``, which lose digits when log n is far from 0 against its spread; then the fit
    is as well conditioned as that spread allows. Shapes: log_n [M], log_y [M, ...]."""
    x = log_n.to(torch.float64).view(-1, *[1] * (log_y.dim() - 1))  # [M, 1, ...]
    ly = log_y.to(torch.float64)
    dx, dy = x - x.mean(0), ly - ly.mean(0)
    b = (dx * dy).sum(0) / (dx * dx).sum(0).clamp_min(1e-300)
    return ly.mean(0) - b * x.mean(0), b


def fit_power_law(n: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """Least squares in log-log: ``log y = log a + b log n``; returns (a, b).

    Shapes:
        n: [M] (M >= 2 distinct, > 0), y: [M, ...] (> 0) -> a, b: [...]
    """
    log_a, b = _fit_log(n.to(torch.float64).log(), y.to(torch.float64).log())
    return log_a.exp(), b


@dataclass
class _SiftState:
    """One layer's SiftAttention state for the current sequence; tensors are [B, H]."""

    length: int  # S of the last call
    shape: tuple[int, int]  # (B, H)
    steps: int = 0  # decode calls so far: the current call is step n = steps
    log_ns: list[float] = field(default_factory=list)  # log n of each measured step
    log_levels: list[Tensor] = field(default_factory=list)  # log(S * quantile) measured
    log_a: Tensor | None = None  # the fit, float64
    b: Tensor | None = None


class Sift(_Accounted):
    """SiftAttention (Power Law Guided Dynamic Sifting, 2025, https://arxiv.org/abs/2506.05300).

    Keep position j when its attention probability ``p_j = softmax(q K^T / sqrt(Dh))_j`` is at
    least a threshold t, t estimating the ``1 - budget`` quantile of this step's probabilities;
    then softmax over the kept scores (renormalised) times their values. As in the paper the
    quantile is of the softmax probabilities.

    The threshold follows the paper's power law over generation steps: ``t = a * n^b / S``,
    where n = 1, 2, 3, ... counts the decode steps of the sequence (n = S - P after a P-token
    prefill) and ``S * t``, the quantile in units of uniform attention's 1/S, is the power law.
    Without a prompt (the paper's notation: step S reads ``K_{:S}``) n = S and this is the
    paper's ``a * S^(b - 1)``. Why not a power law in S: after a long prompt the warm-up spans
    S = P+1 .. P+w, a log range of about w / P (0.016 for w = 8, P = 448), so the fitted slope
    is mostly noise (we saw b = -33), and extrapolated it sent heads' kept fractions to 98% or
    to the argmax alone at a 25% budget. The warm-up's log n spans log 1 .. log w whatever P
    is. Why the 1/S: the quantile of spread-out attention falls like 1/(P + n), no power law in
    n while P and n are comparable; fitted raw, a power law in n kept ~2% of an untrained
    model's positions at a 25% budget. The fit is least squares in log-log (the centred form of
    :func:`fit_power_law`), per (layer, batch row, query head), over the exact quantiles
    measured at earlier steps of the same sequence, and stays in log space: ``log t = log a +
    b log n - log S``, clamped to (0, 1] after exp (``a * S^b`` in linear space overflowed to
    inf * 0 = NaN, which keeps only the argmax).

    The first ``warmup`` (>= 2) decode steps run full attention and measure the quantile (the
    paper's warm-up); afterwards every ``refit_every``-th step measures it again, sifts with
    that exact value and refits. At least one position (the largest) is always kept; ``budget
    = 1`` keeps everything (t = 0), exactly full attention.

    A layer starts a new sequence (n = 1 again) when a call's S is not its previous call's S + 1
    (or B, H change): a new prompt's first decode step, or a teacher-forced window's after its
    prefill. :meth:`new_sequence` forces it, :meth:`reset` also zeroes the counters.

    Args:
        budget: the fraction of positions to keep, in (0, 1].
        warmup: full-attention decode steps measured before the first fit.
        refit_every: steps between later measurements; None: never after the warm-up.

    Shapes:
        q: [B, H, 1, Dh], k, v: [B, Hkv, S, Dh] -> returns [B, H, 1, Dh]
    """

    def __init__(self, budget: float, *, warmup: int = SIFT_WARMUP,
                 refit_every: int | None = SIFT_REFIT_EVERY) -> None:
        if isinstance(budget, Integral) or not isinstance(budget, Real):
            raise ValueError(f"Sift's budget is a fraction of the context, a float in (0, 1] "
                             f"(1.0 keeps all), not a count of positions (an int); got "
                             f"{budget!r}")
        _check_budget(budget)
        if not _is_count(warmup, 2) or not (refit_every is None or _is_count(refit_every, 1)):
            raise ValueError(f"Sift needs warmup >= 2 steps to fit a power law and refit_every "
                             f">= 1 (or None), got warmup={warmup}, refit_every={refit_every}")
        self.budget: float = budget
        self.warmup: int = int(warmup)
        self.refit_every: int | None = None if refit_every is None else int(refit_every)
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

    def _measure(self, state: _SiftState, n: int, probs: Tensor) -> Tensor:
        """Record step n's exact quantile [B, H] and refit log a, b."""
        quantile = torch.quantile(probs, 1 - self.budget, dim=-1)  # [B, H]
        tiny = torch.finfo(probs.dtype).tiny
        state.log_ns.append(math.log(n))
        state.log_levels.append(quantile.clamp_min(tiny).log() + math.log(probs.shape[-1]))
        if len(state.log_ns) >= 2:  # the step numbers on the device of the quantiles
            log_ns = torch.tensor(state.log_ns, device=probs.device)
            state.log_a, state.b = _fit_log(log_ns, torch.stack(state.log_levels))
        return quantile

    def _keep(self, layer: int, scores: Tensor) -> Tensor:
        """One decode step of the layer's sequence: scores [B, H, S] -> kept, bool [B, H, S]."""
        probs = torch.softmax(scores, dim=-1)  # [B, H, S]
        b, h, s = probs.shape
        state = self._state(layer, s, (b, h))
        state.steps += 1
        n = state.steps  # 1 at the first decode step of the sequence
        refit = (self.refit_every is not None and n > self.warmup
                 and (n - self.warmup) % self.refit_every == 0)
        if self.budget >= 1:
            threshold = probs.new_zeros(b, h)
        elif n <= self.warmup:
            self._measure(state, n, probs)
            threshold = probs.new_zeros(b, h)  # warm-up: full attention
        elif refit:
            threshold = self._measure(state, n, probs)
        else:
            assert state.log_a is not None and state.b is not None, "fitted during the warm-up"
            log_t = (state.log_a + state.b * math.log(n) - math.log(s)).clamp(max=0.0)  # t <= 1
            threshold = log_t.exp().to(probs.dtype).clamp_min(torch.finfo(probs.dtype).tiny)
        keep = probs >= threshold[..., None]
        return keep | _top_mask(scores, 1)  # at least the largest

    def select(self, layer: int, q: Tensor, k: Tensor) -> Tensor:
        """The kept positions, bool [B, H, S]; like a call, this is a decode step of the
        layer's sequence (it measures or predicts the threshold and advances n)."""
        return self._keep(layer, _scores(q, k))

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        scores = _scores(q, k)
        keep = self._keep(layer, scores)
        self._account(k, keep, k.shape[3], k.shape[3])
        return _attend(scores, v, keep, q.dtype)


def make_method(name: str, *, budget: float = 0.25, rank_fraction: float = 0.25,
                basis: LokiBasis | None = None, warmup: int = SIFT_WARMUP,
                refit_every: int | None = SIFT_REFIT_EVERY
                ) -> FullAttention | TopK | Loki | Sift:
    """The method called ``name`` (one of :data:`METHODS`) at this budget; ``rank_fraction``
    and ``basis`` are Loki's, ``warmup`` and ``refit_every`` Sift's (the defaults are
    :class:`Sift`'s)."""
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
        return Sift(budget, warmup=warmup, refit_every=refit_every)
    raise ValueError(f"unknown method {name!r}; choose one of {list(METHODS)}")
