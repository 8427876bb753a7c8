"""Batch norm and the ReLU after it, one training step's forward and backward on one block:
plexus's kernels (plexus.norm_kernels) against its torch operations and torch's own
``BatchNorm1d`` + ``relu``, in one run.

    python bench/norm.py                         # [2M, 64] float32 and bf16-kept
    python bench/norm.py --rows 200000 --width 128

Every side gets a fresh copy of the same block each step (outside the timing), the same
gradient, the same threads and allocator (``THP_MEM_ALLOC_ENABLE=1``, set by importing
``common``); the median over ``--steps`` steps after one untimed step is printed with the
time of a copy of the block (one read and one write: "passes" below count reads and writes of
a block, so a copy is 2). Sides:

* ``plexus kernels``: ``ShardedBatchNorm(relu=True)`` on a block of 2^16 entries or more;
* ``plexus torch ops``: the same module on its torch path (``_RowSplitBatchNorm``, then
  ``plexus.ops.ReLU``), as a GPU or a small block runs it;
* ``torch BatchNorm1d``: ``relu(BatchNorm1d(q))``, what a PyG model uses (float32 only).

``--precision bf16`` (default: both) keeps the centred block in bf16 (``StoredIn``). Target:
the kernels faster than the torch operations they replace, and within 1.1x of torch's own
``BatchNorm1d`` + ``relu`` (which keeps two blocks for backward where they keep one). The
passes printed include making each step's fresh tensors (the kept block, the output where
it is not written over the input); the kernels alone make 7 over the block and 3 over the
kept one (common.perf.gcn counts those).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import dense  # (sets THP_MEM_ALLOC_ENABLE)
from common.grid import AxisGroup
from plexus import norms, ops

TARGETS = {"plexus torch ops": 1.0, "torch BatchNorm1d": 1.1}  # the kernels' time over each


def _step(side: str, base: torch.Tensor, grad: torch.Tensor, keep) -> tuple[float, float]:
    """Seconds of one forward and one backward of ``side`` on a fresh copy of ``base``."""
    rows, width = base.shape
    x = base.clone().requires_grad_()
    q = x * 1.0  # a fresh non-leaf block, as the model hands the norm
    dy = dense.empty(rows, width)
    dy.copy_(grad)
    if side == "torch BatchNorm1d":
        bn = torch.nn.BatchNorm1d(width)
        t0 = time.perf_counter()
        y = torch.relu(bn(q))
    else:
        norms.FUSED_MIN_ENTRIES = 1 << 16 if side == "plexus kernels" else 1 << 62
        bn = norms.ShardedBatchNorm(width, torch.ones(rows, dtype=torch.bool), rows,
                                    AxisGroup("p", None, 1, 0))
        t0 = time.perf_counter()
        with ops.StoredIn(keep):
            y = bn(q, relu=True, over_grad=True)
    t1 = time.perf_counter()
    y.backward(dy)
    return t1 - t0, time.perf_counter() - t1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--precision", choices=("fp32", "bf16", "both"), default="both")
    args = p.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(args.rows, args.width, generator=gen) * 2 + 0.5
    grad = torch.randn(args.rows, args.width, generator=gen)
    out = torch.empty_like(base)
    copy = statistics.median(_timed_copy(base, out) for _ in range(5))
    mb = base.numel() * 4 / 2**20
    print(f"block [{args.rows:,}, {args.width}] float32 ({mb:.0f} MiB), "
          f"{torch.get_num_threads()} threads; a copy takes {1e3 * copy:.1f} ms "
          f"({2 * mb / 1024 / copy:.1f} GiB/s read + written)")
    precisions = ("fp32", "bf16") if args.precision == "both" else (args.precision,)
    ok = True
    for precision in precisions:
        keep = torch.bfloat16 if precision == "bf16" else None
        sides = ["plexus kernels", "plexus torch ops"] + (
            ["torch BatchNorm1d"] if precision == "fp32" else [])
        print(f"\n{precision} (centred block kept in {'bf16' if keep else 'float32'})")
        print(f"{'':20}{'forward ms':>12}{'backward ms':>13}{'passes':>9}")
        totals = {}
        for side in sides:
            times = [_step(side, base, grad, keep) for _ in range(args.steps + 1)][1:]
            fwd = statistics.median(t[0] for t in times)
            bwd = statistics.median(t[1] for t in times)
            totals[side] = fwd + bwd
            print(f"{side:20}{1e3 * fwd:>12.1f}{1e3 * bwd:>13.1f}"
                  f"{2 * (fwd + bwd) / copy:>9.1f}")
        ratios = {s: totals["plexus kernels"] / t for s, t in totals.items()
                  if s != "plexus kernels"}
        met = all(r <= TARGETS[s] for s, r in ratios.items())
        ok &= met
        print(f"{precision}: the kernels' time is " + ", ".join(
            f"{r:.2f}x {s} (target <= {TARGETS[s]})" for s, r in ratios.items())
            + f": {'met' if met else 'MISSED'}")
    return 0 if ok else 1


def _timed_copy(src: torch.Tensor, dst: torch.Tensor) -> float:
    t = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - t


if __name__ == "__main__":
    sys.exit(main())
