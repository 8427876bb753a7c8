"""Train a GCN on a whole graph with the Plexus 3D-parallel algorithm.

    python -m plexus.train                                   # built-in graph, one process
    mpiexec -n 8 python -m plexus.train --grid 2x2x2 --dataset ogbn-arxiv --root data
    torchrun --standalone --nproc-per-node 4 -m plexus.train --grid 1x2x2

Every rank reads the dataset and keeps its shards; rank 0 prints and writes ``--metrics``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

import torch

from common.checkpoint import CheckpointError
from common.dist import (
    exit_on_comm_failure,
    fail_all_ranks,
    init_distributed,
    is_comm_failure,
    preemption_flag,
    shutdown,
)
from common.grid import ProcessGrid
from plexus import partition as part
from plexus.graph import Graph
from plexus.ogb_io import DatasetCorruptError
from plexus.prepared import PreparedGraph, is_prepared
from plexus.trainer import CheckpointConfig, TrainConfig, predictions, train_gcn


def default_grid(world_size: int) -> ProcessGrid:
    """The most cubic X x Y x Z = world_size (largest axis first: y, then x, then z)."""
    best = None
    for x in range(1, world_size + 1):
        for y in range(1, world_size // x + 1):
            if world_size % (x * y):
                continue
            z = world_size // (x * y)
            key = (max(x, y, z), -y, -x)
            if best is None or key < best[0]:
                best = (key, (x, y, z))
    return ProcessGrid.plexus(*best[1])


def auto_grid(spec: str, graph, cfg: TrainConfig, ctx) -> ProcessGrid:
    """``--grid auto[:PROFILE]``: the grid :mod:`common.perf` predicts fastest for this graph.

    A pure function of the graph's sizes, the config and the profile, so every rank picks the
    same grid without communicating. Rank 0 logs the choice and the runner-up.
    """
    from common.perf import gcn as perf_gcn
    from common.perf.machine import load_profile

    if isinstance(graph, PreparedGraph):  # counted while preparing
        nnz = graph.nnz
    else:  # nnz of Â: edges other than self-loops, plus one per node
        src, dst = graph.edge_index
        nnz = int((src != dst).sum()) + graph.num_nodes
    work = perf_gcn.GCNWorkload(
        name=graph.name, num_nodes=graph.num_nodes, nnz=nnz, num_features=graph.num_features,
        num_classes=graph.num_classes, num_layers=cfg.layers, hidden=cfg.hidden,
        learn_features=cfg.learn_features)
    machine = load_profile(spec.partition(":")[2] or None)
    grid, plan = perf_gcn.auto_grid(work, ctx.world_size, machine,
                                    ranks_per_node=ctx.local_world_size)
    if ctx.is_main:
        print(f"{plan.describe_choice()} [profile {machine.name}]", flush=True)
    k = graph.blocks if isinstance(graph, PreparedGraph) else None
    if k is not None and any(k % s for s in grid.shape.values()):  # prepared: axes | k
        fits = [p for p in plan.runnable if all(k % s == 0 for s in p.shape.values())]
        if not fits:
            raise ValueError(f"no grid of {ctx.world_size} ranks has axis sizes dividing the "
                             f"{k}x{k} blocks of {graph.path}; prepare with another --blocks")
        grid = ProcessGrid.plexus(fits[0].shape["x"], fits[0].shape["y"], fits[0].shape["z"])
        if ctx.is_main:
            print(f"grid {grid}: the fastest predicted grid whose axes divide k={k}",
                  flush=True)
    return grid


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = TrainConfig()
    p = argparse.ArgumentParser(
        prog="python -m plexus.train",
        description="Full-graph GCN training with Plexus 3D parallelism (SC'25), on CPU "
        "(gloo) or GPU (NCCL), under mpiexec, torchrun, srun or one process.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--dataset", default="planted",
                   help="planted (built-in, learnable), rmat / rmat-SCALE (synthetic), "
                   "ogbn-arxiv, ogbn-products, ogbn-papers100M, or a directory written by "
                   "python -m plexus.prepare (each rank maps only its blocks)")
    p.add_argument("--root", default="data",
                   help="directory holding OGB datasets (and prepared ones, by name)")
    p.add_argument("--grid", default=None,
                   help="XxYxZ process grid (default: the most cubic one for the world size), "
                   "or auto[:PROFILE]: the grid the performance model predicts fastest on a "
                   "machine profile (name or JSON path; default $HPC_MACHINE_PROFILE, else "
                   "local-cpu; see python -m common.plan)")
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--hidden", type=int, default=d.hidden)
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--permutation", choices=part.PERMUTATIONS, default=argparse.SUPPRESS,
                   help=f"load-balancing permutation (default: {d.permutation}; a prepared "
                   "dataset's own)")
    p.add_argument("--learn-features", action="store_true",
                   help="make the input features trainable parameters")
    p.add_argument("--metrics", default=None, metavar="PATH",
                   help="write JSON lines (one per epoch, then a summary) from rank 0")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--log-every", type=int, default=10, help="print every N epochs")
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="write atomic checkpoints here (at the end, every --checkpoint-every "
                   "epochs, and on SIGTERM/SIGUSR1); needs a filesystem all ranks share")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="N")
    p.add_argument("--keep-checkpoints", type=int, default=3, metavar="K")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest intact checkpoint in --checkpoint-dir "
                   "(any grid; bit-for-bit on the same grid)")
    args = p.parse_args(argv)
    args.permutation = getattr(args, "permutation", None)  # None: not given
    return args


def _log_setup(result_info: dict[str, Any], shard, model, ctx, graph, grid) -> None:
    """Block balance per adjacency layout, loading time and per-rank memory (max over ranks).

    Adjacency bytes count every distinct index/value array once (layers may share a block),
    whether held in memory or memory-mapped from a prepared dataset.
    """
    import torch.distributed as dist

    seen: dict[Any, int] = {}
    for b in shard.adj.values():
        for m in (b.a, b.a_t):
            for arr in m.arrays():
                seen[getattr(arr, "filename", None) or id(arr)] = arr.nbytes
    adj = sum(seen.values())
    other = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    t = torch.tensor([float(adj), float(other), float(resident_bytes()), float(peak_bytes())])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    mapped = isinstance(graph, PreparedGraph)
    result_info["memory_per_rank_max"] = {
        "adjacency_bytes": int(t[0]), "adjacency_mapped": mapped, "features_weights_bytes":
        int(t[1]), "resident_bytes_after_setup": int(t[2]), "peak_bytes_after_setup": int(t[3])}
    if ctx.is_main:
        print(f"graph {graph.name}: {graph.num_nodes:,} nodes, {graph.num_edges:,} edges, "
              f"{graph.num_features} features, {graph.num_classes} classes; grid {grid} "
              f"({ctx.world_size} ranks, {ctx.launcher}, {ctx.backend})", flush=True)
        for layer, blk in sorted(shard.adj.items()):
            o, i, p = part.roles(layer)
            print(f"  adjacency layout {layer} (O,I,P)=({o},{i},{p}): max/mean nonzeros per "
                  f"block {blk.balance.max_nnz:,}/{blk.balance.mean_nnz:,.0f} = "
                  f"{blk.balance.ratio:.3f}", flush=True)
        how = "memory-mapped" if mapped else "in memory"
        print(f"  {'loading' if mapped else 'setup'} {result_info['setup_s']:.2f} s; per rank "
              f"(max): adjacency {t[0].item() / 2**20:.1f} MiB ({how}), features and weights "
              f"{t[1].item() / 2**20:.1f} MiB, resident {t[2].item() / 2**20:.1f} MiB "
              f"(peak {t[3].item() / 2**20:.1f} MiB)", flush=True)


def resident_bytes() -> int:
    """Current resident set size of this process (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def peak_bytes() -> int:
    """Peak resident set size of this process so far."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        ctx = init_distributed(device=args.device)
    except ValueError as e:
        fail_all_ranks(str(e), None)
    main_rank = ctx.is_main
    try:
        auto = (args.grid or "").split(":")[0] == "auto"
        grid = None if auto else (ProcessGrid.parse(args.grid) if args.grid
                                  else default_grid(ctx.world_size))
        if grid is not None:
            grid.validate(ctx.world_size)
        cfg = TrainConfig(layers=args.layers, hidden=args.hidden, epochs=args.epochs,
                          lr=args.lr, weight_decay=args.weight_decay, seed=args.seed,
                          permutation=args.permutation or TrainConfig().permutation,
                          learn_features=args.learn_features)
        ck = CheckpointConfig(dir=args.checkpoint_dir, every=args.checkpoint_every,
                              keep=args.keep_checkpoints, resume=args.resume)
        if args.metrics and main_rank:
            _check_writable(args.metrics)
        if args.checkpoint_dir:
            _check_writable(os.path.join(args.checkpoint_dir, "x"), create=True)
        graph = _load_graph(args)
        prepared = isinstance(graph, PreparedGraph)
        if prepared and args.permutation is None:
            cfg = dataclasses.replace(cfg, permutation=graph.permutation)
        if auto:
            grid = auto_grid(args.grid, graph, cfg, ctx)
        if prepared:  # axes must divide k
            graph.check_grid(grid.shape)
            graph.check_config(cfg.permutation)
    except (ValueError, FileNotFoundError, OSError) as e:
        fail_all_ranks(str(e), ctx)
    # written under a temporary name and renamed at the end: a failed run overwrites nothing
    metrics = open(args.metrics + ".tmp", "w") if args.metrics and main_rank else None

    def on_epoch(row: dict[str, Any]) -> None:
        if metrics:
            metrics.write(json.dumps(row) + "\n")
        e = row["epoch"]
        if main_rank and (e == 1 or e % max(args.log_every, 1) == 0 or e == args.epochs):
            share = row["comm_s"] / row["epoch_s"] if row["epoch_s"] else 0.0
            print(f"epoch {e:>4}/{args.epochs}  loss {row['loss']:.4f}  "
                  f"train {100 * row['train_acc']:5.2f}%  val {100 * row['val_acc']:5.2f}%  "
                  f"test {100 * row['test_acc']:5.2f}%  {1000 * row['epoch_s']:8.1f} ms/epoch  "
                  f"comm {100 * share:4.1f}%", flush=True)

    try:
        result = train_gcn(
            graph, grid, ctx.rank, cfg, device=ctx.device, on_epoch=on_epoch, checkpoint=ck,
            should_stop=preemption_flag(),
            on_setup=lambda shard, model, info: _log_setup(info, shard, model, ctx, graph, grid))
    except (CheckpointError, FloatingPointError, DatasetCorruptError) as e:  # on every rank
        if metrics:
            metrics.close()
            os.remove(metrics.name)
        fail_all_ranks(str(e), ctx)
    except (RuntimeError, ConnectionError) as e:
        if not is_comm_failure(e):
            raise
        exit_on_comm_failure(e, ctx)  # a peer was lost mid-epoch
    if main_rank and result.info.get("resumed_from"):
        print(f"resumed from the checkpoint of epoch {result.info['resumed_from']}", flush=True)
    if result.info["preempted"]:
        if main_rank:
            print(f"preempted (SIGTERM/SIGUSR1): checkpoint written at epoch "
                  f"{result.history[-1]['epoch']}; rerun with --resume to continue", flush=True)
            if metrics:
                metrics.close()
                os.replace(args.metrics + ".tmp", args.metrics)
        shutdown()
        return 0
    summary = _summary(result, graph, grid, ctx, args)
    if main_rank:
        _print_summary(summary)
        if metrics:
            metrics.write(json.dumps({"summary": summary}) + "\n")
            metrics.close()
            os.replace(args.metrics + ".tmp", args.metrics)
    shutdown()
    return 0


def _load_graph(args: argparse.Namespace):
    """A prepared directory (``--dataset PATH``, or ``ROOT/NAME``) or a dataset by name."""
    for path in (args.dataset, os.path.join(args.root, args.dataset)):
        if is_prepared(path):
            return PreparedGraph(path)
    from plexus.datasets import load_dataset

    return load_dataset(args.dataset, root=args.root, seed=args.seed)


def _check_writable(path: str, create: bool = False) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    if create:
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            raise ValueError(f"cannot create directory {folder}: {e.strerror}") from e
    if not os.path.isdir(folder):
        raise ValueError(f"--metrics {path}: directory {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"--metrics {path}: directory {folder} is not writable")


def _summary(result, graph, grid, ctx, args) -> dict[str, Any]:
    hist = result.history
    best = max(hist, key=lambda r: r["val_acc"]) if hist else {}
    steady = hist[1:] if len(hist) > 1 else hist  # epoch 1 includes warm-up
    epoch_s = sum(r["epoch_s"] for r in steady) / max(len(steady), 1)
    comm_s = sum(r["comm_s"] for r in steady) / max(len(steady), 1)
    out = {
        "dataset": graph.name, "num_nodes": graph.num_nodes, "num_edges": graph.num_edges,
        "grid": str(grid), "world_size": ctx.world_size, "launcher": ctx.launcher,
        "device": str(ctx.device), **result.info["config"],
        "setup_s": result.info["setup_s"],
        "epoch_s_mean": epoch_s, "comm_s_mean": comm_s,
        "comm_share": comm_s / epoch_s if epoch_s else 0.0,
        "comm_bytes_per_epoch": hist[-1]["comm_bytes"] if hist else 0,
        "memory_per_rank_max": {**result.info.get("memory_per_rank_max", {}),
                                "peak_bytes": _max_over_ranks(peak_bytes())},
        "final": {k: hist[-1][k] for k in ("loss", "train_acc", "val_acc", "test_acc")}
        if hist else {},
        "best_val": {"epoch": best.get("epoch"), "val_acc": best.get("val_acc"),
                     "test_acc": best.get("test_acc")},
    }
    if graph.name.startswith("ogbn-") and hist and isinstance(graph, Graph):
        from plexus.datasets import ogb_accuracy

        pred = predictions(result)
        if ctx.is_main:
            out["ogb_evaluator"] = {
                s: ogb_accuracy(graph.name, graph.y[idx], pred[idx])
                for s, idx in (("train", graph.train_idx), ("val", graph.val_idx),
                               ("test", graph.test_idx))
            }
    return out


def _max_over_ranks(value: int) -> int:
    import torch.distributed as dist

    t = torch.tensor([float(value)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _print_summary(s: dict[str, Any]) -> None:
    rows = [
        ("dataset", f"{s['dataset']} ({s['num_nodes']:,} nodes, {s['num_edges']:,} edges)"),
        ("grid", f"{s['grid']} on {s['world_size']} ranks ({s['launcher']}, {s['device']})"),
        ("model", f"{s['layers']} layers, hidden {s['hidden']}, permutation "
                  f"{s['permutation']}, learn features {s['learn_features']}"),
        ("epochs", f"{s['epochs']} (setup {s['setup_s']:.2f} s)"),
        ("peak memory", f"{s['memory_per_rank_max']['peak_bytes'] / 2**20:,.0f} MiB resident "
                        "per rank (max)"),
        ("epoch time", f"{1000 * s['epoch_s_mean']:.1f} ms, communication "
                       f"{100 * s['comm_share']:.1f}%, {s['comm_bytes_per_epoch'] / 2**20:.2f} "
                       "MiB sent per rank"),
    ]
    if s["final"]:
        f, b = s["final"], s["best_val"]
        rows.append(("final", f"loss {f['loss']:.4f}, train {100 * f['train_acc']:.2f}%, "
                              f"val {100 * f['val_acc']:.2f}%, test {100 * f['test_acc']:.2f}%"))
        rows.append(("best val", f"epoch {b['epoch']}: val {100 * b['val_acc']:.2f}%, "
                                 f"test {100 * b['test_acc']:.2f}%"))
    if "ogb_evaluator" in s:
        rows.append(("OGB Evaluator", ", ".join(f"{k} {100 * v:.2f}%"
                                                for k, v in s["ogb_evaluator"].items())))
    width = max(len(k) for k, _ in rows)
    print("\n" + "\n".join(f"{k:<{width}}  {v}" for k, v in rows), flush=True)


if __name__ == "__main__":
    sys.exit(main())
