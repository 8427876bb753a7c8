"""Collectives along one grid axis, sync or async, with byte accounting.

Each function takes the one :class:`~common.grid.AxisGroup` it communicates over and an
optional :class:`~common.comm_stats.CommStats` owned by the caller. A group of size 1 returns
at once without communicating (the fast path): its result is ``x`` itself, not a copy, even
where the call is out of place over a larger group, so a caller that will modify the result in
place while still needing ``x`` clones it first. With ``async_op=True`` the call returns a
:class:`CommHandle`; ``handle.wait()`` returns the result, so communication can overlap with
compute issued in between. Buffers are allocated on the input's device.

Transport: a CPU tensor on a group with an MPI communicator (``group.mpi``, set up when the job
was started by an MPI launcher; :mod:`common.mpi`) goes through MPI; anything else (CUDA tensors:
NCCL; jobs without MPI: gloo) through the group's ``torch.distributed`` group. The byte counts
are the same either way, and so are the results of gathers and of sums over at most two ranks;
a sum over more ranks is the transport's, whose order (and so whose last bits) depends on the
library, the algorithm it picks for the message size and blocking or not. Seconds: wall time on
the CPU; for CUDA tensors the time between CUDA events on the current stream (NCCL's
``wait()`` does not block the CPU), resolved when the stats are read.

Shapes (``g`` = group size, ``dim`` = the tensor dimension gathered or scattered):
    all_reduce:      x [*]                       -> [*]
    all_gather:      x [..., s, ...]             -> [..., g*s, ...]   (chunks in group order)
    reduce_scatter:  x [..., g*s, ...]           -> [..., s, ...]     (this rank's chunk)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from common.comm_stats import WIRE_PIECE_BYTES, CommStats, ring_bytes
from common.grid import AxisGroup

ReduceOp = dist.ReduceOp
# torch >= 2.12 renamed the single-tensor collectives and deprecated the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CommHandle:
    """Result of an async collective: call :meth:`wait` to get the tensor.

    The time recorded in the stats runs from issue to the end of :meth:`wait`: wall time on
    the CPU, GPU time on the current stream for CUDA tensors (see :func:`_run`).
    """

    def __init__(self, work: Any, finish: Callable[[], torch.Tensor],
                 done: Callable[[float], None] | None = None) -> None:
        self._work, self._finish, self._done = work, finish, done
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            start = time.perf_counter()
            if self._work is not None:
                self._work.wait()
            self._result = self._finish()
            if self._done is not None:
                self._done(time.perf_counter() - start)
        return self._result

    @classmethod
    def done(cls, tensor: torch.Tensor) -> CommHandle:
        """A handle that is already complete (the size-1 fast path)."""
        return cls(None, lambda: tensor)


def _stream_mark(t: torch.Tensor) -> Callable[[], Any] | None:
    """How to time a collective on ``t``: None on the CPU (wall clock); for a CUDA tensor, a
    function that records a timing CUDA event on the device's current stream and returns it.

    NCCL's ``work.wait()`` only makes the current stream wait for the collective, so the wall
    time around it is the launch time; events on the stream, resolved when the stats are read,
    time the collective itself (waiting for peers included)."""
    if not t.is_cuda:
        return None
    stream = torch.cuda.current_stream(t.device)

    def mark() -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    return mark


def _elapsed_s(start: Any, end: Any) -> float:
    """Seconds between two recorded CUDA events (waits for ``end`` to complete)."""
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _run(
    group: AxisGroup,
    op_name: str,
    full_bytes: int,
    stats: CommStats | None,
    launch: Callable[[], Any],
    result: torch.Tensor | Callable[[], torch.Tensor],
    async_op: bool,
    mark: Callable[[], Any] | None = None,
) -> torch.Tensor | CommHandle:
    """Launch a collective; ``result`` is the output tensor, or a function that makes it
    once the collective completed (a view of the buffer). ``mark``: :func:`_stream_mark` of
    the buffer (None: timed by the wall clock)."""
    if mark is not None and stats is not None:
        return _run_on_stream(group, op_name, full_bytes, stats, launch, result, async_op, mark)
    start = time.perf_counter()
    work = launch()
    if not async_op:  # the hot path of small messages: no handle, no closures
        work.wait()
        out = result() if callable(result) else result
        if stats is not None:
            _record(stats, group, op_name, full_bytes, start)
        return out
    done = None
    if stats is not None:

        def done(blocked: float) -> None:  # blocked: the seconds spent inside wait()
            _record(stats, group, op_name, full_bytes, start, blocked)

    finish = result if callable(result) else (lambda: result)
    return CommHandle(work, finish, done)


def _record(stats: CommStats, group: AxisGroup, op_name: str, full_bytes: int, start: float,
            blocked: float | None = None) -> None:
    """Count a collective timed by the wall clock from ``start`` (``time.perf_counter``) to
    now: the ring's bytes of ``full_bytes`` (the whole result, or the whole input of a
    reduce-scatter) over the group; ``blocked``: the seconds the caller spent waiting for it
    (an async collective's :meth:`CommHandle.wait`)."""
    stats.record(group.name, op_name, ring_bytes(op_name, full_bytes, group.size),
                 time.perf_counter() - start, blocked)


def _now(group: AxisGroup, op_name: str, full_bytes: int, stats: CommStats | None,
         call: Callable[[], torch.Tensor | None]) -> torch.Tensor | None:
    """The lean synchronous MPI path: ``call()`` returns the result, or None where the
    transport does not take it (then nothing is counted and the caller goes on)."""
    start = time.perf_counter()
    out = call()
    if out is not None and stats is not None:
        _record(stats, group, op_name, full_bytes, start)
    return out


def _run_on_stream(group: AxisGroup, op_name: str, full_bytes: int, stats: CommStats,
                   launch: Callable[[], Any], result: torch.Tensor | Callable[[], torch.Tensor],
                   async_op: bool, mark: Callable[[], Any]) -> torch.Tensor | CommHandle:
    """:func:`_run` timed by events on the stream: one before the launch, one after
    ``work.wait()`` (which makes the stream wait for the collective); the stats resolve the
    seconds between them when read, so nothing here synchronizes."""
    nbytes = ring_bytes(op_name, full_bytes, group.size)
    begin = mark()
    work = launch()

    def done(blocked: float = 0.0) -> None:  # GPU time: its exposure is not known here
        end = mark()
        stats.record(group.name, op_name, nbytes, lambda: _elapsed_s(begin, end))

    finish = result if callable(result) else (lambda: result)
    if not async_op:
        work.wait()
        out = finish()
        done()
        return out
    return CommHandle(work, finish, done)


def all_reduce(
    x: torch.Tensor,
    group: AxisGroup,
    *,
    op: ReduceOp.RedOpType = ReduceOp.SUM,
    stats: CommStats | None = None,
    async_op: bool = False,
    inplace: bool = False,
) -> torch.Tensor | CommHandle:
    """All-reduce ``x`` over ``group`` (sum by default). Out of place unless ``inplace``
    (over a group of one rank ``x`` itself: the module docstring)."""
    g = group.size
    if g == 1:
        return CommHandle.done(x) if async_op else x
    if inplace and not x.is_contiguous():
        raise ValueError("in-place all_reduce needs a contiguous tensor")
    if _on_wire(x, group, op):
        return _wire_sum(x, group, stats, async_op, inplace=inplace)
    mpi = group.mpi
    if mpi is not None and not async_op:  # the lean synchronous MPI path
        out = _now(group, "all_reduce", x.nbytes, stats,
                   lambda: mpi.all_reduce_now(x.contiguous(), op, inplace))
        if out is not None:
            return out
    if mpi is not None and mpi.supports(x, op):  # MPI reduces out of place: no copy of x first
        src = x.contiguous()
        out = x if inplace else torch.empty_like(src)
        return _run(group, "all_reduce", out.nbytes, stats,
                    lambda: mpi.all_reduce(src, out, op, async_op), out, async_op)
    buf = x if inplace else x.clone(memory_format=torch.contiguous_format)
    return _run(
        group, "all_reduce", buf.nbytes, stats,
        lambda: dist.all_reduce(buf, op=op, group=group.group, async_op=True), buf, async_op,
        _stream_mark(buf),
    )


def all_gather(
    x: torch.Tensor,
    group: AxisGroup,
    *,
    dim: int = 0,
    stats: CommStats | None = None,
    async_op: bool = False,
) -> torch.Tensor | CommHandle:
    """Concatenate every rank's ``x`` along ``dim`` in group order."""
    g = group.size
    if g == 1:
        return CommHandle.done(x) if async_op else x
    if _on_wire(x, group) and x.dtype != group.wire:  # gathered in the wire dtype
        plain = group.on_wire(None)
        got = all_gather(x.to(group.wire), plain, dim=dim, stats=stats, async_op=async_op)
        if isinstance(got, CommHandle):
            return CommHandle(None, lambda: got.wait().to(x.dtype))
        return got.to(x.dtype)
    mpi = group.mpi
    if mpi is not None and not async_op and dim == 0:  # the lean synchronous MPI path
        out = _now(group, "all_gather", g * x.nbytes, stats, lambda: mpi.all_gather_now(x))
        if out is not None:
            return out
    shape = tuple(x.shape)
    dim = dim % len(shape) if shape else 0
    src = x.contiguous()
    result: torch.Tensor | Callable[[], torch.Tensor]
    if dim == 0:  # the chunks lie in place: the buffer is the result
        buf = result = src.new_empty(g * shape[0], *shape[1:]) if shape else src.new_empty(g)
    else:  # [g, *shape] -> chunks moved to dim
        buf = src.new_empty(g, *shape)
        out_shape = (*shape[:dim], g * shape[dim], *shape[dim + 1:])
        result = lambda: buf.movedim(0, dim).reshape(out_shape)  # noqa: E731
    mpi = group.mpi
    if mpi is not None and mpi.supports(src):
        launch = lambda: mpi.all_gather(src, buf, async_op)  # noqa: E731
    else:
        launch = lambda: _all_gather_single(  # noqa: E731
            buf.view(-1), src.view(-1), group=group.group, async_op=True)
    return _run(group, "all_gather", buf.nbytes, stats, launch, result, async_op,
                _stream_mark(buf))


def reduce_scatter(
    x: torch.Tensor,
    group: AxisGroup,
    *,
    dim: int = 0,
    stats: CommStats | None = None,
    async_op: bool = False,
) -> torch.Tensor | CommHandle:
    """Sum ``x`` over ``group`` and keep this rank's chunk along ``dim``.

    ``x.shape[dim]`` must be divisible by the group size (pad first).
    """
    g = group.size
    if g == 1:
        return CommHandle.done(x) if async_op else x
    shape = tuple(x.shape)
    if not shape:
        raise ValueError(f"reduce_scatter over axis {group.name!r}: x is a 0-dimensional "
                         "tensor, which has no dimension to scatter; reshape it to [1] and "
                         "pad it to the group size, or use all_reduce")
    dim = dim % len(shape)
    if shape[dim] % g:
        raise ValueError(
            f"reduce_scatter over axis {group.name!r}: dimension {dim} has size {shape[dim]}, "
            f"not divisible by the group size {g}; pad it to a multiple of {g}"
        )
    if _on_wire(x, group):
        return _wire_sum(x, group, stats, async_op, dim=dim)
    mpi = group.mpi
    if mpi is not None and not async_op and dim == 0:  # the lean synchronous MPI path
        out = _now(group, "reduce_scatter", x.nbytes, stats, lambda: mpi.reduce_scatter_now(x))
        if out is not None:
            return out
    chunk = shape[dim] // g
    out_shape = (*shape[:dim], chunk, *shape[dim + 1:])
    if dim == 0:  # chunk i is already the i-th contiguous block
        src = x.contiguous()
    else:  # [.., g*c, ..] -> [g, .., c, ..]
        src = x.reshape((*shape[:dim], g, chunk, *shape[dim + 1:])).movedim(dim, 0).contiguous()
    out = src.new_empty(*out_shape)
    sum_op = ReduceOp.SUM
    if mpi is not None and mpi.supports(src, sum_op):
        launch = lambda: mpi.reduce_scatter(src, out, sum_op, async_op)  # noqa: E731
    else:
        launch = lambda: _reduce_scatter_single(  # noqa: E731
            out.view(-1), src.view(-1), group=group.group, async_op=True)
    return _run(group, "reduce_scatter", src.nbytes, stats, launch, out, async_op,
                _stream_mark(out))


# ----------------------------------------------------------------------------- the wire dtype
def _on_wire(x: torch.Tensor, group: AxisGroup, op: Any = ReduceOp.SUM) -> bool:
    """Whether ``x`` travels in ``group.wire``: float32 or wire-dtype data, summed or moved."""
    return (group.wire is not None and x.dtype in (torch.float32, group.wire)
            and op == ReduceOp.SUM)


def _wire_sum(x: torch.Tensor, group: AxisGroup, stats: CommStats | None, async_op: bool, *,
              dim: int | None = None, inplace: bool = False) -> torch.Tensor | CommHandle:
    """The sum of every rank's ``x`` over ``group``, its messages in ``group.wire``: each rank
    rounds its ``x`` to the wire dtype once and sends chunk ``j`` to rank ``j`` (an
    all-to-all); rank ``j`` adds the ``g`` chunks it receives in float32, in group order.
    ``dim`` None: an all-reduce, whose float32 chunk sums are rounded to the wire dtype once
    more and all-gathered, in pieces of :data:`WIRE_PIECE_BYTES` of message (its buffers stay
    that small; under gloo and NCCL the next piece's all-to-all runs while this one is added
    up); else a reduce-scatter along ``dim``, whole (float32, ``x``'s chunk). Same bytes per
    rank as a ring in the wire dtype; the same bits on every transport (the order of the sum
    is ours); the error bound is in docs/design/plexus-3d.md section 11. Result: ``x``'s
    dtype (in ``x`` with ``inplace``)."""
    from common import wire as passes  # numba: imported only where messages narrow

    g, wire, shape = group.size, group.wire, tuple(x.shape)
    if dim is None:
        flat_in = x.reshape(-1)
        out = x if inplace else torch.empty(shape, dtype=x.dtype, device=x.device)
        flat_out, n = out.view(-1), flat_in.numel()
        step = max(g, WIRE_PIECE_BYTES // wire.itemsize // g * g)
        pieces = [(lo, min(n, lo + step)) for lo in range(0, n, step)] or [(0, 0)]

        # in place on wire-dtype data, a piece of g equal chunks is its own message, and the
        # sums are gathered straight into it: no pass over the data but the sums'
        own = inplace and x.dtype == wire and x.is_contiguous()

        def message(k: int) -> torch.Tensor:  # piece k, padded to g equal chunks
            lo, hi = pieces[k]
            if own and (hi - lo) % g == 0:
                return flat_in[lo:hi]
            send = torch.empty(-(-(hi - lo) // g) * g, dtype=wire, device=x.device)
            passes.to_bf16(flat_in[lo:hi], send[:hi - lo])
            send[hi - lo:] = 0
            return send

        def store(k: int, send: torch.Tensor, total: torch.Tensor, gather: Callable) -> None:
            lo, hi = pieces[k]
            mine = torch.empty(total.shape, dtype=wire, device=x.device)
            passes.to_bf16(total, mine)
            gather(mine, send)  # the all-to-all is done with the message by now
            if send.data_ptr() != flat_out[lo:hi].data_ptr():
                passes.from_bf16(send[:hi - lo], flat_out[lo:hi])
    else:
        dim = dim % len(shape)
        c = shape[dim] // g
        chunks = x.reshape((*shape[:dim], g, c, *shape[dim + 1:])).movedim(dim, 0)
        out = x.new_empty((*shape[:dim], c, *shape[dim + 1:]))
        pieces = [(0, x.numel())]

        def message(k: int) -> torch.Tensor:
            if dim == 0 and x.is_contiguous():
                send = torch.empty(x.numel(), dtype=wire, device=x.device)
                passes.to_bf16(x, send)
                return send
            return chunks.to(wire, memory_format=torch.contiguous_format).reshape(-1)

        def store(k: int, send: torch.Tensor, total: torch.Tensor, gather: Callable) -> None:
            out.copy_(total.view(out.shape))

    def add_up(recv: torch.Tensor) -> torch.Tensor:  # float32, in group order
        return passes.add_chunks(recv.view(g, -1))

    mpi = group.mpi
    if mpi is not None and x.is_cpu:  # one job on MPI's progress thread: all of it overlaps
        def job(exchange: Callable, gather: Callable) -> None:
            for k in range(len(pieces)):
                send = message(k)
                recv = torch.empty_like(send)
                exchange(send, recv)
                store(k, send, add_up(recv), gather)

        launch: Callable[[], Any] = lambda: mpi.run_composite(job, async_op)  # noqa: E731
        finish: Callable[[], torch.Tensor] = lambda: out  # noqa: E731
    else:  # gloo, NCCL: the all-to-all is async; the sums (and gathers) when waited for
        def exchange(k: int) -> tuple[Any, torch.Tensor, torch.Tensor]:
            send = message(k)
            recv = torch.empty_like(send)
            return dist.all_to_all_single(recv.view(torch.uint8), send.view(torch.uint8),
                                          group=group.group, async_op=True), send, recv

        def gather(src: torch.Tensor, dst: torch.Tensor) -> None:
            _all_gather_single(dst.view(torch.uint8), src.view(torch.uint8), group=group.group)

        first: list[Any] = []

        def launch() -> Any:
            first.append(exchange(0))
            return first[0][0]

        def finish() -> torch.Tensor:
            now = first[0]
            for k in range(len(pieces)):
                now[0].wait()
                ahead = exchange(k + 1) if k + 1 < len(pieces) else None
                store(k, now[1], add_up(now[2]), gather)
                now = ahead
            return out
    op = "all_reduce" if dim is None else "reduce_scatter"
    payload = x.numel() * wire.itemsize  # the padding (< g elements a piece) is not counted
    return _run(group, op, payload, stats, launch, finish, async_op, _stream_mark(out))


def chunk(x: torch.Tensor, group: AxisGroup, *, dim: int = 0) -> torch.Tensor:
    """This rank's chunk of ``x`` along ``dim`` (no communication); size must divide."""
    if group.size == 1:
        return x
    if x.shape[dim] % group.size:
        raise ValueError(
            f"cannot split dimension {dim} of size {x.shape[dim]} over axis {group.name!r} "
            f"of size {group.size}; pad it to a multiple of {group.size}"
        )
    return x.chunk(group.size, dim=dim)[group.rank]
