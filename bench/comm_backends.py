"""The same plexus and llm jobs with ``--comm torch`` (gloo) and ``--comm mpi``, in one run.

    python bench/comm_backends.py                     # all three jobs, 4 ranks each
    python bench/comm_backends.py --jobs planted --epochs 20       # make train's job only
    python bench/comm_backends.py --json runs/comm.json            # also the measurements
    python bench/comm_backends.py --jobs planted --ranks 2         # 2 ranks (the tests' run)

Jobs (issue 12), each launched under mpiexec on 4 ranks (``--ranks 2``: 2) once per transport
(the grids below are the 4-rank ones; at 2 ranks the first axis of each drops to 1):

* plexus: ``python -m plexus.train --dataset rmat-16 --grid 2x2x1 --hidden 128 --layers 3``
  (R-MAT scale 16: 65,536 nodes);
* llm: ``python -m llm.train --preset tiny --grid data=1,depth=1,row=2,col=2``;
* planted: ``make train``'s job (``python -m plexus.train --grid 2x2x1``: the built-in planted
  graph), also run on 1 rank, printing the N-rank / 1-rank epoch time (target <= 5).

Each job writes ``--metrics`` JSON lines; the bench takes the median epoch (plexus) or step
(llm) time over all but the first (warm-up), and the median share of it spent inside
collectives (``comm_s``, wall time from issue to wait), and prints them per transport with the
ratio torch / mpi (> 1: MPI is faster). The losses and the bytes sent per iteration of the
two transports must agree (same numbers, another transport): a mismatch exits 1.

``--json PATH`` also writes what the table was computed from: per job and transport, every
iteration's time, ``comm_s``, ``comm_bytes`` and loss, next to the printed medians and ratios
(tests/bench/test_comm_backends_bench.py recomputes every printed number from them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMS = ("torch", "mpi")
SCALING_TARGET = 5.0  # issue 12: the planted job's 4-rank / 1-rank epoch time at most 5
# ranks -> the plexus grid and the llm row/col axes of every job at that size
GRIDS = {1: ("1x1x1", "row=1,col=1"), 2: ("1x2x1", "row=1,col=2"), 4: ("2x2x1", "row=2,col=2")}
RANKS = tuple(r for r in GRIDS if r > 1)  # --ranks choices (1 rank is the planted baseline)


def job_args(job: str, args: argparse.Namespace, ranks: int) -> list[str]:
    plexus_grid, llm_axes = GRIDS[ranks]
    if job == "planted":
        return ["-m", "plexus.train", "--grid", plexus_grid, "--epochs", str(args.epochs),
                "--log-every", "1000"]
    if job == "plexus":
        return ["-m", "plexus.train", "--dataset", "rmat-16", "--grid", plexus_grid, "--hidden",
                "128", "--layers", "3", "--epochs", str(args.epochs), "--log-every", "1000"]
    return ["-m", "llm.train", "--preset", "tiny", "--grid", f"data=1,depth=1,{llm_axes}",
            "--steps", str(args.steps), "--log-every", "1000", "--eval-batches", "0"]


def run_job(job: str, comm: str, args: argparse.Namespace, tmp: Path, ranks: int) -> dict:
    """Launch one job; return every iteration's time, comm seconds, comm bytes and loss, and
    the median time and comm share over all but the first (warm-up)."""
    metrics = tmp / f"{job}-{comm}-{ranks}.jsonl"
    from common.spawn import ranks_command

    job_cmd = [sys.executable, *job_args(job, args, ranks), "--metrics", str(metrics)]
    cmd = job_cmd if ranks == 1 else ranks_command(ranks, [*job_cmd, "--comm", comm])
    print(f"  {job} on {ranks} rank(s), --comm {comm}: {' '.join(job_cmd[1:])}", flush=True)
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout,
                       stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise SystemExit(f"{job} --comm {comm} failed (exit {r.returncode}):\n{r.stdout}\n"
                         f"{r.stderr}")
    key = "step_s" if job == "llm" else "epoch_s"
    rows = [row for row in map(json.loads, metrics.read_text().splitlines()) if key in row]
    timed = rows[1:] if len(rows) > 1 else rows
    return {"seconds": statistics.median(r[key] for r in timed),
            "comm_share": statistics.median(r["comm_s"] / r[key] for r in timed),
            "iterations": len(timed), "times_s": [r[key] for r in rows],
            "comm_s": [r["comm_s"] for r in rows],
            "comm_bytes": [r.get("comm_bytes", 0) for r in rows],
            "losses": [r["loss"] for r in rows]}


def summarize(by_comm: dict[str, dict]) -> dict[str, float | bool]:
    """One job's ratios: torch / mpi time, and with a 1-rank run the N-rank (mpi) /
    1-rank time and whether it meets ``SCALING_TARGET``."""
    out: dict[str, float | bool] = {
        "torch_over_mpi": by_comm["torch"]["seconds"] / by_comm["mpi"]["seconds"]}
    if "one rank" in by_comm:
        out["ranks_over_one"] = by_comm["mpi"]["seconds"] / by_comm["one rank"]["seconds"]
        out["target_met"] = out["ranks_over_one"] <= SCALING_TARGET
    return out


def mismatches(job: str, by_comm: dict[str, dict]) -> list[str]:
    """The same job on the same grid over another transport computes the same numbers: the
    losses agree and the bytes sent per iteration are equal."""
    out = []
    a, b = by_comm["torch"]["losses"], by_comm["mpi"]["losses"]
    if len(a) != len(b) or any(abs(x - y) > 1e-4 * max(abs(x), 1.0) for x, y in zip(a, b)):
        out.append(f"{job}: losses differ between transports: {a} vs {b}")
    if by_comm["torch"]["comm_bytes"] != by_comm["mpi"]["comm_bytes"]:
        out.append(f"{job}: bytes sent differ between transports: "
                   f"{by_comm['torch']['comm_bytes']} vs {by_comm['mpi']['comm_bytes']}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", default="planted,plexus,llm",
                   help="comma list from planted, plexus, llm")
    p.add_argument("--epochs", type=int, default=8, help="plexus epochs (first is warm-up)")
    p.add_argument("--steps", type=int, default=12, help="llm steps (first is warm-up)")
    p.add_argument("--ranks", type=int, choices=RANKS, default=4,
                   help="ranks per launch (default 4, as issue 12 measures)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per launch")
    p.add_argument("--json", type=Path, metavar="PATH",
                   help="also write the measurements and the printed values as JSON")
    args = p.parse_args(argv)
    jobs = [j.strip() for j in args.jobs.split(",") if j.strip()]
    if bad := [j for j in jobs if j not in ("planted", "plexus", "llm")]:
        p.error(f"unknown job(s) {bad}; choose from planted, plexus, llm")
    if min(args.epochs, args.steps) < 2:
        p.error("need --epochs and --steps >= 2 (the first is warm-up)")
    results: dict[str, dict[str, dict]] = {}
    print(f"comm backends bench: {args.ranks} ranks under mpiexec, each job once per transport")
    with tempfile.TemporaryDirectory(prefix="comm_backends_") as tmp:
        for job in jobs:
            results[job] = {c: run_job(job, c, args, Path(tmp), args.ranks) for c in COMMS}
            if job == "planted":
                results[job]["one rank"] = run_job(job, "none", args, Path(tmp), ranks=1)
    summary = {job: summarize(by_comm) for job, by_comm in results.items()}
    print(f"\n{'job':<8}{'comm':<10}{'median s':>10}{'comm share':>12}{'iters':>7}")
    for job, by_comm in results.items():
        for comm, r in by_comm.items():
            print(f"{job:<8}{comm:<10}{r['seconds']:>10.4f}{100 * r['comm_share']:>11.1f}%"
                  f"{r['iterations']:>7}")
        print(f"{job:<8}torch / mpi time = {summary[job]['torch_over_mpi']:.2f}")
        if "ranks_over_one" in summary[job]:
            print(f"{job:<8}{args.ranks} ranks (mpi) / 1 rank epoch time = "
                  f"{summary[job]['ranks_over_one']:.2f} (target <= {SCALING_TARGET:g}: "
                  + ("met)" if summary[job]["target_met"] else "MISSED)"))
    failures = [f for job, by_comm in results.items() for f in mismatches(job, by_comm)]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "command": " ".join(["python", "bench/comm_backends.py",
                                 *(sys.argv[1:] if argv is None else argv)]),
            "ranks": args.ranks, "epochs": args.epochs, "steps": args.steps, "warmup": 1,
            "scaling_target": SCALING_TARGET, "failures": failures,
            "jobs": {job: {"runs": by_comm, **summary[job]} for job, by_comm in results.items()}
        }, indent=1))
    for f in failures:
        print(f"FAIL: {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
