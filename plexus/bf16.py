"""bf16 storage of float32 activations (``PlexusGCN(precision="bf16")``,
docs/design/plexus-3d.md section 11): :class:`Rounded` rounds a fresh float32 tensor to bf16
values in place, :class:`StoredIn` keeps the activations autograd saves in bf16.

Both keep float32 tensors in the autograd graph: a bf16 tensor there would have its gradient
cast to bf16 (torch casts every gradient to its input's dtype) before the all-reduces that sum
it. plexus.ops re-exports both, beside the operators that use them.
"""

from __future__ import annotations

import weakref
from typing import Any, ClassVar

import torch

from common import dense

__all__ = ["Rounded", "StoredIn", "round_"]


class Rounded(torch.autograd.Function):
    """``x`` rounded to the values of ``dtype`` (bf16), in place and still float32; backward:
    the identity (the straight-through gradient of mixed precision).

    Rounding H before ``H W`` makes the product read exactly the bf16 H that
    :class:`plexus.ops.GatheredMatmul` keeps for ``dW`` and that a cached ``H_0`` holds, so a
    pass gives the same bits whether its H is fresh or cached (and a resumed run those of an
    unbroken one). ``x`` must be fresh (saved by no other operator).

    ``copy``: round into a new tensor (:func:`common.dense.empty_like`) and leave ``x`` as
    it is, for an ``x`` that is not fresh: one pass, where a clone rounded in place is two.

    Shapes: x [n, d] -> [n, d]
    """

    @staticmethod
    def forward(ctx: Any, x, dtype: torch.dtype, copy: bool = False):
        if copy:
            return round_(x, dtype, out=dense.empty_like(x))
        ctx.mark_dirty(x)
        return round_(x, dtype)

    @staticmethod
    def backward(ctx: Any, dy):
        return dy, None, None


# elements of one block of :func:`round_` (1 MiB of float32: the block's bf16 copy is read
# back while it is in the cache, and the allocator reuses it)
ROUND_BLOCK = 1 << 18


def round_(x: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None):
    """``x`` rounded to the values of ``dtype`` (``x.to(dtype)``'s rounding), written into
    ``out`` (``x`` itself by default) and returned: on the CPU a block at a time, so that no
    whole-size ``dtype`` copy is made (a fresh tall allocation each call); the bits of
    ``x.copy_(x.to(dtype))`` either way.

    Shapes: x [...] -> out, of x's shape and dtype
    """
    out = x if out is None else out
    if x.device.type != "cpu" or not (x.is_contiguous() and out.is_contiguous()):
        return out.copy_(x.to(dtype))
    src, dst = x.view(-1), out.view(-1)
    for lo in range(0, src.numel(), ROUND_BLOCK):
        hi = min(src.numel(), lo + ROUND_BLOCK)
        dst[lo:hi].copy_(src[lo:hi].to(dtype))
    return out


class StoredIn(torch.autograd.graph.saved_tensors_hooks):
    """Within this context, the float32 activations autograd saves for backward are kept in
    ``dtype`` (bf16) and widened back when backward reads them; parameters, vectors and
    tensors that need no gradient are kept as they are.

    An activation saved twice (``d * d``) is packed once. Used around the norm, whose torch
    operators save their inputs: a layer norm keeps ``d`` and ``d / std`` [N/P, D/O]; the
    batch norm, a custom Function, keeps ``Q - mean`` in :meth:`current`'s dtype itself.
    """

    _active: ClassVar[list[torch.dtype]] = []  # the dtypes of the contexts entered, innermost last

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        packed: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

        def pack(t: torch.Tensor) -> Any:
            if (t.dtype != torch.float32 or t.dim() != 2 or min(t.shape) < 2
                    or not t.requires_grad or isinstance(t, torch.nn.Parameter)):
                return t
            hit = packed.get(id(t))
            if hit is None or hit[0]() is not t:
                hit = packed[id(t)] = (weakref.ref(t), dense.converted(t.detach(), dtype))
            return _Packed(hit[1])

        def unpack(p: Any) -> torch.Tensor:
            return p.t.float() if isinstance(p, _Packed) else p

        super().__init__(pack, unpack)

    def __enter__(self) -> StoredIn:
        StoredIn._active.append(self.dtype)
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        StoredIn._active.pop()

    @staticmethod
    def current() -> torch.dtype | None:
        """The dtype of the innermost context entered, or None: for a custom Function, whose
        own saves autograd hands to no hook (its forward runs without grad, so nothing it
        makes requires one), to keep what it saves in that dtype itself."""
        return StoredIn._active[-1] if StoredIn._active else None


class _Packed:
    """A saved activation kept in a narrower dtype by :class:`StoredIn`."""

    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
