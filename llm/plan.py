"""Rank every 4D grid for a GPT preset by predicted step time (the planner of common.perf).

    python -m llm.plan --preset gpt7b --batch 1024 --seq-len 2048 --ranks 64 \\
        --machine perlmutter-a100 --bf16 --top 10
    python -m llm.plan --preset tiny --batch 16 --seq-len 128 --ranks 4

Builds a :class:`common.perf.gpt.GPTWorkload` from the preset's sizes and prints the plan of
:mod:`common.perf.cli` (predicted compute and communication per axis, memory per rank, whether
it fits) and its choice: the grid that ``llm.train --grid auto[:PROFILE]`` takes for the same
sizes (``--batch`` = ``--batch-size`` x ``--grad-accum``, ``--micro-batch`` = ``--batch-size``).
For sizes that are not a preset: ``python -m common.perf gpt``.
"""

from __future__ import annotations

import argparse
import sys

from common.perf.cli import add_gpt_size_args, add_plan_args, gpt_sizes, print_plan
from common.perf.gpt import GPTWorkload
from llm.model import PRESETS, get_preset


def workload(args: argparse.Namespace) -> GPTWorkload:
    """The planner's view of one ``llm.train`` step of ``--preset`` with the given sizes."""
    return GPTWorkload.from_config(get_preset(args.preset), name=args.preset, **gpt_sizes(args))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m llm.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), required=True)
    add_gpt_size_args(p)
    add_plan_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return print_plan(lambda: workload(args), args)


if __name__ == "__main__":
    sys.exit(main())
