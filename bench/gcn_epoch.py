"""One-rank GCN epoch time: ours (Plexus, grid 1x1x1) against PyG's GCNConv, in one run.

    python bench/gcn_epoch.py                       # 200K nodes, 3.2M edges, 128 features
    python bench/gcn_epoch.py --nodes 20000 --epochs 3   # quick

Both train the same 3-layer GCN (hidden 128, no bias, AdamW, cross-entropy on the training
split) on the same graph with the same number of torch threads. PyG gets its fastest CPU path:
``GCNConv(normalize=False)`` on a precomputed normalised CSR adjacency (``torch.sparse_csr``),
so neither side spends time on normalisation inside the epoch. Printed: median epoch time of
each, the ratio ours/PyG (target <= 0.6), and our SpMM throughput against the machine's memory
bandwidth measured here by a large copy (STREAM-copy style).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from common.dist import init_distributed, shutdown  # noqa: E402
from common.grid import ProcessGrid  # noqa: E402
from plexus.datasets import planted_partition  # noqa: E402
from plexus.partition import normalized_adjacency  # noqa: E402
from plexus.shard import to_torch_csr  # noqa: E402
from plexus.trainer import TrainConfig, train_gcn  # noqa: E402


def memory_bandwidth(num_bytes: int = 512 * 2**20, reps: int = 5) -> float:
    """Copy bandwidth in GB/s (bytes read + bytes written per second), best of ``reps``."""
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * num_bytes / best / 1e9


def spmm_throughput(adj: torch.Tensor, width: int, reps: int = 3) -> tuple[float, float]:
    """(seconds per SpMM, GB/s moved) for ``adj @ X`` with X [N, width] float32.

    Bytes counted as the minimum traffic without feature reuse: per nonzero one index
    (4 or 8 B), one value (4 B) and one feature row (4*width B); plus the output rows.
    """
    x = torch.randn(adj.shape[1], width)
    adj @ x
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        adj @ x
        times.append(time.perf_counter() - t)
    sec = statistics.median(times)
    nnz = adj.values().numel()
    idx = adj.col_indices().element_size()
    moved = nnz * (idx + 4 + 4 * width) + adj.shape[0] * 4 * width
    return sec, moved / sec / 1e9


def pyg_epochs(graph, adj, hidden: int, layers: int, epochs: int, lr: float) -> list[float]:
    from torch_geometric.nn import GCNConv

    torch.manual_seed(0)
    dims = [graph.num_features] + [hidden] * (layers - 1) + [graph.num_classes]
    convs = torch.nn.ModuleList([GCNConv(a, b, normalize=False, bias=False)
                                 for a, b in zip(dims[:-1], dims[1:])])
    opt = torch.optim.AdamW(convs.parameters(), lr=lr, weight_decay=5e-4)
    times = []
    for _ in range(epochs):
        t = time.perf_counter()
        opt.zero_grad()
        h = graph.x
        for i, conv in enumerate(convs):
            h = conv(h, adj)
            h = h.relu() if i < len(convs) - 1 else h
        loss = torch.nn.functional.cross_entropy(h[graph.train_idx], graph.y[graph.train_idx])
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=200_000)
    p.add_argument("--avg-degree", type=float, default=16.0, help="edges = nodes * degree")
    p.add_argument("--features", type=int, default=128)
    p.add_argument("--classes", type=int, default=32)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--epochs", type=int, default=5, help="timed epochs (after one warm-up)")
    p.add_argument("--threads", type=int, default=None, help="default: all cores")
    args = p.parse_args()
    warnings.filterwarnings("ignore", message=".*[Ss]parse.*")
    init_distributed(device="cpu", launcher="single", set_threads=args.threads is None)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()

    t = time.perf_counter()
    graph = planted_partition(num_nodes=args.nodes, avg_degree=args.avg_degree,
                              num_features=args.features, num_classes=args.classes, seed=0)
    adj = to_torch_csr(normalized_adjacency(graph.edge_index.numpy(), graph.num_nodes))
    print(f"graph: {graph.num_nodes:,} nodes, {graph.num_edges:,} edges "
          f"({adj.values().numel():,} nonzeros with self-loops), {args.features} features, "
          f"{args.classes} classes; {args.layers} layers, hidden {args.hidden}; "
          f"{threads} threads; built in {time.perf_counter() - t:.1f} s", flush=True)

    cfg = TrainConfig(epochs=args.epochs + 1, hidden=args.hidden, layers=args.layers, lr=0.01)
    ours = [r["epoch_s"] for r in
            train_gcn(graph, ProcessGrid.parse("1x1x1"), 0, cfg).history[1:]]
    pyg = pyg_epochs(graph, adj, args.hidden, args.layers, args.epochs + 1, 0.01)[1:]
    o, q = statistics.median(ours), statistics.median(pyg)
    print(f"\n{'':24}{'median s/epoch':>16}{'min':>10}{'max':>10}")
    print(f"{'ours (Plexus 1x1x1)':24}{o:>16.3f}{min(ours):>10.3f}{max(ours):>10.3f}")
    print(f"{'PyG GCNConv (CSR)':24}{q:>16.3f}{min(pyg):>10.3f}{max(pyg):>10.3f}")
    print(f"ratio ours/PyG: {o / q:.3f}  (target <= 0.6)")

    bw = memory_bandwidth()
    sec, gbs = spmm_throughput(adj, args.hidden)
    print(f"\nSpMM [{adj.shape[0]:,} x {adj.shape[1]:,}, {adj.values().numel():,} nnz] @ "
          f"[{adj.shape[1]:,} x {args.hidden}]: {1000 * sec:.1f} ms, {gbs:.2f} GB/s of "
          f"minimum traffic = {100 * gbs / bw:.1f}% of the measured copy bandwidth "
          f"{bw:.2f} GB/s")
    shutdown()


if __name__ == "__main__":
    main()
