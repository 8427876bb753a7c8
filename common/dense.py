"""Dense float32 products on the CPU through oneDNN, where torch's BLAS leaves the CPU's
widest vectors unused.

torch's CPU ``mm`` calls MKL. MKL picks its code path by CPU vendor, and on AMD CPUs runs
its AVX2 kernels even where the CPU has AVX-512; oneDNN, which torch also ships (it is what
``torch.compile`` calls for CPU linear layers), picks the widest instruction set the CPU
reports, whoever made it. On the development machine (a 2-core AMD EPYC VM with AVX-512) a
``[200K, 128] @ [128, 128]`` float32 product takes 19 ms through oneDNN against 35 ms
through ``torch.mm`` (344 and 189 GFLOP/s; ``python bench/gcn_epoch.py`` prints both rates
for a layer's product).

:func:`mm` is ``a @ b`` through oneDNN's linear primitive
(``torch.ops.mkldnn._linear_pointwise``) where that applies: ``backend`` ``auto`` or
``onednn``, both operands float32 2-D CPU tensors, ``a`` row-major (a transposed view, as
in ``dW = H^T dQ``, would be copied first, which costs more than it saves: those stay with
torch), at least :data:`MIN_WORK` multiply-adds, and no autograd graph to record (the callers
are ``autograd.Function`` passes). The precision is the same, float32 products summed in
float32 (the primitive did not follow ``torch.backends.mkldnn.matmul.fp32_precision = "bf16"``
here: its error against float64 stayed 5e-7); the summation order is oneDNN's, so results
equal torch's to float rounding, not bit for bit. ``torch`` keeps every product on
``torch.mm``.

Shapes: a [m, k] @ b [k, n] -> [m, n]
"""

from __future__ import annotations

import functools

import torch

BACKENDS = ("auto", "onednn", "torch")
# below this many multiply-adds (m k n) oneDNN's per-call overhead (about 15 us here) costs
# more than its faster kernel saves: [3000, 16] @ [16, 16] took 0.023 ms against torch's
# 0.013, [3000, 64] @ [64, 64] 0.085 against 0.127
MIN_WORK = 1 << 20


@functools.cache
def onednn_available() -> bool:
    """Whether this torch build has oneDNN's linear primitive and it runs here."""
    op = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
    if op is None or not torch.backends.mkldnn.is_available():
        return False
    try:
        got = op(torch.ones(2, 3), torch.ones(4, 3), None, "none", [], "")
    except (RuntimeError, NotImplementedError):
        return False
    return tuple(got.shape) == (2, 4) and bool((got == 3).all())


def check_backend(backend: str) -> str:
    """``backend`` if it is one of :data:`BACKENDS` and runs here, else a ValueError that says
    why (``onednn`` asked of a torch without oneDNN's linear primitive)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown dense product backend {backend!r}; choose from {BACKENDS}")
    if backend == "onednn" and not onednn_available():
        raise ValueError(f"dense product backend 'onednn': this torch ({torch.__version__}) "
                         "has no usable oneDNN linear primitive; use 'auto' or 'torch'")
    return backend


def uses_onednn(a: torch.Tensor, b: torch.Tensor, backend: str = "auto") -> bool:
    """Whether :func:`mm` computes ``a @ b`` through oneDNN (see the module docstring)."""
    if backend not in BACKENDS:
        check_backend(backend)  # raises
    return (backend != "torch" and a.device.type == "cpu" and b.device.type == "cpu"
            and a.dtype == torch.float32 and b.dtype == torch.float32
            and a.dim() == 2 and b.dim() == 2 and a.is_contiguous()
            and a.shape[0] * a.shape[1] * b.shape[1] >= MIN_WORK
            and not (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad))
            and onednn_available())


def mm(a: torch.Tensor, b: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``a @ b``, a new tensor, through oneDNN where :func:`uses_onednn`, else ``torch.mm``.
    (oneDNN's primitive has no ``out=`` form: a product meant for rows of a larger tensor is
    better written there by ``torch.mm(..., out=...)`` than copied from a temporary.)

    Shapes: a [m, k], b [k, n] -> [m, n]
    """
    if not uses_onednn(a, b, backend):
        return torch.mm(a, b)
    # the primitive computes x @ weight^T with weight [n, k]; b is small (a weight), so the
    # copy that makes its transpose contiguous is cheap (none when b is a transposed view)
    return torch.ops.mkldnn._linear_pointwise(a, b.t().contiguous(), None, "none", [], "")
