"""The Plexus training loop, usable from Python on any graph (the CLI is plexus.train).

Example (one process, or inside any already-started torch.distributed job)::

    from plexus import fit
    result = fit(graph_or_pyg_data, grid="1x1x1", epochs=100)
    print(result.history[-1]["test_acc"])

Lower level: ``train_gcn(source, grid, rank, model=ModelConfig(...), optim=..., run=...)`` on
any :class:`~plexus.data.shard.ShardSource` (``plexus.data.open_source``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from common import collectives as coll
from common.alloc import retain_freed_memory
from common.checkpoint import list_steps
from common.comm_stats import CommStats
from common.dist import any_rank
from common.grid import AxisGroup, ProcessGrid
from common.mpi import MPITransport
from common.run import CheckpointConfig
from plexus import checkpoint as ckpt
from plexus import layout
from plexus.config import ModelConfig, OptimConfig, RunConfig, aggregation_of, split_config
from plexus.data import SPLITS, DatasetCorruptError, GraphShard, ShardSource
from plexus.loss import correct_counts, sharded_argmax, sharded_cross_entropy
from plexus.model import PlexusGCN


@dataclass
class TrainResult:
    """Per-epoch metrics (dicts as written to ``--metrics``) and the final state."""

    history: list[dict[str, Any]]
    model: PlexusGCN
    shard: GraphShard
    groups: dict[str, AxisGroup]
    info: dict[str, Any] = field(default_factory=dict)


def setup(source: ShardSource, grid: ProcessGrid, rank: int, model: ModelConfig, *,
          seed: int = 0, device: torch.device | str = "cpu", transport: MPITransport | None = None
          ) -> tuple[GraphShard, dict[str, AxisGroup], PlexusGCN]:
    """Create the axis groups (collective; over ``transport`` too, if given), this rank's
    shard, and the model.

    If reading the shard fails on any rank (a damaged file may touch some ranks only), every
    rank raises: the failing ones their own error, the others a DatasetCorruptError saying so,
    so that no rank waits in a collective for one that stopped.
    """
    groups = grid.create_groups(rank, transport=transport)
    widths = layout.layer_widths(source.num_features, model.hidden, model.num_layers,
                                 source.num_classes)
    error: Exception | None = None
    try:
        shard = source.shard(grid.shape, grid.coords(rank), widths)
    except (ValueError, OSError) as e:
        error = e
    if any_rank(error is not None, device, transport):
        raise error or DatasetCorruptError(f"another rank could not read its shard of "
                                           f"{source.name} (its error is above)")
    net = PlexusGCN(shard, groups, model=model.model, learn_features=model.learn_features,
                    seed=seed, dropout=model.dropout, bias=model.bias, norm=model.norm,
                    normalize_features=model.normalize_features, residual=model.residual)
    # the model keeps its 1/Z slice of the [N/X, D_0/Y] block: release the block itself
    shard.features_block = shard.features_block.new_empty((0, shard.features_block.shape[1]))
    return shard, groups, net


def make_optimizer(net: PlexusGCN, optim: OptimConfig) -> torch.optim.Optimizer:
    """Adam or AdamW over ``net``'s parameters, one group per layer with that layer's weight
    decay (the input features, if trained, join layer 0)."""
    decays = optim.layer_decays(net.num_layers)
    groups: list[list[torch.nn.Parameter]] = [[] for _ in decays]
    for _name, t, _kind, layer in net.sharded_state():
        if isinstance(t, torch.nn.Parameter):
            groups[layer or 0].append(t)
    cls = torch.optim.Adam if optim.optimizer == "adam" else torch.optim.AdamW
    return cls([{"params": ps, "weight_decay": wd} for ps, wd in zip(groups, decays) if ps],
               lr=optim.lr)


def train_gcn(
    source: ShardSource,
    grid: ProcessGrid,
    rank: int,
    *,
    model: ModelConfig,
    optim: OptimConfig | None = None,
    run: RunConfig | None = None,
    device: torch.device | str = "cpu",
    checkpoint: CheckpointConfig | None = None,
    on_epoch: Callable[[dict[str, Any]], None] | None = None,
    on_setup: Callable[[GraphShard, PlexusGCN, dict[str, Any]], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    transport: MPITransport | None = None,
) -> TrainResult:
    """Train a GCN or GraphSAGE on ``source`` with the Plexus 3D algorithm; every rank of
    ``grid`` calls this.

    Accuracies of epoch ``e`` are measured as PyG's examples do: a forward pass in eval mode
    (no dropout, batch norm on its running statistics) on the weights after the epoch's update,
    so the last epoch's row is the final model (``eval_s`` is its time, apart from
    ``epoch_s``). Model selection as OGB does it: ``info["best"]`` holds the epoch of best
    validation accuracy with its accuracies, and the model's shards at that epoch are kept (a
    copy of this rank's parameters) for :func:`split_predictions` with ``best=True``.

    ``should_stop`` (e.g. :func:`common.dist.preemption_flag`) is checked after every epoch and
    agreed over all ranks; when it fires, the run checkpoints (if configured) and returns
    with ``info["preempted"] = True``. ``transport`` (``DistContext.transport``): CPU tensors
    go through MPI.

    Raises:
        ValueError: the grid does not match the process count or the source.
        DatasetCorruptError: a rank could not read its shard (on every rank).
        CheckpointError: ``checkpoint.resume`` found a damaged or foreign checkpoint.
        FloatingPointError: the loss became NaN or infinite.
    """
    optim, run, ck = optim or OptimConfig(), run or RunConfig(), checkpoint or CheckpointConfig()
    t0 = time.perf_counter()
    grid.check(dist.get_world_size() if dist.is_initialized() else 1, source.grid_problems)
    need = aggregation_of(model.model)
    if getattr(source, "aggregation", "gcn") != need:
        raise ValueError(f"model {model.model!r} needs a source built with aggregation={need!r}"
                         f"; {source.name} has {getattr(source, 'aggregation', 'gcn')!r}")
    if torch.device(device).type == "cpu" and run.retain_freed_memory:
        retain_freed_memory()  # reuse activation pages every epoch (see common.alloc)
    shard, groups, net = setup(source, grid, rank, model, seed=run.seed, device=device,
                               transport=transport)
    net.to(device)
    for blk in [*shard.adj.values(), *(shard.root or {}).values()]:
        blk.a.to(device, kernel=run.spmm), blk.a_t.to(device, kernel=run.spmm)
    config = {"model": asdict(model), "optim": asdict(optim), "run": asdict(run),
              "permutation": source.permutation}
    info = {"setup_s": time.perf_counter() - t0, "config": config, "grid": str(grid)}
    o_ax, _, p_ax = layout.roles(model.num_layers - 1)
    g_o, g_p = groups[o_ax], groups[p_ax]
    labels = shard.labels.to(device)
    masks = {s: m.to(device) for s, m in shard.masks.items()}
    opt = make_optimizer(net, optim)
    stats, history, first = CommStats(), [], 1
    meta = {**ckpt.identity(net, source.name), "config": config, "grid": str(grid)}
    if ck.resume and list_steps(ck.dir):
        done, history = ckpt.load(ck.dir, net, opt, meta=meta, group=transport)
        first, info["resumed_from"] = done + 1, done
    if on_setup is not None:  # set up, and resumed if asked
        on_setup(shard, net, info)
    info["preempted"] = False
    best: dict[str, Any] | None = None
    for row in history:  # a resumed run's earlier epochs (their model shards are not kept)
        if best is None or row["val_acc"] > best["val_acc"]:
            best = {k: row[k] for k in ("epoch", "train_acc", "val_acc", "test_acc")}
    best_state: dict[str, torch.Tensor] | None = None
    for epoch in range(first, run.epochs + 1):
        stats.reset()
        start = time.perf_counter()
        net.train()
        opt.zero_grad(set_to_none=True)
        logits = net(stats, step=epoch)
        loss = sharded_cross_entropy(logits, labels, masks["train"],
                                     num_classes=shard.num_classes,
                                     count=shard.split_counts["train"],
                                     group_o=g_o, group_p=g_p, stats=stats)
        del logits  # the evaluation pass below must not find last pass's logits still alive
        loss.backward()
        opt.step()
        loss_value = loss.item()
        del loss
        epoch_s = time.perf_counter() - start
        if not torch.isfinite(torch.tensor(loss_value)):
            raise FloatingPointError(
                f"loss became {loss_value} at epoch {epoch}; lower --lr or check the features")
        start = time.perf_counter()
        correct = _evaluate(net, labels, masks, g_o, g_p)
        row = {
            "epoch": epoch,
            "loss": loss_value,
            **{f"{s}_acc": correct[s] / max(shard.split_counts[s], 1) for s in SPLITS},
            "epoch_s": epoch_s,
            "eval_s": time.perf_counter() - start,
            "comm_s": stats.total_seconds,
            "comm_bytes": stats.total_bytes,
            "comm_bytes_by_axis": {a: r.bytes for a, r in stats.by_axis().items()},
        }
        if best is None or row["val_acc"] > best["val_acc"]:
            best = {k: row[k] for k in ("epoch", "train_acc", "val_acc", "test_acc")}
            best_state = _state(net)
        history.append(row)
        if on_epoch is not None:
            on_epoch(row)
        stop = should_stop is not None and any_rank(should_stop(), device, transport)
        if ck.dir and (stop or epoch == run.epochs or (ck.every and epoch % ck.every == 0)):
            ckpt.save(ck.dir, net, opt, epoch=epoch, history=history, meta=meta, keep=ck.keep,
                      group=transport)
        if stop:
            info["preempted"] = True
            break
    info["best"] = best
    info["best_state"] = best_state
    return TrainResult(history, net, shard, groups, info)


def _state(net: PlexusGCN) -> dict[str, torch.Tensor]:
    """A copy of this rank's shards of every parameter and statistic."""
    return {name: t.detach().clone() for name, t, _, _ in net.sharded_state()}


