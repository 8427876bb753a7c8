"""Engine-independent parts of the performance model: collectives, predictions, plans.

An engine (:mod:`common.perf.gcn`, :mod:`common.perf.gpt`) lists, for one grid, every
collective a rank issues in one step (:class:`Collective`: axis, op, full tensor bytes, count),
its compute terms and its memory. This module turns collectives into per-axis bytes and seconds
with the machine's alpha-beta model, enumerates grids (every ordered factorization of ``G`` into
the engine's axes), and ranks the grids that fit in memory by predicted time. Pure Python.

Bytes per rank of one collective are :func:`common.comm_stats.ring_bytes` — the same integer
arithmetic the trainers' :class:`~common.comm_stats.CommStats` uses, so the counted bytes per
axis equal the model's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from common.comm_stats import ring_bytes
from common.grid import ProcessGrid
from common.perf.machine import MachineProfile, check_op


@dataclass(frozen=True)
class Collective:
    """``count`` calls of ``op`` along ``axis`` on a tensor of ``full_bytes`` bytes.

    ``full_bytes`` is ``M`` of the ring formulas: the all-reduce input, the all-gather output,
    the reduce-scatter input.
    """

    axis: str
    op: str
    full_bytes: int
    count: int = 1

    def __post_init__(self) -> None:
        check_op(self.op)


def factorizations(n: int, num_axes: int) -> list[tuple[int, ...]]:
    """Every ordered tuple of ``num_axes`` positive integers whose product is ``n``.

    >>> factorizations(4, 2)
    [(1, 4), (2, 2), (4, 1)]
    """
    if n < 1 or num_axes < 1:
        raise ValueError(f"need n >= 1 and num_axes >= 1, got n={n}, num_axes={num_axes}")
    if num_axes == 1:
        return [(n,)]
    return [(d, *rest) for d in range(1, n + 1) if n % d == 0
            for rest in factorizations(n // d, num_axes - 1)]


def group_size(shape: Mapping[str, int], name: str) -> int:
    """Ranks in the group called ``name``: an axis (``"row"``) or several (``"data+depth"``)."""
    out = 1
    for axis in name.split("+"):
        out *= shape[axis]
    return out


def group_stride(grid: ProcessGrid, name: str) -> int:
    """Rank distance between neighbours of the group ``name`` (its fastest axis's stride).

    For several axes adjacent in the layout (``data+depth``, ``depth+row+col``) the group's
    ranks are ``stride`` apart, as for one axis.
    """
    return min(grid.stride(a) for a in name.split("+"))


def bytes_by_axis(collectives: Iterable[Collective], shape: Mapping[str, int]) -> dict[str, int]:
    """Bytes sent per rank on each group (groups that send nothing are left out)."""
    out: dict[str, int] = {}
    for c in collectives:
        b = c.count * ring_bytes(c.op, c.full_bytes, group_size(shape, c.axis))
        if b:
            out[c.axis] = out.get(c.axis, 0) + b
    return out


def comm_seconds(collectives: Iterable[Collective], grid: ProcessGrid, machine: MachineProfile,
                 node_ranks: int) -> dict[str, float]:
    """Predicted seconds per group; each group's rings are placed by its stride in ``grid``."""
    out: dict[str, float] = {}
    for c in collectives:
        g = group_size(grid.shape, c.axis)
        if g > 1:
            t = machine.collective_time(c.op, c.full_bytes, g, stride=group_stride(grid, c.axis),
                                        node_ranks=node_ranks)
            out[c.axis] = out.get(c.axis, 0.0) + c.count * t
    return out


@dataclass
class Prediction:
    """Predicted cost of one step (epoch or training step) on one grid, per rank.

    Attributes:
        shape: axis -> size, in the engine's axis order.
        compute: kind (``spmm``, ``gemm``, ``elementwise``...) -> seconds.
        comm: axis -> seconds of communication.
        comm_bytes: axis -> bytes sent per rank.
        memory: bytes per rank.
        memory_limit: bytes available per rank.
        invalid: why the grid cannot run (shapes that do not divide), or "".
        extra: engine-specific choices shown in tables (e.g. the GPT micro-batch).
    """

    shape: dict[str, int]
    compute: dict[str, float]
    comm: dict[str, float]
    comm_bytes: dict[str, int]
    memory: float
    memory_limit: float
    invalid: str = ""
    extra: dict[str, object] = field(default_factory=dict)
    hidden: float = 0.0  # seconds of ``comm`` that overlap with compute hides

    @property
    def compute_s(self) -> float:
        return sum(self.compute.values())

    @property
    def comm_s(self) -> float:
        return sum(self.comm.values())

    @property
    def exposed_comm_s(self) -> float:
        """Communication the compute waits for: ``comm_s`` less what overlap hides."""
        return self.comm_s - self.hidden

    @property
    def total_s(self) -> float:
        """Compute plus the exposed communication."""
        return self.compute_s + self.exposed_comm_s

    @property
    def fits(self) -> bool:
        return self.memory <= self.memory_limit

    @property
    def runnable(self) -> bool:
        return self.fits and not self.invalid

    @property
    def dims(self) -> int:
        """Axes of size > 1 (a 3D plexus grid has 3)."""
        return sum(s > 1 for s in self.shape.values())

    def label(self) -> str:
        if list(self.shape) == ["x", "y", "z"]:
            return "x".join(str(s) for s in self.shape.values())
        return ",".join(f"{a}={s}" for a, s in self.shape.items())


@dataclass
class Plan:
    """Predictions of every grid, runnable ones first, fastest first."""

    num_ranks: int
    axes: tuple[str, ...]
    predictions: list[Prediction]
    title: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def runnable(self) -> list[Prediction]:
        return [p for p in self.predictions if p.runnable]

    @property
    def best(self) -> Prediction:
        """The fastest runnable grid; ValueError saying why when there is none."""
        if not self.runnable:
            valid = [p for p in self.predictions if not p.invalid]
            if not valid:
                p = self.predictions[0]
                raise ValueError(f"no grid of {self.num_ranks} ranks fits: every grid has a "
                                 f"problem, e.g. {p.label()}: {p.invalid}")
            small = min(valid, key=lambda p: p.memory)
            raise ValueError(f"no grid of {self.num_ranks} ranks fits in memory and divides the "
                             f"shapes; smallest need: {small.memory / 2**30:.2f} GiB per rank "
                             f"({small.label()}) against {small.memory_limit / 2**30:.2f}")
        return self.runnable[0]

    @property
    def runner_up(self) -> Prediction | None:
        r = self.runnable
        return r[1] if len(r) > 1 else None

    def find(self, shape: Mapping[str, int] | Sequence[int]) -> Prediction:
        sizes = tuple(shape.values()) if isinstance(shape, Mapping) else tuple(shape)
        for p in self.predictions:
            if tuple(p.shape.values()) == sizes:
                return p
        raise ValueError(f"grid {sizes} is not in the plan of {self.num_ranks} ranks")

    def table(self, top: int | None = None) -> str:
        """Fixed-width table: grid, total, compute, communication per axis, memory, fits.

        Groups over several axes (``data+depth``) are summed in the ``comm other`` column.
        """
        other = any(k not in self.axes for p in self.predictions for k in p.comm)
        head = (f"{'#':>3} {'grid':<28}{'total ms':>10}{'compute':>9}"
                + "".join(f"{'comm ' + a:>11}" for a in self.axes)
                + (f"{'comm other':>11}" if other else "") + f"{'GiB/rank':>10}  fits")
        lines = [self.title] if self.title else []
        lines.append(head)
        shown = self.predictions if top is None else self.predictions[:top]
        for k, p in enumerate(shown, 1):
            fits = "yes" if p.runnable else ("no: " + p.invalid if p.invalid else "no: memory")
            rest = sum(v for a, v in p.comm.items() if a not in self.axes)
            lines.append(
                f"{k:>3} {p.label():<28}{1e3 * p.total_s:>10.2f}{1e3 * p.compute_s:>9.2f}"
                + "".join(f"{1e3 * p.comm.get(a, 0.0):>11.2f}" for a in self.axes)
                + (f"{1e3 * rest:>11.2f}" if other else "")
                + f"{p.memory / 2**30:>10.3f}  {fits}"
                + "".join(f"  {k}={v}" for k, v in p.extra.items()))
        if top is not None and len(self.predictions) > top:
            lines.append(f"    ... {len(self.predictions) - top} more grids")
        lines.extend(self.notes)
        return "\n".join(lines)

    def describe_choice(self) -> str:
        """One line for logs: the chosen grid, its predicted split, and the runner-up."""
        best, second = self.best, self.runner_up
        comm = ", ".join(f"{a} {1e3 * v:.1f}" for a, v in best.comm.items() if v)
        out = (f"grid auto: {best.label()} of {len(self.predictions)} grids (predicted "
               f"{1e3 * best.total_s:.1f} ms: compute {1e3 * best.compute_s:.1f}, "
               f"communication {1e3 * best.comm_s:.1f}{' (' + comm + ')' if comm else ''}; "
               f"{best.memory / 2**30:.2f} GiB per rank)")
        if second is not None:
            out += (f"; runner-up {second.label()} ({1e3 * second.total_s:.1f} ms, "
                    f"+{100 * (second.total_s / best.total_s - 1):.1f}%)")
        return out


def rank_predictions(predictions: list[Prediction], num_ranks: int, axes: Sequence[str],
                     title: str = "") -> Plan:
    """Sort: runnable grids first by predicted time, then the rest by memory."""
    ordered = sorted(predictions, key=lambda p: (not p.runnable,
                                                 p.total_s if p.runnable else p.memory))
    return Plan(num_ranks, tuple(axes), ordered, title)


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman rank correlation (ties get their average rank)."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError(f"need two sequences of equal length >= 2, got {len(a)}, {len(b)}")
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return cov / var if var else 0.0


def _ranks(v: Sequence[float]) -> list[float]:
    order = sorted(range(len(v)), key=lambda i: v[i])
    ranks = [0.0] * len(v)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks
