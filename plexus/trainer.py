"""The Plexus training loop, usable from Python on any graph (the CLI is plexus.train).

Example (one process, or inside any already-started torch.distributed job)::

    from plexus import fit
    result = fit(graph_or_pyg_data, grid="1x1x1", epochs=100)
    print(result.history[-1]["test_acc"])
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from common.alloc import retain_freed_memory
from common.checkpoint import list_steps
from common.comm_stats import CommStats
from common.dist import any_rank
from common.grid import AxisGroup, ProcessGrid
from plexus import checkpoint as ckpt
from plexus import partition as part
from plexus.graph import Graph
from plexus.loss import correct_counts, sharded_argmax, sharded_cross_entropy
from plexus.model import PlexusGCN
from plexus.ogb_io import DatasetCorruptError
from plexus.shard import SPLITS, GraphShard, shard_graph


@dataclass(kw_only=True)
class TrainConfig:
    """Hyper-parameters of one training run.

    Attributes:
        layers: number of GCN layers L (>= 1).
        hidden: hidden width.
        epochs: full-graph epochs.
        lr, weight_decay: AdamW settings.
        seed: seeds weights and permutations (same seed, same numbers on any grid).
        permutation: ``none``, ``single`` or ``double`` (load balance, plexus-3d.md section 6).
        learn_features: make the input features trainable.
        pad_multiple: pad the node count to a multiple of this too (in-memory graphs; set it
            to a prepared dataset's block count k to get the prepared run's exact numbers).
    """

    layers: int = 3
    hidden: int = 128
    epochs: int = 100
    lr: float = 0.01
    weight_decay: float = 5e-4
    seed: int = 0
    permutation: str = "double"
    learn_features: bool = False
    pad_multiple: int = 1

    def __post_init__(self) -> None:
        if self.layers < 1 or self.hidden < 1 or self.epochs < 0 or self.pad_multiple < 1:
            raise ValueError(f"need layers >= 1, hidden >= 1, epochs >= 0, pad_multiple >= 1; "
                             f"got layers={self.layers}, hidden={self.hidden}, epochs="
                             f"{self.epochs}, pad_multiple={self.pad_multiple}")
        if not self.lr > 0 or self.weight_decay < 0:
            raise ValueError(f"need lr > 0 and weight_decay >= 0; got lr={self.lr}, "
                             f"weight_decay={self.weight_decay}")
        if self.permutation not in part.PERMUTATIONS:
            raise ValueError(f"unknown permutation {self.permutation!r}; choose from "
                             f"{part.PERMUTATIONS}")


@dataclass(kw_only=True)
class CheckpointConfig:
    """Where and how often to checkpoint.

    Attributes:
        dir: checkpoint directory (None: no checkpoints).
        every: save every N epochs (0: only at the end and on preemption).
        keep: complete checkpoints to keep.
        resume: continue from the newest intact checkpoint in ``dir`` (if there is one).
    """

    dir: str | None = None
    every: int = 0
    keep: int = 3
    resume: bool = False

    def __post_init__(self) -> None:
        if self.every < 0 or self.keep < 1:
            raise ValueError(f"need checkpoint every >= 0 and keep >= 1; got every="
                             f"{self.every}, keep={self.keep}")
        if self.resume and not self.dir:
            raise ValueError("--resume needs --checkpoint-dir")


@dataclass
class TrainResult:
    """Per-epoch metrics (dicts as written to ``--metrics``) and the final state."""

    history: list[dict[str, Any]]
    model: PlexusGCN
    shard: GraphShard
    groups: dict[str, AxisGroup]
    info: dict[str, Any] = field(default_factory=dict)


def setup(
    graph: Graph | Any, grid: ProcessGrid, rank: int, cfg: TrainConfig
) -> tuple[GraphShard, dict[str, AxisGroup], PlexusGCN]:
    """Create the axis groups (collective), this rank's shard, and the model.

    ``graph`` is an in-memory :class:`Graph` (every rank builds its blocks from it) or a
    :class:`~plexus.prepared.PreparedGraph` (every rank maps its blocks from disk; its
    permutations are the prepared ones, ``cfg.seed`` still seeds the weights).
    """
    from plexus.prepared import PreparedGraph

    if isinstance(graph, PreparedGraph):  # check before the collective group creation
        graph.check_grid(grid.shape)
        graph.check_config(cfg.permutation)
    groups = grid.create_groups(rank)
    if isinstance(graph, PreparedGraph):
        error: Exception | None = None
        try:
            shard = graph.shard(grid.shape, grid.coords(rank), num_layers=cfg.layers,
                                hidden=cfg.hidden)
        except (ValueError, OSError) as e:  # a damaged file may touch some ranks only
            error = e
        if any_rank(error is not None):  # so every rank stops, none waits in a collective
            raise DatasetCorruptError(str(error) if error else
                                      f"another rank could not read its blocks of {graph.path} "
                                      "(its error is above)")
    else:
        shard = shard_graph(graph, grid.shape, grid.coords(rank), num_layers=cfg.layers,
                            hidden=cfg.hidden, permutation=cfg.permutation, seed=cfg.seed,
                            pad_multiple=cfg.pad_multiple)
    model = PlexusGCN(shard, groups, learn_features=cfg.learn_features, seed=cfg.seed)
    return shard, groups, model


def train_gcn(
    graph: Graph,
    grid: ProcessGrid,
    rank: int,
    cfg: TrainConfig,
    *,
    device: torch.device | str = "cpu",
    on_epoch: Callable[[dict[str, Any]], None] | None = None,
    on_setup: Callable[[GraphShard, PlexusGCN, dict[str, Any]], None] | None = None,
    checkpoint: CheckpointConfig | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> TrainResult:
    """Train a GCN on ``graph`` with the Plexus 3D algorithm; every rank of ``grid`` calls this.

    Accuracies of epoch ``e`` are those of the forward pass of that epoch (before its
    optimizer step), so no extra forward pass is spent on evaluation.

    ``should_stop`` (e.g. :func:`common.dist.preemption_flag`) is checked after every epoch and
    agreed over all ranks; when it fires, the run checkpoints (if configured) and returns
    with ``info["preempted"] = True``.
    """
    t0 = time.perf_counter()
    if torch.device(device).type == "cpu":
        retain_freed_memory()  # reuse activation pages every epoch (see common.alloc)
    shard, groups, model = setup(graph, grid, rank, cfg)
    model.to(device)
    for blk in shard.adj.values():
        blk.a.to(device), blk.a_t.to(device)
    info = {"setup_s": time.perf_counter() - t0, "config": asdict(cfg), "grid": str(grid)}
    if on_setup is not None:
        on_setup(shard, model, info)
    o_ax, _, p_ax = part.roles(cfg.layers - 1)
    g_o, g_p = groups[o_ax], groups[p_ax]
    labels = shard.labels.to(device)
    masks = {s: m.to(device) for s, m in shard.masks.items()}
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    stats, history, first = CommStats(), [], 1
    ck = checkpoint or CheckpointConfig()
    meta = {**ckpt.identity(model, graph.name), "config": asdict(cfg), "grid": str(grid)}
    if ck.resume and list_steps(ck.dir):
        done, history = ckpt.load(ck.dir, model, opt, meta=meta)
        first = done + 1
        info["resumed_from"] = done
    info["preempted"] = False
    for epoch in range(first, cfg.epochs + 1):
        stats.reset()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = model(stats)
        loss = sharded_cross_entropy(logits, labels, masks["train"],
                                     num_classes=shard.num_classes,
                                     count=shard.split_counts["train"],
                                     group_o=g_o, group_p=g_p, stats=stats)
        loss.backward()
        opt.step()
        pred = sharded_argmax(logits.detach(), num_classes=shard.num_classes, group_o=g_o,
                              stats=stats)
        correct = correct_counts(pred, labels, masks, g_p, stats=stats)
        loss_value = loss.item()
        if not torch.isfinite(torch.tensor(loss_value)):
            raise FloatingPointError(
                f"loss became {loss_value} at epoch {epoch}; lower --lr or check the features")
        row = {
            "epoch": epoch,
            "loss": loss_value,
            **{f"{s}_acc": correct[s] / max(shard.split_counts[s], 1) for s in SPLITS},
            "epoch_s": time.perf_counter() - start,
            "comm_s": stats.total_seconds,
            "comm_bytes": stats.total_bytes,
            "comm_bytes_by_axis": {a: r.bytes for a, r in stats.by_axis().items()},
        }
        history.append(row)
        if on_epoch is not None:
            on_epoch(row)
        stop = should_stop is not None and any_rank(should_stop(), device)
        if ck.dir and (stop or epoch == cfg.epochs or (ck.every and epoch % ck.every == 0)):
            ckpt.save(ck.dir, model, opt, epoch=epoch, history=history, meta=meta,
                      keep=ck.keep)
        if stop:
            info["preempted"] = True
            break
    return TrainResult(history, model, shard, groups, info)


@torch.no_grad()
def predictions(result: TrainResult) -> torch.Tensor | None:
    """Predicted class of every node in original order, on every rank (None if 0 layers).

    Gathers the small [N/P] prediction vectors over P; costs one forward pass.
    """
    from common import collectives as C

    o_ax, _, p_ax = part.roles(result.model.num_layers - 1)
    logits = result.model()
    pred = sharded_argmax(logits, num_classes=result.shard.num_classes,
                          group_o=result.groups[o_ax])
    rows = torch.from_numpy(result.shard.out_rows)
    allp = C.all_gather(pred, result.groups[p_ax])
    allr = C.all_gather(rows, result.groups[p_ax])
    out = torch.full((result.shard.num_nodes,), -1, dtype=torch.int64)
    real = allr >= 0
    out[allr[real]] = allp[real].cpu()
    return out


def fit(data: Any, *, grid: str | ProcessGrid = "1x1x1", device: str = "cpu",
        on_epoch: Callable[[dict[str, Any]], None] | None = None,
        **config: Any) -> TrainResult:
    """Train on a :class:`~plexus.graph.Graph` or a PyG ``Data`` (x, y, edge_index, masks).

    Starts a single-process ``torch.distributed`` group if none is running; under a launcher
    call :func:`common.init_distributed` first. ``config`` goes to :class:`TrainConfig`.
    """
    import torch.distributed as dist

    from common.dist import init_distributed

    graph = data if isinstance(data, Graph) else Graph.from_pyg(data)
    if not dist.is_initialized():
        init_distributed(device=device)
    grid = ProcessGrid.parse(grid) if isinstance(grid, str) else grid
    grid.validate(dist.get_world_size())
    return train_gcn(graph, grid, dist.get_rank(), TrainConfig(**config), device=device,
                     on_epoch=on_epoch)
