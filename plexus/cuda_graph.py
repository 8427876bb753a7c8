"""A one-GPU training step captured once in a CUDA graph and replayed (``--cuda-graphs``).

The whole graph is static: the adjacency, the features, the labels and the loss's rows never
change, and the model's parameters, gradients and optimizer state are updated in place. So the
step (forward, loss, backward, optimizer step) launches the same kernels on the same buffers
every epoch, and a CUDA graph replays them with one launch from the host, where a small
graph's epoch is otherwise bound by the host (its kernel launches and the custom autograd
functions' Python), not by the GPU.

What changes from epoch to epoch is read from device memory: the dropout masks' step
(:meth:`plexus.layer_dropout.LayerDropout.set_step` writes it before each replay; the Triton
kernels read it, :mod:`plexus.dropout_triton`). The optimizer is capturable (its step counts
on the device) and its learning rate constant. Nothing in the step reads a number back to the
host. The numbers are those of the eager step: the replay runs the same kernels.

:class:`StepGraph` runs the first :data:`WARMUP` steps eagerly on a side stream (lazy
initialisations, kernel compilation and the first epoch's caches happen there, not in the
capture), captures the next, and replays it from then on. A capture that fails (an operation
that cannot be captured) ends in a warning and eager steps from then on: the same numbers,
without the graph.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from plexus.triton_switch import uses_triton

__all__ = ["WARMUP", "StepGraph", "check_asked", "why_not"]

WARMUP = 2  # eager steps on a side stream before the capture


def why_not(device: torch.device, world_size: int, dropout: float,
            capturable: bool = True) -> str | None:
    """Why a training step on ``device`` with ``world_size`` ranks and ``dropout`` cannot be
    captured here (None: it can); ``capturable``: whether the optimizer can be."""
    if device.type != "cuda":
        return "it needs a CUDA device"
    if world_size > 1:
        return "it runs on one rank"
    if dropout > 0 and not uses_triton(device):
        return ("dropout on a GPU draws its masks in a CUDA graph only with Triton's kernels "
                "(pip install triton; PLEXUS_TRITON not 0)")
    if not capturable:
        return ("the optimizer cannot be captured (torch's fused Adam takes float32 "
                "parameters only: bf16 trainable features are not)")
    return None


def check_asked(cuda_graphs: bool | None, device: torch.device, world_size: int,
                dropout: float, capturable: bool = True) -> bool:
    """Whether the step is captured: ``cuda_graphs`` (None: where it can be).

    Raises:
        ValueError: ``cuda_graphs`` is True and the step cannot be captured (why named).
    """
    why = why_not(device, world_size, dropout, capturable)
    if why is not None and cuda_graphs:
        raise ValueError(f"--cuda-graphs: {why}; drop the flag or use --no-cuda-graphs")
    return why is None and cuda_graphs is not False


class StepGraph:
    """A training step, eager for :data:`WARMUP` calls, then captured and replayed.

    Args:
        body: one step on the current stream, from gradients set to None to the optimizer's
            step; returns the loss (a device scalar).
        zero_grad: sets every gradient to None (before each eager step and the capture).
        before_replay: writes what the next replay reads (the dropout step).
        keep: the state the captured step reads that the caller might drop and reallocate
            between replays (a cache of the model's): taken before the capture, held for the
            graph's life.
        restore: puts back what ``keep`` took, after a failed capture (which may have filled
            caches with tensors that were recorded, not computed).
        ready: why the step cannot be captured now (None: it can), asked again just before
            the capture (a Triton kernel that failed during the warm-up turns its masks into
            host numbers that a graph would freeze).
    """

    def __init__(self, body: Callable[[], torch.Tensor], *, zero_grad: Callable[[], None],
                 before_replay: Callable[[], None], keep: Callable[[], Any] = lambda: None,
                 restore: Callable[[Any], None] = lambda kept: None,
                 ready: Callable[[], str | None] = lambda: None) -> None:
        self.body, self.zero_grad, self.before_replay = body, zero_grad, before_replay
        self.keep, self.restore, self.ready = keep, restore, ready
        self.graph: torch.cuda.CUDAGraph | None = None
        self.loss: torch.Tensor | None = None
        self.failed: str | None = None  # why the capture failed, once it has
        self.eager_steps = 0
        self._kept: Any = None
        self._stream: torch.cuda.Stream | None = None

    @property
    def replaying(self) -> bool:
        """Whether the step now runs as the captured graph."""
        return self.graph is not None

    def __call__(self) -> torch.Tensor:
        """One step; its loss (a device scalar: read it after the call)."""
        if self.failed is not None:
            self.zero_grad()
            return self.body()
        if self.graph is None and self.eager_steps < WARMUP:
            self.eager_steps += 1
            return self._on_side_stream()
        if self.graph is None and not self._capture():
            self.zero_grad()
            return self.body()
        self.before_replay()
        assert self.graph is not None and self.loss is not None
        self.graph.replay()
        return self.loss

    def _on_side_stream(self) -> torch.Tensor:
        """An eager step on a side stream, as CUDA's capture wants its warm-up."""
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        current = torch.cuda.current_stream()
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            self.zero_grad()
            loss = self.body()
        current.wait_stream(self._stream)
        return loss

    def _capture(self) -> bool:
        """Capture the step (nothing runs: the first replay computes it); False, with a
        warning, where it cannot be captured."""
        why = self.ready()
        if why is not None:
            return self._fail(why)
        self.zero_grad()  # the backward of the capture assigns gradients in the graph's pool
        kept = self.keep()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.current_stream()
        try:
            with torch.cuda.graph(graph):
                loss = self.body()
        except Exception as exc:  # an operation that cannot be captured, of many types
            # (torch.cuda.graph's exit ends the capture before it restores the stream, and
            # does not restore it when ending the capture raises)
            torch.cuda.set_stream(stream)
            self.restore(kept)
            cause = exc.__context__  # (CUDA's own error says only that capture was broken)
            return self._fail(f"{type(exc).__name__}: {exc}" + (
                "" if cause is None else f"; after {type(cause).__name__}: {cause}"))
        self.graph, self.loss, self._kept = graph, loss, kept
        return True

    def _fail(self, why: str) -> bool:
        """Every later step eager, with a warning naming ``why``; False."""
        self.failed = why
        warnings.warn(f"plexus: the training step could not be captured in a CUDA graph "
                      f"({why[:400]}); it runs eagerly (the same numbers, more host time). "
                      "--no-cuda-graphs skips the attempt.", RuntimeWarning, stacklevel=4)
        return False
