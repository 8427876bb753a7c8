"""Small exchanges every rank of a group makes alike: agree on a flag or a few numbers, pass
Python objects around, wait for each other.

* :func:`any_rank` / :func:`max_over_ranks`: one tiny all-reduce that makes a flag or a few
  numbers the same on every rank (through the MPI transport when one is given).
* :func:`broadcast_object` / :func:`all_gather_object` / :func:`barrier` /
  :func:`rank_and_size`: Python objects (checkpoints, start-up) over a ``group``: a
  torch.distributed group, the job's :class:`~common.mpi.MPITransport` (the whole job, over
  MPI: what the trainers pass when mpiexec started them) or None (the world over
  torch.distributed, or one process without it).

Every function here is collective over its group (except :func:`rank_and_size`): every rank
calls it, in the same order. Without a process group each is the one-process answer.

Over the MPI transport an object travels pickled over ``COMM_WORLD``: its length first (a
broadcast, or an all-gather of every rank's), then the bytes (a broadcast, or an
``Allgatherv`` at the offsets the lengths give), each a job-wide call of
:meth:`MPITransport.call`, so that it waits as the transport's synchronous collectives do.
"""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from common.mpi import MPITransport

__all__ = ["all_gather_object", "any_rank", "barrier", "broadcast_object", "max_over_ranks",
           "rank_and_size"]


def max_over_ranks(values: Sequence[float], device: torch.device | str = "cpu",
                   transport: MPITransport | None = None) -> list[float]:
    """The elementwise maximum of ``values`` over all ranks, on every rank (one all-reduce of
    float64; collective). Without a process group, ``values`` themselves. ``transport``
    (``DistContext.transport``): through MPI when ``device`` is the CPU (microseconds where
    gloo takes milliseconds); every rank must pass one or none alike."""
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    if transport is not None and t.is_cpu:
        mpi = _mpi()
        transport.call("Allreduce", mpi.IN_PLACE,
                       [mpi.buffer.fromaddress(t.data_ptr(), t.nbytes), mpi.DOUBLE], op=mpi.MAX)
    elif dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def any_rank(flag: bool, device: torch.device | str = "cpu",
             transport: MPITransport | None = None) -> bool:
    """True on every rank if ``flag`` is True on any rank (one tiny all-reduce; collective;
    ``transport`` as in :func:`max_over_ranks`)."""
    return max_over_ranks([1.0 if flag else 0.0], device, transport)[0] > 0


def rank_and_size(group: Any = None) -> tuple[int, int]:
    """This rank's index in ``group`` and the group's size ((0, 1) without torch.distributed)."""
    if isinstance(group, MPITransport):
        return group.rank, group.size
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj``, in group order, on every rank of ``group`` (collective)."""
    if isinstance(group, MPITransport):
        return _mpi_all_gather_object(obj, group)
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, group: Any = None) -> Any:
    """The ``obj`` of ``group``'s first rank, on every rank of it (collective)."""
    if isinstance(group, MPITransport):
        return _mpi_broadcast_object(obj, group)
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0,
                               group=group)
    return box[0]


def barrier(group: Any = None) -> None:
    """Every rank of ``group`` waits here for the others (collective)."""
    if isinstance(group, MPITransport):
        group.call("Barrier")
    elif dist.is_initialized():
        dist.barrier(group)


def _mpi() -> Any:
    from mpi4py import MPI  # present wherever an MPITransport was built

    return MPI


def _mpi_broadcast_object(obj: Any, transport: MPITransport, root: int = 0) -> Any:
    """Rank ``root``'s ``obj`` on every rank of the job: its pickle's length, then the bytes."""
    byte, mine = _mpi().BYTE, transport.rank == root
    data = pickle.dumps(obj) if mine else b""
    size = bytearray(len(data).to_bytes(8, "little"))
    transport.call("Bcast", [size, byte], root=root)
    buf = bytearray(data) if mine else bytearray(int.from_bytes(size, "little"))
    transport.call("Bcast", [buf, byte], root=root)
    return obj if mine else pickle.loads(buf)


def _mpi_all_gather_object(obj: Any, transport: MPITransport) -> list[Any]:
    """Every rank's ``obj`` in rank order: the pickles' lengths, then the bytes of all."""
    byte, data = _mpi().BYTE, pickle.dumps(obj)
    sizes = bytearray(8 * transport.size)
    transport.call("Allgather", [len(data).to_bytes(8, "little"), byte], [sizes, byte])
    counts = [int.from_bytes(sizes[8 * r: 8 * r + 8], "little") for r in range(transport.size)]
    displs = [0, *itertools.accumulate(counts[:-1])]
    buf = bytearray(sum(counts))
    transport.call("Allgatherv", [data, byte], [buf, (counts, displs), byte])
    return [pickle.loads(buf[d: d + c]) for d, c in zip(displs, counts)]
