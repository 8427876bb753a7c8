"""``python -m plexus.prepare``: write a graph as k x k block files (the writer:
:mod:`plexus.data.writer`), or check a prepared dataset's checksums.

    python -m plexus.prepare --source rmat --scale 24 --edge-factor 64 --features 16 \\
        --out data/rmat-24-k8                       # 1B generated edges, never all in memory
    python -m plexus.prepare --source ogbn-papers100M --root data --out data/papers100M-k8
    python -m plexus.prepare --source edges.npy --num-nodes 1000000 --out data/mygraph
    python -m plexus.prepare --source planted --out data/planted-k8    # small, built-in
    python -m plexus.prepare --verify data/rmat-24-k8                  # checksums only
    python -m plexus.train --dataset data/rmat-24-k8 --grid 2x2x2      # train on it
    python -m plexus.train --dataset data/rmat-24-k8 --model sage      # GraphSAGE too

Peak memory: a chunk of edges (``--chunk-edges``), one block, O(nodes). The dataset holds the
blocks of both aggregations (the GCN's ``Â`` and GraphSAGE's mean adjacency). A dataset of an
older format version is refused with the command that prepares it again (``--force``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np

from plexus.data import partition as part
from plexus.data.lock import preparing_lock
from plexus.data.registry import load_dataset
from plexus.data.schema import verify
from plexus.data.sources import (
    EdgeSource,
    edge_file_source,
    graph_source,
    ogb_source,
    rmat_source,
)
from plexus.data.writer import prepare


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m plexus.prepare",
        description="Write a graph as k x k memory-mappable block files for plexus.train, "
        "streaming the edges (peak memory: a chunk of edges, one block, O(nodes)).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--source", default=None,
                   help="rmat (streamed R-MAT generator), ogbn-arxiv / ogbn-products / "
                   "ogbn-papers100M (raw files under --root, read in chunks), a .npy edge file "
                   "([2, E] or [E, 2] integers), or a built-in name (planted, rmat-SCALE: "
                   "loaded in memory, for small graphs)")
    p.add_argument("--out", default=None, help="output directory (must not exist)")
    p.add_argument("--blocks", type=int, default=8,
                   help="k: k x k blocks; training grid axis sizes must divide k")
    p.add_argument("--permutation", choices=part.PERMUTATIONS, default="double")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the permutations and of generated data")
    p.add_argument("--root", default="data",
                   help="OGB and PyG names: directory of the dataset folders")
    p.add_argument("--scale", type=int, default=20, help="R-MAT: log2 of the node count")
    p.add_argument("--edge-factor", type=int, default=16, help="R-MAT: edges per node")
    p.add_argument("--features", type=int, default=128, help="R-MAT / edge file: feature width")
    p.add_argument("--classes", type=int, default=32, help="R-MAT / edge file: classes")
    p.add_argument("--num-nodes", type=int, default=None, help="edge file: node count")
    p.add_argument("--symmetrize", action="store_true",
                   help="edge file or directed OGB dataset: add reverse edges and drop "
                   "duplicates and self-loops (undirected graph; what --symmetrize of "
                   "plexus.train prepares into its cache)")
    p.add_argument("--chunk-edges", type=int, default=1 << 23, help="edges per chunk")
    p.add_argument("--force", action="store_true",
                   help="replace an existing --out that is a prepared dataset (a folder "
                   "without plexus's manifest.json is never deleted)")
    p.add_argument("--verify", metavar="DIR", default=None,
                   help="only check the checksums of a prepared dataset")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    if args.verify is None and (args.source is None or args.out is None):
        p.error("--source and --out are required (or --verify DIR)")
    return args


def source_from_args(args: argparse.Namespace, tmp_dir: str) -> EdgeSource:
    if args.source == "rmat":
        return rmat_source(args.scale, args.edge_factor, args.seed,
                           num_features=args.features, num_classes=args.classes,
                           chunk_edges=args.chunk_edges, tmp_dir=tmp_dir)
    if args.source.startswith("ogbn-"):
        source = ogb_source(args.source, args.root, chunk_edges=args.chunk_edges,
                            tmp_dir=tmp_dir)
        if args.symmetrize and not source.symmetric:  # as plexus.data.cache: to_undirected
            source = dataclasses.replace(source, symmetrize=True, dedupe=True)
        return source
    if args.source.endswith(".npy"):
        if args.num_nodes is None:
            raise ValueError("an edge file needs --num-nodes")
        return edge_file_source(args.source, args.num_nodes, symmetrize=args.symmetrize,
                                num_features=args.features, num_classes=args.classes,
                                seed=args.seed, chunk_edges=args.chunk_edges, tmp_dir=tmp_dir)
    return graph_source(load_dataset(args.source, root=args.root, seed=args.seed),
                        chunk_edges=args.chunk_edges)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.verify is not None:
            bad = verify(args.verify, quiet=args.quiet)
            print(f"{args.verify}: " + ("intact" if not bad else
                                        f"{len(bad)} damaged or missing file(s): "
                                        + ", ".join(bad[:10])))
            return 1 if bad else 0
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        # not at once with a job preparing OUT; where flock fails, prepare unlocked
        with preparing_lock(out, verbose=True, required=False):
            source = source_from_args(args, tmp_dir=str(out.parent))
            m = prepare(source, out, blocks=args.blocks, permutation=args.permutation,
                        seed=args.seed, force=args.force, quiet=args.quiet)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    nnz = np.asarray(m["block_nnz"]["even"])
    print(f"{out}: {m['num_nodes']:,} nodes, {m['num_edges']:,} edges ({m['nnz']:,} nonzeros "
          f"with self-loops; {m['mean']['nnz']:,} in the mean aggregation's) in "
          f"{m['blocks']}x{m['blocks']} blocks, max/mean nonzeros per block "
          f"{nnz.max() / max(nnz.mean(), 1):.3f}; {m['prepare_seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

