"""One-rank GCN epoch time: ours (Plexus, grid 1x1x1) against PyG's GCNConv, equal work, in one run.

    python bench/gcn_epoch.py                       # 200K nodes, 3.2M edges, 128 features
    python bench/gcn_epoch.py --nodes 20000 --rounds 1 --warmup 1   # quick
    python bench/gcn_epoch.py --device cuda --nodes 100000   # both on one GPU
    python bench/gcn_epoch.py --dropout 0.5         # OGB's recipe: dropout on both sides
    python bench/gcn_epoch.py --norm batch          # batch norm after every hidden layer
    python bench/gcn_epoch.py --device cuda --nodes 1000000 --dropout 0.5 --precision fp32,bf16

Both train the same 3-layer GCN (hidden 128, no bias, AdamW, cross-entropy on the training
split) on the same graph with the same number of torch threads, and both step torch's fused
AdamW (ours makes it by default; PyG is given it). PyG gets its fastest CPU path:
``GCNConv(normalize=False)`` on a precomputed normalised CSR adjacency (``torch.sparse_csr``),
so neither side spends time on normalisation inside the epoch. Two workloads, each equal work:

* ``fixed``: fixed input features. Ours computes ``A X`` once (in the untimed first epoch) and
  reuses it; PyG is given the same: ``A X`` precomputed once, its first layer a linear map of
  it (``(A X) W = A (X W)``).
* ``learn``: trainable input features (a parameter on both sides): every epoch runs every
  SpMM, the first layer's backward included.

``--dropout P`` (default 0, as above) drops every layer's input on both sides, the features'
included: ours with its grid-independent hashed masks (recomputing layer 0's aggregation in
backward with fixed features), PyG with ``F.dropout``. ``A X`` then changes every epoch, so
with fixed features both sides aggregate every layer every epoch. ``--norm batch`` puts a
batch norm between every hidden layer and its ReLU on both sides: ours its sharded batch norm
(plexus.norms), PyG ``torch.nn.BatchNorm1d``.

``--precision fp32,bf16`` also runs ours with ``--precision bf16`` (the features and the
activations kept for backward in bf16; fixed features only, as plexus.train takes it) after the
float32 workloads, judged against PyG in float32 (the model whose accuracy bench/accuracy.py
compares it with); PyG in bf16 (its layers, features and adjacency in bf16) is printed beside
where torch's CSR matmul takes bf16 (a GPU; not the CPU).

Allocator: PyTorch's CPU allocator faults in every 4 KiB page of a fresh large tensor;
``THP_MEM_ALLOC_ENABLE=1`` (huge pages, which importing ``common`` sets) and our trainer's
retained heap (common.alloc) avoid that. Each side runs in its own process (the settings are
process-wide and read once): ours as it runs by default (huge pages, retained heap and its
pool of tall buffers, common.dense), PyG as a PyG user has it (neither), with huge pages, and
with both; the fastest PyG counts. Ours also runs without the pool (``--no-pool-buffers``: the
tall buffers handed back as PyG's are), printed beside with its own ratio; the target is
judged on the default.

Timing: every process trains ``--warmup`` untimed epochs, then ``--epochs`` timed ones: ours'
first epoch computes and caches ``A X`` and compiles the kernels, and until the retained heap
and the pool of tall buffers hold what an epoch frees, the next ones still fault in fresh
pages. The processes run in ``--rounds`` rounds, each round every side once, the order
reversed every other round, so that a machine whose speed drifts over minutes slows both sides
alike and one slow process moves no median by much; each side's median is over all its timed
epochs.
Printed: the median epoch time of each, ``ours/PyG`` per workload against the target (<= 0.35
on the CPU; on a GPU, where both sides run the same vendor kernels, <= 1.0, and from a million
nodes <= 0.8 in float32, <= 0.5 in bf16: :func:`target_of`; bf16 on the CPU has none) with the
ratio of each round's medians beside it; with dropout, our dropout's share of our epoch
(measured apart on the epoch's blocks, :func:`dropout_seconds`; target on a GPU <= 10%); and the
SpMM throughput of our kernel and of torch's CSR matmul against the machine's memory bandwidth
measured here by a large copy (STREAM-copy style). ``--spmm torch`` runs ours on torch's CSR
matmul. ``--device cuda`` runs both on one GPU (ours through torch's CSR matmul there, as
PyG; every time is taken after the GPU has finished; the allocator variants do not apply).
On a GPU each side's process runs every workload of ``--variants`` in turn (there are no
allocator settings to keep apart), half the processes' start-up. ``--profile`` runs one more
epoch of each side under torch.profiler, after the timed ones, and prints its costliest GPU
kernels (CPU operators on the CPU): where a target is missed, where the time went.
``--json PATH`` appends the run (a row per workload, with its provenance:
bench/provenance.py) to PATH; bench/results/epoch_time.json is the one bench/plots.py draws.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import itertools
from collections.abc import Callable

import scipy.sparse as sp
import torch

from bench.profiling import ProfileAfter, print_top
from bench.provenance import append_run, provenance
from common import dense
from common.alloc import retain_freed_memory
from common.dist import init_distributed
from common.grid import ProcessGrid
from common.memory import release
from plexus.config import split_config
from plexus.data import InMemorySource
from plexus.data.generators import planted_partition
from plexus.data.partition import normalized_adjacency
from plexus.sparse import SPMM_KERNELS, BlockSparse, CSRBlock
from plexus.trainer import train_gcn

CPU = torch.device("cpu")
DROPOUT_S: dict[str, list[float]] = {}  # per workload, our workers' dropout seconds an epoch
PROFILES: dict[str, dict[str, list]] = {}  # per workload, each side's top_ops (--profile)
ERRORS: dict[str, str] = {}  # per workload, why PyG's bf16 run failed (where it did)
FALLBACKS: dict[str, str] = {}  # per workload, what of ours fell back (a failed CUDA graph
# capture, a Triton kernel that failed): then ours ran eagerly or on torch's paths


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
    out = {}
    for name, fn in (("ours", lambda: ours.matmul(x)), ("torch CSR", lambda: theirs @ x)):
        sec = timed(fn, reps, device)
        out[name] = (sec, moved / sec / 1e9)
    return out


def timed(fn: Callable[[], object], reps: int, device: torch.device = CPU) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls after one untimed call."""
    sync = synchronizer(device)
    fn()
    times = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _rates(flops: float, theirs: Callable[[], torch.Tensor], ours: Callable[[], torch.Tensor],
           backend: str, reps: int, device: torch.device) -> dict[str, float]:
    """{name: GFLOP/s} of the same product through ``torch.mm`` (``theirs``) and ours, and
    the largest difference between the two relative to the largest entry."""
    out = {"torch.mm": flops / timed(theirs, reps, device) / 1e9,
           f"ours ({backend})": flops / timed(ours, reps, device) / 1e9}
    want = theirs()
    out["relative difference"] = ((ours() - want).abs().max() / want.abs().max()).item()
    return out


