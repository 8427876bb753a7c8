"""One plexus run of bench/accuracy.py on every rank of a grid: ``bench/accuracy.py --grid``
launches it under ``mpiexec`` (common.spawn.run_worker) with the graph saved by the driver
and ``plexus.fit``'s keyword arguments as JSON; rank 0 hands back the history and the best
epoch. The graph is the bench's 10,000-node one, small enough for every rank to load whole.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--graph", required=True, help="the graph, saved with torch.save")
    p.add_argument("--grid", required=True)
    p.add_argument("--config", required=True, help="plexus.fit's keyword arguments, JSON")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*[Ss]parse.*")
    import torch.distributed as dist

    import plexus
    from common.spawn import print_result

    graph = torch.load(args.graph, weights_only=False)
    result = plexus.fit(graph, grid=args.grid, **json.loads(args.config))
    if not dist.is_initialized() or dist.get_rank() == 0:
        print_result({"history": result.history, "best": result.info["best"]})


if __name__ == "__main__":
    main()
