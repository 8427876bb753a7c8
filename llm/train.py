"""Train a GPT on a 4D grid (data x depth x row x col) with the goldfish loss: the CLI.

    python -m llm.train                                    # tiny GPT, built-in corpus, 1 process
    mpiexec -n 8 python -m llm.train --grid data=2,depth=1,row=2,col=2 --steps 500
    python -m llm.train --docs 32 --epochs 300 --batch-size 32 --goldfish-k 4 \\
        --checkpoint-dir runs/gf
    python -m llm.train --docs 32 --epochs 400 --batch-size 32 --goldfish-k 4 \\
        --checkpoint-dir runs/gf --resume   # the same run, to 400 epochs
    mpiexec -n 4 python -m llm.train --preset small --grid data=1,depth=2,row=2,col=1 \
        --precision bf16 --activation-checkpointing       # bf16, blocks recomputed in backward
    python -m llm.memorization --checkpoint runs/gf --docs 32 --suffix-len 32
    python -m llm.sample --checkpoint runs/gf --prompt "The assert statement"

This module parses arguments, builds the configs and prints: the grid is
:func:`common.perf.choose_grid`'s, the trainer, its resume and its loop (:func:`llm.trainer.run`)
:mod:`llm.trainer`'s. Every rank draws only its shards of the model, keyed by ``--seed``
(the same model on every grid; no rank holds it all); rank 0 prints and writes ``--metrics``
(JSON lines); every rank writes its shards of the checkpoints (``DIR/step-N/``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from common.dist import DistContext
from common.failure import preemption_flag
from common.grid import AXONN_AXES
from common.memory import describe_peaks, peaks_per_rank_max
from common.parallel import ParallelState
from common.perf.choose import choose_grid, parse_grid
from common.perf.gpt import GPTWorkload
from common.precision import PRECISIONS
from common.run import (
    CheckpointConfig,
    MetricsWriter,
    add_checkpoint_args,
    add_launch_args,
    check_checkpoint_dir,
    check_writable,
    checkpoint_config,
    run_or_exit,
    start,
    steady_mean,
)
from llm.config import (
    STRATEGIES,
    DataConfig,
    GoldfishConfig,
    OptimConfig,
    PrecisionConfig,
    RunConfig,
)
from llm.mfu import mfu
from llm.model import PRESETS, GPTConfig, get_preset
from llm.parallel.gpt import AXIS_SETS
from llm.trainer import Trainer, run

DEFAULT_PRESET = "tiny"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d, o, r = DataConfig(), OptimConfig(), RunConfig()
    p = argparse.ArgumentParser(
        prog="python -m llm.train",
        description="GPT training on a 4D grid (data x depth x row x col, AxoNN-style) with the "
        "goldfish loss, on CPU (gloo) or GPU (NCCL), under mpiexec, torchrun, srun or alone.")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help=f"model sizes (default: {DEFAULT_PRESET}; python -m llm.plan ranks "
                   "grids)")
    p.add_argument("--vocab-size", type=int, default=None, metavar="V",
                   help="the preset with this vocabulary (a --tokenizer larger than 256 ids)")
    p.add_argument("--init", default=None, metavar="HF_DIR",
                   help="start from a Hugging Face Llama directory (config.json + safetensors): "
                   "its sizes replace --preset, and each rank reads only its slices of the "
                   "weights; its tokenizer.json is the default --tokenizer")
    p.add_argument("--grid", default=None, help="e.g. data=2,depth=1,row=2,col=2 or 2x1x2x2 "
                   "(data x depth x row x col), or auto[:PROFILE] (the performance model's "
                   "choice, see python -m llm.plan); default: data parallel over all ranks")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 200)")
    p.add_argument("--epochs", type=float, default=None, help="passes over the training "
                   "samples instead of --steps")
    p.add_argument("--docs", type=int, default=None, help="train on the first N documents, "
                   "each truncated to --seq-len tokens (the memorization setting)")
    p.add_argument("--text", nargs="+", default=None, metavar="FILE",
                   help="UTF-8 text files instead of the built-in corpus (pydoc topics)")
    p.add_argument("--text-split", choices=("files", "paragraphs"), default="files",
                   help="one document per file, or per blank-line-separated paragraph "
                   "(default: %(default)s); .jsonl files: one document per line's text")
    p.add_argument("--token-file", default=None, metavar="FILE",
                   help="a pre-tokenised stream (.bin uint16 or .npy, python -m llm.tokenize), "
                   "memory-mapped, instead of --text")
    p.add_argument("--token-cache", default=None, metavar="DIR",
                   help="tokenize --text once into DIR and memory-map it (streams big corpora)")
    p.add_argument("--tokenizer", default=None, metavar="SPEC",
                   help="bytes, or a Hugging Face tokenizer.json (file or model directory); "
                   "default: --init's tokenizer.json if it has one, else bytes")
    p.add_argument("--batch-size", type=int, default=d.batch_size,
                   help="global sequences per micro-batch, split over data x depth "
                   "(default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=d.seq_len,
                   help="tokens per sequence (default: %(default)s)")
    p.add_argument("--grad-accum", type=int, default=r.grad_accum,
                   help="micro-batches per optimizer step (default: %(default)s)")
    p.add_argument("--lr", type=float, default=o.lr, help="peak learning rate (default: "
                   "%(default)s)")
    p.add_argument("--min-lr-ratio", type=float, default=o.min_lr_ratio,
                   help="the cosine decays to this share of --lr (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=o.warmup_steps,
                   help="linear warmup steps (default: %(default)s)")
    p.add_argument("--weight-decay", type=float, default=o.weight_decay,
                   help="AdamW weight decay of the matrices (default: %(default)s)")
    p.add_argument("--neftune-alpha", type=float, default=o.neftune_alpha, metavar="A",
                   help="NEFTune: uniform noise scaled by A / sqrt(seq_len * d_model) on the "
                   "token embeddings in training (the paper uses 5); 0: off")
    p.add_argument("--grad-clip", type=float, default=o.grad_clip,
                   help="global gradient-norm clip; 0: none (default: %(default)s)")
    p.add_argument("--goldfish-k", type=int, default=0,
                   help="drop ~1/k of the targets from the loss; 0: off (default: 0)")
    p.add_argument("--goldfish-h", type=int, default=13,
                   help="hash context width (default: %(default)s)")
    p.add_argument("--goldfish-strategy", choices=STRATEGIES, default="hash",
                   help="which targets to drop (default: %(default)s, the paper's)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the weights, the data order and the split (default: 0)")
    p.add_argument("--val-fraction", type=float, default=d.val_fraction,
                   help="share of documents held out in stream mode (default: %(default)s)")
    p.add_argument("--eval-every", type=int, default=r.eval_every,
                   help="evaluate every N steps; 0: at the end only (default: %(default)s)")
    p.add_argument("--eval-batches", type=int, default=d.eval_batches,
                   help="held-out batches per evaluation (default: %(default)s)")
    p.add_argument("--log-every", type=int, default=r.log_every,
                   help="print every N steps; 0: first, evaluated and saved steps only "
                   "(default: %(default)s)")
    add_checkpoint_args(p, unit="steps")
    # the flags' names before the two trainers shared them (same destinations)
    p.add_argument("--out", dest="checkpoint_dir", metavar="DIR", default=argparse.SUPPRESS,
                   help="alias of --checkpoint-dir")
    p.add_argument("--save-every", dest="checkpoint_every", type=int, metavar="N",
                   default=argparse.SUPPRESS, help="alias of --checkpoint-every")
    p.add_argument("--metrics", default=None, metavar="PATH",
                   help="JSON lines, one per step and a summary (written to PATH.tmp, renamed "
                   "at the end; --resume appends)")
    p.add_argument("--overlap", default=r.overlap,
                   help="communication overlap: all, none, or a list of oar,ors,oag "
                   "(default: %(default)s)")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="bf16: bf16 compute and communication with float32 master weights, "
                   "optimizer state and loss (default: %(default)s)")
    p.add_argument("--peak-tflops", type=float, default=None, metavar="T",
                   help="one device's dense peak TFLOP/s, for the MFU printed every logged "
                   "step (default: from llm.mfu's table on a GPU it knows; none on a CPU)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each transformer block in backward instead of keeping its "
                   "activations (less memory, about one more forward of compute)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer block (fused kernels: faster steps "
                   "after a first one that compiles; grids without tensor parallelism)")
    add_launch_args(p)
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank; 0 "
                   "(default): 1 for models with d_model <= 128 (their GEMMs lose more to "
                   "thread sync than they gain), else the rank's share of the cores "
                   "(OMP_NUM_THREADS wins if set)")
    return p.parse_args(argv)


def build(args: argparse.Namespace, ctx: DistContext, checkpoint: CheckpointConfig
          ) -> tuple[Trainer, str | None]:
    """Configs from the command line, the grid and its groups (collective), then the trainer;
    and the planner's note when ``--grid auto`` chose."""
    init, model_config = model_of(args)
    if args.token_file and args.text:
        raise ValueError("give --text or --token-file, not both")
    source = "tokens" if args.token_file else args.text_split if args.text else "pydoc"
    data = DataConfig(source=source, paths=(args.token_file,) if args.token_file else
                      tuple(args.text or ()), tokenizer=tokenizer_of(args),
                      token_cache=args.token_cache, docs=args.docs, seq_len=args.seq_len,
                      batch_size=args.batch_size, val_fraction=args.val_fraction,
                      eval_batches=args.eval_batches, seed=args.seed)
    optim = OptimConfig(lr=args.lr, min_lr_ratio=args.min_lr_ratio, warmup_steps=args.warmup,
                        weight_decay=args.weight_decay, grad_clip=args.grad_clip,
                        neftune_alpha=args.neftune_alpha)
    goldfish = GoldfishConfig(k=args.goldfish_k, h=args.goldfish_h,
                              strategy=args.goldfish_strategy)
    run_cfg = RunConfig(steps=args.steps, epochs=args.epochs, grad_accum=args.grad_accum,
                        eval_every=args.eval_every, log_every=args.log_every,
                        overlap=args.overlap, peak_tflops=args.peak_tflops)
    width = 2 if args.precision == "bf16" else 4  # what --grid auto's memory model counts
    work = GPTWorkload.from_config(model_config, global_batch=args.batch_size * args.grad_accum,
                                   micro_batch=args.batch_size, seq_len=args.seq_len,
                                   param_bytes=width, grad_bytes=width, activation_bytes=width,
                                   activation_checkpointing=args.activation_checkpointing)
    grid, note = choose_grid(parse_grid(args.grid, ctx.world_size, AXONN_AXES), work,
                             ctx.world_size, ranks_per_node=ctx.local_world_size)
    precision = PrecisionConfig(precision=args.precision,
                                activation_checkpointing=args.activation_checkpointing,
                                compile=args.compile)
    trainer = Trainer(model_config, data, optim, goldfish, run_cfg,
                      ParallelState.create(ctx, grid, AXIS_SETS), seed=args.seed,
                      precision=precision, checkpoint=checkpoint)
    if init is not None:
        trainer.init_from(init)
    return trainer, note


