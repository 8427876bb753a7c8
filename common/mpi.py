"""The MPI transport: collectives on CPU tensors through mpi4py, with real asynchronous progress.

Gloo moves CPU tensors over TCP sockets, even between ranks of one node; the machine's MPI uses
shared memory there and tuned algorithms everywhere (a small all-reduce through MPICH takes a
small fraction of gloo's time: bench/collectives.py). When the job was started by an MPI
launcher, :func:`common.dist.init_distributed` builds an :class:`MPITransport`, and
:meth:`common.dist.DistContext.create_groups` gives every axis group an :class:`MPIGroup`: a
communicator split from ``COMM_WORLD`` along the same axes. :mod:`common.collectives` then runs
CPU tensors through it (same API, same autograd pairs, same byte accounting) and everything
else (CUDA tensors: NCCL) through the group's ``torch.distributed`` group.

Asynchronous progress. MPICH advances a non-blocking collective only inside MPI calls, so an
``Iallreduce`` left alone while torch computes would mostly wait for ``wait()``. Instead one
communication thread per process (:mod:`common.progress`) runs each async collective, in issue
order, while the caller computes: MPI's blocking call (GIL released), or, with fewer than two
cores per rank, a non-blocking call that it tests and sleeps on (:func:`poll`), so that it
does not spin on the core the compute needs (the policy: :class:`MPITransport`). Synchronous
collectives run on the caller's thread when nothing is queued, else behind the queued ones, so
every rank issues every communicator's collectives in the same order. Collectives of one
process must be issued from one thread (as with ``torch.distributed``).

Large all-reduces in pieces. An all-reduce of more than :data:`ALLREDUCE_PIECE_BYTES` runs as
one MPI all-reduce per piece of that size, in order: the sums are the same elementwise
operation, and MPICH's shared-memory all-reduce of a message beyond the last-level cache is
much slower per byte than of pieces that fit (``mpiexec -n N python bench/collectives.py
--ops all_reduce``; docs/benchmarks.md). All-gathers and reduce-scatters go whole.
``HPC_MPI_ALLREDUCE_PIECE`` (bytes; 0: whole) changes the size; the ranks agree on the
smallest given.

Dtypes. Buffers are passed to MPI zero-copy (the tensors' addresses: :meth:`MPIGroup._msg`).
MPI has no reduction for bfloat16 and float16: those are reduced in float32 and rounded once
at the end (more accurate than a bf16 running sum); gathers move them as 16-bit integers.

Two-level collectives (PCCL, ``two_level=True``): an all-gather over a group that spans nodes
runs first across nodes, between the ranks with the same position in their node (each rank
sends only its own chunk over the network, all NICs busy at once), then within each node; a
reduce-scatter first within each node (so only 1/L of the data crosses nodes), then across;
each step with MPI's own algorithm for its size. Used when the group has the same number of
ranks on every node, in node-major order. Nodes come from ``MPI_COMM_TYPE_SHARED``, or from
``ranks_per_node`` (consecutive ranks per node) to simulate a layout on one machine.

Pickled objects, flags and numbers that every rank of the job agrees on go through
:mod:`common.exchange`, which calls :meth:`MPITransport.call`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from common.progress import DONE, POLITE, Done, ProgressThread, Work, polite_level, poll

# torch reduce ops -> MPI op names (AVG and the others have no MPI twin)
_MPI_OPS = {"SUM": "SUM", "MAX": "MAX", "MIN": "MIN", "PRODUCT": "PROD"}
# dtypes MPI cannot reduce: reduce in float32, round once
_UPCAST = (torch.bfloat16, torch.float16)
_REDUCIBLE = frozenset((torch.float32, torch.float64, torch.int8, torch.int16, torch.int32,
                        torch.int64, torch.uint8, *_UPCAST))
_SUM = dist.ReduceOp.SUM  # one object: the common case is tested by identity, not hashed
# an all-reduce above this many bytes runs in pieces of it (module docstring)
ALLREDUCE_PIECE_BYTES = 4 << 20
ENV_ALLREDUCE_PIECE = "HPC_MPI_ALLREDUCE_PIECE"

__all__ = ["ALLREDUCE_PIECE_BYTES", "DONE", "Done", "MPIGroup", "MPITransport", "ProgressThread",
           "Work", "cores_available", "mpi_world_size"]


def cores_available() -> int:
    """Cores this process may run on (its CPU affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        return os.cpu_count() or 1


def _mpi() -> Any:
    from mpi4py import MPI

    return MPI


def mpi_world_size(*, start: bool = False) -> int:
    """Ranks in ``MPI_COMM_WORLD``, or 0 if mpi4py is not importable or (``start=False``) MPI
    is not running yet; ``start=True`` initialises MPI (importing mpi4py does)."""
    try:
        mpi = _mpi()
    except ImportError:
        return 0
    return mpi.COMM_WORLD.Get_size() if start or mpi.Is_initialized() else 0


def _types(mpi: Any) -> tuple[dict, dict]:
    """(reduce, gather): torch dtype -> MPI datatype. Reductions take only the types MPI can
    reduce; gathers move 16-bit floats as 16-bit words (other dtypes go as bytes)."""
    reduce = {torch.float32: mpi.FLOAT, torch.float64: mpi.DOUBLE, torch.int8: mpi.INT8_T,
              torch.int16: mpi.INT16_T, torch.int32: mpi.INT32_T, torch.int64: mpi.INT64_T,
              torch.uint8: mpi.UINT8_T}
    return reduce, {**reduce, torch.bfloat16: mpi.INT16_T, torch.float16: mpi.INT16_T}


class MPIGroup:
    """One axis group's communicator (and, two-level, its node and cross-node parts).

    Attributes:
        comm: the mpi4py communicator, ranks in group order.
        node, cross: for two-level collectives, the communicators of this rank's node and of
            the ranks at the same node position on every node; None when not used.
        progress: the process's :class:`ProgressThread`.
        piece: all-reduces of more bytes run in pieces of this size (0: whole; the module
            docstring). Every rank of the group must give the same.
        polite: which collectives run as non-blocking MPI calls completed by :func:`poll`
            (test, sleep, test) instead of MPI's spinning blocking call: ``"none"``,
            ``"async"`` (the progress thread leaves the core to the compute it overlaps) or
            ``"all"``. Every rank must decide the same way (MPI does not match a blocking
            collective with a non-blocking one), and does: the choice depends on ``async_op``
            and on this setting, which :class:`MPITransport` agrees on.

    Messages are the tensor's address and an explicit MPI datatype (:meth:`_msg`): mpi4py
    parses no buffer format (a numpy view costs two torch calls and mpi4py's parsing per
    collective). The closures handed to the progress thread hold the tensors until the
    collective completes.
    """

    def __init__(self, comm: Any, progress: ProgressThread, node: Any = None,
                 cross: Any = None, *, polite: str = "none",
                 piece: int = ALLREDUCE_PIECE_BYTES) -> None:
        self.comm, self.progress, self.node, self.cross = comm, progress, node, cross
        self.polite, self.piece = polite, piece
        mpi = _mpi()
        self._in_place, self._byte, self._address = mpi.IN_PLACE, mpi.BYTE, mpi.buffer.fromaddress
        # keyed by torch's ReduceOp values (hashable), resolved once: this is the hot path
        self._ops = {getattr(dist.ReduceOp, t): getattr(mpi, m) for t, m in _MPI_OPS.items()}
        self._mpi_sum = mpi.SUM
        self._reduce_types, self._gather_types = _types(mpi)
        # whether sync collectives may call MPI's blocking routine directly (:meth:`_now`)
        self._direct = polite != "all" and node is None
        self.size = comm.Get_size()

    @property
    def two_level(self) -> bool:
        return self.node is not None

    def supports(self, x: torch.Tensor, op: Any = None) -> bool:
        """Whether this transport runs a collective on ``x`` (with reduce ``op``)."""
        if not x.is_cpu:
            return False
        return op is None or (x.dtype in _REDUCIBLE and (op is _SUM or op in self._ops))

    def _now(self, async_op: bool) -> bool:
        """Whether MPI's blocking routine runs here and now (a sync collective with nothing
        queued); what :meth:`ProgressThread.run` would do, without its closure."""
        return not async_op and self._direct and not self.progress.pending

    def _mpi_op(self, op: Any) -> Any:
        return self._mpi_sum if op is _SUM else self._ops[op]

    def _msg(self, t: torch.Tensor, types: dict) -> list:
        """The mpi4py message for a contiguous CPU tensor's memory (no copy, no numpy)."""
        return [self._address(t.data_ptr(), t.nbytes), types.get(t.dtype, self._byte)]

    # The synchronous fast path (:mod:`common.collectives` calls these first): the collective
    # on this thread, output allocated here, or None when it must go through the queue (an
    # async collective pending, polite "all", two-level, a dtype MPI cannot reduce). One Python
    # call between the API and MPI: a small collective shows every microsecond of overhead.
    def all_reduce_now(self, x: torch.Tensor, op: Any, inplace: bool) -> torch.Tensor | None:
        """All-reduce of contiguous ``x`` (into ``x`` itself when ``inplace``; else a new
        tensor, MPI reading ``x`` directly), or None (see above)."""
        if (self.progress.pending or not self._direct or not x.is_cpu
                or x.dtype not in self._reduce_types or not (op is _SUM or op in self._ops)):
            return None
        kind = self._reduce_types[x.dtype]
        out = x if inplace else torch.empty_like(x)
        mpi_op = self._mpi_sum if op is _SUM else self._ops[op]
        if x.nbytes <= self.piece or not self.piece:
            address = self._address
            send = self._in_place if inplace else [address(x.data_ptr(), x.nbytes), kind]
            self.comm.Allreduce(send, [address(out.data_ptr(), out.nbytes), kind], mpi_op)
        else:
            self._allreduce(x, out, kind, mpi_op, False)
        return out

    def all_gather_now(self, x: torch.Tensor) -> torch.Tensor | None:
        """All-gather of ``x`` [s, ...] along dim 0 -> [g * s, ...], or None (see above)."""
        if self.progress.pending or not self._direct or not x.is_cpu or not x.dim():
            return None
        src = x.contiguous()
        out = src.new_empty(self.size * src.numel())  # flat: cheaper than a shape tuple
        if src.dim() > 1:
            out = out.view(-1, *src.shape[1:])
        kind = self._gather_types.get(src.dtype, self._byte)
        address = self._address
        self.comm.Allgather([address(src.data_ptr(), src.nbytes), kind],
                            [address(out.data_ptr(), out.nbytes), kind])
        return out

    def reduce_scatter_now(self, x: torch.Tensor) -> torch.Tensor | None:
        """Sum-reduce-scatter of ``x`` [g * s, ...] along dim 0 -> [s, ...] (the caller checked
        that g divides), or None (see above)."""
        if (self.progress.pending or not self._direct or not x.is_cpu
                or x.dtype not in self._reduce_types):
            return None
        src = x.contiguous()
        out = src.new_empty(src.numel() // self.size)
        if src.dim() > 1:
            out = out.view(-1, *src.shape[1:])
        kind = self._reduce_types[src.dtype]
        address = self._address
        self.comm.Reduce_scatter_block([address(src.data_ptr(), src.nbytes), kind],
                                       [address(out.data_ptr(), out.nbytes), kind],
                                       self._mpi_sum)
        return out

    # Each method returns a Work; the out buffers are the caller's, filled when it completes.
    # Inputs and outputs are contiguous; their shapes do not matter, only their sizes.
    def all_reduce(self, src: torch.Tensor, out: torch.Tensor, op: Any,
                   async_op: bool) -> Work | Done:
        """``out`` = the reduction of every rank's ``src`` (``out`` may be ``src``: in
        place). Out of place MPI reads ``src`` directly: no copy of it first."""
        mpi_op, types = self._mpi_op(op), self._reduce_types
        if self._now(async_op) and src.dtype not in _UPCAST:
            self._allreduce(src, out, types[src.dtype], mpi_op, False)
            return DONE
        nb = self._nb(async_op)

        def call() -> None:
            if src.dtype in _UPCAST:
                wide = src.float()
                self._allreduce(wide, wide, types[wide.dtype], mpi_op, nb)
                out.copy_(wide)
                return
            self._allreduce(src, out, types[src.dtype], mpi_op, nb)
        return self.progress.run(call, async_op)

    def _allreduce(self, src: torch.Tensor, out: torch.Tensor, kind: Any, mpi_op: Any,
                   nb: bool) -> None:
        """``out`` = the reduction of every rank's ``src`` (in place when ``out is src``),
        in pieces of :attr:`piece` bytes, one after another (the module docstring)."""
        size, total = out.element_size(), out.nbytes
        step = max(size, self.piece - self.piece % size) if 0 < self.piece < total else total
        address, s0, o0 = self._address, src.data_ptr(), out.data_ptr()
        for lo in range(0, max(total, 1), max(step, 1)):  # one call for an empty tensor
            n = min(step, total - lo)
            send = self._in_place if out is src else [address(s0 + lo, n), kind]
            _run(self.comm, "Allreduce", send, [address(o0 + lo, n), kind], op=mpi_op, nb=nb)

    def all_gather(self, src: torch.Tensor, out: torch.Tensor, async_op: bool) -> Work | Done:
        """``out`` [g * n] = every rank's ``src`` [n] in group order (flat order)."""
        types = self._gather_types
        if self._now(async_op):
            self.comm.Allgather(self._msg(src, types), self._msg(out, types))
            return DONE
        nb = self._nb(async_op)

        def call() -> None:
            if self.two_level:
                self._all_gather_2l(src, out, nb)
            else:
                _run(self.comm, "Allgather", self._msg(src, types), self._msg(out, types), nb=nb)
        return self.progress.run(call, async_op)

    def reduce_scatter(self, src: torch.Tensor, out: torch.Tensor, op: Any,
                       async_op: bool) -> Work | Done:
        """``out`` [n] = this rank's chunk of the sum of every rank's ``src`` [g * n]."""
        mpi_op, types = self._mpi_op(op), self._reduce_types
        if self._now(async_op) and src.dtype not in _UPCAST:
            self.comm.Reduce_scatter_block(self._msg(src, types), self._msg(out, types), mpi_op)
            return DONE
        nb = self._nb(async_op)

        def call() -> None:
            wide = src.dtype in _UPCAST
            # (float32 named: torch.empty would take the default dtype, which a user may
            # have set to float64, and MPI would refuse the mismatched buffers)
            s, o = ((src.float(), torch.empty(out.shape, dtype=torch.float32)) if wide
                    else (src, out))
            if self.two_level:
                self._reduce_scatter_2l(s, o, mpi_op, nb)
            else:
                _run(self.comm, "Reduce_scatter_block", self._msg(s, types), self._msg(o, types),
                     op=mpi_op, nb=nb)
            if wide:
                out.copy_(o)
        return self.progress.run(call, async_op)

    def run_composite(self, fn: Any, async_op: bool) -> Work | Done:
        """Run ``fn(exchange, gather)`` as one collective in issue order (on the progress
        thread when async): ``exchange(src, out)`` is MPI's all-to-all of ``src`` [g * n]
        into ``out`` [g * n] (chunk j to rank j), ``gather(src, out)`` its all-gather; both
        move any dtype as 16-bit words or bytes (:mod:`common.collectives`' bf16 sums)."""
        nb, types, comm = self._nb(async_op), self._gather_types, self.comm

        def exchange(src: torch.Tensor, out: torch.Tensor) -> None:
            _run(comm, "Alltoall", self._msg(src, types), self._msg(out, types), nb=nb)

        def gather(src: torch.Tensor, out: torch.Tensor) -> None:
            _run(comm, "Allgather", self._msg(src, types), self._msg(out, types), nb=nb)

        return self.progress.run(lambda: fn(exchange, gather), async_op)

    def _nb(self, async_op: bool) -> bool:
        """Non-blocking + :func:`poll` (True) or MPI's blocking call (False)."""
        return self.polite == "all" or (async_op and self.polite == "async")

    # Two-level (PCCL). Group order is node-major: rank (n, l) = node n, position l; g = N * L.
    def _all_gather_2l(self, src: torch.Tensor, out: torch.Tensor, nb: bool) -> None:
        num_nodes, per_node = self.cross.Get_size(), self.node.Get_size()
        n, types = src.numel(), self._gather_types
        across = torch.empty(num_nodes * n, dtype=src.dtype)  # [N, n]: position l of each node
        _run(self.cross, "Allgather", self._msg(src, types), self._msg(across, types), nb=nb)
        by_pos = torch.empty(per_node * num_nodes * n, dtype=src.dtype)  # [L, N, n]
        _run(self.node, "Allgather", self._msg(across, types), self._msg(by_pos, types), nb=nb)
        out.view(num_nodes, per_node, n).copy_(by_pos.view(per_node, num_nodes, n).transpose(0, 1))

    def _reduce_scatter_2l(self, src: torch.Tensor, out: torch.Tensor, mpi_op: Any,
                           nb: bool) -> None:
        num_nodes, per_node = self.cross.Get_size(), self.node.Get_size()
        n, types = out.numel(), self._reduce_types
        # [N, L, n] -> [L, N, n]: the node step leaves position l the node's sum of column l
        by_pos = src.view(num_nodes, per_node, n).transpose(0, 1).contiguous()
        mine = torch.empty(num_nodes * n, dtype=src.dtype)  # [N, n]
        _run(self.node, "Reduce_scatter_block", self._msg(by_pos, types), self._msg(mine, types),
             op=mpi_op, nb=nb)
        _run(self.cross, "Reduce_scatter_block", self._msg(mine, types), self._msg(out, types),
             op=mpi_op, nb=nb)


def _run(comm: Any, name: str, *args: Any, nb: bool, **kwargs: Any) -> None:
    """mpi4py's collective ``name`` (``"Allreduce"``, ...) on ``comm``: MPI's blocking call,
    or (``nb``) its non-blocking twin (``"Iallreduce"``) completed by :func:`poll`."""
    if nb:
        poll(getattr(comm, "I" + name[0].lower() + name[1:])(*args, **kwargs))
    else:
        getattr(comm, name)(*args, **kwargs)


def _piece_from_env() -> int:
    """The all-reduce piece size in bytes: ``HPC_MPI_ALLREDUCE_PIECE`` (0: whole messages),
    else :data:`ALLREDUCE_PIECE_BYTES`."""
    text = os.environ.get(ENV_ALLREDUCE_PIECE, "").strip()
    try:
        value = int(text) if text else ALLREDUCE_PIECE_BYTES
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{ENV_ALLREDUCE_PIECE}={text!r}: give a size in bytes (0: all-reduce "
                         "whole messages)")
    return value


class MPITransport:
    """The MPI side of a job: ``COMM_WORLD``, node layout and the progress thread.

    Built by :func:`common.dist.init_distributed` (``comm="mpi"``, or ``"auto"`` under an MPI
    launcher) and owned by its ``DistContext``; :meth:`close` stops the thread and frees the
    communicators.

    Args:
        two_level: use two-level all-gather / reduce-scatter on groups that span nodes.
        ranks_per_node: consecutive world ranks per node (simulates a node layout); None: the
            real nodes (``MPI_COMM_TYPE_SHARED``).
        polite: ``"none"``, ``"async"`` or ``"all"`` (see :class:`MPIGroup`); None: from the
            busiest node of the job (agreed by all ranks): ``"none"`` with two cores or more
            per rank, ``"async"`` up to two ranks per core, ``"all"`` above.
    """

    def __init__(self, *, two_level: bool = False, ranks_per_node: int | None = None,
                 polite: str | None = None) -> None:
        mpi = _mpi()
        self.world = mpi.COMM_WORLD
        self.rank, self.size = self.world.Get_rank(), self.world.Get_size()
        self.two_level = two_level
        local = self.world.Split_type(mpi.COMM_TYPE_SHARED, key=self.rank)
        # a node's id: its smallest world rank
        node, local_size = local.allreduce(self.rank, op=mpi.MIN), local.Get_size()
        local.Free()
        if ranks_per_node is not None:
            if ranks_per_node < 1 or self.size % ranks_per_node:
                raise ValueError(f"ranks_per_node={ranks_per_node} must divide the "
                                 f"{self.size} ranks of the job")
            node = self.rank // ranks_per_node
        self.node_of: list[int] = self.world.allgather(node)
        if polite is None:  # from the busiest node (progress.polite_level), agreed by all
            level = polite_level(local_size / cores_available())
            polite = POLITE[self.world.allreduce(level, op=mpi.MAX)]
        if polite not in POLITE:
            raise ValueError(f"polite={polite!r}: use none, async or all")
        self.polite = polite
        try:  # agreed before raising, so that a rank with a bad value leaves none waiting
            mine, bad = _piece_from_env(), None
        except ValueError as e:
            mine, bad = -1, e
        self.piece = self.world.allreduce(mine, op=mpi.MIN)
        if self.piece < 0:
            raise bad or ValueError(f"{ENV_ALLREDUCE_PIECE} on another rank of the job is not "
                                    "a size in bytes")
        self.progress = ProgressThread()
        self._comms: list[Any] = []

    def call(self, name: str, *args: Any, **kwargs: Any) -> None:
        """``COMM_WORLD``'s collective ``name`` (mpi4py's buffer method: ``"Bcast"``,
        ``"Allgatherv"``, ...) on every rank, waiting as the transport's synchronous
        collectives do: MPI's blocking call, or with ``polite="all"`` its non-blocking twin
        (``"Ibcast"``) completed by :func:`poll`. The job-wide exchanges of
        :mod:`common.exchange` (flags, numbers, pickled objects) run through it."""
        _run(self.world, name, *args, nb=self.polite == "all", **kwargs)

    def split(self, groups: Sequence[Sequence[int]]) -> MPIGroup | None:
        """The :class:`MPIGroup` of this rank among ``groups`` (a partition of the world's
        ranks, each in group order); collective over ``COMM_WORLD``. None for a group of 1."""
        color = next(i for i, members in enumerate(groups) if self.rank in members)
        members = list(groups[color])
        comm = self.world.Split(color, key=members.index(self.rank))
        self._comms.append(comm)
        node = cross = None
        if self.two_level:
            node, cross = self._two_level_parts(comm, members)
        if len(members) == 1:
            return None
        return MPIGroup(comm, self.progress, node, cross, polite=self.polite,
                        piece=self.piece)

    def _two_level_parts(self, comm: Any, members: list[int]) -> tuple[Any, Any]:
        nodes = [self.node_of[r] for r in members]
        order = list(dict.fromkeys(nodes))  # distinct nodes in group order
        per_node = nodes.count(order[0])
        usable = (len(order) > 1 and per_node > 1 and nodes == sorted(nodes)
                  and all(nodes.count(n) == per_node for n in order))
        # every member computes the same `usable` (same lists), so all split or none
        if not usable:
            return None, None
        me = members.index(self.rank)
        node = comm.Split(me // per_node, key=me)
        cross = comm.Split(me % per_node, key=me)
        self._comms += [node, cross]
        return node, cross

    def close(self) -> None:
        """Stop the progress thread and free the communicators (idempotent). A collective
        still in flight (a failing rank exits) leaves them to the exiting process."""
        if not self.progress.stop():
            return
        for c in self._comms:
            try:
                c.Free()
            except Exception:  # MPI already finalised at interpreter exit
                pass
        self._comms.clear()
