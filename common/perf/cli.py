"""Rank every process grid of G ranks by predicted time, for a GCN epoch or a GPT step.

    python -m common.perf gcn --dataset ogbn-products --ranks 64 --machine perlmutter-a100
    python -m common.perf gcn --nodes 16384 --nnz 442478 --features 128 --classes 32 \\
        --ranks 8 --precision bf16
    python -m common.perf gpt --vocab 32000 --layers 32 --heads 32 --d-model 4096 \\
        --d-ff 11008 --batch 1024 --seq-len 2048 --ranks 64 --machine perlmutter-a100 --bf16
    python -m common.perf gcn --dataset ogbn-papers100M --learn-features --ranks 2048 \\
        --machine frontier-mi250x --collectives both --top 5
    python -m common.perf profiles

Prints, per grid: predicted time split into compute and communication per axis, memory per
rank, and whether it fits (see :mod:`common.perf`). ``--collectives`` picks the collective
algorithm (:mod:`common.perf.machine`: ``ring``, PCCL's ``two-level``, ``auto``: the cheaper per
call); ``both`` prints the ring and the two-level plan and whether two-level pays. The engines
hand the planner their workload (:class:`~common.perf.gcn_workload.GCNWorkload`,
:class:`~common.perf.gpt.GPTWorkload`); the trainers' ``--grid`` goes through
:func:`common.perf.choose.parse_grid` and :func:`~common.perf.choose.choose_grid` (``auto``:
:func:`~common.perf.choose.auto_grid`), and ``python -m llm.plan`` adds the llm presets on top
of this command. Pure Python: imports no engine and no torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from typing import Any

from common.perf import gcn as perf_gcn
from common.perf import gpt as perf_gpt
from common.perf.choose import Workload, plan
from common.perf.machine import ALGORITHMS, available_profiles, load_profile
from common.perf.model import Plan

DATASETS = {"ogbn-products": perf_gcn.ogbn_products, "ogbn-papers100M": perf_gcn.ogbn_papers100m}


def gcn_workload(args: argparse.Namespace) -> perf_gcn.GCNWorkload:
    """The GCN workload of the ``gcn`` sub-command's flags."""
    heads = args.heads if args.model == "gat" else 1
    # --hidden is one head's width, as plexus.train's; the workload counts every head's
    opts = {"model": args.model, "num_layers": args.layers, "hidden": args.hidden * heads,
            "heads": heads,
            "attention_dropout": args.attention_dropout,
            "learn_features": args.learn_features, "cache_first_aggregation": not args.no_cache,
            "overlap": {"auto": None, "on": True, "off": False}[args.overlap],
            "norm": args.norm, "precision": args.precision, "dropout": args.dropout,
            "recompute_first": not args.keep_first_aggregation,
            "weight_first": {"auto": None, "on": True, "off": False}[args.weight_first]}
    if args.dataset:  # the preset, with any size given beside it (--nnz of a symmetrised copy)
        given = {f: getattr(args, k) for k, f in (("nodes", "num_nodes"), ("nnz", "nnz"),
                                                  ("features", "num_features"),
                                                  ("classes", "num_classes"))
                 if getattr(args, k) is not None}
        return dataclasses.replace(DATASETS[args.dataset](**opts), **given)
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
            "activation_bytes": width,
            "activation_checkpointing": getattr(args, "activation_checkpointing", False)}


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


def _at_least(low: int) -> Any:
    """An argparse type: an int of at least ``low`` (argparse names the flag on a refusal)."""
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    parse.__name__ = "int"  # argparse's message: "invalid int value"
    return parse


