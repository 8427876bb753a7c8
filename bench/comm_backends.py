"""The same plexus and llm jobs with ``--comm torch`` (gloo) and ``--comm mpi``, in one run.

    python bench/comm_backends.py                     # all three jobs, 4 ranks each
    python bench/comm_backends.py --jobs planted --epochs 20       # make train's job only

Jobs (issue 12), each launched under mpiexec on 4 ranks once per transport:

* plexus: ``python -m plexus.train --dataset rmat-16 --grid 2x2x1 --hidden 128 --layers 3``
  (R-MAT scale 16: 65,536 nodes);
* llm: ``python -m llm.train --preset tiny --grid data=1,depth=1,row=2,col=2``;
* planted: ``make train``'s job (``python -m plexus.train --grid 2x2x1``: the built-in planted
  graph), also run on 1 rank, printing the 4-rank / 1-rank epoch time (target <= 5).

Each job writes ``--metrics`` JSON lines; the bench takes the median epoch (plexus) or step
(llm) time over all but the first (warm-up), and the median share of it spent inside
collectives (``comm_s``, wall time from issue to wait), and prints them per transport with the
ratio torch / mpi (> 1: MPI is faster). The losses of the two transports must agree (same
numbers, another transport): a mismatch exits 1.
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
RANKS = 4


def job_args(job: str, args: argparse.Namespace, ranks: int = RANKS) -> list[str]:
    if job == "planted":
        return ["-m", "plexus.train", "--grid", "2x2x1" if ranks > 1 else "1x1x1", "--epochs",
                str(args.epochs), "--log-every", "1000"]
    if job == "plexus":
        return ["-m", "plexus.train", "--dataset", "rmat-16", "--grid", "2x2x1", "--hidden",
                "128", "--layers", "3", "--epochs", str(args.epochs), "--log-every", "1000"]
    return ["-m", "llm.train", "--preset", "tiny", "--grid", "data=1,depth=1,row=2,col=2",
            "--steps", str(args.steps), "--log-every", "1000", "--eval-batches", "0"]


def run_job(job: str, comm: str, args: argparse.Namespace, tmp: Path, ranks: int = RANKS
            ) -> dict:
    """Launch one job; return its median time, median comm share and losses."""
    metrics = tmp / f"{job}-{comm}-{ranks}.jsonl"
    from common.launch import ranks_command

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
            "losses": [r["loss"] for r in rows], "iterations": len(timed)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", default="planted,plexus,llm",
                   help="comma list from planted, plexus, llm")
    p.add_argument("--epochs", type=int, default=8, help="plexus epochs (first is warm-up)")
    p.add_argument("--steps", type=int, default=12, help="llm steps (first is warm-up)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per launch")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    args = p.parse_args(argv)
    jobs = [j.strip() for j in args.jobs.split(",") if j.strip()]
    if bad := [j for j in jobs if j not in ("planted", "plexus", "llm")]:
        p.error(f"unknown job(s) {bad}; choose from planted, plexus, llm")
    if min(args.epochs, args.steps) < 2:
        p.error("need --epochs and --steps >= 2 (the first is warm-up)")
    results: dict[str, dict[str, dict]] = {}
    print(f"comm backends bench: {RANKS} ranks under mpiexec, each job once per transport")
    with tempfile.TemporaryDirectory(prefix="comm_backends_") as tmp:
        for job in jobs:
            results[job] = {c: run_job(job, c, args, Path(tmp)) for c in COMMS}
            if job == "planted":
                results[job]["one rank"] = run_job(job, "none", args, Path(tmp), ranks=1)
    failures = []
    if args.json:
        print(json.dumps(results))
    else:
        print(f"\n{'job':<8}{'comm':<10}{'median s':>10}{'comm share':>12}{'iters':>7}")
        for job, by_comm in results.items():
            for comm, r in by_comm.items():
                print(f"{job:<8}{comm:<10}{r['seconds']:>10.4f}{100 * r['comm_share']:>11.1f}%"
                      f"{r['iterations']:>7}")
            ratio = by_comm["torch"]["seconds"] / by_comm["mpi"]["seconds"]
            print(f"{job:<8}torch / mpi time = {ratio:.2f}")
            if "one rank" in by_comm:
                four = by_comm["mpi"]["seconds"] / by_comm["one rank"]["seconds"]
                print(f"{job:<8}{RANKS} ranks (mpi) / 1 rank epoch time = {four:.2f} (target "
                      "<= 5)")
    for job, by_comm in results.items():
        a, b = by_comm["torch"]["losses"], by_comm["mpi"]["losses"]  # same grid: same numbers
        if len(a) != len(b) or any(abs(x - y) > 1e-4 * max(abs(x), 1.0) for x, y in zip(a, b)):
            failures.append(f"{job}: losses differ between transports: {a} vs {b}")
    for f in failures:
        print(f"FAIL: {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
