"""Train a GCN on a whole graph with the Plexus 3D-parallel algorithm.

    python -m plexus.train                                   # built-in graph, one process
    mpiexec -n 8 python -m plexus.train --grid 2x2x2 --dataset ogbn-arxiv --root data
    torchrun --standalone --nproc-per-node 4 -m plexus.train --grid 1x2x2

Every rank reads the dataset and keeps its shards; rank 0 prints and writes ``--metrics``.
"""

from __future__ import annotations

import argparse
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

    src, dst = graph.edge_index
    work = perf_gcn.GCNWorkload(  # nnz of Â: edges other than self-loops, plus one per node
        name=graph.name, num_nodes=graph.num_nodes,
        nnz=int((src != dst).sum()) + graph.num_nodes, num_features=graph.num_features,
        num_classes=graph.num_classes, num_layers=cfg.layers, hidden=cfg.hidden,
        learn_features=cfg.learn_features)
    machine = load_profile(spec.partition(":")[2] or None)
    grid, plan = perf_gcn.auto_grid(work, ctx.world_size, machine,
                                    ranks_per_node=ctx.local_world_size)
    if ctx.is_main:
        print(f"{plan.describe_choice()} [profile {machine.name}]", flush=True)
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
                   "ogbn-arxiv, ogbn-products, ogbn-papers100M")
    p.add_argument("--root", default="data", help="directory holding OGB datasets")
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
    p.add_argument("--permutation", choices=part.PERMUTATIONS, default=d.permutation)
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
    return p.parse_args(argv)


def _log_setup(result_info: dict[str, Any], shard, model, ctx, graph, grid) -> None:
    """Block balance per adjacency layout and per-rank memory (max over ranks)."""
    import torch.distributed as dist

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    # every CSR block and its transpose (values, column and row indices), then the weights and
    # the feature shard (a parameter or a buffer: counted once either way)
    mem = sum(b.a.nbytes + b.a_t.nbytes for b in shard.adj.values())
    mem += sum(nbytes(t) for t in [*model.parameters(), *model.buffers()])
    t = torch.tensor([float(mem)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if ctx.is_main:
        print(f"graph {graph.name}: {graph.num_nodes:,} nodes, {graph.num_edges:,} edges, "
              f"{graph.num_features} features, {graph.num_classes} classes; grid {grid} "
              f"({ctx.world_size} ranks, {ctx.launcher}, {ctx.backend})", flush=True)
        for layer, blk in sorted(shard.adj.items()):
            o, i, p = part.roles(layer)
            print(f"  adjacency layout {layer} (O,I,P)=({o},{i},{p}): max/mean nonzeros per "
                  f"block {blk.balance.max_nnz:,}/{blk.balance.mean_nnz:,.0f} = "
                  f"{blk.balance.ratio:.3f}", flush=True)
        print(f"  memory per rank (max): {t.item() / 2**20:.1f} MiB in adjacency, features and "
              f"weights; setup {result_info['setup_s']:.2f} s", flush=True)


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
                          permutation=args.permutation, learn_features=args.learn_features)
        ck = CheckpointConfig(dir=args.checkpoint_dir, every=args.checkpoint_every,
                              keep=args.keep_checkpoints, resume=args.resume)
        if args.metrics and main_rank:
            _check_writable(args.metrics)
        if args.checkpoint_dir:
            _check_writable(os.path.join(args.checkpoint_dir, "x"), create=True)
        from plexus.datasets import load_dataset

        graph = load_dataset(args.dataset, root=args.root, seed=args.seed)
        if auto:
            grid = auto_grid(args.grid, graph, cfg, ctx)
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
    except (CheckpointError, FloatingPointError) as e:  # the same on every rank
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
        "final": {k: hist[-1][k] for k in ("loss", "train_acc", "val_acc", "test_acc")}
        if hist else {},
        "best_val": {"epoch": best.get("epoch"), "val_acc": best.get("val_acc"),
                     "test_acc": best.get("test_acc")},
    }
    if graph.name.startswith("ogbn-") and hist:
        from plexus.datasets import ogb_accuracy

        pred = predictions(result)
        if ctx.is_main:
            out["ogb_evaluator"] = {
                s: ogb_accuracy(graph.name, graph.y[idx], pred[idx])
                for s, idx in (("train", graph.train_idx), ("val", graph.val_idx),
                               ("test", graph.test_idx))
            }
    return out


def _print_summary(s: dict[str, Any]) -> None:
    rows = [
        ("dataset", f"{s['dataset']} ({s['num_nodes']:,} nodes, {s['num_edges']:,} edges)"),
        ("grid", f"{s['grid']} on {s['world_size']} ranks ({s['launcher']}, {s['device']})"),
        ("model", f"{s['layers']} layers, hidden {s['hidden']}, permutation "
                  f"{s['permutation']}, learn features {s['learn_features']}"),
        ("epochs", f"{s['epochs']} (setup {s['setup_s']:.2f} s)"),
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
