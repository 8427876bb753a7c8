"""Choose a grid: rank every factorization of G ranks for a workload, pick the best.

One :func:`plan` and one :func:`auto_grid` serve both engines: the engine hands over its
workload (:class:`~common.perf.gcn_workload.GCNWorkload` or
:class:`~common.perf.gpt.GPTWorkload`) and its grid constraints (functions
``shape -> [problem, ...]``, as :meth:`ProcessGrid.check` takes). Both trainers' ``--grid``
goes through the same two calls, parsed once::

    spec = parse_grid(args.grid, ctx.world_size, axes)     # "2x2x2", "data=2,row=2", "auto:PROFILE"
    grid, note = choose_grid(spec, work, ctx.world_size, constraints=[source.grid_problems])

Pure Python; the command line is ``python -m common.perf``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass

from common.grid import PLEXUS_AXES, Constraint, ProcessGrid
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
        work: a :class:`~common.perf.gcn_workload.GCNWorkload` (``x, y, z`` grids) or a
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


# ------------------------------------------------------------------------- --grid
@dataclass(frozen=True)
class GridSpec:
    """A ``--grid`` value, parsed once (:func:`parse_grid`).

    Attributes:
        grid: the fixed grid (given, or the default one when ``--grid`` was left out); None
            for ``auto``.
        profile: ``auto``'s machine profile, a name or a JSON path (None:
            ``$HPC_MACHINE_PROFILE``, else ``local-cpu``).
    """

    grid: ProcessGrid | None = None
    profile: str | None = None

    @property
    def auto(self) -> bool:
        """Whether the performance model picks the grid (``auto[:PROFILE]``)."""
        return self.grid is None


def default_grid(num_ranks: int, axes: Sequence[str] = PLEXUS_AXES) -> ProcessGrid:
    """The grid when ``--grid`` is left out. Plexus's ``x, y, z``: the most cubic
    X x Y x Z = ``num_ranks`` (ties: the larger y, then the larger x); any other axes (llm's
    ``data, depth, row, col``): every rank on the first axis (data parallel)."""
    axes = tuple(axes)
    if axes != PLEXUS_AXES:
        return ProcessGrid.parse(f"{axes[0]}={num_ranks}", axes)
    best: tuple[tuple[int, int, int], tuple[int, int, int]] | None = None
    for x in range(1, num_ranks + 1):
        for y in range(1, num_ranks // x + 1):
            if num_ranks % (x * y):
                continue
            z = num_ranks // (x * y)
            key = (max(x, y, z), -y, -x)
            if best is None or key < best[0]:
                best = (key, (x, y, z))
    assert best is not None
    return ProcessGrid.plexus(*best[1])


def parse_grid(text: str | None, num_ranks: int, axes: Sequence[str] = PLEXUS_AXES
               ) -> GridSpec:
    """``--grid`` of either trainer: ``2x2x2`` or ``data=2,row=2`` (sizes along ``axes``),
    ``auto[:PROFILE]`` (the grid :func:`auto_grid` predicts fastest on a machine profile), or
    None / empty (:func:`default_grid` of ``num_ranks``).

    Raises:
        ValueError: a malformed grid, naming the text and the axes.
    """
    if not text:
        return GridSpec(default_grid(num_ranks, axes))
    name, _, profile = text.partition(":")
    if name == "auto":
        return GridSpec(profile=profile or None)
    return GridSpec(ProcessGrid.parse(text, axes))


def choose_grid(spec: GridSpec, work: Workload, num_ranks: int, *,
                ranks_per_node: int | None = None, constraints: Sequence[Constraint] = ()
                ) -> tuple[ProcessGrid, str | None]:
    """The grid a trainer runs on, checked: the fixed grid of ``spec``, or for ``auto`` the
    one :func:`auto_grid` picks among those that satisfy ``constraints``.

    A pure function of its arguments, so every rank picks the same grid without
    communicating.

    Args:
        spec: the parsed ``--grid`` (:func:`parse_grid`).
        work: the planner's view of the run (its ``grid_problems`` always apply).
        num_ranks: the processes launched.
        ranks_per_node: for ``auto``; default: the profile's.
        constraints: functions ``shape -> problems``, e.g. a data source's
            ``grid_problems`` (a prepared graph's axes must divide its blocks).

    Returns:
        The grid, and for ``auto`` one line for rank 0 to log (the choice, the runner-up and
        the profile); None for a fixed grid.

    Raises:
        ValueError: the grid does not match ``num_ranks`` (the arithmetic in the message),
            has problems, or no grid fits (``auto``); an unknown profile.
    """
    note = None
    if spec.grid is not None:
        grid = spec.grid
    else:
        machine = load_profile(spec.profile)
        grid, ranked = auto_grid(work, num_ranks, machine=machine,
                                 ranks_per_node=ranks_per_node, constraints=constraints)
        note = f"{ranked.describe_choice()} [profile {machine.name}]"
    grid.check(num_ranks, work.grid_problems, *constraints)
    return grid, note
