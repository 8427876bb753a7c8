"""Choose a grid: rank every factorization of G ranks for a workload, pick the best.

One :func:`plan` and one :func:`auto_grid` serve both engines (``plexus.train --grid auto`` and
``llm.train --grid auto``): the engine hands over its workload
(:class:`~common.perf.gcn.GCNWorkload` or :class:`~common.perf.gpt.GPTWorkload`) and its grid
constraints (functions ``shape -> [problem, ...]``, as :meth:`ProcessGrid.check` takes).
Pure Python; the command line is ``python -m common.perf.plan``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from common.grid import Constraint, ProcessGrid
from common.perf import gcn as perf_gcn
from common.perf import gpt as perf_gpt
from common.perf.machine import MachineProfile, load_profile
from common.perf.model import Plan, rank_predictions

Workload = perf_gcn.GCNWorkload | perf_gpt.GPTWorkload
def _machine(machine: MachineProfile | str | os.PathLike | None) -> MachineProfile:
    return machine if isinstance(machine, MachineProfile) else load_profile(machine)


def plan(work: Workload, num_ranks: int, *,
         machine: MachineProfile | str | os.PathLike | None = None,
         ranks_per_node: int | None = None, constraints: Sequence[Constraint] = ()) -> Plan:
    """Every grid of ``num_ranks`` ranks for ``work``, runnable ones first, fastest first.

    Args:
        work: a :class:`~common.perf.gcn.GCNWorkload` (``x, y, z`` grids) or a
            :class:`~common.perf.gpt.GPTWorkload` (``data, depth, row, col`` grids).
        num_ranks: G.
        machine: a :class:`MachineProfile`, a profile name or JSON path, or None
            (``$HPC_MACHINE_PROFILE``, else ``local-cpu``).
        ranks_per_node: default: the profile's.
        constraints: as in :meth:`ProcessGrid.check`: functions ``shape -> problems``; a grid
            with problems is not runnable (the workload's own ``grid_problems`` always
            applies).

    Raises:
        ValueError: an unknown profile. TypeError: not a workload.
    """
    profile = _machine(machine)
    if isinstance(work, perf_gcn.GCNWorkload):
        out = perf_gcn.plan_gcn(work, num_ranks, profile, ranks_per_node=ranks_per_node)
    elif isinstance(work, perf_gpt.GPTWorkload):
        out = perf_gpt.plan_gpt(work, num_ranks, profile, ranks_per_node=ranks_per_node)
    else:
        raise TypeError(f"plan needs a GCNWorkload or a GPTWorkload, got {type(work).__name__}")
    if not constraints:
        return out
    for pred in out.predictions:
        problems = [p for c in constraints for p in c(dict(pred.shape))]
        if problems:
            pred.invalid = "; ".join([pred.invalid, *problems] if pred.invalid else problems)
    ranked = rank_predictions(out.predictions, num_ranks, out.axes, out.title)
    return dataclasses.replace(ranked, notes=out.notes)


def auto_grid(work: Workload, num_ranks: int, *,
              machine: MachineProfile | str | os.PathLike | None = None,
              ranks_per_node: int | None = None, constraints: Sequence[Constraint] = ()
              ) -> tuple[ProcessGrid, Plan]:
    """The predicted-fastest runnable grid for ``work`` (the trainers' ``--grid auto``).

    Arguments as in :func:`plan`. The result is a pure function of the arguments, so every
    rank picks the same grid. Log ``plan.describe_choice()`` on rank 0 (the choice and the
    runner-up).

    Returns:
        The grid (``ProcessGrid.plexus`` for a GCN, ``ProcessGrid.axonn`` for a GPT) and the
        plan.

    Raises:
        ValueError: an unknown profile, or no grid fits in memory without problems.
    """
    ranked = plan(work, num_ranks, machine=machine, ranks_per_node=ranks_per_node,
                  constraints=constraints)
    shape = ranked.best.shape
    if isinstance(work, perf_gcn.GCNWorkload):
        return ProcessGrid.plexus(shape["x"], shape["y"], shape["z"]), ranked
    return ProcessGrid.axonn(shape["data"], shape["depth"], shape["row"], shape["col"]), ranked


# ------------------------------------------------------------------------- command line
