"""Train a GCN on a whole graph with the Plexus 3D-parallel algorithm (command line).

    python -m plexus.train                                   # built-in graph, one process
    mpiexec -n 8 python -m plexus.train --grid 2x2x2 --dataset ogbn-arxiv --root data
    python -m plexus.train --dataset Planetoid/Cora --root data --layers 2 --hidden 16 \\
        --epochs 200 --normalize-features --runs 10      # PyG's GCN example, 10 seeds
    torchrun --standalone --nproc-per-node 4 -m plexus.train --grid 1x2x2
    mpiexec -n 8 python -m plexus.train --dataset ogbn-papers100M --grid 2x2x2   # prepared
        # once into data/prepared/ogbn-papers100M-k8-double-s0, then mapped (plexus.data.cache)

This module parses arguments: the grid is :func:`common.perf.choose_grid`'s, the dataset
:func:`plexus.data.job.open_dataset`'s, the trainer and its loop :mod:`plexus.trainer`'s, what
is printed :mod:`plexus.report`'s. Rank 0 prints and writes ``--metrics``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from common import dense
from common.checkpoint import CheckpointError
from common.dist import DistContext
from common.failure import preemption_flag
from common.memory import release, resident_bytes
from common.parallel import ParallelState
from common.perf.choose import choose_grid, parse_grid
from common.run import (
    MetricsWriter,
    add_checkpoint_args,
    add_launch_args,
    check_checkpoint_dir,
    check_writable,
    checkpoint_config,
    run_or_exit,
    start,
)
from plexus.config import (
    GAT_HEADS,
    MODELS,
    NORMS,
    OPTIMIZERS,
    PRECISIONS,
    ModelConfig,
    OptimConfig,
    RunConfig,
    check_run_options,
    gcn_workload,
)
from plexus.cuda_graph import check_asked
from plexus.data import DatasetCorruptError, ShardSource, available_datasets
from plexus.data.cache import PREPARE_MODES, PrepareFailedError
from plexus.data.job import job_token, open_dataset
from plexus.data.partition import PERMUTATIONS
from plexus.data.schema import DEFAULT_ROOT
from plexus.report import log_setup, print_summary, run_summary, runs_summary
from plexus.sparse import SPMM_KERNELS
from plexus.trainer import Trainer, TrainResult, run

_print_summary = print_summary  # its former name here, which callers still import


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    m, o, r = ModelConfig(), OptimConfig(), RunConfig()
    p = argparse.ArgumentParser(
        prog="python -m plexus.train",
        description="Full-graph GCN training with Plexus 3D parallelism (SC'25), on CPU "
        "(gloo) or GPU (NCCL), under mpiexec, torchrun, srun or one process.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--dataset", default="planted",
                   help=f"{', '.join(available_datasets())}, a .npy edge file, or a directory "
                   "written by python -m plexus.prepare (each rank maps only its blocks)")
    p.add_argument("--root", default=DEFAULT_ROOT,
                   help="directory holding OGB datasets (and prepared ones, by name; the "
                   "cache of --prepare in ROOT/prepared)")
    p.add_argument("--prepare", choices=PREPARE_MODES, default="auto",
                   help="prepare the dataset once into ROOT/prepared/NAME-kK-PERMUTATION-sSEED"
                   "[-sym] (rank 0 writes, the other ranks wait; later runs reuse it) and "
                   "memory-map it per rank. auto: for ogbn-papers100M, ogbn-products, .npy edge "
                   "files and OGB datasets over 1 GiB (nodes*features*4 + edges*16 bytes, from "
                   "the file headers), for every --model (a prepared dataset serves them all); "
                   "always: every OGB dataset or edge file; never: load the whole graph on "
                   "every rank")
    p.add_argument("--blocks", type=int, default=None, metavar="K",
                   help="k (k x k blocks) of a cache --prepare writes; every grid axis must "
                   "divide it. Default: the smallest multiple of lcm(X, Y, Z) >= 8 of the grid "
                   "(--grid XxYxZ or the default one); 8 with --grid auto")
    p.add_argument("--grid", default=None,
                   help="XxYxZ process grid (default: the most cubic one for the world size), "
                   "or auto[:PROFILE]: the grid the performance model predicts fastest on a "
                   "machine profile (name or JSON path; default $HPC_MACHINE_PROFILE, else "
                   "local-cpu; see python -m common.perf)")
    p.add_argument("--model", choices=MODELS, default=m.model,
                   help="gcn (Kipf & Welling), sage (GraphSAGE: mean of in-neighbours plus "
                   "a root weight) or gat (graph attention, PyG's GATConv: --heads, "
                   "--attention-dropout)")
    p.add_argument("--layers", type=int, default=m.num_layers, help="layers")
    p.add_argument("--hidden", type=int, default=m.hidden,
                   help="hidden width (gat: of each head; a hidden layer is heads x hidden)")
    p.add_argument("--heads", type=int, default=m.heads,
                   help="gat only: attention heads of every layer, concatenated in the hidden "
                   "layers and averaged in the last; every layer's inner grid axis must divide "
                   f"it; {GAT_HEADS} when not given")
    p.add_argument("--attention-dropout", type=float, default=m.attention_dropout,
                   help="gat: dropout rate on the attention coefficients (PyG's GATConv "
                   "dropout; the same masks on any grid)")
    p.add_argument("--dropout", type=float, default=m.dropout,
                   help="dropout rate on the input of every layer (the same masks on any grid)")
    p.add_argument("--no-bias", dest="bias", action="store_false", help="layers without bias")
    p.add_argument("--norm", choices=NORMS, default=m.norm,
                   help="normalisation after every hidden layer (batch statistics are "
                   "reduced over the ranks, so any grid trains the serial model)")
    p.add_argument("--residual", action="store_true",
                   help="residual connections in the hidden-to-hidden layers (1 .. L-2: "
                   "needs --layers 3 or more)")
    p.add_argument("--labelled-rows", choices=("auto", "on", "off"), default="auto",
                   help="last layer on the rows of labelled nodes only (exact): auto where at "
                   "most half the nodes are in a split")
    p.add_argument("--overlap", choices=("auto", "on", "off"), default="auto",
                   help="aggregate in row blocks whose all-reduces (and the weight "
                   "all-gathers) travel while the next block computes: auto where some "
                   "axis has more than one rank and the communication has resources of its "
                   "own (a GPU, or two cores per rank); off: the unblocked layer")
    p.add_argument("--aggregation-blocks", type=int, default=None, metavar="K",
                   help="row blocks of the blocked aggregation (default: 4 with overlap)")
    p.add_argument("--keep-first-aggregation", dest="recompute_first", action="store_false",
                   help="gcn and sage: with fixed features and dropout, keep layer 0's "
                   "aggregation H_0 for its weight gradient instead of recomputing it in "
                   "backward (default: "
                   "recompute, which saves an [N, D_0] block for one more layer-0 SpMM)")
    p.add_argument("--weight-first", choices=("auto", "on", "off"), default="auto",
                   help="multiply by the weight before aggregating, A (F W), as PyG's GCNConv "
                   "does: the SpMMs run at the narrower width. auto: in the layers that narrow "
                   "and have one rank; on: every layer whose outer and inner axes have one "
                   "rank (but layer 0 with fixed features); off: aggregate first everywhere")
    p.add_argument("--normalize-features", action="store_true",
                   help="row-normalise the input features (PyG's NormalizeFeatures)")
    p.add_argument("--symmetrize", action="store_true",
                   help="add the reverse of every edge (directed graphs such as ogbn-arxiv, "
                   "as OGB's examples do)")
    p.add_argument("--learn-features", action="store_true",
                   help="make the input features trainable parameters")
    p.add_argument("--precision", choices=PRECISIONS, default=m.precision,
                   help="bf16: input features and the activations kept for backward stored "
                   "in bf16, every message of the model's collectives sent in bf16 (half the "
                   "bytes); SpMM, GEMM and collective sums, weights, gradients and Adam state "
                   "in float32 (not with --learn-features)")
    p.add_argument("--epochs", type=int, default=r.epochs)
    p.add_argument("--eval-every", type=int, default=r.eval_every, metavar="N",
                   help="evaluate (an eval-mode forward, accuracies on every split) after "
                   "every N-th epoch and the last; the best validation epoch is chosen among "
                   "the evaluated ones (PyG's examples evaluate every epoch)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=o.optimizer,
                   help="adam: weight decay as an L2 term (PyG/OGB examples); adamw: decoupled")
    p.add_argument("--lr", type=float, default=o.lr)
    p.add_argument("--weight-decay", type=_decays, default=o.weight_decay, metavar="WD[,WD...]",
                   help="one value, or one per layer (PyG's GCN example: 5e-4,0 decays only "
                   "the first layer)")
    p.add_argument("--seed", type=int, default=r.seed,
                   help="seeds the weights, dropout, the permutations and generated graphs")
    p.add_argument("--runs", type=int, default=1,
                   help="train N times with seeds SEED..SEED+N-1 and print mean +- std of the "
                   "test accuracy at the best validation epoch (as OGB reports)")
    p.add_argument("--permutation", choices=PERMUTATIONS, default=None,
                   help="load-balancing permutation (default: double; a prepared "
                   "dataset's own)")
    p.add_argument("--spmm", choices=SPMM_KERNELS, default=r.spmm,
                   help="CPU SpMM kernel: numba, cache-blocked (auto when numba is installed), "
                   "numba-rows (row-parallel, no column slices) or torch.sparse (gat runs "
                   "SpMMs only with --residual)")
    p.add_argument("--gemm", choices=dense.BACKENDS, default=r.gemm,
                   help="gcn and sage: backend of the dense products H W, dQ W^T and dW: "
                   "auto (oneDNN for "
                   "float32 on the CPU: it uses AVX-512 where torch's MKL does not, on AMD "
                   "CPUs; tf32 in bf16 on a GPU), onednn, torch (torch's BLAS) or tf32 (on a "
                   "GPU the tensor cores in TF32, float32 sums)")
    p.add_argument("--no-retain-freed-memory", dest="retain_freed_memory",
                   action="store_false",
                   help="give large freed buffers back to the OS (default: keep them, so "
                   "every epoch reuses its activation pages; see common.alloc)")
    p.add_argument("--pool-buffers", action=argparse.BooleanOptionalAction, default=None,
                   help="keep freed activation buffers (the tall [N, D] ones) for reuse: no "
                   "fresh pages for most of them after the first step (faster where fresh "
                   "pages are slow, as on VMs that hand freed memory back to their host), for "
                   "about 1%% more peak memory or less (common.dense). Default: on where freed "
                   "memory is retained (see --no-retain-freed-memory)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="capture the training step in a CUDA graph and replay it every epoch "
                   "(the same numbers, one launch an epoch; plexus.cuda_graph). Default: on "
                   "where it can run (one rank on a GPU; with dropout, Triton's masks)")
    p.add_argument("--metrics", default=None, metavar="PATH",
                   help="write JSON lines (one per epoch, then a summary) from rank 0")
    p.add_argument("--log-every", type=int, default=10, help="print every N epochs")
    add_launch_args(p)
    add_checkpoint_args(p, unit="epochs")
    return p.parse_args(argv)


def _decays(text: str) -> float | tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number or comma-separated numbers "
                                         "(one per layer)") from None
    return values[0] if len(values) == 1 else values


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ctx = start(args)
    import plexus.kernels  # noqa: F401  numba's memory: the process's share, not the data's
    start_bytes = resident_bytes()  # the process before any data: what the planner leaves out
    source, parallel, configs = run_or_exit(ctx, lambda: build(args, ctx), user_errors=(
        ValueError, OSError, PrepareFailedError))
    metrics = MetricsWriter(args.metrics, enabled=ctx.is_main, resume=args.resume)
    run_index = 0

    def on_epoch(row: dict[str, Any]) -> None:
        metrics.write({"run": run_index, **row} if args.runs > 1 else row)
        e = row["epoch"]
        if ctx.is_main and (e == 1 or e % max(args.log_every, 1) == 0 or e == args.epochs):
            share = row["comm_s"] / row["epoch_s"] if row["epoch_s"] else 0.0
            exposed = row["comm_exposed_s"] / row["epoch_s"] if row["epoch_s"] else 0.0
            acc = (f"train {100 * row['train_acc']:5.2f}%  val {100 * row['val_acc']:5.2f}%  "
                   f"test {100 * row['test_acc']:5.2f}%  " if "val_acc" in row else
                   f"{'(not evaluated)':<39}")  # --eval-every: the columns stay aligned
            print(f"epoch {e:>4}/{args.epochs}  loss {row['loss']:.4f}  {acc}"
                  f"{1000 * row['epoch_s']:8.1f} ms/epoch  comm {100 * share:4.1f}% "
                  f"(exposed {100 * exposed:4.1f}%)",
                  flush=True)

    def train() -> TrainResult:
        run_cfg = dataclasses.replace(configs["run"], seed=args.seed + run_index)
        trainer = Trainer(source, parallel, model=configs["model"], optim=configs["optim"],
                          run=run_cfg, checkpoint=configs["checkpoint"])
        trainer.resume()  # if --resume and there is a checkpoint
        if run_index == 0:
            log_setup(trainer, ctx, start_bytes)
        run(trainer, on_row=on_epoch, should_stop=preemption_flag())
        return trainer.result()

    summaries = []
    with metrics:
        for run_index in range(args.runs):
            if ctx.is_main and args.runs > 1:
                print(f"run {run_index + 1}/{args.runs} (seed {args.seed + run_index})",
                      flush=True)
            result = run_or_exit(ctx, train, user_errors=(
                CheckpointError, FloatingPointError, DatasetCorruptError))
            if ctx.is_main and result.info.get("resumed_from"):
                print(f"resumed from the checkpoint of epoch {result.info['resumed_from']}",
                      flush=True)
            if result.info["preempted"]:
                if ctx.is_main:
                    print(f"preempted (SIGTERM/SIGUSR1): checkpoint written at epoch "
                          f"{result.history[-1]['epoch']}; rerun with --resume to continue",
                          flush=True)
                return 0
            summary = run_summary(result, source, parallel.grid, ctx)
            summaries.append(summary)
            # free this run's model, shards and optimizer state (and on a GPU hand their
            # memory back) before the next run sets up: two runs never hold memory at once
            del result
            release(parallel.device)
            if ctx.is_main:
                print_summary(summary)
                metrics.write({"summary": summary} if args.runs == 1 else
                              {"run": run_index, "summary": summary})
        if args.runs > 1:
            overall = runs_summary(summaries)
            if ctx.is_main:
                print("\n" + overall["text"], flush=True)
                metrics.write({"runs_summary": overall})
    return 0


_AUTO_ON_OFF = {"auto": None, "on": True, "off": False}


def build(args: argparse.Namespace, ctx: DistContext) -> tuple[ShardSource, ParallelState, dict]:
    """The configs, the dataset, the grid and its groups (collective), from the flags."""
    token = job_token(ctx, prepare=args.prepare)  # first: no rank may be left waiting in it
    configs = {
        "model": ModelConfig(model=args.model, num_layers=args.layers, hidden=args.hidden,
                             heads=args.heads, attention_dropout=args.attention_dropout,
                             learn_features=args.learn_features, dropout=args.dropout,
                             bias=args.bias, norm=args.norm,
                             normalize_features=args.normalize_features,
                             residual=args.residual,
                             labelled_rows_only=_AUTO_ON_OFF[args.labelled_rows],
                             overlap=_AUTO_ON_OFF[args.overlap],
                             aggregation_blocks=args.aggregation_blocks,
                             precision=args.precision,
                             recompute_first=args.recompute_first,
                             weight_first=_AUTO_ON_OFF[args.weight_first]),
        "optim": OptimConfig(optimizer=args.optimizer, lr=args.lr,
                             weight_decay=args.weight_decay),
        "run": RunConfig(epochs=args.epochs, eval_every=args.eval_every, seed=args.seed,
                         spmm=args.spmm, gemm=args.gemm,
                         retain_freed_memory=args.retain_freed_memory,
                         pool_buffers=args.pool_buffers, cuda_graphs=args.cuda_graphs),
    }
    configs["optim"].layer_decays(args.layers)  # a per-layer list must fit the depth
    check_run_options(configs["model"], configs["run"])
    if args.runs < 1:
        raise ValueError(f"--runs must be >= 1, got {args.runs}")
    if args.runs > 1 and args.epochs < 1:  # no run would have an accuracy to average
        raise ValueError(f"--runs {args.runs} reports the mean test accuracy over the runs, "
                         f"and --epochs {args.epochs} trains and evaluates nothing: give "
                         "--epochs >= 1, or --runs 1")
    ck = configs["checkpoint"] = checkpoint_config(args)
    if args.runs > 1 and ck.dir:
        raise ValueError("--runs > 1 trains several models; checkpoints hold one: drop "
                         "--checkpoint-dir or use --runs 1")
    if args.metrics:  # every rank checks, so every rank fails alike
        check_writable(args.metrics, flag="--metrics")
    if ck.dir:
        check_checkpoint_dir(ck.dir, resume=ck.resume)
    spec = parse_grid(args.grid, ctx.world_size)
    source = open_dataset(args.dataset, ctx, grid=spec, blocks=args.blocks, model=args.model,
                          token=token, root=args.root, permutation=args.permutation,
                          seed=args.seed, symmetrize=args.symmetrize, prepare=args.prepare)
    grid, note = choose_grid(spec, gcn_workload(configs["model"], source), ctx.world_size,
                             ranks_per_node=ctx.local_world_size,
                             constraints=[source.grid_problems])
    if note and ctx.is_main:
        print(note, flush=True)
    parallel = ParallelState.create(ctx, grid)
    check_asked(args.cuda_graphs, parallel.device, parallel.world_size, configs["model"].dropout)
    return source, parallel, configs


if __name__ == "__main__":
    sys.exit(main())
