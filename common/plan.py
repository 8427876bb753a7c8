"""Rank every process grid of G ranks by predicted time, for a GCN epoch or a GPT step.

    python -m common.plan gcn --dataset ogbn-products --ranks 64 --machine perlmutter-a100
    python -m common.plan gcn --nodes 16384 --nnz 442478 --features 128 --classes 32 --ranks 8
    python -m common.plan gpt --preset gpt7b --batch 1024 --seq-len 2048 --ranks 64 \\
        --machine perlmutter-a100 --bf16
    python -m common.plan profiles

Prints, per grid: predicted time split into compute and communication per axis, memory per
rank, and whether it fits (see :mod:`common.perf`). The trainers' ``--grid auto`` use the same
functions: :func:`common.perf.gcn.auto_grid` (plexus.train) and :func:`choose_gpt_grid`
(llm.train). Pure Python, except that ``gpt --preset`` reads the sizes from llm.model (torch).
"""

from __future__ import annotations

import argparse
import sys

from common.grid import ProcessGrid
from common.perf import gcn as perf_gcn
from common.perf import gpt as perf_gpt
from common.perf.machine import available_profiles, load_profile
from common.perf.model import Plan

DATASETS = {"ogbn-products": perf_gcn.ogbn_products, "ogbn-papers100M": perf_gcn.ogbn_papers100m}


def choose_gpt_grid(config, *, batch_size: int, grad_accum: int = 1, seq_len: int,
                    world_size: int, ranks_per_node: int | None = None,
                    profile: str | None = None, param_bytes: int = 4) -> tuple[ProcessGrid, Plan]:
    """``llm.train --grid auto[:PROFILE]``: the 4D grid predicted fastest for a GPT step.

    Args:
        config: an ``llm.model.GPTConfig`` (read by attribute).
        batch_size: global sequences per micro-batch (llm.train ``--batch-size``).
        grad_accum: micro-batches per step (``--grad-accum``).
        seq_len: tokens per sequence.
        world_size, ranks_per_node: the job (``ctx.world_size``, ``ctx.local_world_size``).
        profile: machine profile name or JSON path (None: ``$HPC_MACHINE_PROFILE`` or
            ``local-cpu``).
        param_bytes: 4 (float32, as llm.train runs) or 2 (bf16 weights and activations).

    Returns:
        The grid and the plan; log ``plan.describe_choice()`` on rank 0. The result is a pure
        function of the arguments, so every rank picks the same grid.

    Raises:
        ValueError: unknown profile, or no grid fits in memory and divides heads and batch.
    """
    work = perf_gpt.GPTWorkload.from_config(
        config, global_batch=batch_size * grad_accum, micro_batch=batch_size, seq_len=seq_len,
        param_bytes=param_bytes, grad_bytes=param_bytes, activation_bytes=param_bytes)
    return perf_gpt.auto_grid(work, world_size, load_profile(profile),
                              ranks_per_node=ranks_per_node)


def _gcn(args: argparse.Namespace) -> Plan:
    opts = {"num_layers": args.layers, "hidden": args.hidden,
            "learn_features": args.learn_features, "cache_first_aggregation": not args.no_cache}
    if args.dataset:
        work = DATASETS[args.dataset](**opts)
    else:
        missing = [f"--{k}" for k in ("nodes", "nnz", "features", "classes")
                   if getattr(args, k) is None]
        if missing:
            raise ValueError(f"give --dataset or all of --nodes --nnz --features --classes "
                             f"(missing {' '.join(missing)})")
        work = perf_gcn.GCNWorkload(name="graph", num_nodes=args.nodes, nnz=args.nnz,
                                    num_features=args.features, num_classes=args.classes,
                                    **opts)
    return perf_gcn.plan_gcn(work, args.ranks, load_profile(args.machine),
                             ranks_per_node=args.ranks_per_node)


def _gpt(args: argparse.Namespace) -> Plan:
    width = 2 if args.bf16 else 4
    sizes = {"global_batch": args.batch, "micro_batch": args.micro_batch,
             "seq_len": args.seq_len, "param_bytes": width, "grad_bytes": width,
             "activation_bytes": width}
    if args.preset:
        from llm.model import get_preset

        work = perf_gpt.GPTWorkload.from_config(get_preset(args.preset), name=args.preset,
                                                **sizes)
    else:
        missing = [f"--{k.replace('_', '-')}" for k in ("vocab", "layers", "heads", "d_model",
                                                         "d_ff") if getattr(args, k) is None]
        if missing:
            raise ValueError(f"give --preset or the model sizes (missing {' '.join(missing)})")
        work = perf_gpt.GPTWorkload(vocab_size=args.vocab, n_layer=args.layers,
                                    n_head=args.heads, n_kv_head=args.kv_heads,
                                    d_model=args.d_model, d_ff=args.d_ff, **sizes)
    return perf_gpt.plan_gpt(work, args.ranks, load_profile(args.machine),
                             ranks_per_node=args.ranks_per_node)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m common.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="engine", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--ranks", type=int, required=True, help="G, the number of ranks")
    common.add_argument("--machine", default=None,
                        help="profile name or JSON path (default $HPC_MACHINE_PROFILE or "
                        "local-cpu)")
    common.add_argument("--ranks-per-node", type=int, default=None,
                        help="default: the profile's (all ranks on one node for CPU profiles)")
    common.add_argument("--top", type=int, default=None, help="print only the best N grids")
    g = sub.add_parser("gcn", parents=[common], help="Plexus GCN epoch (x, y, z grids)")
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
    t = sub.add_parser("gpt", parents=[common], help="GPT step (data, depth, row, col grids)")
    t.add_argument("--preset", default=None, help="an llm.model preset (tiny, gpt1b, gpt7b...)")
    t.add_argument("--vocab", type=int)
    t.add_argument("--layers", type=int)
    t.add_argument("--heads", type=int)
    t.add_argument("--kv-heads", type=int, default=None)
    t.add_argument("--d-model", type=int)
    t.add_argument("--d-ff", type=int)
    t.add_argument("--batch", type=int, required=True, help="global sequences per step")
    t.add_argument("--micro-batch", type=int, default=None,
                   help="global sequences per micro-step (default: the largest that fits)")
    t.add_argument("--seq-len", type=int, required=True)
    t.add_argument("--bf16", action="store_true", help="bf16 weights, gradients, activations")
    sub.add_parser("profiles", help="list the shipped machine profiles")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.engine == "profiles":
            for name in available_profiles():
                m = load_profile(name)
                print(f"{name:<18} {m.description}")
            return 0
        plan = _gcn(args) if args.engine == "gcn" else _gpt(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(plan.table(top=args.top))
    if plan.runnable:
        print(plan.describe_choice())
    return 0


if __name__ == "__main__":
    sys.exit(main())
