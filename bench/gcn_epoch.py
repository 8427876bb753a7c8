"""One-rank GCN epoch time: ours (Plexus, grid 1x1x1) against PyG's GCNConv, in one run.

    python bench/gcn_epoch.py                       # 200K nodes, 3.2M edges, 128 features
    python bench/gcn_epoch.py --nodes 20000 --epochs 3   # quick
    python bench/gcn_epoch.py --device cuda --nodes 100000   # both on one GPU

Both train the same 3-layer GCN (hidden 128, no bias, AdamW, cross-entropy on the training
split) on the same graph with the same number of torch threads. PyG gets its fastest CPU path:
``GCNConv(normalize=False)`` on a precomputed normalised CSR adjacency (``torch.sparse_csr``),
so neither side spends time on normalisation inside the epoch. Printed: median epoch time of
each, the ratio ours/PyG (target <= 0.6), and the SpMM throughput of our kernel and of torch's
CSR matmul against the machine's memory bandwidth measured here by a large copy (STREAM-copy
style). ``--spmm torch`` runs ours on torch's CSR matmul instead of the numba kernel.
``--device cuda`` runs both on one GPU (ours through torch's CSR matmul there, as PyG; every
time is taken after the GPU has finished), the bandwidth by a copy on the GPU.

Our trainer keeps freed activation buffers in the heap (common.alloc; a process-wide glibc
setting), so PyG is timed first as its users run it, and once more after ours under the same
allocator setting, for reference; ``--no-retain-freed-memory`` turns the setting off.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import itertools
from collections.abc import Callable

import scipy.sparse as sp
import torch

from common.alloc import retain_freed_memory
from common.dist import init_distributed
from common.grid import ProcessGrid
from plexus.config import split_config
from plexus.data import InMemorySource
from plexus.data.generators import planted_partition
from plexus.data.partition import normalized_adjacency
from plexus.sparse import SPMM_KERNELS, BlockSparse, CSRBlock
from plexus.trainer import train_gcn

CPU = torch.device("cpu")


def to_torch_csr(m: sp.csr_matrix) -> torch.Tensor:
    """scipy CSR -> torch CSR (int32 indices where they fit), as PyG's users would build."""
    return CSRBlock.from_scipy(m).to_torch()


def synchronizer(device: torch.device) -> Callable[[], None]:
    """What waits for the device's queued work before a clock is read (nothing on the CPU)."""
    return torch.cuda.synchronize if device.type == "cuda" else lambda: None


def memory_bandwidth(num_bytes: int = 512 * 2**20, reps: int = 5,
                     device: torch.device = CPU) -> float:
    """Copy bandwidth in GB/s (bytes read + bytes written per second), best of ``reps``."""
    src = torch.ones(num_bytes // 4, device=device)
    dst = torch.empty_like(src)
    sync = synchronizer(device)
    best = float("inf")
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - t)
    return 2 * num_bytes / best / 1e9


def spmm_throughput(adj: sp.csr_matrix, width: int, reps: int = 5,
                    device: torch.device = CPU) -> dict[str, tuple]:
    """{kernel: (seconds per SpMM, GB/s moved)} for ``adj @ X``, X [N, width] float32, with
    ours (plexus.sparse: the numba kernel on the CPU, torch CSR on a GPU) and torch's CSR
    matmul (what PyG runs), on ``device``.

    Bytes counted as the minimum traffic without feature reuse: per nonzero one index
    (4 B), one value (4 B) and one feature row (4*width B); plus the output rows.
    """
    ours = BlockSparse.single(adj).to(device)
    theirs = to_torch_csr(adj).to(device)
    x = torch.randn(adj.shape[1], width, device=device)
    moved = adj.nnz * (4 + 4 + 4 * width) + adj.shape[0] * 4 * width
    sync = synchronizer(device)
    out = {}
    for name, fn in (("ours", lambda: ours.matmul(x)), ("torch CSR", lambda: theirs @ x)):
        fn()
        times = []
        for _ in range(reps):
            sync()
            t = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t)
        sec = statistics.median(times)
        out[name] = (sec, moved / sec / 1e9)
    return out


