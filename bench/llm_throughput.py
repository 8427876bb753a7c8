"""Tokens/s of our GPT trainer on the 1x1x1x1 grid against a plain PyTorch loop, in one run.

    python bench/llm_throughput.py                        # tiny preset, 16 x 128 tokens/step
    python bench/llm_throughput.py --preset small --batch-size 8 --seq-len 256 --steps 10
    python bench/llm_throughput.py --device cuda --preset small --batch-size 8 --seq-len 256
    python bench/llm_throughput.py --device cuda --preset gpt1b --precision bf16 --compile \
        --batch-size 4 --seq-len 1024 --steps 10      # MFU of the 1.1B model in bf16

Both sides train the same model from the same seed on the same batches (the same resumable
iterator) with the same AdamW settings, weight-decay groups and global-norm clipping. The
baseline is the nanoGPT-style loop: ``model(x)``, ``cross_entropy``, ``backward``,
``clip_grad_norm_``, ``step``. Ours is ``Trainer.train_step`` (goldfish mask and token
accounting, sharded loss, gradient sync and norm on the grid, learning-rate schedule,
logging row). The two alternate step by step, each first every other step, so that machine
noise hits both alike;
printed: median step time of each (and the quartiles), tokens/s, and the ratio ours / baseline
of the median tokens/s (target >= 0.95); with ``--rounds N`` the steps are timed in N rounds
and the ratio printed is the lowest round's, each round's beside it. One thread by default: on
a shared 2-core machine two threads per process make single steps stall unpredictably (the
ratio far apart from one run to the next), while one thread gives repeatable numbers; pass
``--threads 2`` to compare.
``--device cuda`` runs both on one GPU (each step timed after the GPU has finished).
``--precision bf16`` trains both in bf16 with float32 master weights (the baseline builds the
same ``GPT(compute_dtype=bfloat16)``), ``--compile`` compiles each transformer block of both
(:func:`llm.trainer.compile_blocks`; the first warm-up step of each compiles, so give
``--warmup`` at least 2). On a GPU both step torch's fused AdamW. The MFU column (on a GPU
``llm.mfu`` knows, or with ``--peak-tflops``) is the model's FLOPs a second over the peak of
the precision run. ``--profile``: after the timed steps, one more step of each side under
torch.profiler (:mod:`bench.profiling`): its costliest GPU kernels by device time and the
share of the step's wall time the GPU spent in kernels (on the CPU, its costliest
operators), so that a missed target names where the time went.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.nn.functional import cross_entropy

from bench.profiling import print_top, profile_step
from common.grid import ProcessGrid
from common.parallel import ParallelState
from llm.config import DataConfig, GoldfishConfig, OptimConfig, PrecisionConfig, RunConfig
from llm.data.batches import BatchIterator, encode_stream, load_documents, split_documents
from llm.mfu import mfu, peak_tflops
from llm.model import GPT, PRESETS, get_preset
from llm.parallel.gpt import AXIS_SETS
from llm.precision import compute_dtype
from llm.trainer import Trainer


class Baseline:
    """The plain single-process loop on the same model, optimizer and batches."""

    def __init__(self, preset: str, data: DataConfig, optim: OptimConfig, seed: int,
                 device: torch.device, precision: PrecisionConfig) -> None:
        # the trainer's keyed initialisation, compute dtype and compiled blocks
        self.model = GPT(get_preset(preset), seed=seed, device=device,
                         compute_dtype=compute_dtype(precision.precision))
        if precision.compile:
            self.model.compile_blocks()
        self.device = device
        decay = [p for p in self.model.parameters() if p.dim() > 1]
        rest = [p for p in self.model.parameters() if p.dim() <= 1]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": optim.weight_decay},
             {"params": rest, "weight_decay": 0.0}], lr=optim.lr, betas=optim.betas,
            fused=True if device.type == "cuda" else None)  # as the trainer's
        train_docs, _ = split_documents(load_documents(), data.val_fraction, data.seed)
        self.batches = BatchIterator(encode_stream(train_docs), batch_size=data.batch_size,
                                     seq_len=data.seq_len, seed=data.seed)
        self.clip = optim.grad_clip

    def train_step(self) -> float:
        x, y = next(self.batches)
        x, y = x.to(self.device), y.to(self.device)
        logits = self.model(x)
        loss = cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        return loss.item()


def timed(step, device: torch.device) -> float:
    """Seconds of ``step()``, from a device with no work queued to one that has finished it."""
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    sync()
    start = time.perf_counter()
    step()
    sync()
    return time.perf_counter() - start


def quartiles(times: list[float]) -> str:
    q1, _, q3 = statistics.quantiles(times, n=4)
    return f"{1000 * q1:.1f}-{1000 * q3:.1f} ms"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=40, help="timed steps per side")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per side")
    p.add_argument("--rounds", type=int, default=1,
                   help="timed rounds of --steps alternating steps each; the ratio printed "
                   "last is the lowest round's (the target holds in every round)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where both sides train (default: %(default)s)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="both sides' compute: bf16 with float32 master weights, or fp32 "
                   "(default: %(default)s)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer block on both sides")
    p.add_argument("--peak-tflops", type=float, default=None, metavar="T",
                   help="the device's dense peak in the precision run, for an MFU column "
                   "(default: llm.mfu's table for a GPU it knows; none on a CPU)")
    p.add_argument("--profile", action="store_true",
                   help="after the timed steps, one more step of each side under "
                   "torch.profiler: its costliest GPU kernels and the GPU's busy share of "
                   "the step (CPU operators on the CPU)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda was asked for, but torch sees no CUDA device")
    device = torch.device(args.device)
    if args.steps < 1 or args.rounds < 1:
        p.error("--steps and --rounds must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    data = DataConfig(batch_size=args.batch_size, seq_len=args.seq_len, eval_batches=0)
    optim = OptimConfig()
    total = args.warmup + args.steps
    precision = PrecisionConfig(precision=args.precision, compile=args.compile)
    ours = Trainer(get_preset(args.preset), data, optim, GoldfishConfig(),
                   RunConfig(steps=total), ParallelState.single(ProcessGrid.axonn(1, 1, 1, 1),
                                                                AXIS_SETS, device=device),
                   precision=precision)
    base = Baseline(args.preset, data, optim, seed=0, device=device, precision=precision)
    for _ in range(args.warmup):
        timed(ours.train_step, device), timed(base.train_step, device)
    t_ours, t_base, ratios = [], [], []
    for _ in range(args.rounds):
        first = len(t_ours)
        for i in range(args.steps):  # alternate step by step, each side first every other
            pair = [(t_ours, ours), (t_base, base)]
            for times, side in pair if i % 2 == 0 else pair[::-1]:
                times.append(timed(side.train_step, device))
        ratios.append(statistics.median(t_base[first:]) / statistics.median(t_ours[first:]))
    tokens = args.batch_size * args.seq_len
    med_ours, med_base = statistics.median(t_ours), statistics.median(t_base)
    config = get_preset(args.preset)
    print(f"GPT {args.preset} ({config.num_params():,} parameters), {args.batch_size} x "
          f"{args.seq_len} tokens per step, on {device}, {precision}, torch threads "
          f"{torch.get_num_threads()}, {args.steps} alternating steps per side"
          + (f" in each of {args.rounds} rounds" if args.rounds > 1 else ""))
    # MFU where the device's peak is known (--peak-tflops, or llm.mfu's table for the GPU)
    peak = peak_tflops(device, args.precision, args.peak_tflops)
    per_token = config.flops_per_token(args.seq_len)
    print(f"{'':24}{'median step':>14}{'quartiles':>24}{'tokens/s':>12}"
          + (f"{'MFU':>8}" if peak else ""))
    for name, med, times in (("plain PyTorch loop", med_base, t_base),
                             ("ours, grid 1x1x1x1", med_ours, t_ours)):
        share = f"{100 * mfu(per_token, tokens, med, 1, peak):>7.2f}%" if peak else ""
        print(f"{name:24}{1000 * med:>11.1f} ms{quartiles(times):>24}{tokens / med:>12,.0f}"
              + share)
    if peak:
        print(f"(MFU: {per_token:,} FLOPs a token over {peak:g} TFLOP/s, llm.mfu)")
    ratio = min(ratios)
    each = (f" (the lowest of {len(ratios)} rounds: {', '.join(f'{r:.3f}' for r in ratios)})"
            if len(ratios) > 1 else "")
    print(f"throughput ratio ours / plain = {ratio:.3f}{each} (target >= 0.95"
          f"{' in every round' if len(ratios) > 1 else ''}: "
          f"{'met' if ratio >= 0.95 else 'NOT met'})")
    if args.profile:
        for name, side in (("ours", ours), ("plain", base)):
            print_profiled(name, profile_step(side.train_step, device), device)
    return 0


def print_profiled(name: str, got, device: torch.device) -> None:
    """One side's profiled step (a :class:`bench.profiling.StepProfile`): its wall time, the
    GPU's busy share of it, and its costliest entries."""
    share = got.busy_share()
    busy = ("" if share is None else
            f", GPU busy {got.busy_ms:.1f} ms: {100 * share:.0f}% of it")
    what = "GPU kernels, device" if device.type == "cuda" else "operators, CPU"
    print_top(f"{name}: one profiled step {got.wall_ms:.1f} ms{busy}; its costliest {what} "
              "ms:", got.top)


if __name__ == "__main__":
    sys.exit(main())
