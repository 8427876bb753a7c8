"""The parallel state of a run: one value, built once in the entry point and passed down.

As torchtitan's ``ParallelDims``: the entry point starts the job, chooses the grid, creates its
axis groups once, and hands the result to the trainer, which hands each component the one
group it uses. Nothing below the entry point rebuilds the grid from its groups or creates
groups of its own::

    ctx = init_distributed()                                  # common.dist
    grid, _ = choose_grid(parse_grid("2x2x2", ctx.world_size), work, ctx.world_size)
    parallel = ParallelState.create(ctx, grid)                # collective: every rank
    trainer = plexus.trainer.Trainer(source, parallel, model=ModelConfig())

The groups come from :meth:`common.dist.DistContext.create_groups`, which gives every group
the job's MPI transport under mpiexec. :meth:`ParallelState.single` serves one process on its
own (a 1-rank grid needs no process group); :meth:`ParallelState.for_rank` serves callers
that hold a rank and a transport but no context (``plexus.trainer.train_gcn``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from common.dist import DistContext
from common.grid import AxisGroup, ProcessGrid
from common.mpi import MPITransport, cores_available

__all__ = ["AxisSets", "ParallelState"]

AxisSets = Iterable[str | Iterable[str]] | None  # as ProcessGrid.create_groups takes them


@dataclass(frozen=True)
class ParallelState:
    """This rank's place in the job: the grid, its axis groups, the device and the transport.

    Attributes:
        grid: the process grid (checked against the number of processes at creation).
        groups: axis (or axes joined by ``+``) -> this rank's :class:`~common.grid.AxisGroup`.
        rank: this process's global rank.
        device: where this rank computes.
        transport: the job's :class:`~common.mpi.MPITransport` (CPU tensors and job-wide
            agreements go over MPI), or None (``torch.distributed`` only).
        ctx: the :class:`~common.dist.DistContext` it was created from, or None (made by
            :meth:`single` or :meth:`for_rank`).
    """

    grid: ProcessGrid
    groups: Mapping[str, AxisGroup]
    rank: int
    device: torch.device
    transport: MPITransport | None = field(default=None, compare=False, repr=False)
    ctx: DistContext | None = field(default=None, compare=False, repr=False)

    def comm_offloaded(self) -> bool:
        """Whether collectives run beside the compute without taking its cores: on a GPU
        (NCCL), or on a CPU with at least two cores per rank of this node (a core for the
        MPI transport's communication thread; common.perf.gcn_workload.overlap_pays)."""
        if self.device.type != "cpu":
            return True
        local = self.ctx.local_world_size if self.ctx is not None else self.grid.num_ranks
        return cores_available() >= 2 * max(1, local)

    @classmethod
    def create(cls, ctx: DistContext, grid: ProcessGrid, axis_sets: AxisSets = None
               ) -> ParallelState:
        """The entry point's call: ``grid``'s axis groups over the job's transport.

        Collective: every rank calls it with the same arguments and creates every group, in
        the same order (:meth:`common.dist.DistContext.create_groups`).

        Args:
            ctx: the job (:func:`common.dist.init_distributed`).
            grid: the chosen grid (:func:`common.perf.choose_grid`).
            axis_sets: the axes, or tuples of axes, to make groups for; default: each single
                axis (llm adds ``data+depth`` and ``depth+row+col``:
                :data:`llm.parallel.gpt.AXIS_SETS`).

        Raises:
            ValueError: the grid's size is not the number of processes launched.
        """
        grid.check(ctx.world_size)
        return cls(grid, ctx.create_groups(grid, axis_sets), ctx.rank, ctx.device,
                   ctx.transport, ctx)

    @classmethod
    def single(cls, grid: ProcessGrid, axis_sets: AxisSets = None,
               device: torch.device | str = "cpu") -> ParallelState:
        """One process on its own (tests, benches, a notebook): every group of a 1-rank grid
        has size 1 and needs no process group.

        Raises:
            ValueError: ``grid`` has more than one rank.
        """
        if grid.num_ranks != 1:
            raise ValueError(f"ParallelState.single needs a 1-rank grid; grid {grid} has "
                             f"{grid.num_ranks} ranks (use ParallelState.create(ctx, grid))")
        return cls(grid, grid.create_groups(0, axis_sets, transport=None), 0,
                   torch.device(device))

    @classmethod
    def for_rank(cls, grid: ProcessGrid, rank: int, *, transport: MPITransport | None,
                 device: torch.device | str = "cpu", axis_sets: AxisSets = None
                 ) -> ParallelState:
        """For callers handed a rank and a transport rather than the context; collective, as
        :meth:`create`. Prefer :meth:`create`: with ``transport=None`` under mpiexec, CPU
        tensors take gloo instead of MPI.

        Raises:
            ValueError: the grid's size is not the number of processes running.
        """
        grid.check(dist.get_world_size() if dist.is_initialized() else 1)
        return cls(grid, grid.create_groups(rank, axis_sets, transport=transport), rank,
                   torch.device(device), transport)

    @property
    def world_size(self) -> int:
        """The number of ranks (the grid's, checked against the job's at creation)."""
        return self.grid.num_ranks

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that prints and writes."""
        return self.rank == 0
