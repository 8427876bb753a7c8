"""Dense float32 products on the CPU through oneDNN, where torch's BLAS leaves the CPU's
widest vectors unused.

torch's CPU ``mm`` calls MKL. MKL picks its code path by CPU vendor, and on AMD CPUs runs
its AVX2 kernels even where the CPU has AVX-512; oneDNN, which torch also ships (it is what
``torch.compile`` calls for CPU linear layers), picks the widest instruction set the CPU
reports, whoever made it. On an AMD CPU with AVX-512 a layer's ``[N, 128] @ [128, 128]``
product then runs well above ``torch.mm``'s rate (``python bench/gcn_epoch.py`` prints
both rates; docs/benchmarks.md, "The dense products through oneDNN").

:func:`mm` is ``a @ b`` through oneDNN's linear primitive
(``torch.ops.mkldnn._linear_pointwise``) where that applies: ``backend`` ``auto`` or
``onednn``, both operands float32 2-D CPU tensors, ``a`` row-major (the primitive would
copy a transposed view first, which costs more than it saves: ``dW = H^T dQ`` is
:func:`tn`'s), at least :data:`MIN_WORK` multiply-adds, and no autograd graph to record (the callers
are ``autograd.Function`` passes). The precision is the same, float32 products summed in
float32 (the primitive does not follow ``torch.backends.mkldnn.matmul.fp32_precision = "bf16"``:
its error against float64 stays float32's); the summation order is oneDNN's, so results
equal torch's to float rounding, not bit for bit. ``torch`` keeps every product on
``torch.mm``. ``tf32`` is ``auto`` on the CPU; on a CUDA device its float32 products run on
the tensor cores in TF32 (each operand rounded to 10 mantissa bits, the sums float32:
``torch.backends.cuda.matmul.fp32_precision = "tf32"`` for the call, put back after), where
``torch.mm``'s default keeps them on the slower float32 units; a bf16 value is exact in TF32.

:func:`tn` is the weight gradient ``a^T b`` (``dW = H^T dQ``: both operands tall, the sum
over their rows). oneDNN's linear primitive would first copy the transposed ``a``, but its
inner-product backward-weights primitive (``aten::mkldnn_linear_backward_weights``) sums
over the rows of two row-major operands as they lie, well above MKL's rate on such a CPU
(docs/benchmarks.md, "The weight gradients through oneDNN"). That primitive reads
only tensors in oneDNN's own layout, and copying two tall operands into it costs what it
saves, so the tall tensors that feed a ``dW`` (the SpMM's output ``H``, the ReLU's gradient
``dQ``) are allocated by :func:`empty`: a oneDNN tensor in the plain row-major layout, seen
by torch (and numba) as an ordinary dense tensor over the same memory. :func:`tn` finds the
oneDNN tensor behind each operand by its address and runs the primitive on both without a
copy; an operand that was not allocated so (a view, a slice, another dtype) takes
``torch.mm``. Same float32 precision, another summation order.

The buffers of :func:`empty` are tall (``[N, D]``, 102 MB at 200K x 128) and a training step
allocates and frees the same ones every step. Above glibc's retention cap (common.alloc)
each is a fresh ``mmap``, faulted in and zeroed by the kernel again, slower to fill than a
reused one. On a VM that hands freed guest pages back to its host (free page reporting) a
few in a hundred such allocations also stall for a tenth of a second while the host provides
the pages again, enough to make whole epochs far slower (docs/design/plexus-3d.md
section 7). With :func:`pool_freed` on (plexus: whenever
it retains freed memory, its default), a freed buffer is kept for the next request of its
shape (or a smaller one) under rules that keep idle buffers from adding to a step's peak
(:class:`_Pool`, :func:`hand_back_pooled`).

Shapes: a [m, k] @ b [k, n] -> [m, n]; tn: a [m, k], b [m, n] -> [k, n]
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
import warnings
import weakref
from collections.abc import Iterator

import numpy as np
import torch

BACKENDS = ("auto", "onednn", "torch", "tf32")
# below this many multiply-adds (m k n) oneDNN's fixed per-call overhead costs more than its
# faster kernel saves: a [3000, 16] @ [16, 16] product is faster through torch, a
# [3000, 64] @ [64, 64] one through oneDNN
MIN_WORK = 1 << 20
# the rows of one oneDNN call of mm: its input and output blocks at most this big, which
# glibc serves from its retained heap (common.alloc) and the cache holds until copied out
BLOCK_BYTES = 4 << 20
# the float32 copy :func:`tn` makes of a bf16 operand: whole up to this size, else a row block
# of this size at a time (the copy of a tall kept H would be a step's largest transient)
WIDEN_BYTES = 64 << 20
# a pooled buffer serves a request of another shape if at most this many times its size
FIT = 4


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


@contextlib.contextmanager
def tensor_cores(backend: str, t: torch.Tensor) -> Iterator[None]:
    """Within: float32 products on ``t``'s CUDA device in TF32 where ``backend`` is ``tf32``
    (the module docstring); the setting before put back after. Elsewhere nothing."""
    if backend != "tf32" or t.device.type != "cuda":
        yield
        return
    matmul = torch.backends.cuda.matmul
    new = hasattr(matmul, "fp32_precision")  # torch >= 2.9; mixing it with allow_tf32 raises
    name, value = ("fp32_precision", "tf32") if new else ("allow_tf32", True)
    before = getattr(matmul, name)
    setattr(matmul, name, value)
    try:
        yield
    finally:
        setattr(matmul, name, before)


def check_backend(backend: str) -> str:
    """``backend`` if it is one of :data:`BACKENDS` and runs here, else a ValueError that says
    why (``onednn`` asked of a torch without oneDNN's linear primitive)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown dense product backend {backend!r}; choose from {BACKENDS}")
    if backend == "onednn" and not onednn_available():
        raise ValueError(f"dense product backend 'onednn': this torch ({torch.__version__}) "
                         "has no usable oneDNN linear primitive; use 'auto' or 'torch'")
    return backend


def uses_onednn(a: torch.Tensor, b: torch.Tensor, backend: str = "auto", *,
                widen: bool = False) -> bool:
    """Whether :func:`mm` computes ``a @ b`` through oneDNN (see the module docstring);
    ``widen``: ``a`` is bf16, widened block by block."""
    if backend not in BACKENDS:
        check_backend(backend)  # raises
    return (backend != "torch" and a.device.type == "cpu" and b.device.type == "cpu"
            and a.dtype == (torch.bfloat16 if widen else torch.float32)
            and b.dtype == torch.float32
            and a.dim() == 2 and b.dim() == 2 and a.is_contiguous()
            and a.shape[0] * a.shape[1] * b.shape[1] >= MIN_WORK
            and not (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad))
            and onednn_available())