def model_of(args: argparse.Namespace) -> tuple[Any, GPTConfig]:
    """(the opened ``--init`` directory or None, the model's sizes)."""
    if args.init is None:
        config = get_preset(args.preset or DEFAULT_PRESET)
        return None, (config if args.vocab_size is None
                      else dataclasses.replace(config, vocab_size=args.vocab_size))
    if args.preset is not None or args.vocab_size is not None:
        raise ValueError("--init takes the model's sizes from its config.json: drop --preset "
                         "and --vocab-size")
    from llm.hf.llama import HFCheckpoint

    init = HFCheckpoint(args.init)
    return init, init.config


def tokenizer_of(args: argparse.Namespace) -> str:
    """``--tokenizer``, else ``--init``'s tokenizer.json, else bytes."""
    if args.tokenizer:
        return args.tokenizer
    if args.init and (Path(args.init) / "tokenizer.json").is_file():
        return str(Path(args.init) / "tokenizer.json")
    return "bytes"


def _set_threads(args: argparse.Namespace) -> None:
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    elif "OMP_NUM_THREADS" not in os.environ and args.init is None and \
            PRESETS[args.preset or DEFAULT_PRESET]().d_model <= 128:
        torch.set_num_threads(1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with start(args) as ctx:  # closes the process group at the end, also after an error
        _set_threads(args)
        run_or_exit(ctx, lambda: _train(args, ctx), user_errors=(ValueError, OSError,
                                                                 FloatingPointError))
    return 0


def _train(args: argparse.Namespace, ctx: DistContext) -> None:
    ck = checkpoint_config(args)
    if args.metrics:
        check_writable(args.metrics, flag="--metrics")
    if ck.dir:
        check_checkpoint_dir(ck.dir, resume=ck.resume)
    trainer, note = build(args, ctx, ck)
    resumed = trainer.resume()  # if --resume and there is a checkpoint
    if ctx.is_main:
        if note:
            print(note, flush=True)
        print(_header(trainer, args, ctx, resumed), flush=True)
    start_s = time.perf_counter()
    with MetricsWriter(args.metrics, enabled=ctx.is_main, resume=resumed is not None) as metrics:

        def on_row(row: dict[str, Any]) -> None:
            metrics.write(row)
            s, every = row["step"], trainer.run_cfg.log_every
            if ctx.is_main and (s == 1 or "val_loss" in row or "checkpoint" in row or
                                (every and s % every == 0)):
                print(_format_row(row, trainer), flush=True)

        history = run(trainer, on_row=on_row, should_stop=preemption_flag())
        peaks = peaks_per_rank_max(ctx.device, ctx.transport)  # collective
        summary = _summary(history, time.perf_counter() - start_s, trainer, peaks)
        metrics.write({"summary": {k: v for k, v in summary.items() if k != "text"}})
    if ctx.is_main:
        if history and history[-1].get("preempted"):
            print(f"preempted (SIGTERM/SIGUSR1) at step {trainer.step}"
                  + (f"; checkpoint in {ck.dir}, rerun with --resume" if ck.dir else
                     "; no --checkpoint-dir, so nothing was saved"), flush=True)
        print(summary["text"], flush=True)


def _header(trainer: Trainer, args: argparse.Namespace, ctx: DistContext,
            resumed: int | None) -> str:
    cfg, data, g = trainer.model_config, trainer.data_cfg, trainer.goldfish
    grid, ck = trainer.parallel.grid, trainer.checkpoint
    text = (f"{data.docs} documents x {data.seq_len + 1} tokens" if data.docs is not None
            else "a stream of documents")
    if data.source == "pydoc":
        source = "built-in corpus (pydoc topics)"
    elif data.source == "tokens":
        source = f"token file {data.paths[0]}"
    else:
        source = f"{len(data.paths)} text file(s)"
    source += f", tokenizer {data.tokenizer}"
    fish = (f"goldfish k={g.k} h={g.h} {g.strategy}" if g.k else "standard loss (no goldfish)")
    if resumed is not None:
        start = f", resumed at step {resumed}"
    elif ck.resume:
        start = f", no checkpoint in {ck.dir} yet: starting at step 0"
    else:
        start = ""
    name = f"from {args.init}" if args.init else args.preset or DEFAULT_PRESET
    return (f"GPT {name}: {cfg.num_params():,} parameters ({cfg.num_layers} layers, "
            f"d_model {cfg.d_model}, {cfg.num_heads} heads); grid {grid} ({ctx.world_size} "
            f"ranks, {ctx.launcher}, {ctx.comm_label}), overlap {trainer.run_cfg.overlap}, "
            f"precision {trainer.precision}\n"
            f"data: {source}, {text}; {fish}; {trainer.total_steps} steps of "
            f"{data.batch_size} x {data.seq_len} tokens x {trainer.run_cfg.grad_accum} "
            f"micro-batches{start}")


def _format_row(row: dict[str, Any], trainer: Trainer) -> str:
    text = f"step {row['step']:>5}/{trainer.total_steps}  loss {row['loss']:.4f}"
    if row["num_dropped"]:
        text += f" (all {row['loss_all']:.4f}, dropped {row['loss_dropped']:.4f})"
    text += (f"  lr {row['lr']:.2e}  |g| {row['grad_norm']:.3f}  "
             f"{row['tokens_per_s']:,.0f} tok/s")
    if "mfu" in row:
        text += f"  MFU {100 * row['mfu']:.1f}%"
    if "val_loss" in row:
        text += f"  val {row['val_loss']:.4f} (ppl {row['val_ppl']:.2f})"
    if "checkpoint" in row:
        text += f"  saved {row['checkpoint']}"
    return text


def _summary(history: list[dict[str, Any]], seconds: float, trainer: Trainer,
             peaks: dict[str, int]) -> dict:
    """The run's summary; ``peaks`` (:func:`common.memory.peaks_per_rank_max`): the peak
    resident bytes per rank and, on a GPU, the allocator's peaks (max over ranks)."""
    memory = {f"{k}_per_rank_max": v for k, v in peaks.items()}
    if not history:
        return {"steps": trainer.step, **memory,
                "text": f"nothing to do: already at step {trainer.step}"}
    tokens_per_s = steady_mean(history, "tokens") / steady_mean(history, "step_s")
    last = history[-1]
    out = {"steps": trainer.step, "loss": last["loss"], "val_loss": last.get("val_loss"),
           "tokens_per_s": tokens_per_s, "wall_s": seconds, **memory}
    val = f", val loss {last['val_loss']:.4f}" if "val_loss" in last else ""
    if "mfu" in last:  # the steady steps' FLOPs over their time, as tokens/s
        out["mfu"] = mfu(trainer.flops_per_token, steady_mean(history, "tokens"),
                         steady_mean(history, "step_s"), trainer.parallel.grid.num_ranks,
                         trainer.peak_tflops)
        val += f", MFU {100 * out['mfu']:.1f}% of {trainer.peak_tflops:g} TFLOP/s"
    out["text"] = (f"done: {trainer.step} steps in {seconds:.1f} s, loss {last['loss']:.4f}"
                   f"{val}, {tokens_per_s:,.0f} tokens/s, peak memory {describe_peaks(peaks)}")
    return out


if __name__ == "__main__":
    sys.exit(main())