@torch.no_grad()
def _load_state(net: PlexusGCN, state: dict[str, torch.Tensor]) -> None:
    for name, t, _, _ in net.sharded_state():
        t.copy_(state[name])


@torch.no_grad()
def _evaluate(net: PlexusGCN, labels: torch.Tensor, masks: dict[str, torch.Tensor],
              g_o: AxisGroup, g_p: AxisGroup) -> dict[str, int]:
    """Correct predictions per split of an eval-mode forward pass (collective)."""
    net.eval()
    logits = net()
    pred = sharded_argmax(logits, num_classes=net.shard.num_classes, group_o=g_o)
    return correct_counts(pred, labels, masks, g_p)


@torch.no_grad()
def _gathered_outputs(result: TrainResult, best: bool = False) -> tuple[torch.Tensor, ...]:
    """(predicted class, label, split code, original node id) of every padded output row,
    gathered over P onto every rank: int64 [N_pad] each (node id -1 on padding). One forward
    pass in eval mode, on the final weights (or, with ``best``, those of the best validation
    epoch, when this run kept them)."""
    o_ax, _, p_ax = layout.roles(result.model.num_layers - 1)
    shard, g_p, net = result.shard, result.groups[p_ax], result.model
    saved = result.info.get("best_state") if best else None
    net.eval()
    if saved:
        final = _state(net)
        _load_state(net, saved)
    logits = net()
    if saved:
        _load_state(net, final)
    pred = sharded_argmax(logits, num_classes=shard.num_classes, group_o=result.groups[o_ax])
    code = torch.zeros_like(shard.labels)
    for i, s in enumerate(SPLITS, start=1):
        code[shard.masks[s]] = i
    device = pred.device
    rows = torch.from_numpy(shard.out_rows).to(device)
    return tuple(coll.all_gather(t.to(device), g_p).cpu()
                 for t in (pred, shard.labels, code, rows))


