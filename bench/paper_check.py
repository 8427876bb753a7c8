"""The performance model against the Plexus paper (SC'25) on the shipped GPU profiles.

    python bench/paper_check.py                         # perlmutter-a100, frontier-mi250x
    python bench/paper_check.py --profile my.json       # another profile for the A100 numbers

Prints, for every epoch time of the paper the model can express (ogbn-products on 4 .. 512
GPUs with the best 3D / 2D / 1D grid on 64, ogbn-papers100M on 64 .. 2048 A100s and 2048
MI250X GCDs, Reddit), the predicted epoch of the best grid, the paper's number and the ratio
predicted / paper, in the paper's setting (trainable input features, 3 layers, hidden 128).
Exits 1 unless every ogbn-products and ogbn-papers100M number on Perlmutter is within 1.5x and
the best 3D grid beats the best 2D, which beats the best 1D, at 64 GPUs. Pure arithmetic: see
:mod:`common.perf.paper` for the numbers and their sources.

Then SAR's CPU-cluster rows (:mod:`common.perf.sar`): GraphSAGE with batch norm, hidden 256, on
ogbn-papers100M at 32, 64 and 128 two-socket Icelake nodes (profile ``icelake-hdr200``, one
rank per socket): our predicted epoch time and memory per node beside SAR's measured ones, and
the ratios, in float32 and with ``--precision bf16`` (bf16 features, kept activations and
messages), each with what the savings contribute (the memory per node as before each: the
adjacency with int64 indices and stored transposes, then int32 indices per block, then the
transpose read from the block, then the batch norm and its ReLU as plexus.norms' kernels).
Informational: they do not change the exit status.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.perf.machine import load_profile
from common.perf.paper import BOUND, PERLMUTTER, compare, problems, table
from common.perf.sar import PROFILE as SAR_PROFILE
from common.perf.sar import compare_sar, sar_table, savings_table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", default=PERLMUTTER,
                   help="profile name or JSON path for the paper's A100 numbers")
    args = p.parse_args(argv)
    machine = load_profile(args.profile)
    rows = compare({PERLMUTTER: machine})
    print(f"profile {machine.name} (A100 numbers); 3-layer GCN, hidden 128, trainable input "
          f"features; best predicted grid per line\n")
    print(table(rows))
    fails = problems(rows)
    print()
    for f in fails:
        print(f"FAIL: {f}")
    if not fails:
        print(f"OK: every bounded number within {BOUND}x of the paper; best 3D < 2D < 1D on 64 "
              f"GPUs")
    print(f"\nSAR (CPU cluster), profile {SAR_PROFILE}: GraphSAGE + batch norm, hidden 256, 3 "
          "layers, ogbn-papers100M made symmetric; ours predicted (best grid, memory per node), "
          "SAR measured (its README)\n")
    for precision in ("fp32", "bf16"):
        print(f"--precision {precision}")
        rows = compare_sar(precision=precision)
        print(sar_table(rows))
        capped = compare_sar(precision=precision, within_sar_memory=True)
        if [c.prediction.shape for c in capped] != [c.prediction.shape for c in rows]:
            print("the fastest grid within SAR's memory per node:")
            print(sar_table(capped))
        print("what each saving contributes, on the best grids:")
        print(savings_table(rows))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
