"""The model against the Plexus paper's measurements (docs/design/plexus-3d.md
section 8, docs/design/perf-model.md).

Ranjan et al., "Plexus: Taming Billion-edge Graphs with 3D Parallel Full-graph GNN Training",
SC'25 (arXiv 2505.04083). Times are ms per epoch read off the paper's figures. The predictions
model the paper's setting: its code trains the input features (``learn_features``: a gradient
flows back to ``F_0`` with its collectives, and ``H_0`` cannot be cached), 3 layers, hidden 128,
on the shipped profiles ``perlmutter-a100`` (A100 numbers) and ``frontier-mi250x`` (MI250X
numbers), made of published hardware figures and stated efficiencies (see their ``sources``).
Nothing here is fitted to the paper's numbers.

Checks (:func:`problems`):

* every bounded number (ogbn-products and ogbn-papers100M on Perlmutter) within
  ``BOUND = 1.5x`` of the paper: ``1/1.5 <= predicted / paper <= 1.5``;
* ogbn-products on 64 GPUs: best 3D < best 2D < best 1D (paper: 69 / 82 / 180 ms).

Numbers the model expresses but that are not bounded (another machine, another dataset) are
printed with their ratio too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from common.perf.gcn import GCNWorkload, ogbn_papers100m, ogbn_products, plan_gcn
from common.perf.machine import MachineProfile, load_profile
from common.perf.model import Prediction

BOUND = 1.5
PERLMUTTER, FRONTIER = "perlmutter-a100", "frontier-mi250x"


def reddit(**kw: Any) -> GCNWorkload:
    """Reddit (PyG): 232,965 nodes, 114,615,892 directed edges + 232,965 self-loops, 602
    features, 41 classes."""
    return GCNWorkload(name="reddit", num_nodes=232_965, nnz=114_848_857, num_features=602,
                       num_classes=41, **kw)


DATASETS: dict[str, Callable[..., GCNWorkload]] = {
    "ogbn-products": ogbn_products, "ogbn-papers100M": ogbn_papers100m, "reddit": reddit}


@dataclass(frozen=True)
class PaperNumber:
    """One epoch time of the paper.

    Attributes:
        dataset: a key of :data:`DATASETS`.
        machine: the profile of the paper's machine.
        gpus: ranks (GPUs or GCDs).
        paper_ms: the paper's ms per epoch.
        dims: compare with the best grid with this many axes > 1 (3D, 2D, 1D); None: the
            best grid.
        bounded: part of the ``BOUND`` check.
    """

    dataset: str
    machine: str
    gpus: int
    paper_ms: float
    dims: int | None = None
    bounded: bool = True

    def label(self) -> str:
        grid = "best grid" if self.dims is None else f"best {self.dims}D"
        return f"{self.dataset}, {self.gpus} {self.machine.split('-')[1].upper()}, {grid}"


PAPER_NUMBERS: tuple[PaperNumber, ...] = (
    PaperNumber("ogbn-products", PERLMUTTER, 4, 155.0),
    PaperNumber("ogbn-products", PERLMUTTER, 64, 69.0, dims=3),
    PaperNumber("ogbn-products", PERLMUTTER, 64, 82.0, dims=2),
    PaperNumber("ogbn-products", PERLMUTTER, 64, 180.0, dims=1),
    PaperNumber("ogbn-products", PERLMUTTER, 512, 25.0),
    *(PaperNumber("ogbn-papers100M", PERLMUTTER, g, ms) for g, ms in
      ((64, 2784.0), (128, 1894.0), (256, 1358.0), (512, 933.0), (1024, 640.0),
       (2048, 536.0))),
    PaperNumber("ogbn-papers100M", FRONTIER, 2048, 767.0),
    PaperNumber("reddit", PERLMUTTER, 4, 130.0, bounded=False),
    PaperNumber("reddit", PERLMUTTER, 128, 17.7, bounded=False),
)


def paper_workload(dataset: str) -> GCNWorkload:
    """The paper's set-up on ``dataset``: trainable input features, 3 layers, hidden 128, the
    last layer on every row (its code has no training mask), collectives not overlapped (its
    blocked aggregation is an option the tables do not say was on)."""
    return DATASETS[dataset](learn_features=True, cache_first_aggregation=False, num_layers=3,
                             hidden=128, labelled_rows_only=False, overlap=False)


@dataclass
class Comparison:
    """A paper number and the prediction it is compared with."""

    number: PaperNumber
    prediction: Prediction

    @property
    def predicted_ms(self) -> float:
        return 1e3 * self.prediction.total_s

    @property
    def ratio(self) -> float:
        """predicted / paper."""
        return self.predicted_ms / self.number.paper_ms

    @property
    def within(self) -> bool:
        return 1 / BOUND <= self.ratio <= BOUND


def compare(machines: Mapping[str, MachineProfile] | None = None) -> list[Comparison]:
    """Predictions for every :data:`PAPER_NUMBERS` entry.

    Args:
        machines: profile name -> profile to use instead of the shipped one (e.g. a
            measured Perlmutter profile under ``"perlmutter-a100"``).
    """
    profiles = dict(machines or {})
    plans: dict[tuple[str, str, int], list[Prediction]] = {}
    out = []
    for num in PAPER_NUMBERS:
        key = (num.dataset, num.machine, num.gpus)
        if key not in plans:
            machine = profiles.setdefault(num.machine, load_profile(num.machine))
            plans[key] = plan_gcn(paper_workload(num.dataset), num.gpus, machine).runnable
        runnable = [p for p in plans[key] if num.dims in (None, p.dims)]
        if not runnable:
            raise ValueError(f"{num.label()}: no grid fits in memory on {num.machine}")
        out.append(Comparison(num, runnable[0]))
    return out


def problems(comparisons: list[Comparison]) -> list[str]:
    """Why the check fails (empty: it passes): bounded numbers off by more than ``BOUND``, or
    ogbn-products on 64 GPUs not ranking best 3D < best 2D < best 1D."""
    out = [f"{c.number.label()}: predicted {c.predicted_ms:.1f} ms vs paper "
           f"{c.number.paper_ms:g} ms, ratio {c.ratio:.2f} outside [{1 / BOUND:.2f}, {BOUND}]"
           for c in comparisons if c.number.bounded and not c.within]
    best = {d: c.predicted_ms for d, c in products_by_dims(comparisons).items()}
    if not best.get(3, 0) < best.get(2, 0) < best.get(1, 0):
        out.append(f"ogbn-products, 64 GPUs: best 3D < 2D < 1D violated (ms {best})")
    return out


def products_by_dims(comparisons: list[Comparison]) -> dict[int, Comparison]:
    """The ogbn-products 64-GPU comparisons by grid dimensionality (3, 2, 1)."""
    return {c.number.dims: c for c in comparisons
            if c.number.dataset == "ogbn-products" and c.number.gpus == 64 and c.number.dims}


def table(comparisons: list[Comparison]) -> str:
    """One line per paper number: grid, prediction split, paper, ratio."""
    lines = [f"{'paper number':<40}{'grid':<10}{'pred ms':>9}{'compute':>9}{'comm':>8}"
             f"{'GiB':>6}{'paper ms':>10}{'pred/paper':>11}  bounded"]
    for c in comparisons:
        p = c.prediction
        lines.append(f"{c.number.label():<40}{p.label():<10}{c.predicted_ms:>9.1f}"
                     f"{1e3 * p.compute_s:>9.1f}{1e3 * p.comm_s:>8.1f}{p.memory / 2**30:>6.1f}"
                     f"{c.number.paper_ms:>10g}{c.ratio:>11.2f}  "
                     + ("yes" if c.number.bounded else "no"))
    b = products_by_dims(comparisons)
    if len(b) == 3:
        lines.append("ogbn-products, 64 GPUs: " + ", ".join(
            f"{d}D/3D {b[d].predicted_ms / b[3].predicted_ms:.2f} (paper "
            f"{b[d].number.paper_ms / b[3].number.paper_ms:.2f})" for d in (2, 1)))
    return "\n".join(lines)