def predictions(result: TrainResult) -> torch.Tensor:
    """Predicted class of every node in original order, on every rank (collective).

    Gathers the [N/P] prediction vectors over P; costs one forward pass.
    """
    pred, _, _, rows = _gathered_outputs(result)
    out = torch.full((result.shard.num_nodes,), -1, dtype=torch.int64)
    real = rows >= 0
    out[rows[real]] = pred[real]
    return out


def split_predictions(result: TrainResult, *, best: bool = False
                      ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{split: (labels, predicted classes)}`` of every split's nodes under the final model
    (or the best validation epoch's, with ``best``), on every rank (collective; for the OGB
    Evaluator). Works on any source: the labels come from the shards, not a whole graph."""
    pred, labels, code, _ = _gathered_outputs(result, best)
    return {s: (labels[code == i], pred[code == i]) for i, s in enumerate(SPLITS, start=1)}


def fit(data: Any, *, grid: str | ProcessGrid = "1x1x1", device: str = "cpu",
        permutation: str = "double", symmetrize: bool = False,
        on_epoch: Callable[[dict[str, Any]], None] | None = None,
        **config: Any) -> TrainResult:
    """Train on a :class:`~plexus.data.Graph`, a PyG ``Data`` (x, y, edge_index, masks) or any
    :class:`~plexus.data.ShardSource`.

    Starts a single-process ``torch.distributed`` group if none is running; under a launcher
    call :func:`common.init_distributed` first. ``config`` holds fields of ModelConfig,
    OptimConfig and RunConfig (``model="sage", num_layers=2, hidden=16, dropout=0.5,
    optimizer="adam", weight_decay=5e-4, lr=0.01, epochs=200``). ``symmetrize`` adds the
    reverse of every edge of a graph first (OGB's ``to_symmetric()``). The test accuracy at
    the best validation epoch is ``result.info["best"]["test_acc"]``.
    """
    from common.dist import init_distributed
    from plexus.data import Graph, InMemorySource

    configs = split_config(**config)
    if isinstance(data, ShardSource):
        source = data
    else:
        graph = data if isinstance(data, Graph) else Graph.from_pyg(data)
        if symmetrize:
            graph = graph.to_undirected()
        source = InMemorySource(graph, permutation=permutation, seed=configs["run"].seed,
                                aggregation=aggregation_of(configs["model"].model))
    transport = None
    if not dist.is_initialized():
        transport = init_distributed(device=device).transport
    grid = ProcessGrid.parse(grid) if isinstance(grid, str) else grid
    return train_gcn(source, grid, dist.get_rank(), device=device, on_epoch=on_epoch,
                     transport=transport, **configs)
