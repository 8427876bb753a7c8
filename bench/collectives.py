"""Bus bandwidth and latency of our collectives next to mpi4py's own calls, on the same buffers.

Run from the repository root (no install needed; the script puts the repo root on sys.path)::

    mpiexec -n 4 python bench/collectives.py                     # 1 KiB .. 64 MiB, powers of 4
    mpiexec -n 2 python bench/collectives.py --comm torch        # ours over gloo instead
    mpiexec -n 2 python bench/collectives.py --max-size 64K --iters 3 --ops all_reduce
    mpiexec -n 4 python bench/collectives.py --sizes 1K,1M --csv bench/results/coll.csv
    mpiexec -n 2 python bench/collectives.py --json coll.json     # also the measurements

Every rank builds a 1-D grid ``world=N`` (:class:`common.grid.ProcessGrid`) and its group with
``ctx.create_groups(grid)``, as the README's core snippet does, and for each op (all-reduce,
all-gather, reduce-scatter) and message size runs :mod:`common.collectives` (the transport of
``--comm``: ``mpi``, the default under mpiexec, or ``torch`` = gloo), then
mpi4py's ``Allreduce`` / ``Allgather`` / ``Reduce_scatter_block`` on the same numpy arrays (the
torch tensors are ``torch.from_numpy`` views of them). Ours returns a new tensor per call, as
the API does, so the MPI baseline ("MPI us") receives into a new tensor per call too (same
allocator, same work); "reused us" is MPI into one buffer reused every call, printed for
reference. The process keeps freed buffers (:func:`common.alloc.retain_freed_memory`, as the
trainers do).

Target (issue 12), printed per row: from 64 KiB up, ours / MPI time <= 1.15; below 64 KiB, ours
at most 20 us above MPI's time. Timings are reported, never asserted: the exit code reflects
only the checks below.

Timing: ``--warmup`` calls of each, then ``--repeats`` rounds; a round times one block of
``--iters`` back-to-back calls of ours, then one of MPI, each after an MPI barrier. A block's
time is the **max over ranks of the per-rank mean** (as in nccl-tests); the reported time is
the **median over the rounds** of that (alternating rounds let both see the same background
load). Above 1 MiB the counts shrink in proportion to size (at least 4 timed calls per block and
1 warm-up) so the 64 MiB end stays short. Bandwidths follow nccl-tests, with ``M`` the full
buffer (all-reduce input, all-gather output, reduce-scatter input) and ``n`` ranks::

    algbw = M / time;   busbw = algbw * 2(n-1)/n  (all-reduce),  algbw * (n-1)/n  (others)

``--wire bf16`` runs ours over a group whose float32 messages travel as bf16 (summed in
float32: ``AxisGroup.on_wire``, plexus ``--precision bf16``) against MPI's float32 calls, on
integers below 256 (exact in bf16): ours must equal MPI's result (an all-reduce's rounded to
bf16 once) and count half the bytes. It has no time target: on one node the messages cross
memory, where the conversions cost about what the halved bytes save. The all-reduce is also
timed as plexus's narrowed aggregation runs it ("narrow us", ``rounds_s["ours_narrow"]``):
the float32 data rounded into a bf16 buffer, which is then summed in place, its own message
(no float32 result to widen into); its result must equal MPI's likewise.

Checks (any failure prints on rank 0 and exits 1): once per size, our result equals MPI's
(integer-valued float32 data, so sums are exact in any order); and the bytes our
:class:`~common.comm_stats.CommStats` recorded over the warm-up and timed calls equal
``calls * M * 2(n-1)/n`` (all-reduce) or ``calls * M * (n-1)/n`` (others). Only rank 0
prints.

``--json PATH`` also writes what the tables were computed from: per row, the block time of
every round (``rounds_s``: ours, mpi, mpi_reused) next to the printed values, and per rank the
CommStats (calls, bytes) and the size and sum of ours' and MPI's results
(tests/bench/test_collectives_bench.py recomputes every printed number from them).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
from mpi4py import MPI

from common import collectives as coll
from common.alloc import retain_freed_memory
from common.comm_stats import CommStats
from common.dist import init_distributed
from common.failure import fail_all_ranks
from common.grid import AxisGroup, ProcessGrid

OPS = ("all_reduce", "all_gather", "reduce_scatter")
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n}
SCALE_ABOVE = 1 << 20  # iterations shrink in proportion to size above 1 MiB
MIN_ITERS = 4  # but a block keeps at least 4 timed calls (2 left one slow call deciding a row)
TIMING = "median over rounds of (max over ranks of mean per call)"
COLUMNS = ("op", "ranks", "bytes", "iters", "ours_us", "ours_busbw", "mpi_us", "mpi_busbw",
           "ratio", "target_met", "mpi_reused_us")
RATIO_FROM, MAX_RATIO, MAX_EXTRA_US = 64 << 10, 1.15, 20.0  # the targets


def target_met(row: dict) -> bool:
    """Ours / MPI <= 1.15 from 64 KiB; below, ours at most 20 us above MPI."""
    if row["bytes"] >= RATIO_FROM:
        return row["ratio"] <= MAX_RATIO
    return row["ours_us"] - row["mpi_us"] <= MAX_EXTRA_US


def parse_size(text: str) -> int:
    """``"64K"`` -> 65536; suffixes K, M, G (binary), optional trailing ``B``/``iB``."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        return int(t[:-1] if mult > 1 else t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 1K, 64K, 16M") from None