def pyg_epochs(graph, adj, hidden: int, layers: int, epochs: int, lr: float,
               device: torch.device = CPU) -> list[float]:
    from torch_geometric.nn import GCNConv

    torch.manual_seed(0)
    dims = [graph.num_features] + [hidden] * (layers - 1) + [graph.num_classes]
    convs = torch.nn.ModuleList([GCNConv(a, b, normalize=False, bias=False)
                                 for a, b in itertools.pairwise(dims)]).to(device)
    opt = torch.optim.AdamW(convs.parameters(), lr=lr, weight_decay=5e-4)
    x, adj = graph.x.to(device), adj.to(device)
    train = graph.train_idx.to(device)
    y = graph.y.to(device)[train]
    sync = synchronizer(device)
    times = []
    for _ in range(epochs):
        sync()
        t = time.perf_counter()
        opt.zero_grad()
        h = x
        for i, conv in enumerate(convs):
            h = conv(h, adj)
            h = h.relu() if i < len(convs) - 1 else h
        loss = torch.nn.functional.cross_entropy(h[train], y)
        loss.backward()
        opt.step()
        sync()
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
    p.add_argument("--spmm", choices=SPMM_KERNELS, default="auto",
                   help="our CPU SpMM kernel (ablation: torch)")
    p.add_argument("--no-retain-freed-memory", dest="retain", action="store_false",
                   help="ablation: leave glibc's allocator settings alone in our run")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where both sides train (default: %(default)s)")
    args = p.parse_args()
    warnings.filterwarnings("ignore", message=".*[Ss]parse.*")
    ctx = init_distributed(device=args.device, launcher="single",
                           set_threads=args.threads is None)
    device = ctx.device
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()

    t = time.perf_counter()
    graph = planted_partition(num_nodes=args.nodes, avg_degree=args.avg_degree,
                              num_features=args.features, num_classes=args.classes, seed=0)
    a_hat = normalized_adjacency(graph.edge_index.numpy(), graph.num_nodes)
    adj = to_torch_csr(a_hat)
    print(f"graph: {graph.num_nodes:,} nodes, {graph.num_edges:,} edges "
          f"({adj.values().numel():,} nonzeros with self-loops), {args.features} features, "
          f"{args.classes} classes; {args.layers} layers, hidden {args.hidden}; "
          f"{threads} threads; on {device}; built in {time.perf_counter() - t:.1f} s",
          flush=True)

    # PyG first, with the allocator as a PyG user has it; our trainer then applies
    # common.alloc.retain_freed_memory (process-wide), so PyG runs again under the same setting
    pyg = pyg_epochs(graph, adj, args.hidden, args.layers, args.epochs + 1, 0.01, device)[1:]
    cfg = split_config(epochs=args.epochs + 1, hidden=args.hidden, num_layers=args.layers,
                       lr=0.01, spmm=args.spmm, retain_freed_memory=args.retain,
                       bias=False, dropout=0.0, optimizer="adamw")  # PyG's side's model
    ours = [r["epoch_s"] for r in train_gcn(InMemorySource(graph), ProcessGrid.parse("1x1x1"),
                                            0, device=device, **cfg).history[1:]]
    tuned = retain_freed_memory() if args.retain else False
    pyg_tuned = pyg_epochs(graph, adj, args.hidden, args.layers, args.epochs + 1, 0.01,
                           device)[1:]
    o, q, qt = (statistics.median(t) for t in (ours, pyg, pyg_tuned))
    print(f"\n{'':36}{'median s/epoch':>16}{'min':>10}{'max':>10}")
    for name, t in (("ours (Plexus 1x1x1)", ours), ("PyG GCNConv (CSR)", pyg),
                    ("PyG GCNConv (CSR), our allocator", pyg_tuned)):
        print(f"{name:36}{statistics.median(t):>16.3f}{min(t):>10.3f}{max(t):>10.3f}")
    print(f"ratio ours/PyG: {o / q:.3f}  (target <= 0.6)")
    if tuned:
        print(f"ratio ours/PyG with our allocator setting too: {o / qt:.3f}  (for reference)")

    bw = memory_bandwidth(device=device)
    print(f"\nSpMM [{a_hat.shape[0]:,} x {a_hat.shape[1]:,}, {a_hat.nnz:,} nnz] @ "
          f"[{a_hat.shape[1]:,} x {args.hidden}]; {device} copy bandwidth {bw:.2f} GB/s")
    for name, (sec, gbs) in spmm_throughput(a_hat, args.hidden, device=device).items():
        print(f"  {name:10} {1000 * sec:7.1f} ms  {gbs:6.2f} GB/s of minimum traffic = "
              f"{100 * gbs / bw:5.1f}% of the copy bandwidth")
    ctx.close()


if __name__ == "__main__":
    main()