def gemm_throughput(rows: int, width: int, backend: str, reps: int = 5,
                    device: torch.device = CPU) -> dict[str, float]:
    """:func:`_rates` of a layer's ``[rows, width] @ [width, width]`` float32 product through
    ``torch.mm`` (what PyG's linear layers run) and :func:`common.dense.mm` with ``backend``
    (ours)."""
    h = torch.randn(rows, width, device=device)
    w = torch.randn(width, width, device=device) / width**0.5
    return _rates(2.0 * rows * width * width, lambda: torch.mm(h, w),
                  lambda: dense.mm(h, w, backend=backend), backend, reps, device)


def weight_grad_throughput(rows: int, width: int, backend: str, reps: int = 5,
                           device: torch.device = CPU) -> dict[str, float]:
    """The same for a layer's weight gradient ``H^T dQ`` (both ``[rows, width]``, allocated as
    our layers allocate them: :func:`common.dense.empty`) through ``torch.mm`` and
    :func:`common.dense.tn` with ``backend``."""
    g = torch.Generator(device=device).manual_seed(1)
    h, dq = (dense.empty(rows, width, device=device).normal_(generator=g) for _ in range(2))
    return _rates(2.0 * rows * width * width, lambda: torch.mm(h.t(), dq),
                  lambda: dense.tn(h, dq, backend=backend), backend, reps, device)


