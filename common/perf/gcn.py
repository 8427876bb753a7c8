"""Performance model of one Plexus 3D GCN epoch (docs/design/plexus-3d.md sections 2-4,
docs/design/perf-model.md).

Grid ``X x Y x Z``; layer ``l`` gives the axes the roles (O, I, P) = (x, y, z), (z, x, y),
(y, z, x) for ``l % 3 = 0, 1, 2``. With ``N`` nodes and widths ``D_l`` padded exactly as
:mod:`plexus.layout` pads them, a rank of layer ``l`` holds
``A_l [N/P, N/O]`` (``nnz / (P O)`` nonzeros), ``F_l [N/O, D_l/I]``, ``W_l [D_l/I, D_l+1/O]``
(flattened, ``1/P`` of it), ``H_l [N/P, D_l/I]`` and ``Q_l [N/P, D_l+1/O]``.

Collectives per layer (``M`` = full bytes, float32; a flat shard is padded to a multiple of
``P`` elements): (1) all-gather F over P (layer 0), (2) all-reduce H over O, (3) all-gather W
over P, (4) all-reduce Q over I, (5) all-gather W over P, (6) reduce-scatter dW over P,
(7) all-reduce dH over O, (8) all-reduce dF over P (layers >= 1) or reduce-scatter (layer 0,
trainable features). GraphSAGE (``model="sage"``) also aggregates the root term ``R = S F``
with the permuted identity ``S`` (about ``N / (P O)`` nonzeros per block) and multiplies it by
a second weight: (2), (3), (5), (6) and (7) run twice; (1), (4) and (8) once.

With fixed features ``H_0`` is cached after the first epoch, so a steady
epoch skips (1), (2) and the layer-0 SpMM, and nothing flows back into layer 0's aggregation:
(5), (7), (8) and the SpMM with ``A_0^T`` are skipped too. The trainer adds the sharded loss
(plexus/loss.py): three all-reduces of ``[R]`` over O and one scalar over P. An epoch is the
training step the trainer times (``epoch_s``), of the paper's bare model (no bias, dropout or
norm); the evaluation forward after it (``eval_s``) is not modelled.

The last layer computes only the ``R`` output rows of labelled nodes when at most half the
nodes are labelled (:func:`labelled_rows_pay`, as plexus.model does): its SpMM reads those
rows of ``A`` (about ``R / (N/P)`` of the block's nonzeros), its ``H``, ``Q`` and the loss
are ``R`` rows, and the gathered rows and their transpose are kept beside the full block.
``R = round(labelled_fraction * num_nodes / P)``, the mean over the ranks; otherwise
``R = N/P``.

Compute per rank:

* SpMM is memory-bound (docs/design/perf-model.md): ``bytes = nnz (b_idx + 4) + (rows + 1) b_idx
  + nnz * ceil(4 D / line) line + rows * 4 D``, time = bytes / spmm_bandwidth. The gathered
  row is rounded up to the cache line or sector, the shape penalty that makes narrow (tall and
  skinny) dense operands slow per flop.
* GEMM ``[m, k] @ [k, n]``: roofline ``max(2 m k n / flops, 4 (m k + k n + m n) / mem_bw)``.
* A layer that multiplies first (:func:`weight_first_pays`, ``Q = A (F' W)``): its SpMMs, both
  passes, gather ``D_l+1/O``-wide float32 rows, and its GEMMs run over the ``N/O`` rows of
  ``F'`` (the same as ``N/P`` on one rank).
* Elementwise: ReLU forward/backward, the out-of-place copy of each all-reduce, the loss and
  AdamW, as bytes / memory bandwidth.

Memory per rank: :mod:`common.perf.gcn_memory` (persistent shards, what each layer keeps for
backward, and the largest set of short-lived tensors of the step, phase by phase).

``precision="bf16"`` (plexus.train --precision bf16, docs/design/plexus-3d.md section 11): the
feature shard, its all-gather (1), the layer-0 SpMM's gathered rows, the kept ``H_l``, the
norm's kept input and the cached ``H_0`` take 2 bytes an element; every all-reduce, the
weights, their gathers, gradients and AdamW state, the logits and the other layers' SpMM
operands stay float32. Pure Python.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from common.grid import ProcessGrid, ceil_div, round_up
from common.perf.gcn_memory import RECOMPUTE_BLOCKS as RECOMPUTE_BLOCKS  # re-exported
from common.perf.gcn_memory import gcn_memory
from common.perf.gcn_memory import gcn_memory_parts as gcn_memory_parts  # re-exported
from common.perf.gcn_memory import gcn_memory_phases as gcn_memory_phases  # re-exported
from common.perf.machine import MachineProfile
from common.perf.model import (
    Collective,
    Plan,
    Prediction,
    bytes_by_axis,
    comm_seconds,
    factorizations,
    group_stride,
    rank_predictions,
)

AXES: tuple[str, ...] = ("x", "y", "z")
LABELLED_ROWS_MAX_SHARE = 0.5  # labelled_rows_pay: above it the gathered rows cost more
ROLES: tuple[tuple[str, str, str], ...] = (("x", "y", "z"), ("z", "x", "y"), ("y", "z", "x"))
F32 = 4
PRECISIONS = ("fp32", "bf16")


def roles(layer: int) -> tuple[str, str, str]:
    """(outer, inner, depth) axes of ``layer`` (same rotation as plexus.layout.roles)."""
    return ROLES[layer % 3]


def labelled_rows_pay(labelled_fraction: float, option: bool | None = None) -> bool:
    """Whether the last layer runs on the labelled rows only (plexus.model.PlexusGCN's
    ``labelled_rows_only``): ``option`` when given, else when at most
    :data:`LABELLED_ROWS_MAX_SHARE` of the nodes are labelled. Gathering the labelled rows of
    the last layer's block copies ``labelled_fraction`` of it (twice, with the transpose),
    which near 1 costs more memory than the skipped rows of H and the logits save."""
    return labelled_fraction <= LABELLED_ROWS_MAX_SHARE if option is None else option


def weight_first_pays(sizes: Sequence[int], d_in: int, d_out: int, *,
                      fixed_first: bool = False, rows_only: bool = False,
                      option: bool | None = None) -> bool:
    """Whether a layer multiplies by its weight before it aggregates, ``Q = A (F' W)``
    (plexus.model.PlexusGCN's ``weight_first``; docs/design/plexus-3d.md section 12).

    ``sizes``: the layer's (O, I, P) group sizes; ``d_in``, ``d_out``: its padded widths;
    ``fixed_first``: layer 0 with fixed input features (its ``H_0`` is cached or recomputed,
    so it aggregates first); ``rows_only``: the last layer on labelled rows only (weight first
    would multiply every row and keep ``F'`` of every row for a few output rows).

    The order is a local choice only where O and I are 1: ``F'`` then holds whole rows and
    whole columns, ``F' W`` needs no sum over I and its rows are the columns ``A`` reads. The
    SpMMs (forward and backward) then run ``d_out`` wide instead of ``d_in``. With P > 1 every
    P rank would multiply all ``N`` rows and keep ``F' [N, d_in]`` (P times ``H``), so the
    default (``option`` None) takes it where O, I and P are 1 and the layer narrows
    (``d_out < d_in``); True takes it wherever O and I are 1; False never.
    """
    o_size, i_size, p_size = sizes
    if option is False or fixed_first or rows_only or o_size > 1 or i_size > 1:
        return False
    return option is True or (p_size == 1 and d_out < d_in)


AGGREGATION_BLOCKS = 4  # row blocks of an overlapped aggregation (plexus.ops.BlockedAggregation)


def overlap_pays(shape: Mapping[str, int], option: bool | None = None, *,
                 comm_offloaded: bool = True) -> bool:
    """Whether plexus overlaps its aggregation all-reduces (2), (7) and weight all-gathers
    (3) with the SpMM (plexus.model.PlexusGCN's ``overlap``): ``option`` when given, else
    when some axis has more than one rank (a layer has a collective to hide) and
    ``comm_offloaded``: the communication runs on resources the compute does not need (a GPU's
    NCCL, a NIC, or a spare core per rank for the MPI transport's communication thread). With
    one core per rank the thread's shared-memory copies take the compute's core: on the 2-core
    development machine, 2 ranks on R-MAT scale 16 waited 16-19% of the epoch with overlap and
    21-27% without, and the epoch was not faster (docs/benchmarks.md).
    :func:`overlap_hidden_seconds` is what it hides."""
    if option is not None:
        return option
    return comm_offloaded and any(size > 1 for size in shape.values())


def comm_offloaded(machine: MachineProfile, node_ranks: int) -> bool:
    """Whether ``machine``'s collectives leave the compute's cores alone at ``node_ranks``
    ranks per node: a GPU profile, or a CPU one with at least two cores per rank."""
    if machine.device_memory is not None:
        return True
    return machine.cores_per_node is not None and machine.cores_per_node >= 2 * node_ranks


@dataclass(frozen=True, kw_only=True)
class GCNWorkload:
    """A full-graph GCN training run, as the model sees it.

    Attributes:
        name: label for tables.
        model: ``gcn`` or ``sage`` (GraphSAGE: a root term beside the mean aggregation).
        num_nodes: N.
        nnz: nonzeros of the normalised adjacency, self-loops included.
        num_features, num_classes: D_0 and C.
        num_layers, hidden: L and the hidden width.
        learn_features: trainable input features (every collective runs every epoch).
        cache_first_aggregation: reuse ``H_0`` across epochs when features are fixed (our
            trainer does without dropout; the paper's code recomputes it, so its check sets
            this False).
        dropout: the dropout rate (memory only: its keep-masks are kept for backward).
        imbalance: max/mean nonzeros per adjacency block (about 1 with the double
            permutation); scales the SpMM time of the slowest rank.
        index_bytes: CSR index width; None picks int32 when it fits, as plexus.data.shard does.
        labelled_fraction: share of the nodes in a split (train, val or test): 1.0 for
            ogbn-products, 0.014 for ogbn-papers100M.
        labelled_rows_only: the model's option of that name (None: :func:`labelled_rows_pay`
            decides from ``labelled_fraction``).
        overlap: the model's option of that name (None: :func:`overlap_pays` decides from
            the grid); :func:`overlap_hidden_seconds` is what it hides.
        norm: ``none``, ``batch`` or ``layer`` after every hidden layer: per hidden layer
            batch norm all-reduces two column statistics ``[D/O]`` over P forward and both
            gradient sums in one call backward, in 22 elementwise passes over Q (layer norm:
            two row statistics ``[N/P]`` over O in each pass and the affine gradients over P,
            in about 45 passes); Q kept for backward.
        precision: ``fp32`` or ``bf16`` (the model's option of that name: the input features,
            their all-gather and the activations kept for backward in 2 bytes; see the module
            docstring). bf16 cannot learn the features.
        recompute_first: the model's option of that name: with fixed features and dropout,
            ``H_0`` is not kept but recomputed in backward (:attr:`recomputes_first`): the
            layer-0 SpMM, (1) and (2) run twice.
        weight_first: the model's option of that name (None: :func:`weight_first_pays`
            decides per layer; :meth:`weight_first_layer`): ``Q = A (F' W)``, the SpMMs
            ``D_l+1`` wide, ``F'`` kept instead of ``H``.
    """

    name: str = "graph"
    model: str = "gcn"
    num_nodes: int
    nnz: int
    num_features: int
    num_classes: int
    num_layers: int = 3
    hidden: int = 128
    learn_features: bool = False
    cache_first_aggregation: bool = True
    dropout: float = 0.0
    imbalance: float = 1.0
    index_bytes: int | None = None
    labelled_fraction: float = 1.0
    labelled_rows_only: bool | None = None
    overlap: bool | None = None
    norm: str = "none"
    precision: str = "fp32"
    recompute_first: bool = True
    weight_first: bool | None = None

    def __post_init__(self) -> None:
        for f in ("num_nodes", "nnz", "num_features", "num_classes", "num_layers", "hidden"):
            if getattr(self, f) < 1:
                raise ValueError(f"GCNWorkload.{f} must be >= 1, got {getattr(self, f)}")
        if self.model not in ("gcn", "sage"):
            raise ValueError(f"GCNWorkload.model must be gcn or sage, got {self.model!r}")
        if self.imbalance < 1:
            raise ValueError(f"imbalance is max/mean nonzeros, >= 1; got {self.imbalance}")
        if self.norm not in ("none", "batch", "layer"):
            raise ValueError(f"GCNWorkload.norm must be none, batch or layer, got {self.norm!r}")
        if self.index_bytes not in (None, 4, 8):
            raise ValueError(f"index_bytes must be 4, 8 or None, got {self.index_bytes}")
        if not 0 <= self.labelled_fraction <= 1:
            raise ValueError(f"labelled_fraction is a share of the nodes, in [0, 1]; got "
                             f"{self.labelled_fraction}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"GCNWorkload.precision must be one of {PRECISIONS}, got "
                             f"{self.precision!r}")
        if self.precision == "bf16" and self.learn_features:
            raise ValueError("GCNWorkload: precision 'bf16' cannot learn the features "
                             "(plexus keeps them in bf16)")

    @property
    def stored_bytes(self) -> int:
        """Bytes of an element of the features and of the activations kept for backward: 2
        in bf16, 4 in float32."""
        return 2 if self.precision == "bf16" else F32

    @property
    def recomputes_first(self) -> bool:
        """Whether a training step recomputes ``H_0`` in backward instead of keeping it
        (plexus.model.PlexusGCN's ``recompute_first``): fixed features with dropout, and
        layer 0 over every row (not a one-layer model on labelled rows only)."""
        return (self.recompute_first and not self.learn_features and self.dropout > 0
                and (self.num_layers > 1 or not labelled_rows_pay(self.labelled_fraction,
                                                                  self.labelled_rows_only)))

    @property
    def widths(self) -> list[int]:
        """``[D_0, hidden, ..., C]``."""
        return [self.num_features] + [self.hidden] * (self.num_layers - 1) + [self.num_classes]

    def padded(self, shape: Mapping[str, int]) -> tuple[int, list[int]]:
        """(padded N, padded widths), as plexus.layout.padded_num_nodes/padded_widths."""
        n = round_up(self.num_nodes, math.lcm(*shape.values()))
        w = self.widths
        out = [round_up(d, shape[roles(layer)[1]]) for layer, d in enumerate(w[:-1])]
        out.append(round_up(w[-1], shape[roles(len(w) - 2)[0]]))
        return n, out

    def grid_problems(self, shape: Mapping[str, int]) -> list[str]:
        """Problems of running on ``shape``: none; every X x Y x Z grid pads what it needs
        (the same interface as :meth:`common.perf.gpt.GPTWorkload.grid_problems`)."""
        return []

    @property
    def terms(self) -> int:
        """Aggregations (and weights) per layer: 1 for GCN, 2 for GraphSAGE (mean + root)."""
        return 2 if self.model == "sage" else 1

    def output_rows(self, shape: Mapping[str, int]) -> int:
        """R, the last layer's output rows per rank: the labelled ones when
        :func:`labelled_rows_pay`, else all ``N/P`` (padded)."""
        n, _ = self.padded(shape)
        num_p = shape[roles(self.num_layers - 1)[2]]
        if not labelled_rows_pay(self.labelled_fraction, self.labelled_rows_only):
            return n // num_p
        return min(n // num_p, round(self.labelled_fraction * self.num_nodes / num_p))

    def axes(self, layer: int) -> tuple[str, str, str]:
        """(outer, inner, depth) axes of ``layer``: :func:`roles`."""
        return roles(layer)

    def index_width(self) -> int:
        if self.index_bytes is not None:
            return self.index_bytes
        return 4 if max(self.nnz, self.num_nodes) < 2**31 else 8

    def weight_first_layer(self, layer: int, shape: Mapping[str, int]) -> bool:
        """Whether ``layer`` multiplies before it aggregates on ``shape`` (as plexus.model
        decides it: :func:`weight_first_pays` on the padded widths)."""
        _, w = self.padded(shape)
        last = self.num_layers - 1
        return weight_first_pays(
            tuple(shape[ax] for ax in roles(layer)), w[layer], w[layer + 1],
            fixed_first=layer == 0 and not self.learn_features,
            rows_only=layer == last and labelled_rows_pay(self.labelled_fraction,
                                                          self.labelled_rows_only),
            option=self.weight_first)

    def _runs(self, layer: int, first_epoch: bool) -> tuple[bool, bool]:
        """(forward aggregation runs, gradient flows back through the aggregation)."""
        if layer > 0 or self.learn_features:
            return True, True
        return first_epoch or not self.cache_first_aggregation, False


def ogbn_products(**kw: Any) -> GCNWorkload:
    """ogbn-products: 2,449,029 nodes, 126,167,053 nonzeros with self-loops, 100 features,
    47 classes; 3 layers, hidden 128 (the Plexus paper's set-up, docs/design/plexus-3d.md
    section 8)."""
    return GCNWorkload(name="ogbn-products", num_nodes=2_449_029, nnz=126_167_053,
                       num_features=100, num_classes=47, **kw)


def ogbn_papers100m(**kw: Any) -> GCNWorkload:
    """ogbn-papers100M: 111,059,956 nodes, 1,726,745,828 nonzeros, 128 features, 172 classes;
    1,546,782 nodes (1.4%) in the train, valid and test splits."""
    kw.setdefault("labelled_fraction", 1_546_782 / 111_059_956)
    return GCNWorkload(name="ogbn-papers100M", num_nodes=111_059_956, nnz=1_726_745_828,
                       num_features=128, num_classes=172, **kw)


def gcn_collectives(work: GCNWorkload, shape: Mapping[str, int], *, first_epoch: bool = False,
                    loss: bool = True) -> list[Collective]:
    """Every collective one rank issues in one epoch (see the module docstring).

    Args:
        work: the workload.
        shape: ``{"x": X, "y": Y, "z": Z}``.
        first_epoch: epoch 1 (computes ``H_0`` even when it is cached afterwards).
        loss: include the trainer's loss collectives.
    """
    n, w = work.padded(shape)
    out: list[Collective] = []
    k = work.terms

    def flat(numel: int, g: int, width: int = F32) -> int:
        return round_up(numel, g) * width

    last_rows = work.output_rows(shape)
    for layer in range(work.num_layers):
        o, i, p = roles(layer)
        O, I, P = shape[o], shape[i], shape[p]  # noqa: N806 - the paper's names
        f_block = (n // O) * (w[layer] // I)
        w_flat = flat((w[layer] // I) * (w[layer + 1] // O), P)
        rows = last_rows if layer == work.num_layers - 1 else n // P
        h_bytes = rows * (w[layer] // I) * F32
        q_bytes = rows * (w[layer + 1] // O) * F32
        forward, backward = work._runs(layer, first_epoch)
        again = 2 if layer == 0 and work.recomputes_first else 1  # H_0 recomputed backward
        if layer == 0 and forward:
            out.append(Collective(p, "all_gather", flat(f_block, P, work.stored_bytes),
                                  count=again))  # (1)
        if forward:
            out.append(Collective(o, "all_reduce", h_bytes, count=k * again))  # (2)
        out.append(Collective(p, "all_gather", w_flat, count=k))  # (3)
        out.append(Collective(i, "all_reduce", q_bytes))  # (4)
        if backward:
            out.append(Collective(p, "all_gather", w_flat, count=k))  # (5)
        out.append(Collective(p, "reduce_scatter", w_flat, count=k))  # (6)
        if work.norm != "none" and layer < work.num_layers - 1:
            # mean and variance, both passes; the affine weight and bias are replicated over
            # P and their gradients all-reduced there (plexus.layers)
            affine_bytes = w[layer + 1] // O * F32
            if work.norm == "batch":  # statistics per column, over the rows' axis P: the sum
                # and the sum of squares forward, both gradient sums in one call backward
                out.append(Collective(p, "all_reduce", affine_bytes, count=2))
                out.append(Collective(p, "all_reduce", 2 * affine_bytes))
            else:  # layer norm: statistics per row, over the columns' axis O
                out.append(Collective(o, "all_reduce", rows * F32, count=4))
                out.append(Collective(p, "all_reduce", affine_bytes, count=2))
        if backward:
            out.append(Collective(o, "all_reduce", h_bytes, count=k))  # (7)
            if layer == 0:
                out.append(Collective(p, "reduce_scatter", flat(f_block, P)))  # (8)
            else:
                out.append(Collective(p, "all_reduce", f_block * F32))  # (8)
    if loss:
        o, _, p = roles(work.num_layers - 1)
        out.append(Collective(o, "all_reduce", last_rows * F32, count=3))  # max, sum-exp, target
        out.append(Collective(p, "all_reduce", F32))  # the loss sum
    return out


def spmm_bytes(rows: int, nnz: float, width: int, *, index_bytes: int, cache_line: int,
               x_bytes: int = F32) -> float:
    """Bytes a CSR SpMM ``[rows, *] @ [*, width]`` moves without reuse of the gathered rows
    (of ``x_bytes`` an element: 2 for a bf16 X; the output is float32)."""
    row = ceil_div(width * x_bytes, cache_line) * cache_line
    return nnz * (index_bytes + F32) + (rows + 1) * index_bytes + nnz * row + rows * width * F32


def gemm_seconds(m: int, k: int, n: int, flops: float, memory_bandwidth: float) -> float:
    """Roofline time of a float32 GEMM ``[m, k] @ [k, n]``."""
    return max(2.0 * m * k * n / flops, F32 * (m * k + k * n + m * n) / memory_bandwidth)


def gcn_compute(work: GCNWorkload, shape: Mapping[str, int], machine: MachineProfile, *,
                node_ranks: int, first_epoch: bool = False) -> dict[str, float]:
    """Seconds of SpMM, GEMM and elementwise work of one rank in one epoch."""
    rate = machine.compute_at(node_ranks)
    n, w = work.padded(shape)
    idx, line = work.index_width(), machine.cache_line
    spmm = gemm = moved = 0.0
    params = 0
    last_rows = work.output_rows(shape)
    for layer in range(work.num_layers):
        o, i, p = roles(layer)
        O, I, P = shape[o], shape[i], shape[p]  # noqa: N806
        a, b, rows = w[layer] // I, w[layer + 1] // O, n // P
        kept = 1.0  # share of the block's rows (and so nonzeros) the layer computes
        if layer == work.num_layers - 1:
            kept, rows = last_rows / rows, last_rows
        nnz = kept * work.imbalance * work.nnz / (P * O)
        root = kept * work.num_nodes / (P * O)  # GraphSAGE's S block
        k = work.terms
        forward, backward = work._runs(layer, first_epoch)
        x_bytes = work.stored_bytes if layer == 0 else F32  # F_0 is bf16, later F_l float32
        again = 2 if layer == 0 and work.recomputes_first else 1  # H_0 recomputed backward
        first = work.weight_first_layer(layer, shape)  # A (F' W): the SpMMs b wide, O = I = 1
        spmm_width, x_bytes = (b, F32) if first else (a, x_bytes)
        for blk in [nnz, root][:k]:
            if forward:
                spmm += again * spmm_bytes(rows, blk, spmm_width, index_bytes=idx,
                                           cache_line=line, x_bytes=x_bytes)
                moved += again * 2 * rows * a * F32 * (O > 1)  # copy of H (R), all-reduce
                if work.stored_bytes < F32:  # round H (F') in place, keep a bf16 copy for dW
                    moved += (n // O if first else rows) * a * (3 * F32 + 3 * work.stored_bytes)
            if backward:
                spmm += spmm_bytes(n // O, blk, spmm_width, index_bytes=idx, cache_line=line)
                moved += 2 * rows * a * F32 * (O > 1) + 2 * (n // O) * a * F32 * (P > 1)
        n_gemm = 3 if backward else 2  # Q = H W, dW = H^T dQ, and dH = dQ W^T
        gemm += k * n_gemm * gemm_seconds(n // O if first else rows, a, b, rate.gemm_flops,
                                          rate.memory_bandwidth)
        q = rows * b * F32
        moved += 2 * q * (I > 1)  # copy of Q for its all-reduce
        if layer < work.num_layers - 1:
            moved += 2 * q + 3 * q  # ReLU forward (read, write), backward (read 2, write)
            if work.norm == "batch":  # plexus.layers._RowSplitBatchNorm: 8 passes over
                moved += 22 * q  # the block forward, 14 backward
            elif work.norm == "layer":  # tensor operations under autograd: 16 passes
                moved += 45 * q  # forward, about twice that backward
        params += k * round_up(a * b, P) // P
    o, _, p = roles(work.num_layers - 1)
    moved += 12 * last_rows * (w[-1] // shape[o]) * F32  # loss, softmax, argmax passes
    params += round_up((n // shape["x"]) * (w[0] // shape["y"]), shape["z"]) // shape["z"] * (
        work.learn_features)
    moved += 7 * params * F32  # AdamW: read param, grad, 2 moments; write param, 2 moments
    return {"spmm": spmm / rate.spmm_bandwidth, "gemm": gemm,
            "elementwise": moved / rate.memory_bandwidth}


def overlap_hidden_seconds(work: GCNWorkload, shape: Mapping[str, int],
                           machine: MachineProfile, *, node_ranks: int,
                           first_epoch: bool = False,
                           blocks: int = AGGREGATION_BLOCKS) -> float:
    """Seconds of one epoch's communication that the overlapped aggregation hides
    (plexus.ops.BlockedAggregation, docs/design/plexus-3d.md section 10).

    Per layer and term, with the SpMM times ``s_f`` (forward) and ``s_b`` (backward), the
    all-reduce times ``c2``, ``c7`` over O and the weight all-gather ``c3`` over P, and
    ``k`` row blocks (a two-stage pipeline of equal blocks hides ``(k-1)/k`` of the shorter
    stage): forward ``(k-1)/k min(s_f, c2) + min(c3, s_f / k)`` (the weight travels during
    the first block), backward ``(k-1)/k min(s_b, c7)``. Zero where the model does not
    overlap (:func:`overlap_pays`), and where the collectives need the compute's cores
    (:func:`comm_offloaded`: measured to hide nothing on the 2-core machine)."""
    offloaded = comm_offloaded(machine, node_ranks)
    if not offloaded or not overlap_pays(shape, work.overlap, comm_offloaded=offloaded):
        return 0.0  # (forced on with one core per rank, the thread's copies take the core)
    grid = ProcessGrid.plexus(shape["x"], shape["y"], shape["z"])
    rate = machine.compute_at(node_ranks)
    n, w = work.padded(shape)
    idx, line, k = work.index_width(), machine.cache_line, max(1, blocks)
    last_rows = work.output_rows(shape)

    def coll(op: str, axis: str, nbytes: int) -> float:
        g = shape[axis]
        return 0.0 if g == 1 else machine.collective_time(
            op, nbytes, g, stride=group_stride(grid, axis), node_ranks=node_ranks)

    hidden = 0.0
    for layer in range(work.num_layers):
        o, i, p = roles(layer)
        O, I, P = shape[o], shape[i], shape[p]  # noqa: N806
        a, rows = w[layer] // I, n // P
        kept = 1.0
        if layer == work.num_layers - 1:
            kept, rows = last_rows / rows, last_rows
        forward, backward = work._runs(layer, first_epoch)
        c2 = coll("all_reduce", o, rows * a * F32)
        c3 = coll("all_gather", p, round_up(a * (w[layer + 1] // O), P) * F32)
        for blk in [kept * work.imbalance * work.nnz / (P * O),
                    kept * work.num_nodes / (P * O)][:work.terms]:
            s_f = spmm_bytes(rows, blk, a, index_bytes=idx, cache_line=line) / rate.spmm_bandwidth
            s_b = spmm_bytes(n // O, blk, a, index_bytes=idx,
                             cache_line=line) / rate.spmm_bandwidth
            if forward:  # (a cached H_0 has no aggregation for the weight to hide in)
                hidden += (k - 1) / k * min(s_f, c2) + min(c3, s_f / k)
            if backward:
                hidden += (k - 1) / k * min(s_b, c2)  # (7) moves what (2) moved
    return hidden


def predict_gcn(work: GCNWorkload, shape: Mapping[str, int] | Sequence[int],
                machine: MachineProfile, *, ranks_per_node: int | None = None,
                first_epoch: bool = False) -> Prediction:
    """Predicted epoch of ``work`` on one grid ``{"x": X, "y": Y, "z": Z}``."""
    shape = dict(shape) if isinstance(shape, Mapping) else dict(zip(AXES, shape))
    grid = ProcessGrid.plexus(shape["x"], shape["y"], shape["z"])
    num_ranks = grid.num_ranks
    node_ranks = machine.node_ranks(num_ranks, ranks_per_node)
    colls = gcn_collectives(work, shape, first_epoch=first_epoch)
    return Prediction(
        shape=dict(grid.shape),
        compute=gcn_compute(work, shape, machine, node_ranks=node_ranks,
                            first_epoch=first_epoch),
        comm=comm_seconds(colls, grid, machine, node_ranks),
        comm_bytes=bytes_by_axis(colls, shape),
        memory=gcn_memory(work, shape),
        memory_limit=machine.memory_per_rank(num_ranks, ranks_per_node),
        hidden=overlap_hidden_seconds(work, shape, machine, node_ranks=node_ranks,
                                      first_epoch=first_epoch),
    )


def plan_gcn(work: GCNWorkload, num_ranks: int, machine: MachineProfile, *,
             ranks_per_node: int | None = None, first_epoch: bool = False) -> Plan:
    """Every ``X x Y x Z = num_ranks`` grid, ranked by predicted epoch time."""
    preds = [predict_gcn(work, s, machine, ranks_per_node=ranks_per_node,
                         first_epoch=first_epoch) for s in factorizations(num_ranks, 3)]
    rpn = machine.node_ranks(num_ranks, ranks_per_node)
    title = (f"{work.model.upper()} {work.name}: N={work.num_nodes:,} nnz={work.nnz:,} "
             f"D0={work.num_features} hidden={work.hidden} C={work.num_classes} "
             f"L={work.num_layers} on {num_ranks} ranks ({rpn} per node) of {machine.name}; "
             "per epoch, per rank")
    return rank_predictions(preds, num_ranks, AXES, title)

