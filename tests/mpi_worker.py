"""One rank of :func:`tests.distributed.run_ranks` with ``comm="mpi"``: run under mpiexec as
``python -m tests.mpi_worker JOB_DIR``; reads ``(fn, args)`` from ``JOB_DIR/job.pkl``, calls
``fn(ctx, *args)`` with the MPI transport and writes ``(ok, result or traceback)`` to
``JOB_DIR/rank<R>.pkl``."""

import os
import pickle
import sys
import traceback
from pathlib import Path


def main(job: Path) -> int:
    from common.dist import init_distributed
    from common.mpi import cores_available

    fn, args = pickle.loads((job / "job.pkl").read_bytes())
    # At two or more ranks per core every wait sleeps (MPI's blocking calls are replaced by
    # polled non-blocking ones): the results are the same on both paths up to the order of
    # float sums over 3+ ranks (MPICH's non-blocking reduce-scatter of ~1 MB picks another
    # algorithm than its blocking one: other bits), and spinning ranks starve the ranks
    # they wait for: the 4-rank llm fixture runs several times slower spinning. Fewer ranks
    # keep the default (blocking calls for synchronous collectives).
    ranks = int(os.environ.get("PMI_SIZE", "1"))
    polite = "all" if ranks >= 2 * cores_available() else None
    rank, ok, result = None, False, None
    try:
        with init_distributed(device="cpu", timeout_s=120, comm="mpi",
                              mpi_polite=polite) as ctx:
            rank = ctx.rank
            result = fn(ctx, *args)
        ok = True
    except BaseException:  # reported to the parent
        result = traceback.format_exc()
    if rank is None:
        from mpi4py import MPI

        rank = MPI.COMM_WORLD.Get_rank()
    (job / f"rank{rank}.pkl").write_bytes(pickle.dumps((ok, result)))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