def pyg_epochs(graph, adj, hidden: int, layers: int, epochs: int, lr: float,
               device: torch.device = CPU, variant: str = "fixed",
               dropout: float = 0.0, norm: str = "none",
               dtype: torch.dtype = torch.float32,
               on_epoch: Callable[[int], None] | None = None) -> list[float]:
    """PyG's epoch times; ``variant`` ``fixed`` (``A X`` precomputed once, untimed, the first
    layer a linear map of it; with ``dropout`` every layer aggregates, as ours then must) or
    ``learn`` (the features a trainable parameter). ``dropout``: ``F.dropout`` on every layer's
    input, the features' included, where ours drops too. ``norm="batch"``: BatchNorm1d
    between every hidden layer and its ReLU. ``dtype``: of the model, the features and the
    adjacency's values (bf16: PyG's layers and torch's CSR matmul in bf16, where they accept
    it: :func:`pyg_takes_bf16`). ``on_epoch(e)``: called after epoch ``e`` (from 1) is timed."""
    from torch_geometric.nn import GCNConv

    torch.manual_seed(0)
    dims = [graph.num_features] + [hidden] * (layers - 1) + [graph.num_classes]
    convs = torch.nn.ModuleList([GCNConv(a, b, normalize=False, bias=False)
                                 for a, b in itertools.pairwise(dims)]).to(device, dtype)
    norms = torch.nn.ModuleList([torch.nn.BatchNorm1d(b) for b in dims[1:-1]
                                 if norm == "batch"]).to(device, dtype)
    x, adj = graph.x.to(device, dtype), adj.to(device, dtype)
    params = list(convs.parameters()) + list(norms.parameters())
    first_linear = variant == "fixed" and dropout == 0  # the cached A X ours has, once
    if variant == "learn":
        x = torch.nn.Parameter(x.clone())
        params.append(x)
    elif first_linear:
        x = (adj @ x).detach()
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=5e-4, fused=True)  # as ours steps
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
            h = torch.nn.functional.dropout(h, dropout) if dropout else h
            # GCNConv(normalize=False, bias=False) is A (h W); on A X the first is (A X) W
            h = conv.lin(h) if i == 0 and first_linear else conv(h, adj)
            if i < len(convs) - 1:
                h = (norms[i](h) if len(norms) else h).relu()
        loss = torch.nn.functional.cross_entropy(h[train], y)
        loss.backward()
        opt.step()
        sync()
        times.append(time.perf_counter() - t)
        if on_epoch is not None:
            on_epoch(len(times))
    return times


def pyg_takes_bf16(device: torch.device) -> str | None:
    """Why PyG's GCN cannot train in bf16 on ``device`` (None: it can): a small bf16 CSR
    matmul and its backward, as :func:`pyg_epochs` runs them (torch's CSR matmul has no bf16
    on the CPU)."""
    adj = torch.eye(4).to_sparse_csr().to(device, torch.bfloat16)
    x = torch.ones(4, 2, device=device, dtype=torch.bfloat16, requires_grad=True)
    try:
        (adj @ x).sum().backward()
    except (NotImplementedError, RuntimeError) as exc:
        return f"torch's CSR matmul in bf16 on {device.type}: {str(exc).splitlines()[0][:80]}"
    return None


def dropout_seconds(nodes: int, widths: list[int], p: float, device: torch.device,
                    reps: int = 5) -> float:
    """Median seconds of one epoch's dropout as our layers run it (plexus.dropout.drop_block:
    the mask hashed and applied, and the gradient masked again in backward) on a block
    ``[nodes, width]`` per layer input, timed after the device has finished: the masks' share
    of the epoch, measured apart."""
    from plexus.dropout import drop_block

    rows = torch.arange(nodes, device=device)
    blocks = [(torch.randn(nodes, w, device=device, requires_grad=True),
               torch.ones(nodes, w, device=device), torch.arange(w, device=device))
              for w in widths]

    def epoch() -> None:
        for layer, (x, grad, cols) in enumerate(blocks):
            drop_block(x, p, seed=0, step=1, layer=layer, rows=rows, cols=cols).backward(grad)
            x.grad = None

    return timed(epoch, reps, device)


