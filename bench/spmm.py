"""CPU SpMM ``A @ X``: the row kernel, the cache-blocked kernel and torch's CSR matmul, in one run.

    python bench/spmm.py                          # 200K uniform + R-MAT scale 18, width 128
    python bench/spmm.py --nodes 20000 --nnz 320000 --rmat-scale 14 --reps 3   # quick
    python bench/spmm.py --json spmm.json         # also every timing it printed

Kernels (same thread count for all: numba's threads are set to torch's, and printed):

- ``rows``: plexus's row-parallel numba kernel (``BlockSparse`` kernel ``numba-rows``,
  :func:`plexus.kernels.csr_spmm`), each output row written once;
- ``blocked``: the cache-blocked kernel with the default slice width (``BlockSparse`` kernel
  ``numba``, :mod:`plexus.slicing`): column slices sized to the cache, prefetching;
- ``torch CSR``: ``torch.sparse_csr_tensor(...) @ X`` on the same arrays;
- ``blocked S=k`` (``--sweep-slices``) and ``blocked t=w`` (``--feature-tiles``): the blocked
  kernel with ``k`` slices of equal width, or with X's columns in tiles of width ``w``;
- ``rows bf16`` and ``blocked bf16`` (a table of their own below the float32 one): the same two
  numba kernels on ``X.to(bfloat16)`` (``plexus.train --precision bf16``'s layer-0 SpMM): the
  kernel reads the bf16 rows and sums in float32; its output must be bit-identical to the row
  kernel's on ``X.to(bfloat16).float()``. Their bytes count 2 per X element (``2 d`` in place of
  ``4 d`` for the referenced rows), the output float32; ``bf16/fp32`` is the time ratio to
  the float32 kernel of the same name.

Cases: (a) ``uniform``: ``--nodes`` x ``--nodes`` with ``--nnz`` uniform random positions
(duplicates summed) and (b) ``rmat``: the Graph500 R-MAT edge stream of
:func:`plexus.data.generators.rmat_edges` (``2**--rmat-scale`` nodes, ``--rmat-edge-factor``
edges per node, duplicates summed), values uniform in [0, 1), X ``[m, --width]`` float32.

Bytes moved, per SpMM: the compulsory traffic, each array read or written once::

    bytes = indptr + indices + values (their nbytes) + 4 d * (distinct columns with a nonzero)
            + 4 d * n (the output)

``GB/s = bytes / time``, and ``of copy`` divides it by the copy bandwidth measured in the same
run (``torch`` copy of ``--copy-mib`` MiB: read + written bytes / time). ``gather GB/s`` counts
one X row per nonzero instead (``indices + values + 4 d nnz + 4 d n``), the convention of
bench/gcn_epoch.py. Timing: ``--warmup`` calls of each, then ``--reps`` rounds, each round
calling every kernel once (and the copy) so all see the same background load; a kernel's time
is the median over rounds. Target (issue 28): on the ``uniform`` case the blocked kernel moves
bytes at >= 1.5x the row kernel's rate (``blocked/rows``, the ratio of their times). Timings are
reported, never asserted: the exit code is 1 only when a blocked variant's output is not
bit-identical (``torch.equal``) to the row kernel's.

The backward's ``A^T @ Y`` (Y ``[n, d]``) is timed too, in rounds of its own: the stored
transposed CSR (what every layer held before) on the row and blocked kernels, and
:class:`plexus.transpose.TransposedSparse`, which reads A's own CSR and holds no second copy;
it must give the stored transpose's bits (else exit 1), and its target is at most
``TARGET_TRANSPOSED`` times the stored transpose's faster kernel. ``--json PATH`` writes every
round's time next to the printed values (tests/bench/test_spmm_bench.py recomputes them).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import scipy.sparse as sp
import torch

from plexus import slicing
from plexus.data.generators import rmat_edges
from plexus.sparse import BlockSparse, CSRBlock

TARGET_CASE, TARGET_RATIO = "uniform", 1.5
TARGET_TRANSPOSED = 1.2  # the view of A^T may cost this much of the stored transpose's time


def uniform_matrix(n: int, nnz: int, seed: int) -> sp.csr_matrix:
    rng = np.random.default_rng(seed)
    rows, cols = rng.integers(0, n, nnz), rng.integers(0, n, nnz)
    return sp.csr_matrix((rng.random(nnz, dtype=np.float32), (rows, cols)), shape=(n, n))


def rmat_matrix(scale: int, edge_factor: int, seed: int) -> sp.csr_matrix:
    edges = np.concatenate(list(rmat_edges(scale, edge_factor, seed)), axis=1)  # [2, E]
    vals = np.random.default_rng(seed).random(edges.shape[1], dtype=np.float32)
    n = 1 << scale
    return sp.csr_matrix((vals, (edges[0], edges[1])), shape=(n, n))


def compulsory_bytes(block: CSRBlock, width: int, x_bytes: int = 4) -> int:
    """indptr + indices + values + referenced X rows once (``x_bytes`` an element) + the
    output (float32)."""
    referenced = int(np.count_nonzero(np.bincount(block.indices, minlength=block.shape[1])))
    return block.nbytes + width * (x_bytes * referenced + 4 * block.shape[0])


def gather_bytes(block: CSRBlock, width: int, x_bytes: int = 4) -> int:
    """indices + values + one X row per nonzero + the output (bench/gcn_epoch.py's count)."""
    return (block.indices.nbytes + block.values.nbytes
            + width * (x_bytes * block.nnz + 4 * block.shape[0]))


def copy_round(src: torch.Tensor, dst: torch.Tensor) -> float:
    t = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - t


def run_case(name: str, m: sp.csr_matrix, args, copy: tuple[torch.Tensor, torch.Tensor],
             copy_times: list[float]) -> dict:
    """Time every kernel on ``m @ X`` in interleaved rounds; check bit-identity."""
    block = CSRBlock.from_scipy(m)
    a = BlockSparse([[block]], [m.shape[0]], [m.shape[1]])
    x = torch.from_numpy(np.random.default_rng(args.seed + 1).standard_normal(
        (m.shape[1], args.width), dtype=np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "sparse CSR support is in beta"
        csr = block.to_torch()
    cache = slicing.cache_bytes(args.cache_bytes)
    default_cols = slicing.slice_cols(block.shape, block.nnz, 4 * args.width, cache)
    t = time.perf_counter()
    plan = slicing.block_slicing(block, default_cols)
    build_s = time.perf_counter() - t

    def blocked(cols=None, tile=None):
        return lambda: a.to("cpu", kernel="numba").matmul(x, slice_cols=cols,
                                                          feature_tile=tile,
                                                          cache_bytes=args.cache_bytes)

    kernels = {"rows": lambda: a.to("cpu", kernel="numba-rows").matmul(x),
               "blocked": blocked(),
               "torch CSR": lambda: csr @ x}
    for k in args.sweep_slices:
        kernels[f"blocked S={k}"] = blocked(cols=math.ceil(m.shape[1] / k))
    for w in args.feature_tiles:
        kernels[f"blocked t={w}"] = blocked(tile=w)
    x16 = x.to(torch.bfloat16)
    low = {"rows bf16": lambda: a.to("cpu", kernel="numba-rows").matmul(x16),
           "blocked bf16": lambda: a.to("cpu", kernel="numba").matmul(
               x16, cache_bytes=args.cache_bytes)}
    kernels.update(low)
    outputs = {}
    for kname, fn in kernels.items():  # warm-up (compiles, builds the plans)
        for _ in range(args.warmup):
            outputs[kname] = fn()
    times: dict[str, list[float]] = {k: [] for k in kernels}
    for _ in range(args.reps):
        copy_times.append(copy_round(*copy))
        for kname, fn in kernels.items():
            t = time.perf_counter()
            outputs[kname] = fn()
            times[kname].append(time.perf_counter() - t)
    ref = outputs["rows"]
    identical = {k: bool(torch.equal(out, ref)) for k, out in outputs.items()
                 if k.startswith("blocked") and k not in low}
    torch_diff = float((outputs["torch CSR"] - ref).abs().max()) if ref.numel() else 0.0
    ref16 = a.to("cpu", kernel="numba-rows").matmul(x16.float())  # float32 of the bf16 values
    default16 = slicing.slice_cols(block.shape, block.nnz, 2 * args.width, cache)
    bf16 = {"bytes": compulsory_bytes(block, args.width, 2),
            "gather_bytes": gather_bytes(block, args.width, 2),
            "slice_cols": default16, "num_slices": slicing.block_slicing(block,
                                                                      default16).num_slices,
            "kernels": {k: {"times_s": times.pop(k)} for k in low},
            "identical": {k: bool(torch.equal(outputs[k], ref16)) for k in low},
            "max_abs_diff_vs_fp32": float((outputs["rows bf16"] - ref).abs().max())
            if ref.numel() else 0.0}
    return {"name": name, "rows": m.shape[0], "cols": m.shape[1], "nnz": block.nnz,
            "transposed": run_transposed(a, args),
            "index_dtype": str(block.indices.dtype), "width": args.width,
            "bytes": compulsory_bytes(block, args.width),
            "gather_bytes": gather_bytes(block, args.width),
            "cache_bytes": cache, "slice_cols": plan.slice_cols,
            "num_slices": plan.num_slices, "plan_bytes": plan.nbytes,
            "plan_build_s": build_s, "kernels": {k: {"times_s": v} for k, v in times.items()},
            "identical": identical, "torch_max_abs_diff": torch_diff, "bf16": bf16}


def run_transposed(a: BlockSparse, args) -> dict:
    """``A^T @ Y`` (the backward's SpMM), Y ``[n, d]``: the stored transposed CSR on the row
    and blocked kernels against :class:`plexus.transpose.TransposedSparse` on A's own CSR
    (no second copy), in interleaved rounds; the view must give the stored one's bits."""
    from plexus.transpose import TransposedSparse

    y = torch.from_numpy(np.random.default_rng(args.seed + 2).standard_normal(
        (a.shape[0], args.width), dtype=np.float32))
    stored = a.transpose()
    view = TransposedSparse(a)
    kernels = {"stored rows": lambda: stored.to("cpu", kernel="numba-rows").matmul(y),
               "stored blocked": lambda: stored.to("cpu", kernel="numba").matmul(
                   y, cache_bytes=args.cache_bytes),
               "view": lambda: view.matmul(y)}
    outputs = {k: fn() for k, fn in kernels.items()}  # warm-up
    times: dict[str, list[float]] = {k: [] for k in kernels}
    for _ in range(args.reps):
        for kname, fn in kernels.items():
            t = time.perf_counter()
            outputs[kname] = fn()
            times[kname].append(time.perf_counter() - t)
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    return {"times_s": times, "ms": ms,
            "identical": bool(torch.equal(outputs["view"], outputs["stored rows"])),
            "stored_bytes": stored.nbytes, "view_bytes": view.nbytes,
            "ratio": ms["view"] / min(ms["stored rows"], ms["stored blocked"])}


def summarise(case: dict, copy_gbps: float) -> None:
    """Fill in each kernel's ms, GB/s, gather GB/s, fraction of copy; the blocked/rows ratio;
    the same for the bf16 kernels, with their time relative to the float32 kernel's."""
    for table in (case, case["bf16"]):
        for k in table["kernels"].values():
            sec = statistics.median(k["times_s"])
            k.update(ms=1e3 * sec, gbps=table["bytes"] / sec / 1e9,
                     gather_gbps=table["gather_bytes"] / sec / 1e9)
            k["of_copy"] = k["gbps"] / copy_gbps
    case["ratio"] = case["kernels"]["blocked"]["gbps"] / case["kernels"]["rows"]["gbps"]
    for name, k in case["bf16"]["kernels"].items():
        k["time_vs_fp32"] = k["ms"] / case["kernels"][name.removesuffix(" bf16")]["ms"]


def print_case(case: dict) -> None:
    mib = case["cache_bytes"] / 2**20
    print(f"\n# {case['name']}: {case['rows']:,} x {case['cols']:,}, {case['nnz']:,} nonzeros "
          f"({case['index_dtype']} indices), X [{case['cols']:,}, {case['width']}] float32")
    print(f"# bytes = indptr + indices + values + referenced X rows once + output = "
          f"{case['bytes'] / 1e6:.1f} MB (one X row per nonzero: "
          f"{case['gather_bytes'] / 1e6:.1f} MB)")
    print(f"# blocked: cache {mib:.1f} MiB -> {case['slice_cols']:,} columns per slice, "
          f"{case['num_slices']} slice(s); plan {case['plan_bytes'] / 1e6:.2f} MB, built in "
          f"{1e3 * case['plan_build_s']:.1f} ms")
    print(f"{'kernel':16}{'ms':>10}{'GB/s':>9}{'of copy':>9}{'gather GB/s':>13}  identical")
    for kname, k in case["kernels"].items():
        same = case["identical"].get(kname)
        mark = "-" if same is None else ("yes" if same else "NO")
        print(f"{kname:16}{k['ms']:10.2f}{k['gbps']:9.3f}{k['of_copy']:9.3f}"
              f"{k['gather_gbps']:13.2f}  {mark}")
    print(f"blocked/rows = {case['ratio']:.3f}x bytes/s; torch CSR max |diff| vs rows "
          f"{case['torch_max_abs_diff']:.3g}")
    tr = case["transposed"]
    print(f"# A^T @ Y (the backward), Y [{case['rows']:,}, {case['width']}] float32: the stored "
          f"transpose ({tr['stored_bytes'] / 1e6:.1f} MB more) or the view of A's own CSR "
          f"({tr['view_bytes'] / 1e6:.1f} MB more)")
    print("  ".join(f"{k} {v:.2f} ms" for k, v in tr["ms"].items())
          + f"; view/best stored {tr['ratio']:.3f}x (target <= {TARGET_TRANSPOSED}x); "
          f"identical: {'yes' if tr['identical'] else 'NO'}")
    low = case["bf16"]
    print(f"# X bf16 (sums float32): bytes = {low['bytes'] / 1e6:.1f} MB (one X row per "
          f"nonzero: {low['gather_bytes'] / 1e6:.1f} MB); blocked: {low['slice_cols']:,} "
          f"columns per slice, {low['num_slices']} slice(s); identical: to the row kernel on "
          f"X.to(bf16).float(); max |diff| vs fp32 X {low['max_abs_diff_vs_fp32']:.3g}")
    print(f"{'kernel':16}{'ms':>10}{'GB/s':>9}{'of copy':>9}{'gather GB/s':>13}  identical"
          f"{'bf16/fp32 time':>16}")
    for kname, k in low["kernels"].items():
        print(f"{kname:16}{k['ms']:10.2f}{k['gbps']:9.3f}{k['of_copy']:9.3f}"
              f"{k['gather_gbps']:13.2f}  {'yes' if low['identical'][kname] else 'NO':<9}"
              f"{k['time_vs_fp32']:16.3f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=200_000, help="uniform case: n = m")
    p.add_argument("--nnz", type=int, default=6_400_000, help="uniform case: nonzeros drawn")
    p.add_argument("--rmat-scale", type=int, default=18, help="R-MAT case: 2**scale nodes")
    p.add_argument("--rmat-edge-factor", type=int, default=24, help="R-MAT edges per node")
    p.add_argument("--width", type=int, default=128, help="d, the columns of X")
    p.add_argument("--reps", type=int, default=5, help="timed rounds")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=None, help="default: torch's default")
    p.add_argument("--cache-bytes", type=int, default=None,
                   help=f"size the slices for this cache (default: ${slicing.CACHE_ENV}, sysfs)")
    p.add_argument("--sweep-slices", type=lambda s: [int(v) for v in s.split(",") if v],
                   default=[1, 2, 4, 8], help="extra rows: the blocked kernel with k slices")
    p.add_argument("--feature-tiles", type=lambda s: [int(v) for v in s.split(",") if v],
                   default=[64, 32], help="extra rows: feature tiles of these widths")
    p.add_argument("--cases", type=lambda s: [v for v in s.split(",") if v],
                   default=["uniform", "rmat"], help="which cases to run (the target needs "
                   f"{TARGET_CASE})")
    p.add_argument("--copy-mib", type=int, default=256, help="copy bandwidth buffer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the measurements here")
    args = p.parse_args()
    if any(w < 1 or args.width % w for w in args.feature_tiles):
        p.error(f"--feature-tiles {args.feature_tiles}: each must divide --width {args.width}")
    if args.threads:
        torch.set_num_threads(args.threads)
    import numba

    from plexus.sparse import _set_numba_threads

    _set_numba_threads()
    threads = torch.get_num_threads()
    print(f"threads: torch {threads}, numba {numba.get_num_threads()}; "
          f"{args.reps} rounds after {args.warmup} warm-up; time = median over rounds")
    slicing.column_slicing(np.array([0, 1, 2]), np.array([0, 1]), 2, 1)  # load the kernel once,
    # so that a case's "built in" is the planning alone
    src = torch.ones((args.copy_mib << 20) // 4)
    copy = (src, torch.empty_like(src))
    copy_round(*copy)
    copy_times: list[float] = []
    make = {"uniform": lambda: uniform_matrix(args.nodes, args.nnz, args.seed),
            "rmat": lambda: rmat_matrix(args.rmat_scale, args.rmat_edge_factor, args.seed)}
    if not args.cases or set(args.cases) - set(make):
        p.error(f"--cases: choose from {sorted(make)}")
    results = [run_case(name, make[name](), args, copy, copy_times) for name in args.cases]
    copy_gbps = 2 * src.numel() * 4 / statistics.median(copy_times) / 1e9
    print(f"copy bandwidth: {copy_gbps:.2f} GB/s (read + write of {args.copy_mib} MiB, median "
          f"of {len(copy_times)} copies between the rounds)")
    for case in results:
        summarise(case, copy_gbps)
        print_case(case)
    target = next((c for c in results if c["name"] == TARGET_CASE), None)
    ratio = None if target is None else target["ratio"]
    met = None if ratio is None else ratio >= TARGET_RATIO
    identical = all(all(c["identical"].values()) and all(c["bf16"]["identical"].values())
                    and c["transposed"]["identical"] for c in results)
    worst = max(c["transposed"]["ratio"] for c in results)
    print(f"target (every case): A^T by the view <= {TARGET_TRANSPOSED}x the stored transpose's "
          f"best kernel: {'met' if worst <= TARGET_TRANSPOSED else 'MISSED'} ({worst:.3f}x)")
    print(f"\ntarget ({TARGET_CASE}): blocked/rows >= {TARGET_RATIO}x bytes/s: "
          + ("not run" if ratio is None else f"{'met' if met else 'MISSED'} ({ratio:.3f}x)"))
    print(f"bit-identical to the row kernel: {'yes' if identical else 'NO'} (bf16: on its "
          "values in float32)")
    if args.json:
        args.json.write_text(json.dumps(
            {"threads": threads, "numba_threads": numba.get_num_threads(), "reps": args.reps,
             "warmup": args.warmup, "copy_bytes": 2 * src.numel() * 4,
             "copy_times_s": copy_times, "copy_gbps": copy_gbps, "cases": results,
             "target": {"case": TARGET_CASE, "min_ratio": TARGET_RATIO,
                        "ratio": ratio, "met": met},
             "identical": identical}, indent=1))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
