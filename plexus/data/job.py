"""A dataset opened by every rank of a job: the cache's k from the grid, one token per job.

    token = job_token(ctx, prepare=args.prepare)         # collective, before any other check
    spec = parse_grid(args.grid, ctx.world_size)         # common.perf
    source = open_dataset(args.dataset, ctx, grid=spec, token=token, root=args.root)

Rank 0 prepares a big dataset once into ``ROOT/prepared`` while the others wait
(:mod:`plexus.data.cache`); each rank then maps only its blocks.
"""

from __future__ import annotations

import math
import uuid
from typing import Any

from common.dist import DistContext
from common.exchange import broadcast_object
from common.grid import ceil_div
from common.perf.choose import GridSpec
from plexus.config import aggregation_of
from plexus.data.registry import open_source
from plexus.data.shard import ShardSource

MIN_BLOCKS = 8  # k of an auto-prepared cache: at least this many blocks per side


def default_blocks(grid: GridSpec) -> int:
    """``--blocks`` default, the k of a cache prepared now: the smallest multiple of
    lcm(X, Y, Z) >= 8 of a fixed grid, so every axis divides it; 8 for ``auto`` (the chosen
    grid is then one whose axes divide 8)."""
    if grid.grid is None:
        return MIN_BLOCKS
    step = math.lcm(*grid.grid.shape.values())
    return step * ceil_div(MIN_BLOCKS, step)


def job_token(ctx: DistContext, *, prepare: str = "auto") -> str | None:
    """One id for this job, the same on every rank (collective): it tells this job's failure
    marker of a preparation from an earlier job's (:mod:`plexus.data.cache`). Call it before
    any check that may fail on some ranks only, so no rank is left waiting in it.

    Args:
        ctx: the job (:class:`common.dist.DistContext`).
        prepare: ``--prepare``; ``never`` prepares nothing and needs no token.
    """
    if prepare == "never" or ctx.world_size == 1:
        return None
    return broadcast_object(uuid.uuid4().hex if ctx.is_main else None, ctx.transport)


def open_dataset(name: str, ctx: DistContext, *, grid: GridSpec, blocks: int | None = None,
                 model: str = "gcn", token: str | None = None, **options: Any) -> ShardSource:
    """``--dataset`` as a shard source on every rank of the job; a big one is prepared once
    by global rank 0 (one rank per node prints the progress).

    Args:
        name: the dataset (:func:`plexus.data.open_source`).
        ctx: the job (:class:`common.dist.DistContext`).
        grid: the parsed ``--grid``: the default k fits it (:func:`default_blocks`).
        blocks: k of a cache prepared now; None: :func:`default_blocks`.
        model: ``gcn`` or ``sage``: the adjacency the model needs.
        token: :func:`job_token`.
        options: ``root``, ``permutation``, ``seed``, ``symmetrize``, ``prepare`` of
            :func:`~plexus.data.open_source`.

    Raises:
        ValueError: ``blocks`` < 1, and as :func:`~plexus.data.open_source`.
    """
    blocks = default_blocks(grid) if blocks is None else blocks
    if blocks < 1:
        raise ValueError(f"--blocks must be >= 1, got {blocks}")
    return open_source(name, aggregation=aggregation_of(model), blocks=blocks,
                       is_writer=ctx.rank == 0, verbose=ctx.local_rank == 0, token=token,
                       **options)
