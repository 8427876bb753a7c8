"""Named N-D process grids: pure rank arithmetic, plus collective creation of axis groups.

A :class:`ProcessGrid` maps each of ``G`` ranks to a coordinate on named axes. Two layouts are
used by this project:

* Plexus (3D): axes ``x, y, z`` with ``rank = z*(X*Y) + x*Y + y`` (``y`` fastest, then ``x``,
  then ``z``), built with :meth:`ProcessGrid.plexus` or ``ProcessGrid.parse("2x2x2")``.
* AxoNN-style 4D: axes ``data, depth, row, col`` with ``col`` fastest, built with
  :meth:`ProcessGrid.axonn` or ``ProcessGrid.parse("data=2,depth=1,row=2,col=2", AXONN_AXES)``.

Everything except :meth:`ProcessGrid.create_groups` is pure arithmetic on integers and is
tested without ``torch.distributed``. Group creation is *collective*: every rank creates every
group of every requested axis set in the same fixed order (a ``torch.distributed`` rule). Make
the groups with ``ctx.create_groups(grid)`` (:meth:`common.dist.DistContext.create_groups`):
it passes the job's MPI transport, which CPU tensors need to be fast under mpiexec.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

PLEXUS_AXES: tuple[str, ...] = ("x", "y", "z")
PLEXUS_LAYOUT: tuple[str, ...] = ("z", "x", "y")  # slowest -> fastest
# (outer, inner, depth) axes of a Plexus layer: layer l's roles are ROLES[l % 3], so that
# the output of one layer is laid out as the next layer's input (docs/design/plexus-3d.md
# section 2)
ROLES: tuple[tuple[str, str, str], ...] = (("x", "y", "z"), ("z", "x", "y"), ("y", "z", "x"))


def roles(layer: int) -> tuple[str, str, str]:
    """(outer, inner, depth) axis names of Plexus layer ``layer``."""
    return ROLES[layer % 3]


AXONN_AXES: tuple[str, ...] = ("data", "depth", "row", "col")

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_NO_TRANSPORT: Any = object()  # create_groups called as the first releases did

# A grid constraint: the problems of a grid shape (axis -> size) as sentences that show the
# arithmetic, [] when the shape is fine. ProcessGrid.check runs them.
Constraint = Callable[[Mapping[str, int]], list[str]]


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` in integers, for ``b >= 1``."""
    if b < 1:
        raise ValueError(f"ceil_div needs a divisor >= 1, got {b}")
    return -(-a // b)


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is ``>= n`` (padding to a grid axis)."""
    return ceil_div(n, multiple) * multiple


@dataclass(frozen=True)
class ProcessGrid:
    """A named grid of ranks.

    Args:
        shape: axis name -> size, in display order (the order used by ``str(grid)`` and by
            the ``AxBxC`` string form).
        layout: axis names from slowest- to fastest-varying in the rank number. Defaults to
            the order of ``shape`` (last axis fastest).

    Example:
        >>> g = ProcessGrid.plexus(2, 2, 2)
        >>> g.coords(5)            # rank 5 = z*4 + x*2 + y
        {'x': 0, 'y': 1, 'z': 1}
        >>> g.axis_ranks(5, "z")
        [1, 5]
    """

    shape: Mapping[str, int]
    layout: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        shape = dict(self.shape)
        if not shape:
            raise ValueError("a process grid needs at least one axis")
        for name, size in shape.items():
            if not isinstance(name, str) or not _NAME_RE.match(name):
                raise ValueError(f"grid axis name {name!r} is not an identifier")
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"grid axis {name}={size!r}: sizes must be integers >= 1")
        layout = tuple(self.layout) if self.layout else tuple(shape)
        if sorted(layout) != sorted(shape):
            raise ValueError(
                f"grid layout {layout} must list each axis of {tuple(shape)} exactly once"
            )
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "layout", layout)

    # ----------------------------------------------------------------- constructors
    @classmethod
    def plexus(cls, x: int, y: int, z: int) -> ProcessGrid:
        """The Plexus 3D grid: ``rank = z*(X*Y) + x*Y + y``."""
        return cls({"x": x, "y": y, "z": z}, layout=PLEXUS_LAYOUT)

    @classmethod
    def axonn(cls, data: int, depth: int, row: int, col: int) -> ProcessGrid:
        """The AxoNN 4D grid: ``rank = ((data*Z + depth)*R + row)*C + col``."""
        return cls({"data": data, "depth": depth, "row": row, "col": col})

    @classmethod
    def parse(
        cls,
        text: str,
        axes: Sequence[str] = PLEXUS_AXES,
        layout: Sequence[str] | None = None,
    ) -> ProcessGrid:
        """Parse ``"2x2x2"`` (sizes in the order of ``axes``) or ``"data=2,row=2"`` (named).

        In the named form, axes left out have size 1. ``layout`` defaults to the Plexus layout
        for the ``x, y, z`` axes and to the order of ``axes`` otherwise.
        """
        axes = tuple(axes)
        if layout is None:
            layout = PLEXUS_LAYOUT if axes == PLEXUS_AXES else axes
        text = text.strip().replace(" ", "")
        hint = f"expected e.g. '{'x'.join('2' for _ in axes)}' or '{axes[0]}=2,{axes[-1]}=2'"
        if "=" in text:
            shape = dict.fromkeys(axes, 1)
            seen = set()
            for item in filter(None, text.split(",")):
                name, sep, value = item.partition("=")
                if not sep or name not in shape:
                    raise ValueError(f"grid {text!r}: unknown axis {name!r}; axes are {axes}")
                if name in seen:
                    raise ValueError(f"grid {text!r}: axis {name!r} given twice")
                seen.add(name)
                shape[name] = _parse_size(value, text, hint)
        else:
            parts = text.lower().split("x")
            if len(parts) != len(axes):
                raise ValueError(
                    f"grid {text!r} has {len(parts)} sizes but the grid has {len(axes)} axes "
                    f"{axes}; {hint}"
                )
            shape = {name: _parse_size(v, text, hint) for name, v in zip(axes, parts)}
        return cls(shape, layout=tuple(layout))

    # ----------------------------------------------------------------- arithmetic
    @property
    def axes(self) -> tuple[str, ...]:
        """Axis names in display order."""
        return tuple(self.shape)

    @property
    def num_ranks(self) -> int:
        return math.prod(self.shape.values())

    def size(self, axis: str) -> int:
        return self.shape[self._check_axis(axis)]

    def stride(self, axis: str) -> int:
        """Rank distance between neighbours along ``axis``."""
        self._check_axis(axis)
        pos = self.layout.index(axis)
        return math.prod(self.shape[a] for a in self.layout[pos + 1 :])

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank``, keyed by axis name in display order."""
        self._check_rank(rank)
        return {a: (rank // self.stride(a)) % self.shape[a] for a in self.axes}

    def rank(self, coords: Mapping[str, int] | None = None, **kw: int) -> int:
        """Rank of a coordinate; missing axes count as 0."""
        coords = {**(coords or {}), **kw}
        total = 0
        for a, c in coords.items():
            self._check_axis(a)
            if not 0 <= c < self.shape[a]:
                raise ValueError(f"coordinate {a}={c} outside [0, {self.shape[a]})")
            total += c * self.stride(a)
        return total

    def axis_ranks(self, rank: int, axes: str | Iterable[str]) -> list[int]:
        """Ranks sharing all coordinates of ``rank`` except those on ``axes``, sorted.

        The group's local rank of a member is its index in this list.
        """
        axes = self._axis_tuple(axes)
        base = self.coords(rank)
        for a in axes:
            base[a] = 0
        start = self.rank(base)
        offsets = [0]
        for a in axes:
            offsets = [o + c * self.stride(a) for o in offsets for c in range(self.shape[a])]
        return sorted(start + o for o in offsets)

    def groups(self, axes: str | Iterable[str]) -> list[list[int]]:
        """Every group along ``axes``, in a fixed order (by smallest member rank)."""
        axes = self._axis_tuple(axes)
        others = [a for a in self.axes if a not in axes]
        out = []
        for combo in itertools.product(*(range(self.shape[a]) for a in others)):
            out.append(self.axis_ranks(self.rank(dict(zip(others, combo))), axes))
        return sorted(out)

    def validate(self, world_size: int) -> None:
        """Raise ValueError, showing the arithmetic, unless the grid has ``world_size`` ranks.

        The world-size-only case of :meth:`check`.
        """
        self.check(world_size)

    def check(self, world_size: int, *constraints: Constraint) -> None:
        """Raise one ValueError listing every problem of this grid, with its arithmetic.

        Args:
            world_size: the number of processes launched; the sizes must multiply to it.
            constraints: functions ``shape -> list of problem sentences`` (``[]`` when the
                shape is fine), e.g. a workload's ``grid_problems``.

        Example message::

            grid data=2,depth=1,row=4,col=1: heads: num_heads=6 % row=4 = 2
        """
        problems: list[str] = []
        for constraint in constraints:
            problems += constraint(dict(self.shape))
        named = ",".join(f"{a}={s}" for a, s in self.shape.items())
        if self.num_ranks != world_size:
            product = " * ".join(f"{a}={s}" for a, s in self.shape.items())
            message = (f"grid {product} = {self.num_ranks} ranks, but {world_size} processes "
                       f"were launched; pass a grid whose sizes multiply to {world_size}")
            if problems:
                message += f"; and grid {named}: " + "; ".join(problems)
            raise ValueError(message)
        if problems:
            raise ValueError(f"grid {named}: " + "; ".join(problems))

    def __str__(self) -> str:
        if self.axes == PLEXUS_AXES:
            return "x".join(str(s) for s in self.shape.values())
        return ",".join(f"{a}={s}" for a, s in self.shape.items())

    # ----------------------------------------------------------------- groups (collective)
    def create_groups(
        self, rank: int, axis_sets: Iterable[str | Iterable[str]] | None = None, *,
        transport: Any = _NO_TRANSPORT, **pg_kwargs: Any
    ) -> dict[str, AxisGroup]:
        """Create process groups for each axis (or set of axes); collective over the world.

        The usual call is :meth:`common.dist.DistContext.create_groups` (``ctx.create_groups(
        grid)``), which passes the job's transport; this form is for code handed a rank and a
        transport rather than the context. Pass ``transport``: leaving it out sends CPU tensors
        through gloo under mpiexec, milliseconds per small collective where MPI takes
        microseconds (:mod:`common.mpi`). The first releases' call without it
        (``grid.create_groups(ctx.rank)``) still works as it did then (torch.distributed groups
        only), with a DeprecationWarning that names the call to use.

        Every rank must call this with the same arguments: for each axis set, in the given
        order, it creates every group along that set (in :meth:`groups` order) and keeps the
        one containing ``rank``. Groups of size 1 get no ``torch.distributed`` group (they
        need no communication).

        Args:
            rank: this process's global rank.
            axis_sets: axes or tuples of axes; default: each single axis.
            transport: the job's :class:`~common.mpi.MPITransport` (``DistContext.transport``):
                each group also gets an MPI communicator, which CPU tensors then use; or None
                where the job has none (``torch.distributed`` groups only).
            pg_kwargs: forwarded to ``torch.distributed.new_group`` (e.g. ``timeout``).

        Returns:
            name -> :class:`AxisGroup`, where the name of a set is its axes joined by ``+``.

        Raises:
            ValueError: the grid does not have the ranks of the running ``torch.distributed``
                job (:meth:`check`), on every rank before any group is created: a rank outside a
                smaller grid would fail alone and leave the ranks inside waiting for it.
        """
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            self.check(dist.get_world_size())

        if transport is _NO_TRANSPORT:
            warnings.warn("ProcessGrid.create_groups(rank) without transport= is deprecated "
                          "and makes torch.distributed groups only (gloo for CPU tensors, even "
                          "under mpiexec): call ctx.create_groups(grid) with the context of "
                          "common.dist.init_distributed, or pass transport=ctx.transport",
                          DeprecationWarning, stacklevel=2)
            transport = None
        if axis_sets is None:
            axis_sets = self.axes
        out: dict[str, AxisGroup] = {}
        for axes in axis_sets:
            axes = self._axis_tuple(axes)
            name = "+".join(axes)
            mine = self.axis_ranks(rank, axes)
            pg = None
            if len(mine) > 1:
                for members in self.groups(axes):
                    group = dist.new_group(members, **pg_kwargs)
                    if members == mine:
                        pg = group
            mpi = transport.split(self.groups(axes)) if transport is not None else None
            out[name] = AxisGroup(name, pg, len(mine), mine.index(rank), tuple(mine), mpi)
        return out

    # ----------------------------------------------------------------- helpers
    def _check_axis(self, axis: str) -> str:
        if axis not in self.shape:
            raise ValueError(f"unknown grid axis {axis!r}; axes are {self.axes}")
        return axis

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank {rank} outside grid of {self.num_ranks} ranks")

    def _axis_tuple(self, axes: str | Iterable[str]) -> tuple[str, ...]:
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        for a in axes:
            self._check_axis(a)
        if len(set(axes)) != len(axes):
            raise ValueError(f"axis set {axes} repeats an axis")
        return axes


@dataclass(frozen=True)
class AxisGroup:
    """One process group along a grid axis (or set of axes), as seen by one rank.

    Attributes:
        name: axis name (``"x"``, ``"row"``, ``"x+y"``) used in logs and byte accounting.
        group: the ``torch.distributed`` group, or ``None`` when ``size == 1``.
        size: number of ranks in the group.
        rank: this rank's index in the group (its coordinate along the axis).
        members: global ranks of the group, in group-rank order.
        mpi: the group's :class:`~common.mpi.MPIGroup` (CPU tensors go through MPI), or
            ``None`` (no MPI transport, or ``size == 1``).
        wire: the dtype that float32 messages travel in over this group (``torch.bfloat16``:
            half the bytes; sums add in float32, :mod:`common.collectives`), or ``None``: as
            they are. :meth:`on_wire` gives a view of the group with another one.
    """

    name: str
    group: Any
    size: int
    rank: int
    members: tuple[int, ...] = ()
    mpi: Any = None
    wire: Any = None

    def on_wire(self, dtype: Any) -> AxisGroup:
        """This group, its float32 messages moved in ``dtype``: ``torch.bfloat16``, or None
        (as they are)."""
        if dtype is not None and str(dtype) != "torch.bfloat16":
            raise ValueError(f"messages can travel as torch.bfloat16 or as they are (None), "
                             f"not as {dtype}")
        return dataclasses.replace(self, wire=dtype)


def _parse_size(value: str, text: str, hint: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"grid {text!r}: {value!r} is not a positive integer size; {hint}")
    return int(value)