# ours / PyG (the best of its allocator settings, in float32), per workload: on the CPU ours
# runs its own kernels (issue 28's target); on a GPU both sides run cuSPARSE's SpMM and
# cuBLAS's products, so ours must only not be slower where the epoch is short (its own cost
# there is launching, and waiting for the GPU); from a million nodes 0.8 in float32 and 0.5
# in bf16 (whose accuracy bench/accuracy.py checks)
TARGETS = {"cpu": 0.35, "cuda": 1.0}
CUDA_LARGE = (1_000_000, {"fp32": 0.8, "bf16": 0.5})  # (from this many nodes, targets), GPU
DROPOUT_SHARE = 0.10  # on a GPU: our dropout at most this share of our epoch


def target_of(device: torch.device, nodes: int, precision: str = "fp32") -> float | None:
    """The printed target of ours (in ``precision``) / PyG (float32) on ``device`` for a
    graph of ``nodes``; None for bf16 on the CPU, where it halves the bytes kept and sent
    (the wire's, on a cluster), not the epoch: the widening and rounding passes cost time."""
    if device.type == "cuda" and nodes >= CUDA_LARGE[0]:
        return CUDA_LARGE[1][precision]
    return None if device.type == "cpu" and precision != "fp32" else TARGETS[device.type]


VARIANTS = ("fixed", "learn")
PRECISIONS = ("fp32", "bf16")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def case_name(variant: str, precision: str) -> str:
    """A workload in a precision: ``fixed``, ``learn`` (float32), ``fixed-bf16``."""
    return variant if precision == "fp32" else f"{variant}-{precision}"


def case_of(name: str) -> tuple[str, str]:
    """(variant, precision) of a :func:`case_name`."""
    variant, _, precision = name.partition("-")
    return variant, precision or "fp32"


def cases(args: argparse.Namespace) -> list[str]:
    """The workloads run, in order: each of ``--variants`` in each of ``--precision``, but
    trainable features in bf16 (ours keeps bf16 features fixed: plexus.config)."""
    return [case_name(v, p) for p in args.precision for v in args.variants
            if not (p == "bf16" and v == "learn")]
