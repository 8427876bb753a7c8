"""The model against SAR's published CPU-cluster runs (docs/design/perf-model.md,
docs/benchmarks.md).

SAR (Intel Labs, Sequential Aggregation and Rematerialization; Mostafa, MLSys 2022) trains a
3-layer GraphSAGE, hidden 256, batch normalization between the layers, full-batch on
ogbn-papers100M, on nodes of two 36-core Icelake sockets joined by InfiniBand HDR (200 Gb/s).
Its README (github.com/IntelLabs/SAR) plots, read off the figures: 7.4 / 5.1 / 3.8 s per epoch
on 32 / 64 / 128 nodes, about 95 / 47 / 25 GB peak memory per node (vanilla distributed
training without SAR's rematerialization: 150 / 83 / 50 GB). SAR trains on the symmetrised
graph ("111M nodes, 3.2B edges").

The predictions run our planner on the same model and graph (GraphSAGE, batch norm, hidden
256, 3 layers, fixed features, the last layer on the 1.4% labelled rows) on the shipped
``icelake-hdr200`` profile, built from published hardware figures only (its ``sources``), one
rank per socket: the best grid's epoch time and its memory per node (per rank x ranks per node).
Nothing here is fitted to SAR's numbers, and nothing is bounded: the rows say where we are
predicted to stand.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from common.perf.gcn import GCNWorkload, ogbn_papers100m, plan_gcn
from common.perf.gcn_memory import CUT_BYTES, WIDEN_BYTES, gcn_memory
from common.perf.machine import MachineProfile, load_profile
from common.perf.model import Prediction

PROFILE = "icelake-hdr200"
# ogbn-papers100M made symmetric (OGB's to_symmetric: every edge both ways) plus self-loops
PAPERS_SYMMETRIC_NNZ = 2 * 1_615_685_872 + 111_059_956


@dataclass(frozen=True)
class SARNumber:
    """One SAR measurement: nodes, seconds per epoch, peak GB per node (with SAR and
    without its rematerialization)."""

    nodes: int
    epoch_s: float
    peak_gb: float
    vanilla_peak_gb: float


SAR_NUMBERS: tuple[SARNumber, ...] = (
    SARNumber(32, 7.4, 95.0, 150.0),
    SARNumber(64, 5.1, 47.0, 83.0),
    SARNumber(128, 3.8, 25.0, 50.0),
)


def sar_workload(precision: str = "fp32") -> GCNWorkload:
    """SAR's set-up on ogbn-papers100M as our trainer runs it (``python -m plexus.train
    --dataset ogbn-papers100M --model sage --norm batch --hidden 256 --layers 3 --dropout 0
    --symmetrize --precision PRECISION``)."""
    return dataclasses.replace(ogbn_papers100m(model="sage", num_layers=3, hidden=256,
                                               norm="batch", precision=precision),
                               nnz=PAPERS_SYMMETRIC_NNZ)


@dataclass
class SARComparison:
    """A SAR measurement and our prediction on as many nodes."""

    number: SARNumber
    prediction: Prediction
    ranks_per_node: int
    workload: GCNWorkload

    @property
    def epoch_s(self) -> float:
        return self.prediction.total_s

    @property
    def memory_gb_per_node(self) -> float:
        return self.prediction.memory * self.ranks_per_node / 1e9

    @property
    def time_ratio(self) -> float:
        """ours predicted / SAR measured."""
        return self.epoch_s / self.number.epoch_s

    @property
    def memory_ratio(self) -> float:
        return self.memory_gb_per_node / self.number.peak_gb


def compare_sar(machine: MachineProfile | None = None, *, precision: str = "fp32",
                within_sar_memory: bool = False) -> list[SARComparison]:
    """Our best predicted grid for every :data:`SAR_NUMBERS` entry, in ``precision``;
    ``within_sar_memory``: the fastest grid whose memory per node is at most SAR's (the
    fastest of all where none is)."""
    machine = machine or load_profile(PROFILE)
    rpn = machine.ranks_per_node or 1
    out = []
    for num in SAR_NUMBERS:
        plan = plan_gcn(sar_workload(precision), num.nodes * rpn, machine)
        if not plan.runnable:
            raise ValueError(f"SAR, {num.nodes} nodes: no grid fits in memory on "
                             f"{machine.name}")
        grids = plan.runnable
        if within_sar_memory:
            grids = [p for p in grids if p.memory * rpn / 1e9 <= num.peak_gb] or grids
        out.append(SARComparison(num, grids[0], rpn, sar_workload(precision)))
    return out


def sar_table(rows: list[SARComparison]) -> str:
    """One line per node count: our grid, predicted epoch and split, memory per node, SAR's
    numbers, the ratios."""
    lines = [f"{'nodes':>5} {'ranks':>5}  {'grid':<10}{'ours s':>8}{'compute':>9}{'exposed':>9}"
             f"{'GB/node':>9}{'SAR s':>7}{'SAR GB':>8}{'s ours/SAR':>12}{'GB ours/SAR':>13}"]
    for c in rows:
        p = c.prediction
        lines.append(f"{c.number.nodes:>5} {c.number.nodes * c.ranks_per_node:>5}  "
                     f"{p.label():<10}{c.epoch_s:>8.2f}{p.compute_s:>9.2f}"
                     f"{p.exposed_comm_s:>9.2f}{c.memory_gb_per_node:>9.1f}"
                     f"{c.number.epoch_s:>7.1f}{c.number.peak_gb:>8.0f}{c.time_ratio:>12.2f}"
                     f"{c.memory_ratio:>13.2f}")
    return "\n".join(lines)


# the memory before each saving: (label, index_bytes, stored_transposes, fused_norm,
# cut_bytes (None: the index width), mapped, compact_root, widen_bytes (None: whole))
SAVINGS = (("int64 indices + stored transposes", 8, True, False, None, False, False, None),
           ("int32 indices where a block fits", None, True, False, None, False, False, None),
           ("+ A^T read from A", None, False, False, None, False, False, None),
           ("+ norm and ReLU kernels", None, False, True, None, False, False, None),
           ("+ uint16 plan cuts", None, False, True, CUT_BYTES, False, False, None),
           ("+ last full block unmapped", None, False, True, CUT_BYTES, True, False, None),
           ("+ S without its CSR", None, False, True, CUT_BYTES, True, True, None),
           ("+ dW's copy in row blocks (now)", None, False, True, CUT_BYTES, True, True,
            WIDEN_BYTES))


def savings_table(rows: list[SARComparison]) -> str:
    """Memory per node of each row's best grid as before each saving (:data:`SAVINGS`): what
    int32 indices per block, the transpose read from the block (docs/design/plexus-3d.md
    section 13), the batch norm's kernels (section 11), the column-slice plans' cuts as
    uint16 offsets (plexus.slicing), the last layer's full block given back where it runs
    on the labelled rows (plexus.data.shard.GraphShard.restrict_last_layer), GraphSAGE's
    ``S`` kept as its rows' owners and columns where its rows are exchanged
    (plexus.data.shard.RootBlock) and a bf16 ``H`` widened for ``dW`` a row block at a time
    (common.dense.tn) contribute."""
    widths = [len(label) + 3 for label, *_ in SAVINGS]
    lines = [f"{'nodes':>5}  {'grid':<8}" + "".join(
        f"{label:>{w}}" for (label, *_), w in zip(SAVINGS, widths)) + "   (GB per node)"]
    for c in rows:
        work, shape = c.workload, c.prediction.shape
        gb = [gcn_memory(dataclasses.replace(work, index_bytes=idx, mapped=mapped), shape,
                         stored_transposes=stored, fused_norm=fused, cut_bytes=cut,
                         compact_root=compact, widen_bytes=widen)
              * c.ranks_per_node / 1e9
              for _, idx, stored, fused, cut, mapped, compact, widen in SAVINGS]
        lines.append(f"{c.number.nodes:>5}  {c.prediction.label():<8}"
                     + "".join(f"{v:>{w}.1f}" for v, w in zip(gb, widths)))
    return "\n".join(lines)
