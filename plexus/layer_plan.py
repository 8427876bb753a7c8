"""How each layer of a Plexus GCN runs: :class:`LayerPlan`, decided once by :func:`plan_layers`.

Every choice here leaves the function the model computes unchanged (bit for bit, or to float
rounding where the sums run in another order) and trades time against memory. Each is made
by the rule the performance model predicts it with (:mod:`common.perf.gcn_workload`), so the
trainer's model and the planner's prediction decide alike:

    labelled_rows_only  the last layer on the labelled rows only        labelled_rows_pay
    overlap             the aggregation's collectives travel while the  overlap_pays
                        next row block computes; W's all-gather before
    weight_first        per layer, Q = A (F' W) instead of (A F') W     weight_first_pays
    cache_first,        layer 0 with fixed features: H_0 computed once, (plexus.first_layer)
    recompute_first     or not kept but recomputed (F' remade) in backward

The trainer (plexus.trainer.shard_and_model) calls :func:`plan_layers` with its
:class:`~plexus.config.ModelConfig`'s options and hands the plan to the model, which takes
plain booleans and decides nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from common.grid import roles
from common.perf.gcn_workload import (
    AGGREGATION_BLOCKS,
    labelled_rows_pay,
    overlap_pays,
    weight_first_pays,
)
from plexus.data.shard import GraphShard

# the ModelConfig fields plan_layers reads (besides the model kind, features and dropout)
OPTIONS = ("labelled_rows_only", "overlap", "aggregation_blocks", "recompute_first",
           "weight_first")


@dataclass(frozen=True, kw_only=True)
class LayerPlan:
    """How each layer of one model runs (module docstring).

    Attributes:
        labelled_rows_only: the last layer computes only the output rows of nodes in a split,
            all that the loss and the accuracies read (plexus.model.PlexusGCN.output_rows).
        overlap: each aggregation's all-reduces over O (2, 7) are asynchronous, each travelling
            while the next row block computes (:class:`plexus.ops.BlockedAggregation`), and
            each weight's all-gather over P (3) starts before the aggregation.
        aggregation_blocks: row blocks of every aggregation (1: unblocked). Blocks without
            overlap run the same collectives synchronously: the overlapped bits.
        weight_first: per layer, multiply before aggregating, ``Q = A (F' W)``: the SpMMs of
            both passes run ``D_l+1`` wide instead of ``D_l``; equal to float rounding.
        cache_first: layer 0 with fixed features and no dropout: ``H_0`` is the same every
            pass, computed (with collectives 1 and 2) once and reused.
        recompute_first: layer 0 with fixed features and dropout does not keep ``H_0`` for
            ``dW_0``: backward aggregates it again (or, with ``weight_first[0]``, makes
            ``F' = dropout(F_0)`` again) from the pass's mask, kept as bits.
    """

    labelled_rows_only: bool = False
    overlap: bool = False
    aggregation_blocks: int = 1
    weight_first: tuple[bool, ...] = ()
    cache_first: bool = False
    recompute_first: bool = False

    def check(self, *, num_layers: int, learn_features: bool, dropout: float) -> None:
        """Raise ValueError where this plan was made for another model."""
        fixed_first = "cache_first" if self.cache_first else (
            "recompute_first" if self.recompute_first else None)
        problems = []
        if len(self.weight_first) != num_layers:
            problems.append(f"{len(self.weight_first)} weight_first entries for {num_layers} "
                            "layers")
        if fixed_first and learn_features:
            problems.append(f"{fixed_first} with learn_features")
        if fixed_first and (dropout == 0) != self.cache_first:
            problems.append(f"{fixed_first} with dropout {dropout}")
        if self.aggregation_blocks < 1:
            problems.append(f"aggregation_blocks {self.aggregation_blocks}")
        if problems:
            raise ValueError("the layer plan does not fit the model: " + "; ".join(problems)
                             + " (plexus.layer_plan.plan_layers makes one that does)")


def plan_layers(shard: GraphShard, sizes: Mapping[str, int], *, model: str = "gcn",
                learn_features: bool = False, dropout: float = 0.0,
                labelled_rows_only: bool | None = None, overlap: bool | None = None,
                aggregation_blocks: int | None = None, recompute_first: bool = True,
                weight_first: bool | None = None, comm_offloaded: bool = True) -> LayerPlan:
    """The plan of a model of ``model`` (``gcn`` or ``sage``; ``gat`` runs none of the
    options, so its plan is all off) on ``shard`` over a grid of
    ``sizes`` (``{"x": X, "y": Y, "z": Z}``). Each option is :class:`~plexus.config.
    ModelConfig`'s of that name; None leaves the choice to the rule of
    :mod:`common.perf.gcn_workload`:

    - ``labelled_rows_only``: None where at most half the nodes are labelled
      (``labelled_rows_pay``: on a fully labelled graph the gathered rows would copy the whole
      block for nothing).
    - ``overlap``: None where some axis has more than one rank and ``comm_offloaded``: the
      communication has resources the compute does not need (``overlap_pays``).
    - ``aggregation_blocks``: None: ``AGGREGATION_BLOCKS`` with overlap, else 1.
    - ``recompute_first``: True recomputes ``H_0`` where features are fixed and dropout is on
      (one more layer-0 SpMM and collectives 1, 2 per step for the largest block a step
      keeps); False keeps it.
    - ``weight_first``: None multiplies first where the layer's O, I and P have one rank and it
      narrows; True wherever O and I have one rank (``F'`` then holds whole rows and columns),
      but never in a last layer on labelled rows, nor in layer 0 with fixed features unless
      ``H_0`` would be recomputed; False never (``weight_first_pays``).
    """
    num_layers = len(shard.widths) - 1
    if model == "gat":  # attention, not an aggregation and a product: none of these applies
        return LayerPlan(weight_first=(False,) * num_layers)
    fixed = not learn_features
    labelled = sum(shard.split_counts.values()) / max(shard.num_nodes, 1)
    rows_only = labelled_rows_pay(labelled, labelled_rows_only)
    recompute = recompute_first and fixed and dropout > 0
    overlap = overlap_pays(sizes, overlap, comm_offloaded=comm_offloaded)
    first = tuple(weight_first_pays(
        tuple(sizes[ax] for ax in roles(layer)), shard.widths_padded[layer],
        shard.widths_padded[layer + 1], option=weight_first, fixed_first=layer == 0 and fixed,
        remade=recompute, rows_only=layer == num_layers - 1 and rows_only,
        terms=2 if model == "sage" else 1)
        for layer in range(num_layers))
    blocks = (aggregation_blocks if aggregation_blocks is not None
              else AGGREGATION_BLOCKS if overlap else 1)
    return LayerPlan(labelled_rows_only=rows_only, overlap=overlap, aggregation_blocks=blocks,
                     weight_first=first, cache_first=fixed and dropout == 0,
                     recompute_first=recompute)
