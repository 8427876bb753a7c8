"""The performance model against the Plexus paper (SC'25) with the Perlmutter preset.

    python bench/paper_check.py                         # perlmutter-a100
    python bench/paper_check.py --profile my.json       # another profile

Prints the ogbn-products comparison on 64 GPUs (best 3D / 2D / 1D grid, top 5) and the
ogbn-papers100M epoch time on 64 .. 2048 GPUs next to the paper's measurements; exits 1 when a
check fails (top 5 not all 3D, 3D < 2D < 1D violated, or a prediction off by more than 2x).
Pure arithmetic: see :mod:`common.perf.paper` for the numbers and their sources.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.perf.machine import load_profile
from common.perf.paper import check_papers100m, check_products, papers100m_table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", default="perlmutter-a100")
    args = p.parse_args(argv)
    machine = load_profile(args.profile)
    products = check_products(machine)
    print(f"profile {machine.name}\n")
    print(products.table())
    rows = check_papers100m(machine)
    print()
    print(papers100m_table(rows))
    within = all(0.5 <= 1e3 * pred.total_s / ms <= 2.0 for _, pred, ms in rows)
    return 0 if products.top5_all_3d and products.ordered and within else 1


if __name__ == "__main__":
    sys.exit(main())
