"""Fetch or check an OGB node-property dataset (and, for ogbn-arxiv, build ogb's cache).

    python datasets/ogb/prepare.py --name ogbn-arxiv --root data            # check / cache
    python datasets/ogb/prepare.py --name ogbn-products --root data --download

ogbn-arxiv is loaded whole by ``plexus.train``, through ogb's loader, whose processed cache
(``processed/data_processed``) this builds once so that training starts without parsing the
CSV files. ogbn-products and ogbn-papers100M are never loaded that way: ``plexus.train``
prepares them from their raw files into memory-mappable blocks under ``ROOT/prepared/`` on
first use (plexus.data.cache; or ahead of time, ``python -m plexus.prepare``), so for them this
only fetches or checks the raw files and builds no cache (papers100M's would hold the whole
graph in memory for nothing).

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

from plexus.data import DatasetCorruptError, DatasetNotFoundError
from plexus.data.cache import ALWAYS_CACHED
from plexus.data.ogb import OGB_DATASETS, download_dataset, load_ogb, not_found_message
from plexus.data.sources import ogb_inputs, ogb_sizes


def check_raw(name: str, root: Path, *, download: bool) -> str:
    """Fetch (``download``) or check the raw files plexus prepares ``name`` from; a summary.

    Raises:
        DatasetNotFoundError: files missing (and not downloaded).
        DatasetCorruptError: a count file or npz header is unreadable.
    """
    spec = OGB_DATASETS[name]
    ddir = root / spec.dir_name
    missing = [rel for rel in ogb_inputs(name) if not (ddir / rel).is_file()]
    if missing and download:
        download_dataset(spec, root, missing, timeout_s=30.0)
        missing = [rel for rel in ogb_inputs(name) if not (ddir / rel).is_file()]
    if missing:
        raise DatasetNotFoundError(not_found_message(spec, root, missing) + (
            "\n(after downloading)" if download else
            "\nOr rerun with --download on a machine with internet."))
    nodes, edges, features = ogb_sizes(ddir / "raw")
    return (f"{name}: raw files in place under {ddir} ({nodes:,} nodes, {edges:,} edges "
            f"stored, {features} features).\nNo cache built here: plexus.train prepares "
            f"{name} from these raw files into {root / 'prepared'}/ on its first run and "
            "memory-maps it after; to prepare it ahead of time: python -m plexus.prepare "
            f"--source {name} --root {root} --out DIR, then train with --dataset DIR.")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", required=True, choices=list(OGB_DATASETS))
    p.add_argument("--root", default="data")
    p.add_argument("--download", action="store_true", help="download missing files (online)")
    args = p.parse_args()
    start = time.perf_counter()
    try:
        if args.name in ALWAYS_CACHED:
            print(check_raw(args.name, Path(args.root), download=args.download))
        else:
            print(load_ogb(args.name, args.root, download=args.download).summary())
    except (DatasetNotFoundError, DatasetCorruptError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"ready in {time.perf_counter() - start:.1f} s; train with: "
          f"python -m plexus.train --dataset {args.name} --root {args.root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
