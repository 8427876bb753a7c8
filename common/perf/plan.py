"""Rank every process grid of G ranks by predicted time, for a GCN epoch or a GPT step.

    python -m common.perf.plan gcn --dataset ogbn-products --ranks 64 --machine perlmutter-a100
    python -m common.perf.plan gcn --nodes 16384 --nnz 442478 --features 128 --classes 32 \\
        --ranks 8
    python -m common.perf.plan gpt --vocab 32000 --layers 32 --heads 32 --d-model 4096 \\
        --d-ff 11008 --batch 1024 --seq-len 2048 --ranks 64 --machine perlmutter-a100 --bf16
    python -m common.perf.plan profiles

Prints, per grid: predicted time split into compute and communication per axis, memory per
rank, and whether it fits (see :mod:`common.perf`). The engines hand the planner their workload
(:class:`~common.perf.gcn.GCNWorkload`, :class:`~common.perf.gpt.GPTWorkload`); the trainers'
``--grid auto`` call :func:`common.perf.choose.auto_grid`, and ``python -m llm.plan`` adds the
llm presets on top of this command. Pure Python: imports no engine and no torch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from common.perf import gcn as perf_gcn
from common.perf import gpt as perf_gpt
from common.perf.choose import Workload, plan
from common.perf.machine import available_profiles, load_profile

DATASETS = {"ogbn-products": perf_gcn.ogbn_products, "ogbn-papers100M": perf_gcn.ogbn_papers100m}


def gcn_workload(args: argparse.Namespace) -> perf_gcn.GCNWorkload:
    """The GCN workload of the ``gcn`` sub-command's flags."""
    opts = {"num_layers": args.layers, "hidden": args.hidden,
            "learn_features": args.learn_features, "cache_first_aggregation": not args.no_cache}
    if args.dataset:
        return DATASETS[args.dataset](**opts)
    missing = [f"--{k}" for k in ("nodes", "nnz", "features", "classes")
               if getattr(args, k) is None]
    if missing:
        raise ValueError(f"give --dataset or all of --nodes --nnz --features --classes "
                         f"(missing {' '.join(missing)})")
    return perf_gcn.GCNWorkload(name="graph", num_nodes=args.nodes, nnz=args.nnz,
                                num_features=args.features, num_classes=args.classes, **opts)


def gpt_sizes(args: argparse.Namespace) -> dict[str, Any]:
    """The training sizes of the ``gpt`` sub-command's flags (GPTWorkload keywords)."""
    width = 2 if args.bf16 else 4
    return {"global_batch": args.batch, "micro_batch": args.micro_batch,
            "seq_len": args.seq_len, "param_bytes": width, "grad_bytes": width,
            "activation_bytes": width}


def gpt_workload(args: argparse.Namespace) -> perf_gpt.GPTWorkload:
    """The GPT workload of the ``gpt`` sub-command's explicit model sizes."""
    missing = [f"--{k.replace('_', '-')}" for k in ("vocab", "layers", "heads", "d_model",
                                                     "d_ff") if getattr(args, k) is None]
    if missing:
        raise ValueError(f"give the model sizes (missing {' '.join(missing)})")
    return perf_gpt.GPTWorkload(vocab_size=args.vocab, num_layers=args.layers,
                                num_heads=args.heads, num_kv_heads=args.kv_heads,
                                d_model=args.d_model, d_ff=args.d_ff,
                                tie_embeddings=args.tie_embeddings, **gpt_sizes(args))


def add_plan_args(parser: argparse.ArgumentParser) -> None:
    """``--ranks --machine --ranks-per-node --top``: the flags every sub-command shares."""
    parser.add_argument("--ranks", type=int, required=True, help="G, the number of ranks")
    parser.add_argument("--machine", default=None,
                        help="profile name or JSON path (default $HPC_MACHINE_PROFILE or "
                        "local-cpu)")
    parser.add_argument("--ranks-per-node", type=int, default=None,
                        help="default: the profile's (all ranks on one node for CPU profiles)")
    parser.add_argument("--top", type=int, default=None, help="print only the best N grids")


def add_gpt_size_args(parser: argparse.ArgumentParser) -> None:
    """``--batch --micro-batch --seq-len --bf16``: a GPT step's training sizes."""
    parser.add_argument("--batch", type=int, required=True, help="global sequences per step")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="global sequences per micro-step (default: the largest that fits)")
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--bf16", action="store_true",
                        help="bf16 weights, gradients, activations")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m common.perf.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="engine", required=True)
    shared = argparse.ArgumentParser(add_help=False)
    add_plan_args(shared)
    g = sub.add_parser("gcn", parents=[shared], help="Plexus GCN epoch (x, y, z grids)")
    g.add_argument("--dataset", choices=sorted(DATASETS), default=None)
    g.add_argument("--nodes", type=int)
    g.add_argument("--nnz", type=int, help="nonzeros of the adjacency with self-loops")
    g.add_argument("--features", type=int)
    g.add_argument("--classes", type=int)
    g.add_argument("--layers", type=int, default=3)
    g.add_argument("--hidden", type=int, default=128)
    g.add_argument("--learn-features", action="store_true")
    g.add_argument("--no-cache", action="store_true",
                   help="recompute H_0 every epoch (as the paper's code does)")
    t = sub.add_parser("gpt", parents=[shared], help="GPT step (data, depth, row, col grids); "
                       "for the llm presets use python -m llm.plan")
    t.add_argument("--vocab", type=int)
    t.add_argument("--layers", type=int)
    t.add_argument("--heads", type=int)
    t.add_argument("--kv-heads", type=int, default=None)
    t.add_argument("--d-model", type=int)
    t.add_argument("--d-ff", type=int)
    t.add_argument("--tie-embeddings", action="store_true")
    add_gpt_size_args(t)
    sub.add_parser("profiles", help="list the shipped machine profiles")
    return p.parse_args(argv)


def print_plan(build: Callable[[], Workload], args: argparse.Namespace) -> int:
    """Build the workload, plan it with the shared flags, print the table and the choice;
    exit status (2 with the message on a ValueError from either step)."""
    try:
        ranked = plan(build(), args.ranks, machine=args.machine,
                      ranks_per_node=args.ranks_per_node)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(ranked.table(top=args.top))
    if ranked.runnable:
        print(ranked.describe_choice())
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.engine == "profiles":
        for name in available_profiles():
            print(f"{name:<18} {load_profile(name).description}")
        return 0
    build = gcn_workload if args.engine == "gcn" else gpt_workload
    return print_plan(lambda: build(args), args)


if __name__ == "__main__":
    sys.exit(main())
