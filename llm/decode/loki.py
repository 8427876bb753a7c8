"""Loki's offline step: PCA bases of the keys, per layer and kv head, and their storage.

Loki (Singhania et al., NeurIPS 2024, https://arxiv.org/abs/2406.02542; design:
docs/design/llm-inference.md) scores the cached keys in the first d directions of a PCA
basis of keys collected on calibration text. :func:`calibrate_loki` computes the bases of a
model, :class:`LokiBasis` holds and saves them, and :func:`load_or_calibrate` keeps one with
its checkpoint (:func:`basis_path`). The decode-time method that uses them is
:class:`llm.decode.sparse_attention.Loki`.

Shapes legend: B batch, T tokens, Hkv key/value heads, Dh head_dim, L layers.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from llm.data.batches import encode_stream
from llm.data.tokenizers import Tokenizer
from llm.model import GPT, apply_rope, rope_cache

__all__ = ["BASIS_FILE", "LokiBasis", "basis_path", "calibrate_loki", "calibration_batch",
           "load_or_calibrate"]

BASIS_FILE = "loki_basis.safetensors"


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
        """Write a safetensors file; post_rope, rope_theta and the sizes go in its metadata.

        The file is written beside ``path`` and renamed onto it, so an interrupted save leaves
        no partial basis for :func:`load_or_calibrate` to trip over on every later run.
        """
        num_layers, num_kv_heads, head_dim, _ = self.bases.shape
        meta = {"post_rope": str(self.post_rope), "rope_theta": repr(self.rope_theta),
                "num_layers": str(num_layers), "num_kv_heads": str(num_kv_heads),
                "head_dim": str(head_dim)}
        target = Path(path)
        tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
        try:
            save_file({"bases": self.bases.contiguous(),
                       "explained": self.explained.contiguous()}, str(tmp), metadata=meta)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)

    @classmethod
    def load(cls, path: str) -> LokiBasis:
        """Read a file written by :meth:`save`.

        Raises:
            ValueError: the file is not such a basis (truncated, another safetensors file, or
                its sizes disagree with its metadata), naming the file and what to do.
            FileNotFoundError: there is no file at ``path``.
        """
        redo = ("remove it (python -m llm.evaluate then calibrates a new basis at the "
                "checkpoint's own path) or pass a file written by LokiBasis.save")
        if not Path(path).is_file():
            raise FileNotFoundError(f"no Loki basis at {path}")
        try:
            with safe_open(path, framework="pt") as f:
                meta = f.metadata() or {}
                missing = {"bases", "explained"} - set(f.keys())
                if missing:
                    raise ValueError(f"Loki basis {path} lacks the tensor(s) "
                                     f"{sorted(missing)} (not written by LokiBasis.save?); "
                                     f"{redo}")
                bases, explained = f.get_tensor("bases"), f.get_tensor("explained")
        except SafetensorError as e:
            raise ValueError(f"Loki basis {path} is not a readable safetensors file ({e}; "
                             f"an interrupted write?); {redo}") from None
        keys = ("num_layers", "num_kv_heads", "head_dim", "post_rope", "rope_theta")
        missing = [key for key in keys if key not in meta]
        if missing:
            raise ValueError(f"Loki basis {path} lacks the metadata {missing} (not written by "
                             f"LokiBasis.save?); {redo}")
        try:
            sizes = tuple(int(meta[key]) for key in keys[:3])
            rope_theta = float(meta["rope_theta"])
        except ValueError:
            raise ValueError(f"Loki basis {path} has malformed metadata {meta}; {redo}") from None
        if sizes != tuple(bases.shape[:3]):
            raise ValueError(f"{path}: metadata says [L, Hkv, Dh] = {list(sizes)}, but the bases "
                             f"are {list(bases.shape)}; {redo}")
        try:
            return cls(bases=bases, explained=explained, post_rope=meta["post_rope"] == "True",
                       rope_theta=rope_theta)
        except ValueError as e:
            raise ValueError(f"Loki basis {path}: {e}; {redo}") from None


@torch.no_grad()
def calibrate_loki(model: GPT, tokens: Tensor | Iterable[Tensor], *,
                   post_rope: bool = True) -> LokiBasis:
    """PCA of every layer's keys, per kv head, over calibration text (Loki's offline step).

    Runs the model without a cache over each int64 [B, T] batch of ``tokens`` (moved to the
    model's device; the bases come back on the CPU), capturing the keys with forward hooks on
    each block's ``attn.k_proj`` (and rotating them with :func:`llm.model.apply_rope` at
    positions 0..T-1 when ``post_rope``). The PCA is centred,
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
            model(batch.to(device))
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


def basis_path(checkpoint_path: str | Path, step: int, *, post_rope: bool = True) -> Path:
    """Where the Loki basis of a checkpoint lives: in the step directory whose weights are
    read (``DIR/step-N/`` of a root), or ``NAME.loki_basis.safetensors`` next to a file; a
    basis of the keys before RoPE is ``loki_basis_pre_rope.safetensors`` beside it."""
    path = Path(checkpoint_path)
    name = BASIS_FILE if post_rope else BASIS_FILE.replace(".safetensors", "_pre_rope.safetensors")
    if path.is_file():
        return path.with_name(f"{path.stem}.{name}")
    if (path / "manifest.json").is_file():
        return path / name
    return path / f"step-{step:08d}" / name


def calibration_batch(docs: list[str], tokenizer: Tokenizer, window: int, num_tokens: int
                      ) -> Tensor:
    """The first ``num_tokens`` tokens of ``docs`` joined as in training, in rows of
    ``window`` (one shorter row if that is all there is); [B, T] for :func:`calibrate_loki`."""
    stream = encode_stream(docs, tokenizer)[:num_tokens]
    width = max(1, min(window, stream.numel()))
    return stream[: stream.numel() // width * width].view(-1, width)  # [B, T]


def load_or_calibrate(model: GPT, path: Path, calibration: Tensor | None, *,
                      post_rope: bool = True) -> tuple[LokiBasis, bool]:
    """The basis at ``path``, else calibrated on ``calibration`` ([B, T]) and saved there;
    (basis, whether it was calibrated now). ``post_rope``: keys after RoPE (else before).

    Raises:
        ValueError: the basis does not fit the model (another checkpoint's) or was taken on
            the other side of RoPE, or there is none and no ``calibration``.
    """
    c = model.config
    if path.is_file():
        basis = LokiBasis.load(str(path))
        want = (c.num_layers, c.num_kv_heads, c.head_dim)
        if tuple(basis.bases.shape[:3]) != want:
            raise ValueError(f"Loki basis {path} is for [layers, kv heads, head_dim] = "
                             f"{list(basis.bases.shape[:3])}, but the model has {list(want)}")
        if basis.post_rope != post_rope:
            side = ("after", "before") if basis.post_rope else ("before", "after")
            raise ValueError(f"Loki basis {path} holds keys {side[0]} RoPE, but keys "
                             f"{side[1]} RoPE were asked for")
        return basis, False
    if calibration is None:
        raise ValueError(f"no Loki basis at {path}")
    basis = calibrate_loki(model, calibration, post_rope=post_rope)
    basis.save(str(path))
    return basis, True
