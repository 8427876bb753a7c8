"""Job-wide failure handling and agreement: what every rank of a job does together when
something goes wrong, or must be decided alike.

* :func:`any_rank` / :func:`max_over_ranks`: one tiny all-reduce that makes a flag or a few
  numbers the same on every rank (through the MPI transport when one is given).
* :func:`fail_all_ranks`: a user error every rank detects alike; each prints it, then all exit
  with the same code.
* :func:`is_comm_failure` / :func:`exit_on_comm_failure`: a collective failed because a peer is
  gone; the context's heartbeat watchdog (:mod:`common.watchdog`) names it.
* :func:`preemption_flag`: the scheduler's preemption signals as a flag the trainers agree on.
* :func:`broadcast_object` / :func:`all_gather_object` / :func:`barrier` /
  :func:`rank_and_size`: small exchanges of Python objects (checkpoints, start-up) over a
  ``group``: a torch.distributed group, the job's :class:`~common.mpi.MPITransport` (the whole
  job, over MPI: what the trainers pass when mpiexec started them) or None (the world over
  torch.distributed, or one process without it).

:mod:`common.dist` re-exports every name here.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist

from common.mpi import MPITransport

if TYPE_CHECKING:
    from common.dist import DistContext

__all__ = ["all_gather_object", "any_rank", "barrier", "broadcast_object", "exit_on_comm_failure",
           "fail_all_ranks", "is_comm_failure", "max_over_ranks", "preemption_flag",
           "rank_and_size"]

_PEER_LOST = re.compile(r"closed by peer|reset by peer|[Bb]roken pipe|Socket Timeout|"
                        r"Connection refused|NCCL (error|communicator was aborted)")


def preemption_flag(signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1)
                    ) -> Callable[[], bool]:
    """Install handlers for the scheduler's preemption signals; return ``requested()``.

    Slurm sends SIGTERM (or ``--signal=USR1@T``) before killing a job: the trainers check the
    flag once per epoch/step (agreed across ranks), write a checkpoint and exit cleanly.
    """
    hit = threading.Event()
    for sig in signals:
        signal.signal(sig, lambda *_: hit.set())
    return hit.is_set


def is_comm_failure(error: BaseException) -> bool:
    """Whether ``error`` is a collective failing because a peer is gone (not a bug of ours).

    Gloo raises a plain RuntimeError ("Connection closed by peer ..."); newer torch raises
    ``torch.distributed.DistError`` subclasses.
    """
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(error, dist_error):
        return True
    return isinstance(error, (RuntimeError, ConnectionError)) and bool(
        _PEER_LOST.search(str(error)))


def exit_on_comm_failure(error: BaseException, ctx: DistContext | None) -> NoReturn:
    """A collective failed (a peer vanished): let the watchdog name the lost rank, then exit.

    Gloo and NCCL report a dead peer as a generic connection error on the survivors; the
    context's watchdog (if running) identifies which rank stopped heart-beating within
    ``ctx.heartbeat_timeout_s`` and exits the process with that message. Without a watchdog,
    or if it finds nothing, exit 1 with the original error.
    """
    rank = f"[rank {ctx.rank}] " if ctx else ""
    print(f"{rank}error: communication failed ({type(error).__name__}: {error}); "
          "identifying the lost rank...", file=sys.stderr, flush=True)
    if ctx is not None and ctx.watchdog is not None:
        # the watchdog's thread ends the process (os._exit) before this wait runs out
        ctx.watchdog.thread.join(ctx.heartbeat_timeout_s + 10)
    os._exit(1)


def max_over_ranks(values: Sequence[float], device: torch.device | str = "cpu",
                   transport: MPITransport | None = None) -> list[float]:
    """The elementwise maximum of ``values`` over all ranks, on every rank (one all-reduce of
    float64; collective). Without a process group, ``values`` themselves. ``transport``
    (``DistContext.transport``): through MPI when ``device`` is the CPU (microseconds where
    gloo takes milliseconds); every rank must pass one or none alike."""
    if transport is not None and torch.device(device).type == "cpu":
        return transport.max_over_ranks(values)
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def any_rank(flag: bool, device: torch.device | str = "cpu",
             transport: MPITransport | None = None) -> bool:
    """True on every rank if ``flag`` is True on any rank (one tiny all-reduce; collective;
    ``transport`` as in :func:`max_over_ranks`)."""
    return max_over_ranks([1.0 if flag else 0.0], device, transport)[0] > 0


def fail_all_ranks(message: str, ctx: DistContext | None, code: int = 2) -> NoReturn:
    """Report a user error on this rank and exit non-zero.

    For errors every rank detects identically (a bad grid, a bad flag): each rank prints the
    message, ranks meet at a barrier so no launcher kills a peer before it has printed, then
    all exit with ``code``. The barrier is torch.distributed's even under the MPI transport:
    its timeout ends the wait should a rank not get here after all.
    """
    prefix = f"[rank {ctx.rank}] " if ctx and ctx.world_size > 1 else ""
    print(f"{prefix}error: {message}", file=sys.stderr, flush=True)
    if ctx is not None and dist.is_initialized() and ctx.world_size > 1:
        try:
            dist.barrier()
        except Exception:  # we are exiting with an error anyway
            pass
    if ctx is not None:
        ctx.close()
    else:
        from common.dist import shutdown

        shutdown()
    sys.exit(code)


def rank_and_size(group: Any = None) -> tuple[int, int]:
    """This rank's index in ``group`` and the group's size ((0, 1) without torch.distributed)."""
    if isinstance(group, MPITransport):
        return group.rank, group.size
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj``, in group order, on every rank of ``group`` (collective)."""
    if isinstance(group, MPITransport):
        return group.allgather_object(obj)
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, group: Any = None) -> Any:
    """The ``obj`` of ``group``'s first rank, on every rank of it (collective)."""
    if isinstance(group, MPITransport):
        return group.bcast_object(obj)
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0,
                               group=group)
    return box[0]


def barrier(group: Any = None) -> None:
    """Every rank of ``group`` waits here for the others (collective)."""
    if isinstance(group, MPITransport):
        group.barrier()
    elif dist.is_initialized():
        dist.barrier(group)
