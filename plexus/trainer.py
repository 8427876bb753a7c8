"""One rank's training state, its epoch and the training loop (the CLI is plexus.train).

The same shape as :mod:`llm.trainer`: :class:`Trainer` sets up one rank's share of a run
(constructor, from :mod:`plexus.build`), continues from a checkpoint (:meth:`Trainer.resume`),
trains one epoch (:meth:`Trainer.train_step`: full-graph, so one epoch is one optimizer step)
and measures it (:meth:`Trainer.evaluate`); :func:`run` is the loop. Every rank of the grid
calls each of them::

    parallel = ParallelState.create(ctx, grid)            # common.parallel, in the entry point
    trainer = Trainer(source, parallel, model=ModelConfig(), run=RunConfig(epochs=100))
    trainer.resume()                                      # if the checkpoint config says so
    rows = run(trainer, on_row=print)
    best = trainer.best                                   # the best validation epoch

From Python on any graph, one call: ``fit(graph_or_pyg_data, grid="1x1x1", epochs=100)``.
``train_gcn(source, grid, rank, ...)`` is the same for callers that hold a grid and a rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from common import collectives as coll
from common import dense
from common.alloc import retain_freed_memory
from common.checkpoint import list_steps
from common.comm_stats import CommStats
from common.exchange import any_rank
from common.grid import AxisGroup, ProcessGrid
from common.mpi import MPITransport
from common.parallel import ParallelState
from common.run import CheckpointConfig
from plexus import checkpoint as ckpt
from plexus import layout
from plexus.build import make_optimizer, shard_and_model, upload_adjacency
from plexus.config import ModelConfig, OptimConfig, RunConfig, aggregation_of, split_config
from plexus.cuda_graph import StepGraph, check_asked, why_not
from plexus.data import SPLITS, GraphShard, ShardSource
from plexus.loss import correct_counts, sharded_argmax, sharded_cross_entropy
from plexus.model import PlexusGCN
from plexus.triton_switch import failures as triton_failures

BEST_KEYS = ("epoch", "train_acc", "val_acc", "test_acc")


@dataclass
class TrainResult:
    """Per-epoch metrics (dicts as written to ``--metrics``) and the final state."""

    history: list[dict[str, Any]]
    model: PlexusGCN
    shard: GraphShard
    groups: dict[str, AxisGroup]
    info: dict[str, Any] = field(default_factory=dict)


class Trainer:
    """This rank's share of a run: its shard of the graph, its shards of the model, the
    optimizer, the epoch counter, the history and the best validation epoch.

    Accuracies are measured as PyG's examples do: an eval-mode forward pass (no dropout, batch
    norm on its running statistics) on the weights after the epoch's update, every
    ``run.eval_every`` epochs and after the last (:func:`run`). Model selection as OGB does it,
    among the evaluated epochs: :attr:`best` holds the epoch of best validation accuracy and its
    accuracies, :attr:`best_state` a copy of this rank's shards at that epoch (None when an
    epoch before the one a run resumed from stays best: a checkpoint holds only its own
    epoch's shards, so no prediction at the best epoch can be made then).

    Args:
        source: the graph (:func:`plexus.data.open_source`, ``InMemorySource``, ...).
        parallel: the grid and its x, y, z groups (:meth:`ParallelState.create`).
        model, optim, run: the configs (:mod:`plexus.config`).
        checkpoint: where to save, how often, and whether :meth:`resume` continues.

    Raises:
        ValueError: the grid does not suit the source, or the source the model.
        DatasetCorruptError: a rank could not read its shard (on every rank).
    """

    def __init__(self, source: ShardSource, parallel: ParallelState, *, model: ModelConfig,
                 optim: OptimConfig | None = None, run: RunConfig | None = None,
                 checkpoint: CheckpointConfig | None = None) -> None:
        t0 = time.perf_counter()
        self.source, self.parallel, self.model_config = source, parallel, model
        self.optim_cfg, self.run_cfg = optim or OptimConfig(), run or RunConfig()
        self.checkpoint = checkpoint or CheckpointConfig()
        parallel.grid.check(parallel.world_size, source.grid_problems, model.grid_problems)
        need, has = aggregation_of(model.model), getattr(source, "aggregation", "gcn")
        if has != need and hasattr(source, "with_aggregation"):  # the same data, served both ways
            source, has = source.with_aggregation(need), need
            self.source = source
        if has != need:
            raise ValueError(f"model {model.model!r} needs a source built with aggregation="
                             f"{need!r}; {source.name} has {has!r}")
        device = parallel.device
        if model.model == "gat" and device.type != "cpu":
            raise ValueError(f"model 'gat' trains on the CPU (its edge passes and attention "
                             f"dropout are host kernels); got device {device}: use --device cpu")
        if device.type == "cpu":
            # True: reuse activation pages every epoch; False: glibc's thresholds fixed at
            # their defaults, since left alone they rise to each freed buffer's size (up to
            # 32 MiB) and keep such buffers in the heap after all (see common.alloc)
            retain_freed_memory(self.run_cfg.retain_freed_memory)
            dense.pool_freed(self.run_cfg.pools_buffers)  # the tall [N, D] buffers
        self.shard, self.model = shard_and_model(source, parallel, model, seed=self.run_cfg.seed,
                                                 gemm=self.run_cfg.gemm)
        self.model.to(device)
        upload_adjacency(self.shard, device, kernel=self.run_cfg.spmm)
        self.optimizer = make_optimizer(self.model, self.optim_cfg)
        self.labels = self.shard.labels.to(device)
        self.masks = {s: m.to(device) for s, m in self.shard.masks.items()}
        # the loss's rows, found once (nonzero() waits for a GPU: once, not every epoch)
        self.train_rows = self.model.output_rows(self.masks["train"]).nonzero()[:, 0]
        self.graph = self._step_graph()  # None: every step eager
        o_ax, _, p_ax = layout.roles(model.num_layers - 1)
        self.group_o, self.group_p = parallel.groups[o_ax], parallel.groups[p_ax]  # logits
        self.stats = CommStats()
        config = {"model": asdict(model), "optim": asdict(self.optim_cfg),
                  "run": asdict(self.run_cfg), "permutation": source.permutation}
        self.meta = {**ckpt.identity(self.model, source.name, num_edges=source.num_edges,
                                     storage=source.storage,
                                     settings=getattr(source, "settings", None),
                                     normalize_features=model.normalize_features),
                     "config": config, "grid": str(parallel.grid)}  # what a checkpoint must match
        self.epoch = 0
        self.history: list[dict[str, Any]] = []
        self.best: dict[str, Any] | None = None
        self.best_state: dict[str, torch.Tensor] | None = None
        self.preempted = False
        self.info: dict[str, Any] = {"setup_s": time.perf_counter() - t0, "config": config,
                                     "grid": str(parallel.grid)}

    def resume(self, directory: str | None = None) -> int | None:
        """Continue from the newest intact checkpoint under ``directory`` (default: the
        checkpoint config's, when it says ``resume``), written on any grid; its epoch, or None
        when there is none yet. Collective.

        Raises:
            common.checkpoint.CheckpointError: damaged, foreign, or of another model.
        """
        if directory is None and self.checkpoint.resume:
            directory = self.checkpoint.dir
        if not directory or not list_steps(directory):
            return None
        self.epoch, history = ckpt.load(directory, self.model, self.optimizer, meta=self.meta,
                                        group=self.parallel.transport)
        for row in history:
            self.record(row, keep_state=False)
        if self.best is not None and self.best["epoch"] == self.epoch:
            self.best_state = _state(self.model)  # the weights just loaded are that epoch's
        self.info["resumed_from"] = self.epoch
        return self.epoch

    def train_step(self) -> dict[str, Any]:
        """One epoch: a full-graph forward and backward pass and one optimizer step
        (collective); its row: epoch, loss, time and the communication it took.

        Raises:
            FloatingPointError: the loss became NaN or infinite.
        """
        self.epoch += 1
        self.stats.reset()
        start = time.perf_counter()
        self.model.train()
        if self.graph is not None:  # eager first, then captured and replayed
            loss = self.graph()
        else:
            self.optimizer.zero_grad(set_to_none=True)
            loss = self._step()
        loss_value = loss.item()
        del loss
        epoch_s = time.perf_counter() - start
        if not torch.isfinite(torch.tensor(loss_value)):
            raise FloatingPointError(
                f"loss became {loss_value} at epoch {self.epoch}; lower --lr or check the "
                "features" + (f", or the prepared dataset may be damaged: python -m "
                              f"plexus.prepare --verify {self.source.path}"
                              if hasattr(self.source, "path") else ""))
        return {"epoch": self.epoch, "loss": loss_value, "epoch_s": epoch_s,
                "comm_s": self.stats.total_seconds,
                "comm_exposed_s": self.stats.exposed_seconds,
                "comm_bytes": self.stats.total_bytes,
                "comm_bytes_by_axis": {a: r.bytes for a, r in self.stats.by_axis().items()},
                # of those, the padding of uneven messages (GraphSAGE's root rows)
                "comm_padding_by_axis": {a: r.padding for a, r in self.stats.by_axis().items()
                                         if r.padding}}

    def _step(self) -> torch.Tensor:
        """Forward, loss, backward and the optimizer's step (gradients start as None); the
        loss, not read back (a CUDA graph captures this)."""
        logits = self.model(self.stats, step=self.epoch)  # the rows of model.output_rows
        net = self.model
        loss = sharded_cross_entropy(logits, net.output_rows(self.labels),
                                     net.output_rows(self.masks["train"]),
                                     rows=self.train_rows,
                                     num_classes=self.shard.num_classes,
                                     count=self.shard.split_counts["train"],
                                     group_o=self.group_o, group_p=self.group_p,
                                     stats=self.stats)
        del logits  # the evaluation pass must not find this pass's logits still alive
        dense.hand_back_pooled()  # every activation alive: the step's usual peak
        loss.backward()
        self.optimizer.step()
        return loss

    def _step_graph(self) -> StepGraph | None:
        """The CUDA graph of :meth:`_step` where :attr:`RunConfig.cuda_graphs` asks for it and
        it can run, else None.

        Raises:
            ValueError: ``cuda_graphs=True`` where it cannot run (the reason named).
        """
        device, dropout = self.parallel.device, self.model_config.dropout
        capturable = all(g.get("capturable", False) for g in self.optimizer.param_groups)
        if not check_asked(self.run_cfg.cuda_graphs, device, self.parallel.world_size,
                           dropout, capturable):
            return None
        model = self.model
        return StepGraph(self._step, zero_grad=lambda: self.optimizer.zero_grad(set_to_none=True),
                         before_replay=lambda: model.drop.set_step(self.epoch),
                         keep=model.cached_inputs, restore=model.restore_cached_inputs,
                         ready=lambda: why_not(device, 1, dropout))

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Accuracy on every split of an eval-mode forward pass (collective), and its time."""
        start = time.perf_counter()
        self.model.eval()
        net = self.model
        pred = sharded_argmax(net(), num_classes=self.shard.num_classes, group_o=self.group_o)
        correct = correct_counts(pred, net.output_rows(self.labels),
                                 {s: net.output_rows(m) for s, m in self.masks.items()},
                                 self.group_p)
        counts = self.shard.split_counts
        return {**{f"{s}_acc": correct[s] / max(counts[s], 1) for s in SPLITS},
                "eval_s": time.perf_counter() - start}

    def record(self, row: dict[str, Any], *, keep_state: bool = True) -> None:
        """Append an epoch's row to the history. If it was evaluated (it has ``val_acc``; with
        ``eval_every`` > 1 most are not) and its validation accuracy is the best so far, it
        becomes :attr:`best` (with a copy of this rank's shards, ``keep_state``)."""
        self.history.append(row)
        if "val_acc" not in row:
            return
        if self.best is None or row["val_acc"] > self.best["val_acc"]:
            self.best = {k: row[k] for k in BEST_KEYS}
            self.best_state = _state(self.model) if keep_state else None

    def save(self, directory: str, *, keep: int = 3) -> None:
        """Checkpoint this epoch under ``directory`` keeping the newest ``keep``; collective
        (each rank writes its own shards)."""
        ckpt.save(directory, self.model, self.optimizer, epoch=self.epoch,
                  history=self.history, meta=self.meta, keep=keep,
                  group=self.parallel.transport)

    def result(self) -> TrainResult:
        """The history, the model and its shard, and ``info``: setup time, config, grid,
        ``resumed_from``, ``preempted``, ``best``, ``best_state`` and ``fallbacks`` (what did
        not run as planned, and ran eagerly or on torch's kernels instead: a CUDA graph
        capture that failed, Triton kernels that failed in this process; empty: none)."""
        failed = None if self.graph is None else self.graph.failed
        fallbacks = ([] if failed is None else [f"CUDA graph: {failed}"]) + [
            f"Triton: {why}" for why in triton_failures()]
        info = {**self.info, "preempted": self.preempted, "best": self.best,
                "best_state": self.best_state, "fallbacks": fallbacks}
        return TrainResult(self.history, self.model, self.shard, dict(self.parallel.groups),
                           info)


def run(trainer: Trainer, *, checkpoint: CheckpointConfig | None = None,
        on_row: Callable[[dict[str, Any]], None] | None = None,
        should_stop: Callable[[], bool] | None = None) -> list[dict[str, Any]]:
    """The training loop: train an epoch, evaluate it (every ``run_cfg.eval_every`` epochs and
    the last), record it, report, checkpoint; returns this call's rows (``trainer.history``
    holds a resumed run's earlier ones too). Rows of epochs not evaluated have no ``*_acc`` and
    no ``eval_s`` (as llm's rows without ``val_loss``).

    Every rank calls it, after :meth:`Trainer.resume` when resuming. ``checkpoint``: default
    the trainer's. ``should_stop`` (a preemption flag) is agreed over all ranks after every
    epoch; when it fires, the loop evaluates that epoch, checkpoints (if ``checkpoint.dir``),
    sets ``trainer.preempted`` and returns early.
    """
    ck, epochs = checkpoint or trainer.checkpoint, trainer.run_cfg.epochs
    p, every = trainer.parallel, trainer.run_cfg.eval_every
    rows = []
    try:
        while trainer.epoch < epochs:
            row = trainer.train_step()
            stop = should_stop is not None and any_rank(should_stop(), p.device, p.transport)
            last = stop or trainer.epoch == epochs
            if last or trainer.epoch % every == 0:
                # draws no random numbers (dropout masks are hashed) and only reads batch
                # norm's running statistics: training is the same whether or not an epoch
                # is evaluated
                row.update(trainer.evaluate())
            trainer.record(row)
            rows.append(row)
            if on_row is not None:
                on_row(row)
            if ck.dir and (last or (ck.every and trainer.epoch % ck.every == 0)):
                trainer.save(ck.dir, keep=ck.keep)
            if stop:
                trainer.preempted = True
                break
    finally:
        dense.hand_back_pooled()  # no idle tall buffer kept past the loop
    return rows


_loop = run  # train_gcn's keyword ``run`` (the RunConfig) hides the function


def train_gcn(source: ShardSource, grid: ProcessGrid, rank: int, *, model: ModelConfig,
              optim: OptimConfig | None = None, run: RunConfig | None = None,
              device: torch.device | str = "cpu", checkpoint: CheckpointConfig | None = None,
              on_epoch: Callable[[dict[str, Any]], None] | None = None,
              on_setup: Callable[[GraphShard, PlexusGCN, dict[str, Any]], None] | None = None,
              should_stop: Callable[[], bool] | None = None,
              transport: MPITransport | None = None) -> TrainResult:
    """Set up, resume (if ``checkpoint.resume``), and run the loop, for callers that hold a
    grid and a rank rather than a :class:`ParallelState`; every rank of ``grid`` calls this.

    ``transport`` (``DistContext.transport``): CPU tensors go through MPI. ``on_setup(shard,
    model, info)`` is called once set up and resumed. ``info["preempted"]`` tells whether
    ``should_stop`` ended the run early.

    Raises:
        ValueError: the grid does not match the process count or the source.
        DatasetCorruptError: a rank could not read its shard (on every rank).
        CheckpointError: ``checkpoint.resume`` found a damaged or foreign checkpoint.
        FloatingPointError: the loss became NaN or infinite.
    """
    parallel = ParallelState.for_rank(grid, rank, transport=transport, device=device)
    trainer = Trainer(source, parallel, model=model, optim=optim, run=run,
                      checkpoint=checkpoint)
    trainer.resume()
    if on_setup is not None:
        on_setup(trainer.shard, trainer.model, trainer.info)
    _loop(trainer, on_row=on_epoch, should_stop=should_stop)
    return trainer.result()


def fit(data: Any, *, grid: str | ProcessGrid = "1x1x1", device: str | None = None,
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

    A graph on a GPU is taken as it is: it is copied to the CPU, where it is cut into shards
    (the caller's object is left untouched), and ``device`` (None: ``"cuda"`` for a graph on a
    GPU, else ``"cpu"``) is where the model trains.
    """
    from common.dist import init_distributed
    from plexus.data import Graph, InMemorySource

    configs = split_config(**config)
    if device is None:
        x = getattr(data, "x", None)
        device = "cuda" if isinstance(x, torch.Tensor) and x.device.type == "cuda" else "cpu"
    if isinstance(data, ShardSource):
        source = data
    else:
        graph = _graph_on_cpu(data) if isinstance(data, Graph) else Graph.from_pyg(
            _pyg_on_cpu(data))
        if symmetrize:
            graph = graph.to_undirected()
        source = InMemorySource(graph, permutation=permutation, seed=configs["run"].seed,
                                aggregation=aggregation_of(configs["model"].model))
    grid = ProcessGrid.parse(grid) if isinstance(grid, str) else grid
    if dist.is_initialized():
        parallel = ParallelState.for_rank(grid, dist.get_rank(), transport=None, device=device)
    else:
        parallel = ParallelState.create(init_distributed(device=device), grid)
    trainer = Trainer(source, parallel, **configs)
    run(trainer, on_row=on_epoch)
    return trainer.result()


# what Graph.from_pyg reads of a PyG Data
_PYG_KEYS = ("x", "y", "edge_index", "train_mask", "val_mask", "test_mask")


def _pyg_on_cpu(data: Any) -> SimpleNamespace:
    """The attributes of a PyG ``Data`` that :meth:`Graph.from_pyg` reads, on the CPU (copies
    of tensors on a GPU; ``Data.cpu()`` would move the caller's own object)."""
    return SimpleNamespace(**{k: v.cpu() if isinstance(v, torch.Tensor) else v
                              for k in _PYG_KEYS if (v := getattr(data, k, None)) is not None})


def _graph_on_cpu(graph: Any) -> Any:
    """``graph`` with every tensor on the CPU (itself when they are already there)."""
    moved = {f.name: v.cpu() for f in fields(graph)
             if isinstance(v := getattr(graph, f.name), torch.Tensor) and v.device.type != "cpu"}
    return replace(graph, **moved) if moved else graph


# ------------------------------------------------------------------ predictions (collective)
def _state(net: PlexusGCN) -> dict[str, torch.Tensor]:
    """A copy of this rank's shards of every parameter and statistic."""
    return {name: t.detach().clone() for name, t, _, _ in net.sharded_state()}


@torch.no_grad()
def _load_state(net: PlexusGCN, state: dict[str, torch.Tensor]) -> None:
    for name, t, _, _ in net.sharded_state():
        t.copy_(state[name])


@torch.no_grad()
def _outputs(result: TrainResult, best: bool = False, all_rows: bool = False
             ) -> tuple[torch.Tensor, ...]:
    """(predicted class, label, split code, original node id) of this rank's padded output
    rows: int64 [N/P] each (split code 0 outside the splits, node id -1 on padding). One
    forward pass in eval mode, on the final weights (or, with ``best``, those of the best
    validation epoch, when this run kept them). A model on labelled rows only predicts the
    rows in a split (the others get -1) unless ``all_rows``: then the pass computes every
    row."""
    o_ax = layout.roles(result.model.num_layers - 1)[0]
    shard, net = result.shard, result.model
    saved = result.info.get("best_state") if best else None
    if best and saved is None:  # the final weights would pass for the best epoch's
        raise ValueError(f"the weights of the best validation epoch are not available: "
                         f"{best_state_missing(result)}")
    net.eval()
    if saved:
        final = _state(net)
        _load_state(net, saved)
    logits = net(all_rows=all_rows)
    if saved:
        _load_state(net, final)
    pred = sharded_argmax(logits, num_classes=shard.num_classes, group_o=result.groups[o_ax])
    held = None if all_rows else net.labelled_rows
    if held is not None:  # labelled rows only: -1 on the others
        pred = torch.full(shard.labels.shape, -1, dtype=pred.dtype,
                          device=pred.device).index_copy_(0, held.to(pred.device), pred)
    # int64, as the predictions: every transport gathers it (gloo has no int16)
    code = torch.zeros(shard.labels.shape, dtype=torch.int64)
    for i, s in enumerate(SPLITS, start=1):
        code[shard.masks[s]] = i
    device = pred.device
    return pred, shard.labels.to(device, torch.int64), code.to(device), torch.from_numpy(
        shard.out_rows).to(device, torch.int64)


def best_state_missing(result: TrainResult) -> str | None:
    """Why ``result`` holds no weights of its best validation epoch (None when it does):
    the epoch came before the checkpoint the run resumed from, or no epoch was evaluated."""
    if result.info.get("best_state") is not None:
        return None
    best, resumed = result.info.get("best"), result.info.get("resumed_from")
    if best is None:
        return "no epoch was evaluated"
    if resumed is not None and best["epoch"] < resumed:
        return (f"the best validation epoch ({best['epoch']}) came before the resume from "
                f"epoch {resumed}, and a checkpoint holds only its own epoch's weights")
    return f"the weights of epoch {best['epoch']} were not kept"


def _p_group(result: TrainResult) -> AxisGroup:
    """The group of the last layer's P axis, over which its output rows are cut."""
    return result.groups[layout.roles(result.model.num_layers - 1)[2]]


def predictions(result: TrainResult) -> torch.Tensor:
    """Predicted class of every node in original order, on every rank (collective).

    Gathers the [N/P] prediction vectors over P; costs one forward pass over every row
    (``forward(all_rows=True)``: on a model whose last layer runs on the labelled rows, this
    pass alone holds the logits of every node).
    """
    g_p = _p_group(result)
    pred, _, _, rows = (coll.all_gather(t, g_p).cpu()
                        for t in _outputs(result, all_rows=True))
    out = torch.full((result.shard.num_nodes,), -1, dtype=torch.int64)
    real = rows >= 0
    out[rows[real]] = pred[real]
    return out


def split_predictions(result: TrainResult, *, best: bool = False
                      ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{split: (labels, predicted classes)}`` of every split's nodes under the final model
    (or the best validation epoch's, with ``best``: a ValueError where the run does not hold
    them, :func:`best_state_missing`), on every rank (collective; for the OGB
    Evaluator). Works on any source: the labels come from the shards, not a whole graph. The
    forward pass computes the split rows only when the model's last layer does (the same
    logits, so the same Evaluator numbers). Only the split rows cross the network and are
    held: each rank's, padded to the most any rank of P has, gathered over P in rank order."""
    pred, labels, code, _ = _outputs(result, best)
    mine = (code > 0).nonzero()[:, 0]
    g_p = _p_group(result)
    most = coll.all_reduce(torch.tensor([mine.numel()], device=code.device), g_p,
                           op=dist.ReduceOp.MAX)
    padded = torch.zeros(3, int(most.item()), dtype=torch.int64, device=code.device)
    for row, t in zip(padded, (pred, labels, code), strict=True):
        row[:mine.numel()] = t[mine]
    pred, labels, code = coll.all_gather(padded, g_p, dim=1).cpu()  # code 0: padding
    return {s: (labels[code == i], pred[code == i]) for i, s in enumerate(SPLITS, start=1)}
