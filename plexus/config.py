"""Keyword-only configs of a plexus run, one per component, validated at construction.

    ModelConfig   GCN/SAGE/GAT, depth, width, the recipe  -> plexus.model.PlexusGCN
    OptimConfig   Adam (L2 decay) or AdamW, per layer    -> torch.optim.Adam / AdamW
    RunConfig     epochs, seed, CPU kernel and allocator -> plexus.trainer.Trainer

:func:`gcn_workload` is the performance model's view of a run of these configs on a graph
(``--grid auto``, :func:`common.perf.choose_grid`).

How the graph is partitioned (permutation, padding) belongs to the data source
(plexus.data.open_source / InMemorySource); checkpoints to common.run.CheckpointConfig.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from common import dense
from common.perf.gcn_workload import GCNWorkload, heads_problems
from common.precision import PRECISIONS
from plexus.layout import layer_widths
from plexus.sparse import SPMM_KERNELS

MODELS = ("gcn", "sage", "gat")
GAT_HEADS = 8  # heads of a GAT that is given none (PyG's GAT example's)
NORMS = ("none", "batch", "layer")
OPTIMIZERS = ("adam", "adamw")


def aggregation_of(model: str) -> str:
    """The adjacency a model needs from its data source: ``gcn`` (``Â``: GAT reads its
    pattern, ``A + I``, not its values) or ``mean`` (GraphSAGE's mean over in-neighbours,
    with the root blocks)."""
    return "mean" if model == "sage" else "gcn"


@dataclass(kw_only=True)
class ModelConfig:
    """The model (plexus.model.PlexusGCN) and its recipe.

    ``labelled_rows_only``, ``overlap``, ``aggregation_blocks``, ``recompute_first`` and
    ``weight_first`` change how the layers run, not what they compute: the trainer turns them
    into the model's :class:`plexus.layer_plan.LayerPlan` (:func:`plexus.layer_plan.
    plan_layers`, once per model).

    Attributes:
        model: ``gcn`` (Kipf & Welling), ``sage`` (GraphSAGE, mean aggregation + root weight)
            or ``gat`` (graph attention, PyG's ``GATConv``: plexus.gat_model).
        num_layers: layers L (>= 1).
        hidden: hidden width; for ``gat`` the width of each head (a hidden layer is ``heads``
            times as wide, its heads concatenated), as PyG's ``GATConv(.., hidden, heads)``.
        heads: ``gat``'s attention heads in every layer (averaged in the last); each layer's
            I axis must split them. None: :data:`GAT_HEADS` for ``gat``; the other models have
            no heads and refuse a number.
        attention_dropout: ``gat``'s dropout rate on the attention coefficients.
        learn_features: make the input features trainable parameters (as the paper does).
        dropout: dropout rate on the input of every layer (0.5 as the PyG and OGB examples).
        bias: a bias in every layer.
        norm: ``none``, ``batch`` or ``layer`` normalisation after every hidden layer.
        normalize_features: row-normalise the input features (PyG's NormalizeFeatures).
        residual: ``F_l+1 = relu(norm(Q_l)) + F_l`` in the hidden-to-hidden layers
            (plexus.residual), 1 .. L-2: needs ``num_layers >= 3``.
        precision: ``fp32``, or ``bf16``: the input features, the activations kept for
            backward and the model's messages in bf16; sums, weights, gradients and the
            optimizer in float32 (docs/design/plexus-3d.md section 11). Not with
            ``learn_features``.
        labelled_rows_only: the last layer computes only the rows of nodes in a split: None
            (auto: where at most half the nodes are labelled,
            :func:`common.perf.gcn_workload.labelled_rows_pay`), True or False. Exact either way.
        overlap: run each aggregation in row blocks whose all-reduces (and the weight's
            all-gather) travel while the next block computes (plexus.ops.BlockedAggregation):
            None (auto: where some axis has more than one rank and the communication has
            resources of its own, a GPU or two cores per rank,
            :func:`common.perf.gcn_workload.overlap_pays`), True or False.
        aggregation_blocks: row blocks of the blocked aggregation; None: 4 with overlap, else
            1 (the unblocked layer). Blocks without overlap give the overlapped bits.
        recompute_first: with fixed features and dropout, recompute layer 0's aggregation
            ``H_0`` in backward instead of keeping it (plexus.first_layer): less memory,
            one more layer-0 SpMM per step; ``dW_0`` equal to float rounding.
        weight_first: multiply by the weight before aggregating, ``A (F' W)``, in layers that
            narrow and have one rank (plexus.model.PlexusGCN._weight_first): None (auto:
            :func:`common.perf.gcn_workload.weight_first_pays`), True (every layer whose O
            and I axes have one rank) or False. Equal to float rounding.
    """

    model: str = "gcn"
    num_layers: int = 3
    hidden: int = 128
    heads: int | None = None
    attention_dropout: float = 0.0
    learn_features: bool = False
    dropout: float = 0.5
    bias: bool = True
    norm: str = "none"
    normalize_features: bool = False
    residual: bool = False
    labelled_rows_only: bool | None = None
    overlap: bool | None = None
    aggregation_blocks: int | None = None
    precision: str = "fp32"
    recompute_first: bool = True
    weight_first: bool | None = None

    def __post_init__(self) -> None:
        check_recipe(model=self.model, norm=self.norm, dropout=self.dropout,
                     precision=self.precision, learn_features=self.learn_features)
        if self.aggregation_blocks is not None and self.aggregation_blocks < 1:
            raise ValueError(f"need aggregation_blocks >= 1, got {self.aggregation_blocks}")
        if self.heads is not None and self.model != "gat":
            raise ValueError(f"--heads is GAT's: model {self.model!r} has no attention heads "
                             "(its hidden width is --hidden): use --model gat or drop --heads")
        if self.heads is None and self.model == "gat":
            self.heads = GAT_HEADS
        if self.num_layers < 1 or self.hidden < 1 or (self.heads is not None and
                                                       self.heads < 1):
            raise ValueError(f"need num_layers >= 1, hidden >= 1 and heads >= 1; got num_layers="
                             f"{self.num_layers}, hidden={self.hidden}, heads={self.heads}")
        if self.residual and self.num_layers < 3:
            raise ValueError("--residual adds a layer's input to its output in the "
                             "hidden-to-hidden layers (1 .. L-2, whose input is as wide as "
                             f"their output), and --layers {self.num_layers} has none: use "
                             "--layers 3 or more, or drop --residual")
        if not 0 <= self.attention_dropout < 1:
            raise ValueError(f"need 0 <= attention_dropout < 1, got {self.attention_dropout}")
        if self.attention_dropout and self.model != "gat":
            raise ValueError(f"--attention-dropout is GAT's; model {self.model!r} has no "
                             "attention: use --model gat or drop it")
        if self.model == "gat":
            # GAT's layer is attention, not an aggregation and a product: none of these runs
            asked = [name for name in ("labelled_rows_only", "overlap", "weight_first")
                     if getattr(self, name)] + (
                ["aggregation_blocks"] if (self.aggregation_blocks or 1) > 1 else []) + (
                # nor is there an H_0 to keep: layer 0 is attention too
                [] if self.recompute_first else ["recompute_first=False "
                                                  "(--keep-first-aggregation)"])
            if asked:
                raise ValueError(f"model 'gat' does not run {', '.join(asked)}: leave "
                                 "them unset (they change how GCN and GraphSAGE layers run)")

    @property
    def width(self) -> int:
        """The width of a hidden layer: ``hidden``, or ``heads * hidden`` for ``gat``."""
        return self.hidden * self.heads if self.model == "gat" else self.hidden

    def grid_problems(self, shape: Any) -> list[str]:
        """Problems of running this model on a grid of ``shape`` (axis -> ranks), as
        sentences (a :class:`common.grid.ProcessGrid` constraint): GAT's heads must split
        over every layer's inner axis."""
        return heads_problems(self.heads, self.num_layers, shape) if self.model == "gat" else []

    def widths(self, num_features: int, num_classes: int) -> list[int]:
        """``[D_0, width, ..., C]``: every layer's input width and the classes."""
        return layer_widths(num_features, self.width, self.num_layers, num_classes)


def check_recipe(*, model: str, norm: str, dropout: float, precision: str = "fp32",
                 learn_features: bool = False) -> None:
    """Raise ValueError for a recipe no model runs: :class:`ModelConfig`,
    :class:`plexus.model.PlexusGCN` and :class:`plexus.reference.SerialGCN` check alike."""
    if model not in MODELS or norm not in NORMS:
        raise ValueError(f"need model in {MODELS} and norm in {NORMS}; got model={model!r}, "
                         f"norm={norm!r}")
    if not 0 <= dropout < 1:
        raise ValueError(f"need 0 <= dropout < 1, got {dropout}")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose from {PRECISIONS}")
    if model == "gat" and (precision != "fp32" or learn_features):
        raise ValueError("model 'gat' runs in precision 'fp32' with fixed input features; "
                         "drop --precision bf16 and --learn-features")
    if precision == "bf16" and learn_features:
        raise ValueError("precision 'bf16' keeps the input features in bf16 and cannot train "
                         "them (learn_features): use precision 'fp32' to learn them")


@dataclass(kw_only=True)
class OptimConfig:
    """The optimizer.

    Attributes:
        optimizer: ``adam`` (weight decay as an L2 term in the gradient, as PyG's and OGB's
            examples) or ``adamw`` (decoupled weight decay).
        lr: learning rate.
        weight_decay: one value for every layer, or one per layer (layer l's weights, bias and
            norm; the input features, when trained, take layer 0's). PyG's GCN example decays
            the first layer only: ``(5e-4, 0.0)``.
    """

    optimizer: str = "adam"
    lr: float = 0.01
    weight_decay: float | tuple[float, ...] = 5e-4

    def __post_init__(self) -> None:
        if isinstance(self.weight_decay, list):
            self.weight_decay = tuple(self.weight_decay)
        decays = self.weight_decay if isinstance(self.weight_decay, tuple) else (
            self.weight_decay,)
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; choose from {OPTIMIZERS}")
        if not self.lr > 0 or not decays or min(decays) < 0:
            raise ValueError(f"need lr > 0 and weight_decay >= 0; got lr={self.lr}, "
                             f"weight_decay={self.weight_decay}")

    def layer_decays(self, num_layers: int) -> list[float]:
        """Weight decay of each of ``num_layers`` layers.

        Raises:
            ValueError: a per-layer list of the wrong length.
        """
        if not isinstance(self.weight_decay, tuple):
            return [float(self.weight_decay)] * num_layers
        if len(self.weight_decay) != num_layers:
            raise ValueError(f"weight_decay has {len(self.weight_decay)} values for "
                             f"{num_layers} layers; give one value or one per layer")
        return [float(v) for v in self.weight_decay]


@dataclass(kw_only=True)
class RunConfig:
    """Length of the run and process-level switches.

    Attributes:
        epochs: full-graph epochs (>= 0).
        eval_every: evaluate after every N-th epoch (>= 1) and always after the last one (and
            at a preemption stop); model selection sees the evaluated epochs only. 1 (every
            epoch) as PyG's examples; the evaluation is one whole forward pass.
        seed: weight seed (same seed, same numbers on any grid).
        spmm: CPU SpMM kernel: ``auto`` (numba if installed), ``numba`` (both the
            cache-blocked kernel, plexus.slicing), ``numba-rows`` (the row kernel) or
            ``torch``.
        gemm: the backend of the dense products (:func:`common.dense.mm`): ``auto`` (oneDNN
            for float32 products on the CPU; in bf16 on a GPU ``tf32``), ``onednn``,
            ``torch`` (torch's BLAS) or ``tf32`` (on a GPU the tensor cores in TF32).
        retain_freed_memory: keep large freed buffers in the heap on CPU (common.alloc), so
            every epoch reuses its activation pages.
        pool_buffers: keep the freed tall ``[N, D]`` buffers on CPU for reuse
            (:func:`common.dense.pool_freed`): no fresh pages for most of them after the
            first step, for little or no more peak memory (its rules keep idle
            buffers out of a step's peak). None (the default): as ``retain_freed_memory``.
        cuda_graphs: capture the training step in a CUDA graph and replay it
            (plexus.cuda_graph: the same numbers, one launch an epoch). None (the default): on
            where it can run (one rank on a GPU; with dropout, Triton's masks); True: required
            (an error where it cannot run); False: off.
    """

    epochs: int = 100
    eval_every: int = 1
    seed: int = 0
    spmm: str = "auto"
    gemm: str = "auto"
    retain_freed_memory: bool = True
    pool_buffers: bool | None = None
    cuda_graphs: bool | None = None

    def __post_init__(self) -> None:
        if self.epochs < 0:
            raise ValueError(f"need epochs >= 0, got {self.epochs}")
        if self.eval_every < 1:
            raise ValueError(f"need eval_every >= 1 (1: every epoch), got {self.eval_every}")
        if self.spmm not in SPMM_KERNELS:
            raise ValueError(f"unknown SpMM kernel {self.spmm!r}; choose from {SPMM_KERNELS}")
        dense.check_backend(self.gemm)

    @property
    def pools_buffers(self) -> bool:
        """Whether the trainer pools the tall buffers (:attr:`pool_buffers`, resolved)."""
        return self.retain_freed_memory if self.pool_buffers is None else self.pool_buffers


def check_run_options(model: ModelConfig, run: RunConfig) -> None:
    """Raise ValueError for a :class:`RunConfig` kernel choice that ``model`` would ignore:
    GAT's attention multiplies with torch's own products and has kernels of its own
    (plexus.gat), so ``gemm`` never reaches it and ``spmm`` only in a residual's SpMM
    ``S_l F_l``."""
    if model.model != "gat":
        return
    if run.gemm != "auto":
        raise ValueError(f"--gemm {run.gemm} picks the backend of GCN's and GraphSAGE's dense "
                         "products; model 'gat' multiplies with torch's own (plexus.gat): "
                         "drop --gemm")
    if run.spmm != "auto" and not model.residual:
        raise ValueError(f"--spmm {run.spmm} picks the kernel of the SpMMs, and model 'gat' "
                         "runs one only for --residual (its attention has kernels of its own, "
                         "plexus.gat_kernels): drop --spmm, or add --residual")


CONFIGS = {"model": ModelConfig, "optim": OptimConfig, "run": RunConfig}


def split_config(**fields: Any) -> dict[str, Any]:
    """``{"model": ModelConfig, "optim": OptimConfig, "run": RunConfig}`` from flat keyword
    fields (``split_config(num_layers=2, lr=0.05, epochs=10)``), for ``Trainer(source, parallel,
    **...)`` and ``train_gcn(**...)``.

    Raises:
        TypeError: a field no config has.
        ValueError: a field out of range, or one the model ignores (:func:`check_run_options`).
    """
    names = {f.name: key for key, cls in CONFIGS.items() for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - set(names))
    if unknown:
        raise TypeError(f"unknown config field(s) {unknown}; known: {sorted(names)}")
    configs = {key: cls(**{k: v for k, v in fields.items() if names[k] == key})
               for key, cls in CONFIGS.items()}
    check_run_options(configs["model"], configs["run"])
    return configs


def gcn_workload(model: ModelConfig, source: Any) -> GCNWorkload:
    """The planner's view of one epoch of ``model`` on ``source`` (a
    :class:`~plexus.data.ShardSource`: its name and sizes), as the trainer runs it: the first
    aggregation is cached when there is no dropout, the last layer runs on the labelled
    rows when few are labelled (the share of nodes in a split), and a prepared dataset's
    blocks are memory-mapped."""
    labelled = sum(source.split_counts.values()) / max(source.num_nodes, 1)
    return GCNWorkload(name=source.name, model=model.model, num_nodes=source.num_nodes,
                       nnz=source.nnz, cache_first_aggregation=model.dropout == 0,
                       dropout=model.dropout, num_features=source.num_features,
                       num_classes=source.num_classes, num_layers=model.num_layers,
                       hidden=model.width, heads=model.heads if model.model == "gat" else 1,
                       attention_dropout=model.attention_dropout,
                       learn_features=model.learn_features,
                       labelled_fraction=min(1.0, labelled),
                       labelled_rows_only=model.labelled_rows_only, overlap=model.overlap,
                       norm=model.norm, precision=model.precision,
                       recompute_first=model.recompute_first,
                       weight_first=model.weight_first,
                       mapped=getattr(source, "storage", "") == "memory-mapped")
