"""Job-wide failure handling: what every rank of a job does together when something goes wrong.

* :func:`fail_all_ranks`: a user error every rank detects alike; each prints it, then all exit
  with the same code.
* :func:`is_comm_failure` / :func:`exit_on_comm_failure`: a collective failed because a peer is
  gone; the context's heartbeat watchdog (:mod:`common.watchdog`) names it.
* :func:`preemption_flag`: the scheduler's preemption signals as a flag the trainers agree on
  (with :func:`common.exchange.any_rank`).

Built on :mod:`common.dist` (the context each takes); the small agreements and object
exchanges ranks make on the way (:func:`~common.exchange.any_rank`, ...) live in
:mod:`common.exchange`.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
from collections.abc import Callable
from typing import NoReturn

import torch.distributed as dist

from common.dist import DistContext, shutdown

__all__ = ["exit_on_comm_failure", "fail_all_ranks", "is_comm_failure", "preemption_flag"]

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
        shutdown()
    sys.exit(code)
