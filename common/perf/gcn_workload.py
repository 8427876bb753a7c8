"""The GCN workload the planner models (:class:`GCNWorkload`, the ogbn presets) and the rules
it shares with plexus.model, so that the model and its prediction decide alike: which layer
runs on the labelled rows only (:func:`labelled_rows_pay`), multiplies by its weight before it
aggregates (:func:`weight_first_pays`) and overlaps its aggregation with its collectives
(:func:`overlap_pays`). The time model is :mod:`common.perf.gcn`, the memory model
:mod:`common.perf.gcn_memory`; the design is docs/design/plexus-3d.md and
docs/design/perf-model.md. Pure Python.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from common.grid import roles, round_up
from common.perf.machine import MachineProfile
from common.precision import ELEMENT_BYTES, PRECISIONS

AXES: tuple[str, ...] = ("x", "y", "z")
LABELLED_ROWS_MAX_SHARE = 0.5  # labelled_rows_pay: above it the gathered rows cost more
F32 = ELEMENT_BYTES["fp32"]


def labelled_rows_pay(labelled_fraction: float, option: bool | None = None) -> bool:
    """Whether the last layer runs on the labelled rows only (plexus.model.PlexusGCN's
    ``labelled_rows_only``): ``option`` when given, else when at most
    :data:`LABELLED_ROWS_MAX_SHARE` of the nodes are labelled. Gathering the labelled rows of
    the last layer's block copies ``labelled_fraction`` of it (twice, with the transpose),
    which near 1 costs more memory than the skipped rows of H and the logits save."""
    return labelled_fraction <= LABELLED_ROWS_MAX_SHARE if option is None else option


def weight_first_pays(sizes: Sequence[int], d_in: int, d_out: int, *,
                      fixed_first: bool = False, remade: bool = False, rows_only: bool = False,
                      option: bool | None = None, terms: int = 1) -> bool:
    """Whether a layer multiplies by its weight before it aggregates, ``Q = A (F' W)``
    (plexus.model.PlexusGCN's ``weight_first``; docs/design/plexus-3d.md section 12).

    ``sizes``: the layer's (O, I, P) group sizes; ``d_in``, ``d_out``: its padded widths;
    ``fixed_first``: layer 0 with fixed input features: it aggregates first (a cached ``H_0``
    costs no SpMM at all), except where ``remade`` (dropout, and ``H_0`` would be recomputed
    in backward) and ``option`` is True: then ``F' = dropout(F_0)`` is made again for ``dW``
    from the mask's bits (plexus.ops.RemadeInputMatmul) and no ``H_0`` is aggregated twice.
    Not by default: on the 1M-node papers100M-format graph it shortens an epoch but raises the
    peak, mostly by the pages of the transposed block that fixed features never read otherwise
    (docs/design/plexus-3d.md section 12). ``rows_only``: the
    last layer on labelled rows only (weight first would multiply every row and keep ``F'`` of
    every row for a few output rows).

    The order is a local choice only where O and I are 1: ``F'`` then holds whole rows and
    whole columns, ``F' W`` needs no sum over I and its rows are the columns ``A`` reads. The
    SpMMs (forward and backward) then run ``d_out`` wide instead of ``d_in``. With P > 1 every
    P rank would multiply all ``N`` rows and keep ``F' [N, d_in]`` (P times ``H``), so the
    default (``option`` None) takes it where O, I and P are 1 and the layer narrows
    (``d_out < d_in``), or, for GraphSAGE (``terms`` 2), does not widen: it then keeps one
    ``F'`` for both weights' gradients instead of ``H`` and ``R``, and its SpMMs are no
    wider; True takes it wherever O and I are 1; False never.
    """
    o_size, i_size, p_size = sizes
    if option is False or rows_only or o_size > 1 or i_size > 1:
        return False
    if fixed_first:
        return remade and option is True
    return option is True or (p_size == 1 and (d_out < d_in or (terms > 1 and d_out == d_in)))


AGGREGATION_BLOCKS = 4  # row blocks of an overlapped aggregation (plexus.ops.BlockedAggregation)


def overlap_pays(shape: Mapping[str, int], option: bool | None = None, *,
                 comm_offloaded: bool = True) -> bool:
    """Whether plexus overlaps its aggregation all-reduces (2), (7) and weight all-gathers
    (3) with the SpMM (plexus.model.PlexusGCN's ``overlap``): ``option`` when given, else
    when some axis has more than one rank (a layer has a collective to hide) and
    ``comm_offloaded``: the communication runs on resources the compute does not need (a GPU's
    NCCL, a NIC, or a spare core per rank for the MPI transport's communication thread). With
    one core per rank the thread's shared-memory copies take the compute's core, so the
    compute waits about as long either way and the epoch is not faster (docs/benchmarks.md,
    on the overlapped aggregation).
    :func:`overlap_hidden_seconds` is what it hides."""
    if option is not None:
        return option
    return comm_offloaded and any(size > 1 for size in shape.values())


def heads_problems(heads: int, num_layers: int, shape: Mapping[str, int]) -> list[str]:
    """A GAT's grid problems: its ``heads`` must split over each layer's inner axis I (every
    head whole on a rank, plexus.gat), as sentences with the arithmetic."""
    return [f"heads: {heads} % {ax}={shape[ax]} = {heads % shape[ax]} (layer {layer}'s inner "
            "axis; choose heads divisible by it)" for layer in range(num_layers)
            for ax in [roles(layer)[1]] if heads % shape[ax]]


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
        model: ``gcn``, ``sage`` (GraphSAGE: a root term beside the mean aggregation) or
            ``gat`` (graph attention: common.perf.gat models its epoch; none of the options
            below that change how a GCN layer runs applies, and the first layer is never
            cached).
        num_nodes: N.
        nnz: nonzeros of the normalised adjacency, self-loops included.
        num_features, num_classes: D_0 and C.
        num_layers, hidden: L and the hidden width (``gat``: every head's, ``heads`` times a
            head's width).
        heads: ``gat``'s attention heads ``K`` per layer.
        attention_dropout: ``gat``'s rate on the coefficients (its keep-masks are kept).
        learn_features: trainable input features (every collective runs every epoch).
        cache_first_aggregation: reuse ``H_0`` across epochs when features are fixed (our
            trainer does without dropout; the paper's code recomputes it, so its check sets
            this False).
        dropout: the dropout rate (memory only: its keep-masks are kept for backward).
        imbalance: max/mean nonzeros per adjacency block (about 1 with the double
            permutation); scales the SpMM time of the slowest rank.
        index_bytes: CSR index width; None picks int32 where a rank's largest block fits
            (:meth:`index_width`), as plexus does block by block.
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
            the activations kept for backward and every message of (1)-(8) in 2 bytes; see
            common.perf.gcn's docstring). bf16 cannot learn the features.
        recompute_first: the model's option of that name: with fixed features and dropout,
            ``H_0`` is not kept but recomputed in backward (:attr:`recomputes_first`): the
            layer-0 SpMM, (1) and (2) run twice.
        weight_first: the model's option of that name (None: :func:`weight_first_pays`
            decides per layer; :meth:`weight_first_layer`): ``Q = A (F' W)``, the SpMMs
            ``D_l+1`` wide, ``F'`` kept instead of ``H``.
        mapped: the adjacency blocks are memory-mapped from a prepared dataset (``python -m
            plexus.prepare``, as at scale): on the CPU a block no step reads (the last
            layer's full block where it runs on the labelled rows) is not resident. False:
            an in-memory graph, whose blocks all stay in memory.
    """

    name: str = "graph"
    model: str = "gcn"
    num_nodes: int
    nnz: int
    num_features: int
    num_classes: int
    num_layers: int = 3
    hidden: int = 128
    heads: int = 1
    attention_dropout: float = 0.0
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
    mapped: bool = True

    def __post_init__(self) -> None:
        for f in ("num_nodes", "nnz", "num_features", "num_classes", "num_layers", "hidden"):
            if getattr(self, f) < 1:
                raise ValueError(f"GCNWorkload.{f} must be >= 1, got {getattr(self, f)}")
        if self.model not in ("gcn", "sage", "gat"):
            raise ValueError(f"GCNWorkload.model must be gcn, sage or gat, got {self.model!r}")
        if self.model == "gat":
            if self.learn_features or self.precision != "fp32" or self.hidden % self.heads:
                raise ValueError("GCNWorkload: gat runs fp32 with fixed features, and its "
                                 f"hidden width ({self.hidden}) is heads ({self.heads}) times "
                                 "a head's")
            for name, value in (("labelled_rows_only", False), ("overlap", False),
                                ("weight_first", False), ("recompute_first", False),
                                ("cache_first_aggregation", False)):
                object.__setattr__(self, name, value)  # GAT runs none of these
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
        return ELEMENT_BYTES[self.precision]

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
        """Problems of running on ``shape`` (the same interface as :meth:`common.perf.gpt.
        GPTWorkload.grid_problems`): every X x Y x Z grid pads what it needs, but GAT's heads
        must split over each layer's inner axis."""
        return heads_problems(self.heads, self.num_layers, shape) if self.model == "gat" else []

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

    def index_width(self, shape: Mapping[str, int] | None = None) -> int:
        """Bytes of a CSR index: ``index_bytes`` where given, else 4 where the largest block a
        rank of ``shape`` holds (all of A without a shape) has fewer than 2^31 nonzeros and
        rows, as plexus.csr.CSRBlock.from_scipy and plexus.data.writer choose per block
        (prepared blocks are smaller still, ``N/k`` square), else 8."""
        if self.index_bytes is not None:
            return self.index_bytes
        cut = 1 if shape is None else min(
            shape[roles(layer)[2]] * shape[roles(layer)[0]] for layer in range(self.num_layers))
        return 4 if max(self.imbalance * self.nnz / cut, self.num_nodes) < 2**31 else 8

    def weight_first_layer(self, layer: int, shape: Mapping[str, int]) -> bool:
        """Whether ``layer`` multiplies before it aggregates on ``shape`` (as plexus.model
        decides it: :func:`weight_first_pays` on the padded widths)."""
        _, w = self.padded(shape)
        last = self.num_layers - 1
        return weight_first_pays(
            tuple(shape[ax] for ax in roles(layer)), w[layer], w[layer + 1],
            fixed_first=layer == 0 and not self.learn_features, remade=self.recomputes_first,
            rows_only=layer == last and labelled_rows_pay(self.labelled_fraction,
                                                          self.labelled_rows_only),
            option=self.weight_first, terms=self.terms)

    def narrows(self, layer: int, shape: Mapping[str, int]) -> bool:
        """Whether ``layer``'s ``H`` (and ``R``) come out of their all-reduce over O in bf16
        (plexus.ops.BlockedAggregation's ``narrow``): bf16, O > 1, and the layer aggregates
        first over its own input (not a recomputed or remade layer 0)."""
        return (self.stored_bytes < ELEMENT_BYTES["fp32"] and shape[roles(layer)[0]] > 1
                and not self.weight_first_layer(layer, shape)
                and not (layer == 0 and self.recomputes_first))

    def exchanges_root(self, layer: int, shape: Mapping[str, int]) -> bool:
        """Whether ``layer``'s GraphSAGE root term ``R = S F'`` moves its rows by owner
        (plexus.root_rows: an all-gather over O forward, a reduce-scatter backward) instead of
        an SpMM with ``S`` all-reduced over O: a layer that aggregates its own input (not one
        that multiplies first, nor a recomputed or remade layer 0)."""
        return (self.terms == 2 and not self.weight_first_layer(layer, shape)
                and not (layer == 0 and self.recomputes_first))

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
