"""Mixed precision names and a meter of the memory autograd saves for backward.

``--precision bf16`` (:class:`llm.config.PrecisionConfig`) is bf16 compute AND
communication with float32 master weights: the parameters (this rank's flat shards) and the
AdamW moments stay float32; each forward casts the weights to bf16 at use (on a
tensor-parallel grid: before the depth all-gather, :mod:`llm.parallel.layers`), so the GEMMs, the
activations, the row/col all-reduces of activations and the depth reduce-scatter of dW are
bf16; the gradient lands in the float32 ``.grad``, where micro-batches accumulate and the
data-parallel all-reduce runs. RMSNorm statistics, the rotary rotation and the
softmax/cross-entropy of the loss are float32 (:mod:`llm.loss` upcasts the logits). No
loss scaling: bf16 has float32's exponent range.

:class:`SavedActivations` sums the bytes of the tensors autograd saves while it is active
(``torch.autograd.graph.saved_tensors_hooks``): the activation memory of a forward, the
figure activation checkpointing lowers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from common.precision import torch_dtype


def compute_dtype(precision: str) -> torch.dtype | None:
    """The ``compute_dtype`` of :class:`llm.model.GPT` for a ``--precision`` name: None for
    ``fp32`` (the parameters' own dtype: the fp32 code path unchanged), else the dtype."""
    dtype = torch_dtype(precision)
    return None if dtype == torch.float32 else dtype


class SavedActivations:
    """Bytes autograd saves for backward while the context is active.

    Each storage counts once (views and tensors saved by several ops share one), at its full
    size; the storages of ``params`` are left out (a Linear saving its own fp32 weight holds
    no new memory). A non-reentrant checkpoint saves only its inputs here: its recomputation
    in backward packs into checkpoint's own hooks. Count one forward at a time: once saved
    tensors are freed, their addresses may be reused.

    Example::

        with SavedActivations(model.parameters()) as saved:
            loss = loss_fn(model(x), y)
        saved.bytes  # held from here until loss.backward() frees them
    """

    def __init__(self, params: Iterable[Tensor] = ()) -> None:
        self._skip = {p.untyped_storage().data_ptr() for p in params}
        self._sizes: dict[int, int] = {}
        self._hooks: Any = None

    @property
    def bytes(self) -> int:
        return sum(self._sizes.values())

    def _pack(self, t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._skip:
            self._sizes[ptr] = max(self._sizes.get(ptr, 0), storage.nbytes())
        return t

    def __enter__(self) -> SavedActivations:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
