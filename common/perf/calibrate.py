"""Measure the machine it runs on and write a machine profile (JSON) for the performance model.

    python -m common.perf.calibrate --ranks 1,2,4,8 --out common/perf/profiles/local-cpu.json
    mpiexec -n 4 python -m common.perf.calibrate --out my.json --merge   # one rank count

With ``--ranks`` the command starts itself once per rank count under ``mpiexec`` (or
``torchrun`` when there is no mpiexec) and merges the results into one profile. Each launch
of ``G`` ranks measures, with all ``G`` ranks busy at once as in training (so oversubscribed
cores and loopback contention are part of the numbers):

* collectives: for every group size ``g`` dividing ``G``, all ``G/g`` groups run
  all-reduce, all-gather and reduce-scatter together (:mod:`common.collectives` over the
  transport the trainers get from the same launcher: MPI under mpiexec, gloo under torchrun;
  all-reduce in place); the time per call is the block of calls from a common start until the
  last rank is done, divided by the calls, fastest of ``--rounds`` rounds (the least disturbed
  by other jobs); ``t = steps * alpha + ring_bytes / bandwidth`` is fitted by least squares
  on relative error;
* SpMM: ``A @ X`` with a random CSR matrix (uniform columns, as after the double permutation)
  for several widths, by the kernel the GCN trainer runs (``--spmm-kernel``, default plexus's
  numba kernel when importable, else torch's CSR matmul); one bandwidth is fitted under
  :func:`common.perf.gcn.spmm_bytes`;
* GEMM: float32 matmuls of GCN-like shapes through :func:`common.dense.mm` (as the GCN
  layers' forward products run), the median flop/s;
* memory bandwidth: a large copy, (read + write) bytes/s.

Freed buffers stay in the heap (:func:`common.alloc.retain_freed_memory`), as in the trainers.
The profile's ``sources`` record the transport, the MPI library, the SpMM kernel and the
thread counts measured. Only this module imports torch; the model (``common.perf.*``) does not.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np

from common.perf.gcn import gemm_seconds, spmm_bytes
from common.perf.machine import OPS, CollectiveFit, Compute, Link, MachineProfile, ring_factor
from common.perf.machine import ring_steps as _steps
from common.spawn import find_mpiexec

SIZES = (1 << 12, 1 << 16, 1 << 19, 1 << 21, 1 << 23)  # bytes of the full tensor
WIDTHS = (8, 16, 32, 64, 128)
GEMMS = ((8192, 32, 32), (8192, 64, 64), (8192, 128, 128), (8192, 128, 32), (4096, 64, 128))
# the GCN trainer's CPU SpMM (plexus.sparse), named as a string: common imports no engine
DEFAULT_KERNEL = "plexus.kernels:csr_spmm"


def fit_alpha_beta(steps: int, samples: list[tuple[float, float]]) -> tuple[float, float]:
    """Fit ``t = steps * alpha + x / beta`` to ``(x = ring bytes, t)``, weighting relative error.

    Weighted least squares with weights ``1/t^2`` on ``t = c + s x``; ``alpha = c / steps``
    (clamped at 0, then the slope refitted through the origin), ``beta = 1 / s``.
    """
    w = [1.0 / t**2 for _, t in samples]
    sw = sum(w)
    mx = sum(wi * x for wi, (x, _) in zip(w, samples)) / sw
    mt = sum(wi * t for wi, (_, t) in zip(w, samples)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, (x, _) in zip(w, samples))
    sxt = sum(wi * (x - mx) * (t - mt) for wi, (x, t) in zip(w, samples))
    slope = sxt / sxx if sxx else 0.0
    c = mt - slope * mx
    if c < 0 or slope <= 0:
        c = max(c, 0.0)
        slope = sum(wi * x * (t - c) for wi, (x, t) in zip(w, samples)) / sum(
            wi * x * x for wi, (x, _) in zip(w, samples))
    return c / max(steps, 1), 1.0 / max(slope, 1e-30)


def _measure(ctx, args) -> dict:
    import torch
    import torch.distributed as dist

    from common import collectives as coll
    from common import dense
    from common.exchange import max_over_ranks
    from common.grid import ProcessGrid

    world, rank = ctx.world_size, ctx.rank
    gen = torch.Generator().manual_seed(1234 + rank)

    def timed(fn, iters: int, rounds: int) -> float:
        # From a common start until the last rank is done, so that ranks sharing cores are
        # measured sharing them (as in training, where the next collective waits for all).
        fn()
        out = []
        for _ in range(rounds):
            if world > 1:
                dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            if world > 1:
                dist.barrier()
            out.append(max_over_ranks([(time.perf_counter() - t0) / iters])[0])
        return min(out)  # the round least disturbed by other jobs on the machine

    result: dict = {"ranks": world, "threads": torch.get_num_threads(), "collectives": [],
                    "table": [], "transport": _transport_name(ctx),
                    "spmm_kernel": args.spmm_kernel}
    for g in [d for d in range(2, world + 1) if world % d == 0]:
        grid = ProcessGrid({"rest": world // g, "group": g})
        group = ctx.create_groups(grid, ["group"])["group"]
        for op in OPS:
            samples = []
            for size in SIZES:
                numel = size // 4
                x = torch.ones(numel // g if op == "all_gather" else numel)
                call = {"all_reduce": lambda x=x, gr=group: coll.all_reduce(x, gr, inplace=True),
                        "all_gather": lambda x=x, gr=group: coll.all_gather(x, gr),
                        "reduce_scatter": lambda x=x, gr=group: coll.reduce_scatter(x, gr)}[op]
                iters = max(2, min(20, (1 << 21) // size))
                t = timed(call, iters, args.rounds)
                samples.append((ring_factor(op, g) * size, t))
                result["table"].append((op, g, size, t))
            alpha, beta = fit_alpha_beta(_steps(op, g), samples)
            result["collectives"].append({"op": op, "ranks_per_node": world, "group_size": g,
                                          "alpha_s": alpha, "bandwidth": beta})

    n, deg = args.spmm_nodes, args.spmm_degree
    cols = torch.randint(0, n, (n, deg), generator=gen).sort(dim=1).values.reshape(-1)
    with warnings.catch_warnings():  # "sparse CSR support is in beta"
        warnings.simplefilter("ignore", UserWarning)
        a = torch.sparse_csr_tensor(torch.arange(0, n * deg + 1, deg, dtype=torch.int32),
                                    cols.to(torch.int32), torch.rand(n * deg, generator=gen),
                                    size=(n, n), check_invariants=False)
    kernel = _spmm_kernel(args.spmm_kernel)
    indptr, indices, values = (t.numpy() for t in (a.crow_indices(), a.col_indices(),
                                                    a.values()))
    spmm = []
    for width in WIDTHS:
        x = torch.rand(n, width, generator=gen)
        if kernel is None:
            t = timed(lambda x=x: a @ x, 5, args.rounds)
        else:
            out = np.empty((n, width), np.float32)
            xn = x.numpy()
            t = timed(lambda xn=xn, out=out: kernel(indptr, indices, values, xn, out, False), 5,
                      args.rounds)
        spmm.append((spmm_bytes(n, n * deg, width, index_bytes=4, cache_line=args.cache_line),
                     t))
    spmm_bw = sum(b for b, _ in spmm) / sum(t for _, t in spmm)

    big = torch.empty(args.copy_bytes // 4)
    dst = torch.empty_like(big)
    mem_bw = 2 * args.copy_bytes / timed(lambda: dst.copy_(big), 5, args.rounds)
    flops = []
    for m, k, nn in GEMMS:
        h, w = torch.rand(m, k, generator=gen), torch.rand(k, nn, generator=gen)
        flops.append(2 * m * k * nn / timed(lambda h=h, w=w: dense.mm(h, w), 5, args.rounds))
    gemm = statistics.median(flops)
    result["compute"] = {"ranks_per_node": world, "spmm_bandwidth": spmm_bw,
                         "gemm_flops": gemm, "memory_bandwidth": mem_bw}
    result["spmm_table"] = [(wd, b, t) for wd, (b, t) in zip(WIDTHS, spmm)]
    result["gemm_check"] = [gemm_seconds(m, k, nn, gemm, mem_bw) for m, k, nn in GEMMS]
    return result


def _transport_name(ctx) -> str:
    if ctx.transport is None:
        return f"torch.distributed {ctx.backend}"
    from mpi4py import MPI

    return f"MPI ({MPI.Get_library_version().splitlines()[0].strip()}) via common.mpi"


def _spmm_kernel(spec: str):
    """``"torch"`` -> None (torch's CSR matmul); ``"MODULE:FUNCTION"`` -> that function, called
    as ``f(indptr, indices, values, x, out, accumulate)`` on numpy arrays."""
    if spec == "torch":
        return None
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise SystemExit(f"--spmm-kernel {spec}: cannot load it ({e}); use torch or "
                         "MODULE:FUNCTION") from None


def _default_kernel() -> str:
    """plexus's numba kernel when numba is installed (what the GCN trainer runs), else torch."""
    return DEFAULT_KERNEL if importlib.util.find_spec("numba") is not None else "torch"


def _merge(path: Path, res: dict, cache_line: int) -> MachineProfile:
    """Add one launch's measurements to the profile at ``path`` (created if missing)."""
    old = json.loads(path.read_text()) if path.is_file() else None
    world = res["ranks"]
    measured = (f"{world} ranks: collectives over {res['transport']}, SpMM by "
                f"{res['spmm_kernel']}, {res['threads']} torch thread(s) per rank")
    notes = [n for n in (old or {}).get("sources", []) if not n.startswith(f"{world} ranks:")]
    compute = [c for c in (old or {}).get("compute", []) if c["ranks_per_node"] != world]
    compute.append(res["compute"])
    colls = [c for c in (old or {}).get("collectives", []) if c["ranks_per_node"] != world]
    colls.extend(res["collectives"])
    pair = [c for c in colls if c["op"] == "all_reduce" and c["group_size"] == 2]
    pair.sort(key=lambda c: c["ranks_per_node"])
    link = Link(alpha_s=pair[0]["alpha_s"], bandwidth=pair[0]["bandwidth"]) if pair else \
        Link(alpha_s=1e-5, bandwidth=1e9)
    pages = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    profile = MachineProfile(
        name=(old or {}).get("name", path.stem),
        description=(f"Measured on {platform.node() or 'this machine'} ({platform.machine()}, "
                     f"{cores} cores, {pages / 2**30:.1f} GiB) by `python -m "
                     "common.perf.calibrate`; CPU ranks, all on one node. Compute rates and "
                     "collective fits are per count of ranks sharing the node; sources say "
                     "which transport and SpMM kernel were measured."),
        sources=tuple(sorted({"python -m common.perf.calibrate (this file's measurements)",
                              *notes, measured})),
        ranks_per_node=None, cores_per_node=cores, device_memory=None, node_memory=float(pages),
        cache_line=cache_line, intra=link, inter=link, nics_per_node=1,
        compute=tuple(Compute(**c) for c in sorted(compute, key=lambda c: c["ranks_per_node"])),
        collectives=tuple(CollectiveFit(**c) for c in sorted(
            colls, key=lambda c: (c["ranks_per_node"], c["group_size"], c["op"]))),
    )
    profile.save(path)
    return profile


def _report(res: dict) -> str:
    c = res["compute"]
    lines = [f"{res['ranks']} ranks ({res['threads']} torch threads each):",
             f"  SpMM {c['spmm_bandwidth'] / 1e9:.2f} GB/s, GEMM {c['gemm_flops'] / 1e9:.2f} "
             f"GFLOP/s, copy {c['memory_bandwidth'] / 1e9:.2f} GB/s per rank"]
    for f in res["collectives"]:
        lines.append(f"  {f['op']:<15} group {f['group_size']}: alpha {1e6 * f['alpha_s']:8.1f} "
                     f"us, bandwidth {f['bandwidth'] / 1e9:6.3f} GB/s per rank")
    return "\n".join(lines)


def _launcher(n: int) -> list[str]:
    mpiexec = find_mpiexec()
    if mpiexec:
        return [mpiexec, "-n", str(n), sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={n}"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m common.perf.calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.add_argument("--merge", action="store_true",
                   help="add to --out instead of replacing it")
    p.add_argument("--ranks", default=None,
                   help="comma-separated rank counts to launch (e.g. 1,2,4,8); default: measure "
                   "in this launch only")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--spmm-nodes", type=int, default=1 << 14)
    p.add_argument("--spmm-degree", type=int, default=16)
    p.add_argument("--copy-bytes", type=int, default=1 << 26)
    p.add_argument("--cache-line", type=int, default=64)
    p.add_argument("--spmm-kernel", default=_default_kernel(),
                   help=f"the SpMM to time: torch (CSR matmul) or MODULE:FUNCTION (default: "
                   f"{DEFAULT_KERNEL} when numba is installed, as the GCN trainer runs)")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.ranks:
        if out.exists() and not args.merge:
            out.unlink()
        passthrough = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                       if k not in ("out", "merge", "ranks")]
        for n in (int(v) for v in args.ranks.split(",")):
            cmd = [*_launcher(n), "-m", "common.perf.calibrate", f"--out={out}", "--merge",
                   *passthrough]
            subprocess.run(cmd, check=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        return 0

    from common.alloc import retain_freed_memory
    from common.dist import init_distributed

    retain_freed_memory()  # as the trainers run
    with init_distributed(device="cpu") as ctx:
        res = _measure(ctx, args)
    if ctx.is_main:
        print(_report(res), flush=True)
        if not args.merge and out.exists():
            out.unlink()
        _merge(out, res, args.cache_line)
        print(f"  -> {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