# PyG's allocator settings: (label, THP_MEM_ALLOC_ENABLE, retained heap)
PYG_SETTINGS = (("default allocator", "0", False), ("huge pages", "1", False),
                ("huge pages + retained heap", "1", True))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=200_000)
    p.add_argument("--avg-degree", type=float, default=16.0, help="edges = nodes * degree")
    p.add_argument("--features", type=int, default=128)
    p.add_argument("--classes", type=int, default=32)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--epochs", type=int, default=3,
                   help="timed epochs per process and round (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed epochs first, in every process (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of every side once, the order reversed every other round "
                        "(default: %(default)s)")
    p.add_argument("--dropout", type=float, default=0.0,
                   help="dropout on every layer's input, both sides (default: %(default)s; "
                        "with dropout the fixed workload aggregates every layer every epoch)")
    p.add_argument("--norm", choices=("none", "batch"), default="none",
                   help="batch norm between every hidden layer and its ReLU, both sides "
                        "(default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="default: all cores")
    p.add_argument("--spmm", choices=SPMM_KERNELS, default="auto",
                   help="our CPU SpMM kernel (ablation: torch)")
    p.add_argument("--gemm", choices=dense.BACKENDS, default="auto",
                   help="our dense products' backend (ablation: torch, PyG's)")
    p.add_argument("--no-retain-freed-memory", dest="retain", action="store_false",
                   help="ablation: leave glibc's allocator settings alone in our run")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where both sides train (default: %(default)s)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma list from {VARIANTS} (default: both)")
    p.add_argument("--precision", default="fp32",
                   help=f"comma list from {PRECISIONS} (default: %(default)s): ours in bf16 "
                        "(--precision bf16 of plexus.train, fixed features only) is judged "
                        "against PyG in float32, so fp32 runs too; PyG runs bf16 as well "
                        "where torch's CSR matmul takes it")
    p.add_argument("--profile", action="store_true",
                   help="after the timed epochs, one more epoch of each side under "
                        "torch.profiler: its costliest GPU kernels (CPU operators on the CPU)")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="append this run's rows, with their provenance, to PATH "
                        "(e.g. bench/results/epoch_time.json)")
    p.add_argument("--worker", choices=("ours", "pyg"), help=argparse.SUPPRESS)
    p.add_argument("--variant", default="fixed", help=argparse.SUPPRESS)  # a worker's, a list
    p.add_argument("--pool-buffers", action=argparse.BooleanOptionalAction, default=None,
                   help=argparse.SUPPRESS)
    p.add_argument("--worker-retain", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.epochs < 1 or args.warmup < 1 or args.rounds < 1:
        p.error("--epochs, --warmup and --rounds must be at least 1")
    if not 0 <= args.dropout < 1:
        p.error(f"--dropout {args.dropout}: give a rate in [0, 1)")
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if bad := [v for v in args.variants if v not in VARIANTS]:
        p.error(f"unknown variant(s) {bad}; choose from {VARIANTS}")
    precision = {v.strip() for v in args.precision.split(",") if v.strip()}
    if bad := sorted(precision - set(PRECISIONS)):
        p.error(f"unknown precision(s) {bad}; choose from {PRECISIONS}")
    args.precision = ["fp32"] + (["bf16"] if "bf16" in precision else [])
    return args


def build_graph(args: argparse.Namespace):
    """(graph, Â as scipy CSR, Â as torch CSR): the same graph in every process (seed 0)."""
    graph = planted_partition(num_nodes=args.nodes, avg_degree=args.avg_degree,
                              num_features=args.features, num_classes=args.classes, seed=0)
    a_hat = normalized_adjacency(graph.edge_index.numpy(), graph.num_nodes)
    return graph, a_hat, to_torch_csr(a_hat)


def worker(args: argparse.Namespace) -> None:
    """One side in this process, for each workload of ``--variant`` (a comma list of
    :func:`case_name`): print ``{"times": {case: [...]}, "dropout_s": {case: s}, "profile":
    {case: top_ops}, "threads": T}`` as JSON (the dropout's seconds of the float32
    workloads; with ``--profile``, one more epoch profiled:
    :class:`bench.profiling.ProfileAfter`)."""
    warnings.filterwarnings("ignore", message=".*[Ss]parse.*")
    ctx = init_distributed(device=args.device, launcher="single",
                           set_threads=args.threads is None)
    if args.threads:
        torch.set_num_threads(args.threads)
    graph, _, adj = build_graph(args)
    if args.worker == "pyg" and args.worker_retain:
        retain_freed_memory()
    times, dropout_s, profiles, errors = {}, {}, {}, {}  # (dropout_s: ours', an epoch)
    fallbacks: dict[str, str] = {}
    timed_epochs = args.warmup + args.epochs
    total = timed_epochs + int(args.profile)  # and one more under the profiler
    for case in args.variant.split(","):
        variant, precision = case_of(case)
        hook = ProfileAfter(timed_epochs, ctx.device) if args.profile else None
        if args.worker == "pyg":
            try:
                times[case] = pyg_epochs(graph, adj, args.hidden, args.layers, total, 0.01,
                                         ctx.device, variant, args.dropout, args.norm,
                                         DTYPES[precision], hook)[args.warmup:timed_epochs]
            except (RuntimeError, NotImplementedError) as exc:
                if precision == "fp32":
                    raise
                times[case] = None  # PyG's layers refused bf16 here: reported, not fatal
                errors[case] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                continue
            if hook is not None:
                profiles[case] = hook.top
            continue
        cfg = split_config(epochs=total, hidden=args.hidden,
                           num_layers=args.layers, lr=0.01, spmm=args.spmm, gemm=args.gemm,
                           retain_freed_memory=args.retain,
                           pool_buffers=args.pool_buffers,
                           bias=False, dropout=args.dropout, norm=args.norm,
                           optimizer="adamw", precision=precision,
                           learn_features=variant == "learn")  # PyG's side's model
        result = train_gcn(InMemorySource(graph), ProcessGrid.parse("1x1x1"), 0,
                           device=ctx.device,
                           on_epoch=None if hook is None else lambda row, h=hook: h(row["epoch"]),
                           **cfg)
        if result.info["fallbacks"]:
            fallbacks[case] = "; ".join(result.info["fallbacks"])[:600]
        times[case] = [r["epoch_s"] for r in result.history[args.warmup:timed_epochs]]
        if hook is not None:
            profiles[case] = hook.top
        del result
        release(ctx.device)  # the first workload's model (and CUDA graph) before the next
        if args.dropout and precision == "fp32":  # the same blocks for every workload:
            if not dropout_s:  # measured once a process
                widths = [graph.num_features] + [args.hidden] * (args.layers - 1)
                masks_s = dropout_seconds(graph.num_nodes, widths, args.dropout, ctx.device)
            dropout_s[case] = masks_s
    print(json.dumps({"times": times, "dropout_s": dropout_s, "profile": profiles,
                      "errors": errors, "fallbacks": fallbacks,
                      "threads": torch.get_num_threads()}), flush=True)
    ctx.close()


# on a GPU one process a side runs every workload (no allocator settings to keep apart): the
# other workloads' times, (side, THP, retained heap, pool) -> variant -> rounds not yet read
_LATER: dict[tuple, dict[str, list[list[float]]]] = {}


def run_worker(args: argparse.Namespace, side: str, variant: str, thp: str,
               retain: bool, pool: bool | None = None) -> list[float]:
    """Epoch times of one side in a fresh process with ``THP_MEM_ALLOC_ENABLE=thp``; on a GPU
    that process runs every workload of ``--variants`` at once, and this returns ``variant``'s
    times, keeping the others' for their calls (round by round, in order)."""
    later = _LATER.setdefault((side, thp, retain, pool), {})
    if later.get(variant):
        return later[variant].pop(0)
    variants = cases(args) if args.device == "cuda" else [variant]
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", side, "--variant",
           ",".join(variants), "--worker-retain", str(int(retain)), "--nodes", str(args.nodes),
           "--avg-degree", str(args.avg_degree), "--features", str(args.features),
           "--classes", str(args.classes), "--hidden", str(args.hidden), "--layers",
           str(args.layers), "--epochs", str(args.epochs), "--warmup", str(args.warmup),
           "--dropout", str(args.dropout), "--norm", args.norm, "--spmm", args.spmm,
           "--gemm", args.gemm,
           "--device", args.device]
    if args.profile:
        cmd.append("--profile")
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if not args.retain:
        cmd.append("--no-retain-freed-memory")
    if pool is not None:
        cmd.append("--pool-buffers" if pool else "--no-pool-buffers")
    env = {**os.environ, "THP_MEM_ALLOC_ENABLE": thp}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"the {side} worker ({','.join(variants)}, THP={thp}) failed with exit code "
                 f"{done.returncode}:\n{done.stderr[-3000:]}")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    for v, seconds in got["dropout_s"].items():
        DROPOUT_S.setdefault(v, []).append(seconds)
    for v, top in got.get("profile", {}).items():  # each side's first profile
        PROFILES.setdefault(v, {}).setdefault(side, top)
    for v, why in got.get("errors", {}).items():
        ERRORS.setdefault(v, why)
    for v, why in got.get("fallbacks", {}).items():
        FALLBACKS.setdefault(v, why)
    for v in variants:
        if v != variant:
            later.setdefault(v, []).append(got["times"][v])
    return got["times"][variant]


