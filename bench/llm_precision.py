"""bf16 mixed precision + activation checkpointing against fp32: final loss and memory.

    nice -n 19 python bench/llm_precision.py            # small preset, 20 steps, 4 ranks
    python bench/llm_precision.py --preset tiny --steps 10 --grid data=1,depth=1,row=2,col=2

Two runs of the same model from the same seed on the same batches, each in fresh ranks under
``mpiexec`` (``python bench/llm_precision.py --worker ...``): ``--precision fp32``, then
``--precision bf16 --activation-checkpointing``. Per run, rank 0 prints the maximum over
ranks of: the final loss, the bytes autograd saves for backward during one micro-step
(:class:`llm.precision.SavedActivations` around the first step; grad_accum is 1, so a step
is one micro-step), the peak resident memory of the later steps (``common.memory.reset_peak`` /
``peak_bytes``: parameters, optimizer state, gathered weights and activations together), the
median step time and the bytes sent per step by the tensor-parallel collectives (depth, row,
col). Results are appended to bench/results/llm_precision.jsonl.

Transport: ``--comm torch`` (gloo, the default here) moves bf16 as bf16, so the bytes are the
wire's. The MPI transport (``--comm mpi``) sums bf16 in float32 (MPI has no bf16 sum;
common/mpi.py), so its bf16 all-reduces and reduce-scatters send float32 while the byte
accounting (common/collectives.py) counts bf16.

Check: the bf16 + checkpointing loss within 2% of fp32's after the steps. On a CPU without
native bf16 instructions (AVX2 only) bf16 GEMMs are emulated and several times slower than
fp32: the step times here say nothing about a GPU's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "llm_precision.jsonl"
MIB = 2.0**20
RUNS = (("fp32", False), ("bf16", True))  # (precision, activation checkpointing)
TARGET = 0.02  # |loss ratio - 1|


# ----------------------------------------------------------------------------- worker


def worker(args: argparse.Namespace) -> None:
    """Train on this rank and let rank 0 print the run's figures as one JSON line."""
    import torch

    from common.dist import init_distributed
    from common.exchange import max_over_ranks
    from common.grid import AXONN_AXES, ProcessGrid
    from common.memory import peak_bytes, reset_peak
    from common.parallel import ParallelState
    from common.spawn import print_result
    from llm.config import DataConfig, GoldfishConfig, OptimConfig, PrecisionConfig, RunConfig
    from llm.model import get_preset
    from llm.parallel.gpt import AXIS_SETS
    from llm.precision import SavedActivations
    from llm.trainer import Trainer

    torch.set_num_threads(1)  # several ranks share the cores
    with init_distributed(device="cpu", comm=args.comm) as ctx:
        parallel = ParallelState.create(ctx, ProcessGrid.parse(args.grid, AXONN_AXES), AXIS_SETS)
        trainer = Trainer(get_preset(args.preset),
                          DataConfig(seq_len=args.seq_len, batch_size=args.batch_size,
                                     eval_batches=0),
                          OptimConfig(lr=args.lr, warmup_steps=args.steps // 4),
                          GoldfishConfig(), RunConfig(steps=args.steps), parallel, seed=0,
                          precision=PrecisionConfig(precision=args.precision,
                                                    activation_checkpointing=args.checkpointing))
        with SavedActivations(trainer.model.parameters()) as saved:  # one micro-step's forward
            rows = [trainer.train_step()]
        reset_peak()
        while trainer.step < args.steps:
            rows.append(trainer.train_step())
        tp_bytes = sum(r.bytes for (axis, _), r in trainer.stats.records.items()
                       if axis in ("depth", "row", "col"))  # of the last step
        values = {"saved_bytes": saved.bytes, "peak_bytes": peak_bytes(),
                  "step_s": statistics.median(r["step_s"] for r in rows[1:] or rows),
                  "tp_bytes_per_step": tp_bytes}
        got = dict(zip(values, max_over_ranks([float(v) for v in values.values()], ctx.device)))
        if ctx.is_main:
            print_result({"loss": rows[-1]["loss"], "first_loss": rows[0]["loss"], **got})


# ----------------------------------------------------------------------------- driver


def _launch(ranks: int, worker_args: list[str]) -> dict[str, Any]:
    from common.spawn import run_worker

    start = time.perf_counter()
    result = run_worker(Path(__file__).resolve(), ranks, worker_args, cwd=ROOT,
                        env={"OMP_NUM_THREADS": "1"})
    return {**result, "wall_s": time.perf_counter() - start}


def _ranks(grid: str) -> int:
    from common.grid import AXONN_AXES, ProcessGrid

    return ProcessGrid.parse(grid, AXONN_AXES).num_ranks


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", default="small", help="model preset")
    p.add_argument("--grid", default="data=1,depth=2,row=2,col=1",
                   help="data x depth x row x col")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    p.add_argument("--batch-size", type=int, default=8, help="global sequences per step")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--comm", choices=("torch", "mpi"), default="torch",
                   help="transport of the CPU collectives (module docstring)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    p.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    sys.path.insert(0, str(ROOT))
    common = ["--preset", args.preset, "--grid", args.grid, "--steps", str(args.steps),
              "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
              "--lr", str(args.lr), "--comm", args.comm]
    ranks = _ranks(args.grid)
    results = []
    for precision, checkpointing in RUNS:
        extra = ["--precision", precision] + (["--checkpointing"] if checkpointing else [])
        results.append({"precision": precision, "activation_checkpointing": checkpointing,
                        **_launch(ranks, [*common, *extra])})
    base, new = results
    ratio = new["loss"] / base["loss"]
    ok = abs(ratio - 1) <= TARGET
    print(f"\nllm {args.preset}, grid {args.grid} ({ranks} ranks, --comm {args.comm}), "
          f"{args.steps} steps of {args.batch_size} x {args.seq_len} tokens; memory and bytes: "
          f"max over ranks")
    print(f"{'run':<22} {'loss 1':>7} {'loss':>7} {'saved MiB/micro-step':>21} "
          f"{'peak RSS MiB':>13} {'TP MiB/step':>12} {'s/step':>7}")
    for r in results:
        name = r["precision"] + (" + checkpointing" if r["activation_checkpointing"] else "")
        print(f"{name:<22} {r['first_loss']:>7.4f} {r['loss']:>7.4f} "
              f"{r['saved_bytes'] / MIB:>21.1f} {r['peak_bytes'] / MIB:>13.0f} "
              f"{r['tp_bytes_per_step'] / MIB:>12.2f} {r['step_s']:>7.2f}")
    print(f"ratios bf16+ckpt / fp32: loss {ratio:.4f}, saved activations "
          f"{new['saved_bytes'] / base['saved_bytes']:.3f}, peak RSS "
          f"{new['peak_bytes'] / base['peak_bytes']:.3f}, tensor-parallel bytes "
          f"{new['tp_bytes_per_step'] / base['tp_bytes_per_step']:.3f}")
    print(f"check: final loss within {TARGET:.0%} of fp32's: {'met' if ok else 'NOT met'}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with open(RESULTS, "a") as f:
        f.write(json.dumps({"time": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args),
                            "ok": ok, "loss_ratio": ratio, "runs": results}) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