def add_plan_args(parser: argparse.ArgumentParser) -> None:
    """``--ranks --machine --ranks-per-node --top --collectives``: the flags every sub-command
    shares."""
    parser.add_argument("--ranks", type=int, required=True, help="G, the number of ranks")
    parser.add_argument("--machine", default=None,
                        help="profile name or JSON path (default $HPC_MACHINE_PROFILE or "
                        "local-cpu)")
    parser.add_argument("--ranks-per-node", type=_at_least(1), default=None,
                        help="default: the profile's (all ranks on one node for CPU profiles)")
    parser.add_argument("--top", type=_at_least(1), default=None,
                        help="print only the best N grids")
    parser.add_argument("--collectives", choices=[*ALGORITHMS, "both"], default=None,
                        help="collective algorithm: ring, two-level (intra-node then "
                        "inter-node, PCCL), auto (the cheaper per call), or both (print the "
                        "ring and the two-level plans); default: the profile's")


def add_gpt_size_args(parser: argparse.ArgumentParser) -> None:
    """``--batch --micro-batch --seq-len --bf16``: a GPT step's training sizes."""
    parser.add_argument("--batch", type=int, required=True, help="global sequences per step")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="global sequences per micro-step (default: the largest that fits)")
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--bf16", action="store_true",
                        help="bf16 compute and communication (llm.train --precision bf16; "
                        "master weights and AdamW state stay float32)")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="recompute each block in backward (llm.train "
                        "--activation-checkpointing): only block inputs are kept")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m common.perf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="engine", required=True)
    shared = argparse.ArgumentParser(add_help=False)
    add_plan_args(shared)
    g = sub.add_parser("gcn", parents=[shared], help="Plexus GCN epoch (x, y, z grids)")
    g.add_argument("--dataset", choices=sorted(DATASETS), default=None)
    g.add_argument("--nodes", type=int)
    g.add_argument("--nnz", type=int, help="nonzeros of the adjacency with self-loops (with "
                   "--dataset: in place of the preset's, e.g. 3342431700 for ogbn-papers100M "
                   "made symmetric; so --nodes, --features, --classes)")
    g.add_argument("--features", type=int)
    g.add_argument("--classes", type=int)
    g.add_argument("--model", choices=("gcn", "sage", "gat"), default="gcn",
                   help="sage: GraphSAGE, whose root term doubles the aggregation and weight "
                   "collectives; gat: graph attention (common.perf.gat; --hidden is then "
                   "each head's width, as plexus.train's: a hidden layer is heads x hidden)")
    g.add_argument("--heads", type=int, default=8, help="gat: attention heads per layer")
    g.add_argument("--attention-dropout", type=float, default=0.0,
                   help="gat: dropout rate on the attention coefficients")
    g.add_argument("--layers", type=int, default=3)
    g.add_argument("--hidden", type=int, default=128)
    g.add_argument("--learn-features", action="store_true")
    g.add_argument("--norm", choices=("none", "batch", "layer"), default="none",
                   help="normalisation after every hidden layer (plexus.train --norm)")
    g.add_argument("--overlap", choices=("auto", "on", "off"), default="auto",
                   help="the aggregation's collectives overlapped with the SpMM (plexus.train "
                   "--overlap): auto where some axis has more than one rank; the best grid's "
                   "exposed communication is printed with and without it")
    g.add_argument("--precision", choices=perf_gcn.PRECISIONS, default="fp32",
                   help="bf16: the input features, the activations kept for backward and "
                   "every message of the model's collectives in 2 bytes; sums, weights and "
                   "AdamW state float32 (plexus.train --precision)")
    g.add_argument("--no-cache", action="store_true",
                   help="recompute H_0 every epoch (as the paper's code does)")
    g.add_argument("--dropout", type=float, default=0.0,
                   help="dropout rate (plexus.train's default is 0.5; 0 is the paper's bare "
                   "model): its masks are kept for backward, and with fixed features H_0 is "
                   "recomputed in backward")
    g.add_argument("--keep-first-aggregation", action="store_true",
                   help="with fixed features and dropout, keep H_0 for backward instead of "
                   "recomputing it (plexus.train --keep-first-aggregation)")
    g.add_argument("--weight-first", choices=("auto", "on", "off"), default="auto",
                   help="multiply by the weight before aggregating (plexus.train "
                   "--weight-first): auto in the layers that narrow and have one rank")
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
    """Build the workload, plan it with the shared flags, print the table and the choice (for
    ``--collectives both``: the ring and the two-level plan and which pays); exit status (2
    with the message on a ValueError from either step)."""
    algos = ["ring", "two-level"] if args.collectives == "both" else [args.collectives]
    try:
        work = build()
        profile = load_profile(args.machine)
        plans = [plan(work, args.ranks, ranks_per_node=args.ranks_per_node,
                      machine=dataclasses.replace(profile, collective_algorithm=a) if a
                      else profile) for a in algos]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for algo, ranked in zip(algos, plans):
        if len(plans) > 1:
            print(f"\ncollectives: {algo}")
        print(ranked.table(top=args.top))
        if ranked.runnable:
            print(ranked.describe_choice())
            if isinstance(work, perf_gcn.GCNWorkload):
                print(overlap_line(work, ranked.best, profile, args.ranks_per_node))
                print(memory_line(work, ranked.best, profile))
    if len(plans) > 1:
        print(compare_collectives(*plans))
    return 0