def run_round(args: argparse.Namespace, variant: str,
              sides: list[tuple[str, str, str, bool, bool | None]]) -> dict[str, list[float]]:
    """One round: each side's timed epochs, the sides run one after another in this order."""
    return {name: run_worker(args, side, variant, thp, retain, pool)
            for name, side, thp, retain, pool in sides}


def print_profile(case: str, side: str, top: list, device: torch.device) -> None:
    """One side's :func:`bench.profiling.top_ops` of a workload, a line each."""
    what = "GPU kernels, device" if device.type == "cuda" else "operators, CPU"
    total = sum(ms for _, ms, _ in top)
    whose, note = ("our", "; its evaluation included") if side == "ours" else ("PyG's", "")
    print_top(f"{case}: {whose} costliest {what} ms in one profiled epoch (these {total:.1f} "
              f"ms{note}):", top)


def verdict(ratio: float, target: float | None) -> str:
    """``target <= 0.35: met`` (or ``MISSED``), or why there is no target."""
    if target is None:
        return "no target: bf16 on the CPU halves bytes, not time"
    return f"target <= {target}: {'met' if ratio <= target else 'MISSED'}"


def _round_ratio(got: dict[str, list[float]], ours: str, pyg: list[str]) -> float:
    """One round's ours/PyG: our median over the fastest PyG median of that round."""
    return statistics.median(got[ours]) / min(statistics.median(got[n]) for n in pyg)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    warnings.filterwarnings("ignore", message=".*[Ss]parse.*")
    ctx = init_distributed(device=args.device, launcher="single",
                           set_threads=args.threads is None)
    device = ctx.device
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    t = time.perf_counter()
    graph, a_hat, adj = build_graph(args)
    print(f"graph: {graph.num_nodes:,} nodes, {graph.num_edges:,} edges "
          f"({adj.values().numel():,} nonzeros with self-loops), {args.features} features, "
          f"{args.classes} classes; {args.layers} layers, hidden {args.hidden}, "
          f"dropout {args.dropout}, norm {args.norm}; "
          f"{threads} threads; on {device}; built in {time.perf_counter() - t:.1f} s",
          flush=True)
    settings = PYG_SETTINGS if device.type == "cpu" else PYG_SETTINGS[:1]
    ours_label = "huge pages + retained heap" if args.retain else "huge pages"
    no_bf16 = pyg_takes_bf16(device) if "bf16" in args.precision else None
    if "bf16" in args.precision and "learn" in args.variants:
        print("learn-bf16: not run (ours keeps bf16 input features fixed: trainable features "
              "train in float32)")
    ratios, rows = {}, []
    float32: dict[str, tuple] = {}  # variant -> (its rounds, PyG's sides): bf16's baseline
    for case in cases(args):
        variant, precision = case_of(case)
        target = target_of(device, graph.num_nodes, precision)
        what = ("trainable features (every SpMM every epoch)" if variant == "learn"
                else f"fixed features, dropout {args.dropout} on every layer's input (every "
                "SpMM every epoch)" if args.dropout
                else "fixed features (A X computed once on both sides)")
        if precision == "bf16":
            what += ("; ours in bf16 (--precision bf16), judged against PyG in float32" +
                     ("" if no_bf16 is None else f"; PyG in bf16 not run: {no_bf16}"))
        print(f"\n{case}: {what}", flush=True)
        # (name, side, THP_MEM_ALLOC_ENABLE, retained heap, pool): ours first, PyG's after
        sides = [(f"ours (Plexus 1x1x1), {ours_label}", "ours", "1", args.retain, None)]
        if device.type == "cpu":  # without the pool of tall buffers, printed beside
            sides.append(("ours, --no-pool-buffers", "ours", "1", args.retain, False))
        if precision == "fp32" or no_bf16 is None:
            kind = "CSR" if precision == "fp32" else "CSR, bf16"
            sides += [(f"PyG GCNConv ({kind}), {label}", "pyg", thp, retain, None)
                      for label, thp, retain in settings]
        rounds = [run_round(args, case, sides[::-1] if r % 2 else sides)
                  for r in range(args.rounds)]
        if case in ERRORS:  # PyG in bf16 failed where the probe let it start
            print(f"{case}: PyG in bf16 failed, not counted: {ERRORS[case]}")
        if case in FALLBACKS:  # (make gpu-check counts the workload as missed)
            print(f"{case}: FALLBACK: ours did not run as planned: {FALLBACKS[case]}")
        sides = [side for side in sides if all(got[side[0]] is not None for got in rounds)]
        times = {name: [t for got in rounds for t in got[name]] for name, *_ in sides}
        pyg = [name for name, side, *_ in sides if side == "pyg"]
        if precision == "fp32":
            float32[variant] = (rounds, pyg)
        base_rounds, base = float32[variant]  # (cases() runs every fp32 workload first)
        base_times = {n: [t for got in base_rounds for t in got[n]] for n in base}
        best_name = min(base, key=lambda n: statistics.median(base_times[n]))
        best = statistics.median(base_times[best_name])
        print(f"{'':48}{'median s/epoch':>16}{'min':>10}{'max':>10}")
        for name, *_ in sides:
            print(f"{name:48}{statistics.median(times[name]):>16.3f}{min(times[name]):>10.3f}"
                  f"{max(times[name]):>10.3f}", flush=True)
        ours = statistics.median(times[sides[0][0]])
        ratios[case] = ours / best
        per_round = [_round_ratio({**b, **got}, sides[0][0], base)
                     for got, b in zip(rounds, base_rounds)]
        each = ", ".join(f"{r:.3f}" for r in per_round)
        earlier = " in float32 (from its rounds above)" if precision != "fp32" else ""
        print(f"{case}: ours/PyG {ours / best:.3f} against {best_name.split(', ')[1]} "
              f"(the fastest PyG){earlier}  "
              f"({verdict(ours / best, target)}); round by round {each}")
        row = {"variant": variant, "precision": precision, "nodes": graph.num_nodes,
               "edges": graph.num_edges, "nonzeros": adj.values().numel(),
               "features": args.features, "classes": args.classes, "layers": args.layers,
               "hidden": args.hidden, "dropout": args.dropout, "norm": args.norm,
               "ours_s": ours, "pyg_s": best, "pyg_setting": best_name.split(", ")[1],
               "ratio": ours / best, "round_ratios": per_round, "target": target}
        if precision != "fp32" and pyg:  # PyG in the same precision, printed beside
            same = min(statistics.median(times[n]) for n in pyg)
            row["pyg_same_precision_s"] = same
            print(f"{case}: against PyG in {precision} too: ours/PyG {ours / same:.3f}")
        if device.type == "cpu":
            no_pool = statistics.median(times[sides[1][0]])
            row.update(no_pool_s=no_pool, no_pool_ratio=no_pool / best)
            print(f"{case}: with --no-pool-buffers ours/PyG {no_pool / best:.3f} (every tall "
                  "buffer a fresh mmap: on a VM that hands freed pages to its host, some stall)")
        if case in DROPOUT_S:  # the masks measured apart, against our median epoch
            share = statistics.median(DROPOUT_S[case]) / ours
            row["dropout_share"] = share
            judged = (f" (target <= {DROPOUT_SHARE:.0%}: "
                       f"{'met' if share <= DROPOUT_SHARE else 'MISSED'})"
                       if device.type == "cuda" else "")
            print(f"{case}: our dropout (masks hashed and applied, forward and backward) "
                  f"{1000 * statistics.median(DROPOUT_S[case]):.1f} ms of our "
                  f"{1000 * ours:.1f} ms epoch: share {100 * share:.1f}%{judged}")
        for side, top in PROFILES.get(case, {}).items():
            print_profile(case, side, top, device)
        rows.append(row)
    if ratios:  # the line bench/gpu_check.py reads, and ours' time of the first workload
        first = cases(args)[0]
        print(f"\nratio ours/PyG: {ratios[first]:.3f}  ({first}; "
              f"target <= {target_of(device, graph.num_nodes)})")

    bw = memory_bandwidth(device=device)
    print(f"\nSpMM [{a_hat.shape[0]:,} x {a_hat.shape[1]:,}, {a_hat.nnz:,} nnz] @ "
          f"[{a_hat.shape[1]:,} x {args.hidden}]; {device} copy bandwidth {bw:.2f} GB/s")
    spmm = spmm_throughput(a_hat, args.hidden, device=device)
    for name, (sec, gbs) in spmm.items():
        print(f"  {name:10} {1000 * sec:7.1f} ms  {gbs:6.2f} GB/s of minimum traffic = "
              f"{100 * gbs / bw:5.1f}% of the copy bandwidth")
    n, d = a_hat.shape[0], args.hidden
    gflops_of = {}
    for what, measure in ((f"dense product [{n:,} x {d}] @ [{d} x {d}]", gemm_throughput),
                          (f"weight gradient [{n:,} x {d}]^T @ [{n:,} x {d}]",
                           weight_grad_throughput)):
        rates = measure(n, d, args.gemm, device=device)
        diff = rates.pop("relative difference")
        gflops_of[what] = rates
        print(f"{what} (relative difference {diff:.1e}):")
        for name, gflops in rates.items():
            print(f"  {name:18} {gflops:7.1f} GFLOP/s")
    if args.json:
        append_run(args.json, {
            "bench": "gcn_epoch", "device": device.type, "threads": threads,
            "provenance": provenance("gcn_epoch.py", sys.argv[1:] if argv is None else argv,
                                     device.type),
            "rows": rows, "copy_gb_s": bw,
            "spmm": {name: {"ms": 1e3 * sec, "gb_s": gbs} for name, (sec, gbs) in spmm.items()},
            "gflops": gflops_of})
    ctx.close()


if __name__ == "__main__":
    main()