def fmt_size(nbytes: int) -> str:
    """65536 -> ``"64 KiB"``; sizes that are not whole KiB/MiB stay in bytes."""
    for unit, mult in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= mult and nbytes % mult == 0:
            return f"{nbytes // mult} {unit}"
    return f"{nbytes} B"


def make_buffers(op: str, numel: int, n: int, rank: int, wire: str | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(send, mpi_recv) float32 arrays; ``numel`` elements is the full buffer ``M``. With a
    ``wire``, integers below 256, which bf16 holds exactly."""
    if wire:
        full = (np.arange(numel, dtype=np.int64) % 127 + rank % 128).astype(np.float32)
    else:
        full = (np.arange(numel, dtype=np.int64) % 251 + 7 * rank).astype(np.float32)
    if op == "all_reduce":
        return full, np.empty(numel, np.float32)
    if op == "all_gather":  # each rank sends its 1/n part, receives M
        return full[rank::n][: numel // n].copy(), np.empty(numel, np.float32)
    return full, np.empty(numel // n, np.float32)  # reduce_scatter: send M, receive M/n


def make_calls(
    op: str, send: np.ndarray, recv: np.ndarray, group: AxisGroup, comm: MPI.Comm,
    stats: CommStats | None,
) -> dict[str, Callable[[], Any]]:
    """Zero-argument callables: ``ours`` (returns the result tensor), ``mpi`` (MPI into a new
    output tensor per call, as ours returns one: equal work) and ``mpi_reused`` (MPI into the
    same ``recv`` every call: the floor, for reference)."""
    x = torch.from_numpy(send)  # same memory MPI sends from
    shape = recv.shape

    def fresh() -> np.ndarray:  # the allocator ours uses
        return torch.empty(shape).numpy()

    if op == "all_reduce":
        calls = {"ours": lambda: coll.all_reduce(x, group, stats=stats),
                 "mpi": lambda: comm.Allreduce(send, fresh(), op=MPI.SUM),
                 "mpi_reused": lambda: comm.Allreduce(send, recv, op=MPI.SUM)}
        if group.wire is not None:  # plexus's narrowed H: rounded, then summed in place
            from common import wire

            buf = torch.empty(x.numel(), dtype=group.wire)

            def narrow() -> torch.Tensor:
                wire.to_bf16(x, buf)
                return coll.all_reduce(buf, group, inplace=True)

            calls["ours_narrow"] = narrow
        return calls
    if op == "all_gather":
        return {"ours": lambda: coll.all_gather(x, group, stats=stats),
                "mpi": lambda: comm.Allgather(send, fresh()),
                "mpi_reused": lambda: comm.Allgather(send, recv)}
    return {"ours": lambda: coll.reduce_scatter(x, group, stats=stats),
            "mpi": lambda: comm.Reduce_scatter_block(send, fresh(), op=MPI.SUM),
            "mpi_reused": lambda: comm.Reduce_scatter_block(send, recv, op=MPI.SUM)}


def time_blocks(
    calls: dict[str, Callable[[], Any]], iters: int, warmup: int, repeats: int, comm: MPI.Comm
) -> dict[str, list[float]]:
    """Per callable: ``repeats`` block times, each the max over ranks of the mean seconds per
    call (the caller takes their median). Blocks of the callables alternate, so all see the
    same background load, and each round starts with the next callable (round r runs them in
    the order rotated by r), so none is always the first after a size change and a barrier."""
    for _ in range(warmup):
        for fn in calls.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            fn = calls[name]
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            mean = (time.perf_counter() - start) / iters
            times[name].append(comm.allreduce(mean, op=MPI.MAX))
    return times


def iterations(nbytes: int, iters: int, warmup: int) -> tuple[int, int]:
    """(timed, warm-up) counts for a message of ``nbytes``: scaled down above 1 MiB."""
    if nbytes <= SCALE_ABOVE:
        return iters, warmup
    scale = SCALE_ABOVE / nbytes
    return max(min(iters, MIN_ITERS), round(iters * scale)), max(min(warmup, 1),
                                                                round(warmup * scale))


def bench_one(
    op: str, nbytes: int, args: argparse.Namespace, group: AxisGroup, comm: MPI.Comm
) -> tuple[dict, dict, list[str]]:
    """Check and time one (op, size); return its row (the same on every rank), this rank's
    measurements (CommStats and results) and a list of check failures."""
    n, rank = group.size, group.rank
    numel = max(n, nbytes // 4 // n * n)  # float32 elements, divisible by the group size
    full_bytes = numel * 4
    send, recv = make_buffers(op, numel, n, rank, args.wire)
    if args.wire:
        group = group.on_wire(torch.bfloat16)
    iters, warmup = iterations(full_bytes, args.iters, args.warmup)
    errors = []

    calls = make_calls(op, send, recv, group, comm, None)
    calls["mpi_reused"]()
    got = calls["ours"]().numpy()
    local = {"ours_out_bytes": got.nbytes, "mpi_out_bytes": recv.nbytes,
             "ours_sum": float(got.sum(dtype=np.float64)),
             "mpi_sum": float(recv.sum(dtype=np.float64))}
    want = recv
    if args.wire and op == "all_reduce":  # exact float32 sums, rounded to bf16 once
        want = torch.from_numpy(recv).to(torch.bfloat16).float().numpy()
    if got.shape != recv.shape or not np.array_equal(got, want):
        bad = int(np.sum(got != recv)) if got.shape == recv.shape else "shape"
        errors.append(f"{op} {fmt_size(full_bytes)}: ours != MPI on rank {rank} ({bad} diffs)")
    if "ours_narrow" in calls and not np.array_equal(calls["ours_narrow"]().float().numpy(),
                                                    want):
        errors.append(f"{op} {fmt_size(full_bytes)}: ours in place on bf16 != MPI on rank "
                      f"{rank}")

    stats = CommStats()
    rounds = time_blocks(make_calls(op, send, recv, group, comm, stats), iters, warmup,
                         args.repeats, comm)
    t = {name: statistics.median(times) for name, times in rounds.items()}
    t_ours, t_mpi = t["ours"], t["mpi"]

    calls = warmup + args.repeats * iters
    wire_bytes = full_bytes // 2 if args.wire else full_bytes
    expected = calls * (2 if op == "all_reduce" else 1) * (n - 1) * wire_bytes // n
    rec = stats.records.get((group.name, op))
    got_b = (0, 0) if rec is None else (rec.calls, rec.bytes)
    local["stats_calls"], local["stats_bytes"] = got_b
    if got_b != (calls, expected):
        errors.append(f"{op} {fmt_size(full_bytes)}: CommStats (calls, bytes) = {got_b} on rank "
                      f"{rank}, ring formula says ({calls}, {expected})")

    factor = BUS_FACTOR[op](n)
    row = {"op": op, "ranks": n, "bytes": full_bytes, "iters": iters, "warmup": warmup,
           "ours_us": t_ours * 1e6, "ours_busbw": full_bytes / t_ours * factor / 1e9,
           "mpi_us": t_mpi * 1e6, "mpi_busbw": full_bytes / t_mpi * factor / 1e9,
           "ratio": t_ours / t_mpi, "mpi_reused_us": t["mpi_reused"] * 1e6,
           "rounds_s": rounds}
    if "ours_narrow" in t:
        row["narrow_us"] = t["ours_narrow"] * 1e6
        row["narrow_ratio"] = t["ours_narrow"] / t_ours
    row["target_met"] = target_met(row)
    return row, local, errors


def print_table(op: str, rows: list[dict], n: int, wire: str | None = None) -> None:
    """One fixed-width table for ``op``: a row per message size (with ``wire``, whose run has
    no time target, ``n/a`` in the target column)."""
    print(f"\n# {op}, {n} ranks (busbw in GB/s = 1e9 B/s)")
    print(f"{'size':>10}{'iters':>7}{'ours us':>12}{'ours busbw':>12}{'MPI us':>12}"
          f"{'MPI busbw':>12}{'ours/MPI':>10}{'extra us':>10}{'reused us':>11}  target")
    for r in rows:
        print(f"{fmt_size(r['bytes']):>10}{r['iters']:>7}{r['ours_us']:>12.1f}"
              f"{r['ours_busbw']:>12.3f}{r['mpi_us']:>12.1f}{r['mpi_busbw']:>12.3f}"
              f"{r['ratio']:>10.2f}{r['ours_us'] - r['mpi_us']:>10.1f}"
              f"{r['mpi_reused_us']:>11.1f}  "
              f"{'n/a' if wire else 'met' if r['target_met'] else 'MISSED'}")
    narrowed = [r for r in rows if "narrow_us" in r]
    if narrowed:
        print(f"\n# {op} of bf16 data in place (plexus's narrowed H: rounded from float32, "
              "then summed), against the float32 data above")
        print(f"{'size':>10}{'ours us':>12}{'narrow us':>12}{'narrow/ours':>13}")
        for r in narrowed:
            print(f"{fmt_size(r['bytes']):>10}{r['ours_us']:>12.1f}{r['narrow_us']:>12.1f}"
                  f"{r['narrow_ratio']:>13.2f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--comm", choices=("mpi", "torch"), default="mpi",
                   help="transport of our collectives: mpi (common.mpi) or torch (gloo)")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma list from {OPS}")
    p.add_argument("--min-size", type=parse_size, default=1 << 10, help="default 1K")
    p.add_argument("--max-size", type=parse_size, default=64 << 20, help="default 64M")
    p.add_argument("--factor", type=int, default=4, help="size step factor (default 4)")
    p.add_argument("--sizes", help="explicit comma list (e.g. 1K,64K,1M); overrides min/max")
    p.add_argument("--iters", type=int, default=20, help="timed calls per block up to 1 MiB")
    p.add_argument("--warmup", type=int, default=5, help="warm-up calls per size up to 1 MiB")
    p.add_argument("--repeats", type=int, default=5, help="timed blocks per size; median")
    p.add_argument("--csv", type=Path, help="write all rows to this CSV file")
    p.add_argument("--json", type=Path, metavar="PATH",
                   help="also write the rows and the measurements behind them as JSON")
    p.add_argument("--wire", choices=("bf16",),
                   help="ours moves the float32 data as bf16 and sums in float32 "
                   "(AxisGroup.on_wire, plexus --precision bf16) against MPI's float32")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    if bad := [o for o in args.ops if o not in OPS]:
        p.error(f"unknown op(s) {bad}; choose from {OPS}")
    if args.sizes:
        try:
            args.sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
        except argparse.ArgumentTypeError as e:
            p.error(str(e))
    else:
        if args.factor < 2 or args.min_size < 1 or args.max_size < args.min_size:
            p.error("need --factor >= 2 and 1 <= --min-size <= --max-size")
        args.sizes = [args.min_size]
        while args.sizes[-1] * args.factor <= args.max_size:
            args.sizes.append(args.sizes[-1] * args.factor)
    if args.iters < 1 or args.warmup < 0 or args.repeats < 1:
        p.error("need --iters >= 1, --repeats >= 1 and --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark on every rank; return the exit code (1 if a check failed)."""
    args = parse_args(argv)
    ctx = init_distributed(device="cpu", backend="gloo", comm=args.comm)
    retain_freed_memory()
    n, rank, comm = ctx.world_size, ctx.rank, MPI.COMM_WORLD
    if ctx.launcher != "mpiexec" or comm.Get_size() != n:
        fail_all_ranks("MPI is the baseline, so run under mpiexec: mpiexec -n 2 python "
                       f"bench/collectives.py (launcher={ctx.launcher}, MPI size "
                       f"{comm.Get_size()}, torch world {n})", ctx)
    if n < 2:
        fail_all_ranks("needs at least 2 ranks: mpiexec -n 2 python bench/collectives.py", ctx)
    grid = ProcessGrid({"world": n})
    grid.check(n)
    group = ctx.create_groups(grid)["world"]  # collective: every rank creates the group

    rows, locals_, errors = [], [], []
    for op in args.ops:
        for nbytes in args.sizes:
            row, local, errs = bench_one(op, nbytes, args, group, comm)
            rows.append(row)
            locals_.append(local)
            errors += errs
    gathered, failed = comm.gather((errors, locals_), root=0), False
    if rank == 0:
        all_errors = [e for errs, _ in gathered for e in errs]
        failed = bool(all_errors)
        for i, row in enumerate(rows):  # rank r's measurements of this row, in rank order
            row["per_rank"] = [local[i] for _, local in gathered]
        mpi_lib = MPI.Get_library_version().split()[0]
        transport = "MPI transport" if group.mpi is not None else "gloo"
        if args.wire:
            transport += f", {args.wire} messages summed in float32"
        print(f"collectives bench: {n} ranks, ours ({transport}) vs {mpi_lib} via mpi4py, "
              f"torch threads/rank={torch.get_num_threads()}\ntime per call: {TIMING}, "
              f"{args.repeats} rounds")
        for op in args.ops:
            print_table(op, [r for r in rows if r["op"] == op], n, args.wire)
        if args.csv:
            args.csv.parent.mkdir(parents=True, exist_ok=True)
            with args.csv.open("w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
                writer.writeheader()
                writer.writerows(rows)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({
                "command": " ".join(["python", "bench/collectives.py", *args.argv]),
                "ranks": n, "transport": "mpi" if group.mpi is not None else "gloo",
                "mpi_library": mpi_lib, "torch_threads": torch.get_num_threads(),
                "timing": TIMING, "repeats": args.repeats, "failures": all_errors,
                "rows": rows}, indent=1))
        for e in all_errors:
            print(f"FAIL: {e}", file=sys.stderr)
        if not all_errors and args.wire:
            print(f"\n--wire {args.wire}: no target on one node, where the messages cross "
                  "memory, not a network: the conversions cost about what the halved bytes "
                  "save (common.perf.gcn.WIRE_SUM_BYTES). The saving is a cluster's.")
            print("checks OK: ours == MPI's float32 result (rounded to bf16 once for an "
                  "all-reduce) for every size; CommStats bytes == the bf16 ring formula")
        elif not all_errors:
            missed = sum(not r["target_met"] for r in rows)
            print(f"\ntarget (>= 64 KiB: ours/MPI <= {MAX_RATIO}; below: <= {MAX_EXTRA_US:.0f} us "
                  f"extra): {len(rows) - missed}/{len(rows)} rows met")
            print("checks OK: ours == MPI for every size; CommStats bytes == ring formula")
    failed = comm.bcast(failed, root=0)
    ctx.close()  # before mpi4py finalizes MPI at exit
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