def mm(a: torch.Tensor, b: torch.Tensor, *, backend: str = "auto",
       out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """``a @ b`` through oneDNN where :func:`uses_onednn`, else ``torch.mm``; into ``out``
    (a contiguous [m, n] tensor, or rows of one) if given, else into a new tensor from
    :func:`empty`; with ``accumulate``, added into ``out`` (``out += a @ b``).

    oneDNN's primitive has no ``out=`` form and would allocate the whole product afresh, so
    it runs on row blocks of ``a`` whose products (at most :data:`BLOCK_BYTES`) glibc keeps
    in its heap, each copied into ``out`` while it is still in the cache: no slower than one
    call into a reused output, and the tall output is a buffer of :func:`empty`, which
    :func:`tn` reads in place and the pool can reuse (the module docstring). Each row's sum is
    the primitive's either way.

    ``a`` may be bfloat16 where ``b`` is float32 (a bf16 ``H`` kept for ``dW``): its row
    blocks are widened one at a time (exactly), so no float32 copy of the whole of ``a`` is
    made, and the product is the float32 ``mm(a.float(), b)`` of the same backend, bit for bit.
    ``out`` may be bfloat16 where ``b`` is float32 (a ``dH`` summed in bf16): each block of the
    float32 product is rounded into it (torch's rounding), so no float32 copy of the whole
    product is made; through oneDNN the bits of ``mm(a, b).to(torch.bfloat16)``.

    Shapes: a [m, k], b [k, n] -> [m, n]
    """
    if accumulate and out is None:
        raise ValueError("accumulate needs out")
    widen = a.dtype == torch.bfloat16 and b.dtype == torch.float32
    narrow = out is not None and out.dtype == torch.bfloat16 and b.dtype == torch.float32
    if narrow and (accumulate or widen):
        raise ValueError("a bf16 out takes a float32 product, written over it")
    onednn = uses_onednn(a, b, backend, widen=widen)
    if not onednn and not narrow:
        a = a.to(b.dtype) if widen else a
        with tensor_cores(backend, a):
            if accumulate and out is not None:
                return out.addmm_(a, b)
            return torch.mm(a, b) if out is None else torch.mm(a, b, out=out)
    m, k, n = a.shape[0], a.shape[1], b.shape[1]
    if out is None:
        out = empty(m, n, dtype=b.dtype, device=a.device)
    elif tuple(out.shape) != (m, n) or out.dtype not in (b.dtype, torch.bfloat16) or (
            not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {(m, n)} tensor of {b.dtype}")
    # the primitive computes x @ weight^T with weight [n, k]; b is small (a weight), so the
    # copy that makes its transpose contiguous is cheap (none when b is a transposed view)
    weight = b.t().contiguous() if onednn else b
    rows = _block_rows(k, n)
    # a bf16 a: each block widened into one reused float32 block just before its call
    wide = torch.empty((min(rows, m), k), dtype=b.dtype) if widen else None
    for lo in range(0, m, rows):
        hi = min(m, lo + rows)
        x = a[lo:hi] if wide is None else wide[:hi - lo].copy_(a[lo:hi])
        if onednn:
            block = torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
        else:  # (torch's: a bf16 out, rounded block by block)
            with tensor_cores(backend, x):
                block = torch.mm(x, b)
        if accumulate:
            out[lo:hi].add_(block)
        else:
            out[lo:hi].copy_(block)
    return out


def _block_rows(k: int, n: int) -> int:
    """Rows of one oneDNN call of :func:`mm`: float32 input and output blocks of at most
    :data:`BLOCK_BYTES`."""
    return max(1, BLOCK_BYTES // (4 * max(n, k)))


_ONEDNN_LAYOUT = getattr(torch, "_mkldnn", None)  # oneDNN's (mkldnn's) tensor layout

# below this many elements a tensor is allocated by torch.empty: the pairing costs a few tens
# of microseconds, and a tn of such operands is under MIN_WORK anyway
PAIR_MIN = 1 << 16


class _Owner:
    """Holds a oneDNN tensor and exposes its memory to numpy (``__array_interface__``): the
    dense tensor made over it keeps this owner, and so the memory, alive."""

    __slots__ = ("__array_interface__", "__weakref__", "onednn")

    def __init__(self, onednn: torch.Tensor) -> None:
        self.onednn = onednn
        self.__array_interface__ = {
            "shape": tuple(onednn.shape), "typestr": "<f4", "version": 3,
            "data": (torch.ops.mkldnn.data_ptr(onednn), False)}


# address -> the owner of the oneDNN tensor at it; an entry leaves with its owner, i.e. when
# the last dense tensor over that memory is freed (so an address is never stale)
_OWNERS: weakref.WeakValueDictionary[int, _Owner] = weakref.WeakValueDictionary()


@functools.cache
def onednn_tn_available() -> bool:
    """Whether this torch can pair a dense tensor with a oneDNN one (:func:`empty`) and run
    oneDNN's backward-weights primitive on the pair (:func:`tn`)."""
    if (not onednn_available() or _ONEDNN_LAYOUT is None
            or not hasattr(torch.ops.mkldnn, "data_ptr")):
        return False
    try:
        a, b = _paired(64, 3), _paired(64, 2)
        a.copy_(torch.arange(192.0).reshape(64, 3))
        b.copy_(torch.ones(64, 2))
        got = _onednn_tn(_OWNERS[a.data_ptr()], _OWNERS[b.data_ptr()])
    except (RuntimeError, NotImplementedError, AttributeError, TypeError, KeyError):
        return False
    return bool(torch.equal(got, a.t() @ b))


class _Pool:
    """Freed oneDNN buffers of :func:`empty`, kept for later requests (:func:`pool_freed`; the
    module docstring).

    A request takes a pooled buffer of its shape, else the smallest pooled one that holds it
    and is at most :data:`FIT` times its size (the request then gets its first elements, as a
    tensor of its own, which :func:`tn` leaves to torch), else a new one. A ``whole`` request
    (:func:`tn`'s copies, a bf16 block: shape ``[1, half its elements]``) takes only a buffer
    of its own shape, so that bf16 blocks and float32 ones do not take each other's.

    Bound: the buffers held, in use and pooled, never exceed the most that were in use at one
    time before (``mark``): a request the pool cannot serve first hands back, oldest first,
    what would take the total beyond. Idle pooled buffers are still memory other tensors
    cannot use, so :func:`hand_back_pooled` empties the pool where a step's memory peaks, or
    where a freed buffer would otherwise wait idle through most of the step. With both, a
    step's peak stays at, or barely above, its peak without the pool; the bound alone leaves
    it well above on the 1M-node papers100M-format graph (docs/benchmarks.md).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.enabled = False
        self.free: list[torch.Tensor] = []  # oneDNN tensors, oldest first
        self.in_use = self.pooled = self.mark = 0  # bytes
        # buffers freed while the lock was held, not yet counted: see give
        self.returned: collections.deque[torch.Tensor] = collections.deque()

    def take(self, rows: int, cols: int, whole: bool = False) -> torch.Tensor:
        """A oneDNN float32 tensor of shape [rows, cols] (pooled or new), or, unless
        ``whole``, a pooled one of at least rows * cols elements."""
        need = rows * cols
        with self.lock:
            self._settle()
            fits = [i for i, t in enumerate(self.free) if need <= t.numel() <= FIT * need]
            exact = [i for i in fits if tuple(self.free[i].shape) == (rows, cols)]
            fits = [] if whole else fits
            if exact or fits:  # the same shape, the last freed (the warmest); else the smallest
                i = exact[-1] if exact else min(fits, key=lambda i: self.free[i].numel())
                got = self._drop(i)
                self.in_use += 4 * got.numel()
                self._settle()
                return got
            self.in_use += 4 * need
            self.mark = max(self.mark, self.in_use)
            while self.free and self.in_use + self.pooled > self.mark:  # oldest first
                self._drop(0)
            self._settle()
        return torch.empty(rows, cols, layout=_ONEDNN_LAYOUT)

    def give(self, onednn: torch.Tensor) -> None:
        """Called when the last dense tensor over ``onednn`` is freed: by a garbage collection
        this can run inside ``take`` on the same thread (any allocation there may start one),
        so it never waits for the lock. It queues the buffer (``deque.append`` runs no Python
        code) and counts the queue now if the lock is free, else the lock's holder counts it
        before letting go."""
        self.returned.append(onednn)
        if self.lock.acquire(blocking=False):
            try:
                self._settle()
            finally:
                self.lock.release()

    def _settle(self) -> None:
        """Count the queued freed buffers, pooling them if enabled (with the lock held; a
        buffer queued while this runs is counted by this loop too)."""
        while self.returned:
            onednn = self.returned.popleft()
            size = 4 * onednn.numel()
            self.in_use -= size
            if self.enabled:
                self.free.append(onednn)
                self.pooled += size

    def _drop(self, i: int) -> torch.Tensor:
        """Take the i-th pooled buffer out of the pool (with the lock held)."""
        got = self.free.pop(i)
        self.pooled -= 4 * got.numel()
        return got

    def release(self) -> None:
        with self.lock:
            self._settle()
            self.free.clear()
            self.pooled = 0


_POOL = _Pool()


def pool_freed(enable: bool = True) -> None:
    """Keep the freed buffers of :func:`empty` for later requests (``enable``), or hand them
    back to the OS now and from now on. Off until called; plexus's trainer calls it with its
    ``pool_buffers`` setting (by default on where it retains freed memory, which it does by
    default: ``--no-pool-buffers``, ``--no-retain-freed-memory`` turn it off)."""
    _POOL.enabled = enable
    if not enable:
        _POOL.release()


def hand_back_pooled() -> None:
    """Hand the pooled buffers back to the OS now, the pool staying on: called where a step's
    memory peaks, so that idle pooled buffers do not add to the peak (plexus: before backward
    and before the recomputed or remade layer 0's backward), after that layer's forward (its
    input, made again in backward, would wait idle through the step) and after plexus's
    training loop."""
    if _POOL.enabled:
        _POOL.release()


def _paired(rows: int, cols: int, whole: bool = False) -> torch.Tensor:
    t, owner = _pooled(rows, cols, whole)
    _OWNERS[t.data_ptr()] = owner
    return t


def _paired_half(rows: int, cols: int) -> torch.Tensor:
    """A bf16 [rows, cols] tensor over the first bytes of a pooled float32 buffer of
    ``ceil(rows * cols / 2)`` elements (not in ``_OWNERS``: :func:`tn` reads float32 only)."""
    t, _ = _pooled(1, (rows * cols + 1) // 2, whole=True)  # (never a float32 block's buffer)
    return t.view(-1).view(torch.bfloat16)[:rows * cols].view(rows, cols)


def _pooled(rows: int, cols: int, whole: bool = False) -> tuple[torch.Tensor, _Owner]:
    """A float32 [rows, cols] tensor over a pooled (or new) oneDNN buffer (``whole``: all of
    one, so that :func:`tn` reads it through oneDNN), and its owner, which the tensor keeps
    alive and whose end hands the buffer back to the pool."""
    onednn = _POOL.take(rows, cols, whole)
    owner = _Owner(onednn)
    array = np.asarray(owner)
    if array.shape != (rows, cols):  # a larger pooled buffer: its start, as numpy's view,
        array = array.reshape(-1)[:rows * cols].reshape(rows, cols)  # so no torch view
    t = torch.from_numpy(array)
    weakref.finalize(owner, _POOL.give, onednn).atexit = False
    return t, owner


def empty(rows: int, cols: int, *, dtype: torch.dtype = torch.float32,
          device: torch.device | str = "cpu", whole: bool = False) -> torch.Tensor:
    """``torch.empty(rows, cols, dtype=, device=)``; for a float32 CPU tensor of at least
    :data:`PAIR_MIN` elements where oneDNN runs, over the memory of a oneDNN tensor, so that
    :func:`tn` can read it in place (the module docstring). A bf16 CPU tensor of that size
    lies over a float32 oneDNN buffer of half its elements: a tall bf16 block (a bf16 ``H``
    kept for ``dW``) is made and freed every step as the float32 ones are, and the pool
    serves it as it serves them (no page faults and zeroing each step). ``whole``: a float32
    block is all of one pooled buffer, never a larger one's start (which :func:`tn` would
    leave to torch)."""
    if _pairs(rows * cols, dtype, device):
        return _paired(rows, cols, whole)
    if _pairs(rows * cols, torch.float32, device) and dtype == torch.bfloat16:
        return _paired_half(rows, cols)
    return torch.empty(rows, cols, dtype=dtype, device=device)


def converted(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` (``t`` itself where it has that dtype), into a buffer of :func:`empty`
    for a contiguous 2-D CPU ``t``: the same bits."""
    if t.dtype == dtype or t.dim() != 2 or t.device.type != "cpu" or not t.is_contiguous():
        return t.to(dtype)
    return empty(*t.shape, dtype=dtype).copy_(t)


def _pairs(numel: int, dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether :func:`empty` pairs a 2-D tensor of ``numel`` elements with a oneDNN one."""
    return (torch.device(device).type == "cpu" and dtype == torch.float32
            and numel >= PAIR_MIN and onednn_tn_available())


def empty_like(t: torch.Tensor) -> torch.Tensor:
    """A new contiguous tensor of ``t``'s shape, dtype and device: :func:`empty` for a 2-D
    ``t``, ``torch.empty_like`` for any other."""
    if t.dim() != 2:
        return torch.empty_like(t, memory_format=torch.contiguous_format)
    return empty(*t.shape, dtype=t.dtype, device=t.device)


def can_overwrite(t: torch.Tensor) -> bool:
    """Whether writing over ``t`` serves as well as :func:`empty_like` would: ``t`` is
    contiguous and, where :func:`empty_like` would pair it (a large 2-D float32 CPU block),
    the whole of a paired buffer, so that :func:`tn` still reads it in place."""
    if not t.is_contiguous():
        return False
    if t.dim() != 2 or not _pairs(t.numel(), t.dtype, t.device):
        return True
    return _onednn_of(t) is not None


def like_empty(t: torch.Tensor) -> bool:
    """The former name of :func:`can_overwrite` (deprecated)."""
    warnings.warn("common.dense.like_empty is now common.dense.can_overwrite",
                  DeprecationWarning, stacklevel=2)
    return can_overwrite(t)


def _onednn_of(t: torch.Tensor) -> _Owner | None:
    """The owner of the oneDNN tensor that ``t`` is the whole of, or None."""
    owner = _OWNERS.get(t.data_ptr()) if t.device.type == "cpu" else None
    if (owner is None or tuple(t.shape) != owner.__array_interface__["shape"]
            or t.dtype != torch.float32 or not t.is_contiguous()):
        return None
    return owner


def _onednn_tn(a: _Owner, b: _Owner) -> torch.Tensor:
    # the primitive gives dW^T = b^T a ([n, k]) and wants a oneDNN tensor of dW^T's shape
    k, n = a.onednn.shape[1], b.onednn.shape[1]
    shape_of = torch.empty(n, k, layout=_ONEDNN_LAYOUT)
    got = torch.ops.aten.mkldnn_linear_backward_weights(b.onednn, a.onednn, shape_of, False)[0]
    return got.to_dense().t().contiguous()


def uses_onednn_tn(a: torch.Tensor, b: torch.Tensor, backend: str = "auto") -> bool:
    """Whether :func:`tn` computes ``a^T b`` through oneDNN: ``backend`` not ``torch``, both
    operands whole tensors from :func:`empty`, at least :data:`MIN_WORK` multiply-adds and no
    autograd graph to record."""
    if backend not in BACKENDS:
        check_backend(backend)  # raises
    return (backend != "torch" and a.dim() == 2 and b.dim() == 2
            and a.shape[0] * a.shape[1] * b.shape[1] >= MIN_WORK
            and not (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad))
            and _onednn_of(a) is not None and _onednn_of(b) is not None)


def tn(a: torch.Tensor, b: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``a^T @ b``, a new contiguous tensor, through oneDNN where :func:`uses_onednn_tn`, else
    ``torch.mm(a.t(), b)``.

    ``a`` may be bfloat16 where ``b`` is float32 (a bf16 ``H`` kept for ``dW``): it is widened
    exactly, whole where that copy is at most :data:`WIDEN_BYTES` (into a buffer of
    :func:`empty`, so that oneDNN reads it as it lies: the bits of ``tn(a.float(), b)``), else
    a row block at a time: where oneDNN runs, each block of ``a`` widened and the same rows
    of ``b`` copied into whole pooled buffers (the two within :data:`WIDEN_BYTES`; a block
    under :data:`PAIR_MIN` elements goes to torch), their products added in row order;
    elsewhere each block of ``a`` widened into one reused float32 block, whose products
    ``torch.addmm`` sums. Float32 sums either way (the same precision, another order of the
    sum).

    Shapes: a [m, k], b [m, n] -> [k, n]
    """
    if a.dtype == torch.bfloat16 and b.dtype == torch.float32:
        return _tn_widened(a, b, backend)
    if not uses_onednn_tn(a, b, backend):
        with tensor_cores(backend, a):
            return a.t() @ b
    owner_a, owner_b = _onednn_of(a), _onednn_of(b)
    assert owner_a is not None and owner_b is not None
    return _onednn_tn(owner_a, owner_b)


def _tn_widened(a: torch.Tensor, b: torch.Tensor, backend: str) -> torch.Tensor:
    """:func:`tn` of a bf16 ``a`` and a float32 ``b`` (its docstring)."""
    m, k = a.shape
    n = b.shape[1]
    rows = max(1, WIDEN_BYTES // (4 * max(k, 1)))
    if m <= rows:
        return tn(empty(m, k, device=a.device, whole=True).copy_(a), b, backend=backend)
    if backend != "torch" and _pairs(m * k, torch.float32, a.device) and b.is_contiguous():
        # both blocks copied into whole buffers, so that oneDNN reads them (a row slice of b
        # is not a whole buffer); the two copies together within WIDEN_BYTES
        rows = max(1, WIDEN_BYTES // (4 * (k + n)))
        total = None
        for lo in range(0, m, rows):
            hi = min(m, lo + rows)
            part = tn(empty(hi - lo, k, device=a.device, whole=True).copy_(a[lo:hi]),
                      empty(hi - lo, n, device=a.device, whole=True).copy_(b[lo:hi]),
                      backend=backend)
            total = part if total is None else total.add_(part)
        assert total is not None
        return total
    out = torch.zeros(k, n, dtype=b.dtype, device=a.device)
    wide = empty(rows, k, dtype=b.dtype, device=a.device)  # (pooled: above glibc's cap)
    with tensor_cores(backend, a):
        for lo in range(0, m, rows):
            hi = min(m, lo + rows)
            out.addmm_(wide[:hi - lo].copy_(a[lo:hi]).t(), b[lo:hi])
    return out