def overlap_line(work: Any, best: Any, machine: Any, ranks_per_node: int | None) -> str:
    """One line: the best grid's communication and the part the compute waits for, with the
    overlapped aggregation and without (both predicted on that grid), and which one the
    workload's ``overlap`` option (auto: :func:`common.perf.gcn_workload.overlap_pays`) runs."""
    on, off = (perf_gcn.predict_gcn(dataclasses.replace(work, overlap=flag), best.shape, machine,
                                    ranks_per_node=ranks_per_node) for flag in (True, False))
    used = "on" if best.hidden > 0 else "off"
    return (f"overlap ({used} here): communication {1e3 * best.comm_s:.1f} ms per epoch, "
            f"exposed {1e3 * on.exposed_comm_s:.1f} ms with overlap, "
            f"{1e3 * off.exposed_comm_s:.1f} ms without; epoch {1e3 * on.total_s:.1f} ms "
            f"with, {1e3 * off.total_s:.1f} ms without")


def memory_line(work: Any, best: Any, machine: Any) -> str:
    """One line: what the best grid's memory per rank holds, the largest part first
    (:func:`common.perf.gcn_memory.gcn_memory_parts`), so that the top is what to cut."""
    gpu = machine.device_memory is not None
    parts = perf_gcn.gcn_memory_parts(work, best.shape, stored_transposes=gpu,
                                      fused_norm=not gpu, rounds_x=gpu)
    names = {"adjacency": "adjacency", "transient": "transients", "kept_h": "kept H",
             "kept_other": "other kept", "features": "features", "weights": "weights",
             "nodes": "node vectors"}
    items = sorted(parts.items(), key=lambda kv: -kv[1])
    return (f"memory per rank of {best.label()}: " + ", ".join(
        f"{names.get(k, k)} {v / 2**30:.2f} GiB" for k, v in items))


def compare_collectives(ring: Plan, two_level: Plan) -> str:
    """One line: the best grid's predicted time with ring and with two-level collectives."""
    if not ring.runnable or not two_level.runnable:
        return "collectives: no runnable grid to compare"
    r, t = ring.best, two_level.best
    gain = r.total_s / t.total_s - 1
    if abs(gain) < 5e-4:
        verdict = "no difference (within 0.05%)"
    elif gain > 0:
        verdict = f"two-level pays ({100 * gain:.1f}% faster)"
    else:
        verdict = f"ring is better (two-level {100 * (t.total_s / r.total_s - 1):.1f}% slower)"
    return (f"collectives: ring {r.label()} {1e3 * r.total_s:.1f} ms (communication "
            f"{1e3 * r.comm_s:.1f}), two-level {t.label()} {1e3 * t.total_s:.1f} ms "
            f"(communication {1e3 * t.comm_s:.1f}): {verdict}")


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
