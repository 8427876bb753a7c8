"""Peak resident memory around each autograd function of one plexus training epoch, beside the
planner's phases: where a one-rank epoch peaks, and what the planner says of it.

    python bench/op_peaks.py -- --dataset ogbn-papers100M --root data/memory/ogb --model sage \
        --precision bf16 --hidden 64 --no-retain-freed-memory      # after bench/memory.py ogb

Everything after ``--`` goes to ``python -m plexus.train`` (one rank; ``--epochs 1`` unless
given). Before each forward and backward of plexus.ops' autograd functions (the SpMMs, the
products, the ReLU) the process's resident peak is reset (``common.memory.reset_peak``) and
read after it; printed for ``--epoch`` (default 1), one line per call in order: the resident
set before, the peak during and the resident set after, in MiB. Then the planner's persistent
parts and its costliest phases (``common.perf.gcn_memory``) for the run's model on a 1x1x1
grid. The planner counts bytes above the process's start; the measured figures are whole
resident sets (the process's start, its libraries and the runtime's pools included).

The resets make the trainer's own summary peak meaningless for this run (it reads the peak
since the last reset).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MIB = 2.0**20
FUNCTIONS = ("SpMM", "BlockedAggregation", "ReLU", "GatheredMatmul", "RecomputedMatmul",
             "RemadeInputMatmul")


def record(calls: list, epoch: list, trainers: list) -> None:
    """Wrap plexus.ops' autograd functions and Trainer.train_step: ``calls`` gets (epoch,
    function, before, peak, after) bytes for each forward and backward; ``trainers`` each
    trainer that trains."""
    from common.memory import peak_bytes, reset_peak, resident_bytes
    from plexus import ops
    from plexus.trainer import Trainer

    def wrap(cls, name):
        inner = getattr(cls, name)

        def timed(ctx, *args, **kwargs):
            reset_peak()
            before = resident_bytes()
            out = inner(ctx, *args, **kwargs)
            calls.append((epoch[0], f"{cls.__name__}.{name}", before, peak_bytes(),
                          resident_bytes()))
            return out
        setattr(cls, name, staticmethod(timed))

    for fn in FUNCTIONS:
        if hasattr(ops, fn):
            wrap(getattr(ops, fn), "forward")
            wrap(getattr(ops, fn), "backward")
    step = Trainer.train_step

    def counted(self, *args, **kwargs):
        if self not in trainers:
            trainers.append(self)
        epoch[0] = abs(epoch[0]) + 1
        try:
            return step(self, *args, **kwargs)
        finally:
            epoch[0] = -epoch[0]  # outside a training step (evaluation, the report)

    Trainer.train_step = counted


def planner_lines(trainer) -> list[str]:
    """The planner's parts and five costliest phases, MiB, for the trainer's model and source
    on 1x1x1."""
    from common.perf.gcn_memory import gcn_memory_parts, gcn_memory_phases
    from plexus.config import gcn_workload

    work = gcn_workload(trainer.model_config, trainer.source)
    one = {"x": 1, "y": 1, "z": 1}
    parts = gcn_memory_parts(work, one)
    phases = sorted(gcn_memory_phases(work, one).items(), key=lambda kv: -kv[1])[:5]
    return ([f"planner, 1x1x1: {sum(parts.values()) / MIB:,.0f} MiB = "
             + ", ".join(f"{k} {v / MIB:,.0f}" for k, v in parts.items())]
            + [f"  phase {k:<24} {v / MIB:>8,.0f} MiB beyond adjacency, features, nodes, "
               "weights" for k, v in phases])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    ours, train = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epoch", type=int, default=1, help="the training epoch to print")
    args = p.parse_args(ours)
    if not train:
        p.error("give plexus.train's arguments after --")
    if "--epochs" not in train:
        train += ["--epochs", str(args.epoch)]
    if "--grid" in train and train[train.index("--grid") + 1] != "1x1x1":
        p.error("one rank only (--grid 1x1x1)")
    calls: list = []
    trainers: list = []
    record(calls, [0], trainers)
    from plexus.train import main as train_main

    code = train_main(train)
    rows = [c for c in calls if c[0] == args.epoch]
    print(f"\ntraining epoch {args.epoch}: resident MiB around each autograd function "
          "(before, peak during, after)")
    for _, name, before, peak, after in rows:
        print(f"  {name:<28} {before / MIB:>8,.0f} {peak / MIB:>8,.0f} {after / MIB:>8,.0f}")
    if rows:
        top = max(rows, key=lambda c: c[3])
        print(f"peak: {top[3] / MIB:,.0f} MiB in {top[1]}")
    for line in planner_lines(trainers[0]) if trainers else []:
        print(line)
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
