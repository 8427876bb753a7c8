"""Train a GPT on a 4D grid (data x depth x row x col) with the goldfish loss.

    python -m llm.train                                    # tiny GPT, built-in corpus, 1 process
    mpiexec -n 8 python -m llm.train --grid data=2,depth=1,row=2,col=2 --steps 500
    python -m llm.train --docs 32 --epochs 300 --batch-size 32 --goldfish-k 4 --out runs/gf
    python -m llm.train --out runs/gf --resume --epochs 400   # continue exactly where it stopped
    python -m llm.memorization --checkpoint runs/gf --docs 32 --suffix-len 32
    python -m llm.sample --checkpoint runs/gf --prompt "The assert statement"

Every rank builds the same full model from ``--seed`` and keeps its shards; rank 0 prints,
writes ``--metrics`` (JSON lines) and the checkpoints in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from common.dist import (
    any_rank,
    exit_on_comm_failure,
    fail_all_ranks,
    init_distributed,
    is_comm_failure,
    preemption_flag,
    shutdown,
)
from common.grid import AXONN_AXES, ProcessGrid
from llm import checkpoint
from llm.goldfish import STRATEGIES
from llm.model import PRESETS, get_preset
from llm.parallel import check_grid, make_groups
from llm.trainer import DataConfig, GoldfishConfig, OptimConfig, TrainConfig, Trainer


def run(trainer: Trainer, *, out: str | None = None, is_main: bool = True,
        on_row: Callable[[dict[str, Any]], None] | None = None,
        should_stop: Callable[[], bool] | None = None) -> list[dict[str, Any]]:
    """The training loop: step, evaluate, checkpoint, report; returns the logged rows.

    ``should_stop`` (a preemption flag) is agreed over all ranks after every step; when it
    fires the loop checkpoints (with ``out``) and returns early, the last row marked
    ``"preempted"``.
    """
    cfg, history = trainer.train_cfg, []
    while trainer.step < trainer.total_steps:
        row = trainer.train_step()
        stop = should_stop is not None and any_rank(should_stop(), _collective_device())
        if stop:
            row["preempted"] = True
        last = stop or trainer.step == trainer.total_steps
        if last or (cfg.eval_every and trainer.step % cfg.eval_every == 0):
            row.update(trainer.evaluate())
        if out and (last or (cfg.save_every and trainer.step % cfg.save_every == 0)):
            state = trainer.state_dict()  # collective: every rank gathers the full tensors
            if is_main:
                row["checkpoint"] = str(checkpoint.save(state, out))
        history.append(row)
        if on_row is not None:
            on_row(row)
        if stop:
            break
    return history


def _collective_device() -> str:
    import torch.distributed as dist

    return "cuda" if dist.is_initialized() and dist.get_backend() == "nccl" else "cpu"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d, o, t = DataConfig(), OptimConfig(), TrainConfig()
    p = argparse.ArgumentParser(
        prog="python -m llm.train", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="GPT training on a 4D grid (data x depth x row x col, AxoNN-style) with the "
        "goldfish loss, on CPU (gloo) or GPU (NCCL), under mpiexec, torchrun, srun or alone.")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--grid", default=None, help="e.g. data=2,depth=1,row=2,col=2 or 2x1x2x2 "
                   "(data x depth x row x col), or auto[:PROFILE] (the performance model's "
                   "choice, see python -m common.plan); default: data parallel over all ranks")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 200)")
    p.add_argument("--epochs", type=float, default=None, help="passes over the training "
                   "samples instead of --steps")
    p.add_argument("--docs", type=int, default=None, help="train on the first N documents, "
                   "each truncated to --seq-len tokens (the memorization setting)")
    p.add_argument("--text", nargs="+", default=None, metavar="FILE",
                   help="UTF-8 text files instead of the built-in corpus")
    p.add_argument("--text-split", choices=("files", "paragraphs"), default="files",
                   help="one document per file, or per blank-line-separated paragraph")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="global micro-batch")
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--grad-accum", type=int, default=t.grad_accum,
                   help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=o.lr)
    p.add_argument("--min-lr-ratio", type=float, default=o.min_lr_ratio)
    p.add_argument("--warmup", type=int, default=o.warmup_steps, help="warmup steps")
    p.add_argument("--weight-decay", type=float, default=o.weight_decay)
    p.add_argument("--grad-clip", type=float, default=o.grad_clip, help="0: no clipping")
    p.add_argument("--goldfish-k", type=int, default=0, help="drop ~1/k targets; 0: off")
    p.add_argument("--goldfish-h", type=int, default=13, help="hash context width")
    p.add_argument("--goldfish-strategy", choices=STRATEGIES, default="hash")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--val-fraction", type=float, default=d.val_fraction)
    p.add_argument("--eval-every", type=int, default=t.eval_every, help="0: at the end only")
    p.add_argument("--eval-batches", type=int, default=d.eval_batches)
    p.add_argument("--log-every", type=int, default=t.log_every)
    p.add_argument("--save-every", type=int, default=t.save_every, help="0: at the end only")
    p.add_argument("--out", default=None, metavar="DIR", help="checkpoint directory")
    p.add_argument("--resume", action="store_true", help="continue from DIR/checkpoint.pt")
    p.add_argument("--metrics", default=None, metavar="PATH", help="JSON lines, one per step")
    p.add_argument("--overlap", default=t.overlap,
                   help="communication overlap: all, none, or a list of oar,ors,oag")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank; 0: 1 for "
                   "models with d_model <= 128 (their GEMMs lose more to thread sync than they "
                   "gain), else the rank's share of the cores (OMP_NUM_THREADS wins if set)")
    return p.parse_args(argv)


def build(args: argparse.Namespace, grid: ProcessGrid, rank: int, device) -> Trainer:
    """Configs from the command line, then the trainer (creating groups is collective)."""
    model_config = get_preset(args.preset)
    check_grid(model_config, grid.shape)
    data = DataConfig(source=args.text_split if args.text else "pydoc",
                      paths=tuple(args.text or ()), docs=args.docs, seq_len=args.seq_len,
                      batch_size=args.batch_size, val_fraction=args.val_fraction,
                      eval_batches=args.eval_batches, seed=args.seed)
    optim = OptimConfig(lr=args.lr, min_lr_ratio=args.min_lr_ratio, warmup_steps=args.warmup,
                        weight_decay=args.weight_decay, grad_clip=args.grad_clip)
    goldfish = GoldfishConfig(k=args.goldfish_k, h=args.goldfish_h,
                              strategy=args.goldfish_strategy)
    train = TrainConfig(steps=args.steps, epochs=args.epochs, grad_accum=args.grad_accum,
                        eval_every=args.eval_every, save_every=args.save_every,
                        log_every=args.log_every, overlap=args.overlap)
    return Trainer(model_config, data, optim, goldfish, train, make_groups(grid, rank),
                   seed=args.seed, device=device)


def _set_threads(args: argparse.Namespace) -> None:
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    elif "OMP_NUM_THREADS" not in os.environ and args.preset in PRESETS and \
            PRESETS[args.preset]().d_model <= 128:
        torch.set_num_threads(1)


def _check_paths(args: argparse.Namespace) -> None:
    if args.resume and not args.out:
        raise ValueError("--resume needs --out DIR (the directory holding checkpoint.pt)")
    if args.metrics:
        folder = os.path.dirname(os.path.abspath(args.metrics))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise ValueError(f"--metrics {args.metrics}: directory {folder} does not exist or "
                             "is not writable")
    if args.out and os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(f"--out {args.out} exists and is not a directory")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        ctx = init_distributed(device=args.device)
    except ValueError as e:
        fail_all_ranks(str(e), None)
    _set_threads(args)
    try:
        if (args.grid or "").split(":")[0] == "auto":  # the performance model picks
            from common.plan import choose_gpt_grid

            grid, plan = choose_gpt_grid(
                get_preset(args.preset), batch_size=args.batch_size, grad_accum=args.grad_accum,
                seq_len=args.seq_len, world_size=ctx.world_size,
                ranks_per_node=ctx.local_world_size, profile=args.grid.partition(":")[2] or None)
            if ctx.is_main:
                print(plan.describe_choice(), flush=True)
        else:
            grid = (ProcessGrid.parse(args.grid, AXONN_AXES) if args.grid
                    else ProcessGrid.axonn(ctx.world_size, 1, 1, 1))
        grid.validate(ctx.world_size)
        _check_paths(args)
        trainer = build(args, grid, ctx.rank, ctx.device)
        if args.resume:
            trainer.load_state_dict(checkpoint.load(args.out))
    except (ValueError, FileNotFoundError, OSError) as e:
        fail_all_ranks(str(e), ctx)
    metrics = None
    if args.metrics and ctx.is_main:
        metrics = open(args.metrics, "a" if args.resume else "w", buffering=1)
    if ctx.is_main:
        _print_header(trainer, args, grid, ctx)
    start = time.perf_counter()

    def on_row(row: dict[str, Any]) -> None:
        if metrics:
            metrics.write(json.dumps(row) + "\n")
        s = row["step"]
        if ctx.is_main and (s == 1 or "val_loss" in row or "checkpoint" in row or
                            (args.log_every and s % args.log_every == 0)):
            print(_format_row(row, trainer), flush=True)

    try:
        history = run(trainer, out=args.out, is_main=ctx.is_main, on_row=on_row,
                      should_stop=preemption_flag())
    except (RuntimeError, ConnectionError) as e:
        if not is_comm_failure(e):
            raise
        exit_on_comm_failure(e, ctx)  # a peer was lost: name it and exit on every rank
    if history and history[-1].get("preempted") and ctx.is_main:
        print(f"preempted (SIGTERM/SIGUSR1) at step {trainer.step}"
              + (f"; checkpoint in {args.out}, rerun with --resume" if args.out else
                 "; no --out, so nothing was saved"), flush=True)
    if ctx.is_main:
        summary = _summary(history, time.perf_counter() - start, trainer)
        print(summary["text"], flush=True)
        if metrics:
            metrics.write(json.dumps({"summary": {k: v for k, v in summary.items()
                                                  if k != "text"}}) + "\n")
            metrics.close()
    shutdown()
    return 0


def _print_header(trainer: Trainer, args, grid: ProcessGrid, ctx) -> None:
    cfg, data, g = trainer.model_config, trainer.data_cfg, trainer.goldfish
    text = (f"{data.docs} documents x {data.seq_len + 1} tokens" if data.docs is not None
            else "a stream of documents")
    source = "built-in corpus (pydoc topics)" if data.source == "pydoc" else \
        f"{len(data.paths)} text file(s)"
    fish = (f"goldfish k={g.k} h={g.h} {g.strategy}" if g.k else "standard loss (no goldfish)")
    resumed = f", resumed at step {trainer.step}" if args.resume else ""
    print(f"GPT {args.preset}: {cfg.num_params():,} parameters ({cfg.n_layer} layers, "
          f"d_model {cfg.d_model}, {cfg.n_head} heads); grid {grid} ({ctx.world_size} ranks, "
          f"{ctx.launcher}, {ctx.backend}), overlap {trainer.train_cfg.overlap}\n"
          f"data: {source}, {text}; {fish}; {trainer.total_steps} steps of "
          f"{data.batch_size} x {data.seq_len} tokens x {trainer.train_cfg.grad_accum} "
          f"micro-batches{resumed}", flush=True)


def _format_row(row: dict[str, Any], trainer: Trainer) -> str:
    text = f"step {row['step']:>5}/{trainer.total_steps}  loss {row['loss']:.4f}"
    if row["num_dropped"]:
        text += f" (all {row['loss_all']:.4f}, dropped {row['loss_dropped']:.4f})"
    text += (f"  lr {row['lr']:.2e}  |g| {row['grad_norm']:.3f}  "
             f"{row['tokens_per_s']:,.0f} tok/s")
    if "val_loss" in row:
        text += f"  val {row['val_loss']:.4f} (ppl {row['val_ppl']:.2f})"
    if "checkpoint" in row:
        text += f"  saved {row['checkpoint']}"
    return text


def _summary(history: list[dict[str, Any]], seconds: float, trainer: Trainer) -> dict:
    if not history:
        return {"steps": trainer.step, "text": f"nothing to do: already at step {trainer.step}"}
    steady = history[1:] or history  # the first step includes warm-up
    tokens_per_s = sum(r["tokens"] for r in steady) / sum(r["step_s"] for r in steady)
    last = history[-1]
    out = {"steps": trainer.step, "loss": last["loss"], "val_loss": last.get("val_loss"),
           "tokens_per_s": tokens_per_s, "wall_s": seconds}
    val = f", val loss {last['val_loss']:.4f}" if "val_loss" in last else ""
    out["text"] = (f"done: {trainer.step} steps in {seconds:.1f} s, loss {last['loss']:.4f}"
                   f"{val}, {tokens_per_s:,.0f} tokens/s")
    return out


if __name__ == "__main__":
    sys.exit(main())
