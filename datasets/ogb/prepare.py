"""Fetch or check an OGB node-property dataset and build its processed cache.

    python datasets/ogb/prepare.py --name ogbn-arxiv --root data            # check / cache
    python datasets/ogb/prepare.py --name ogbn-products --root data --download

Offline, a missing dataset stops with the directory and files to put there (and the URL to
fetch them from on a machine with internet). Then train with
``python -m plexus.train --dataset ogbn-arxiv --root data``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from plexus.data import DatasetNotFoundError
from plexus.data.ogb import load_ogb


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", required=True,
                   choices=["ogbn-arxiv", "ogbn-products", "ogbn-papers100M"])
    p.add_argument("--root", default="data")
    p.add_argument("--download", action="store_true", help="download missing files (online)")
    args = p.parse_args()
    start = time.perf_counter()
    try:
        graph = load_ogb(args.name, args.root, download=args.download)
    except (DatasetNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{graph.summary()}\nready in {time.perf_counter() - start:.1f} s; train with: "
          f"python -m plexus.train --dataset {args.name} --root {args.root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
