"""Job-wide failure handling: what every rank of a job does together when something goes wrong.

* :func:`fail_all_ranks`: a user error; each rank that detects it prints it, then all exit
  with the same code (a rank that found it alone tells the others, which exit 1 naming it).
* :func:`classify_failure` / :func:`exit_on_failure`: an error that ends the job, named as what
  it is. A lost peer (a collective failed because a rank is gone): the context's heartbeat
  watchdog (:mod:`common.watchdog`) names the rank. A CUDA or NCCL error that is no lost peer
  (out of memory, "Duplicate GPU detected", "invalid usage", "unhandled cuda error", mismatched
  NCCL versions, ...): reported at once, with its cause, on this rank and, through the
  watchdog, on every other.
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
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from common.dist import DistContext, shutdown

__all__ = ["Failure", "classify_failure", "exit_on_comm_failure", "exit_on_failure",
           "fail_all_ranks", "is_comm_failure", "preemption_flag"]

# A peer is gone: gloo's socket errors; NCCL's ncclRemoteError ("remote process exited or there
# was a network error"), an aborted communicator, torch's NCCL watchdog timeout.
_PEER_LOST = re.compile(r"closed by peer|reset by peer|[Bb]roken pipe|Socket Timeout|"
                        r"Connection refused|remote process exited|network error|"
                        r"communicator was aborted|Watchdog caught collective operation timeout")
# An error NCCL reported (through torch): "NCCL error in: ...", "NCCL version 2.21.5",
# "ncclInvalidUsage: ..."
_NCCL = re.compile(r"NCCL error|NCCL version|nccl[A-Z]\w+")
# What to do about running out of memory, on the GPU and on the host.
_GPU_OOM = ("the GPU ran out of memory",
            "use a smaller batch, or a grid that splits the model over more GPUs")
_HOST_OOM = ("the host ran out of memory", "use a smaller batch, or more nodes")
# Errors of this rank's device or of the job's set-up, as CUDA, torch and NCCL word them (NCCL:
# ncclGetErrorString and the "Last error:" line torch appends): (pattern, (what it is, what to
# do), NCCL's only). The first that matches the error's text names it.
_DEVICE_ERRORS = (
    (r"Duplicate GPU detected", ("two ranks share one GPU", "launch one rank per GPU "
                                 "(--device auto runs on the CPU when a node has too few)"), True),
    (r"Mismatched NCCL version", ("the ranks run different NCCL versions",
                                  "install the same torch (and NCCL) on every node"), True),
    (r"CUDA out of memory|CUDA error: out of memory|Cuda failure \S* ?'out of memory'", _GPU_OOM,
     False),
    (r"DefaultCPUAllocator: can't allocate memory", _HOST_OOM, False),
    (r"unhandled cuda error|CUDA error|CUDA driver error|Cuda failure", (
        "a CUDA call failed", "for where, rerun with CUDA_LAUNCH_BLOCKING=1 (and NCCL_DEBUG=INFO)"),
     False),
    (r"invalid usage|invalid argument", ("NCCL was called wrongly",
                                         "rerun with NCCL_DEBUG=WARN for NCCL's reason"), True),
    (r"system error", ("a system call or device failed inside NCCL (network interface, shared "
                       "memory, ...)", "rerun with NCCL_DEBUG=INFO for which"), True),
    (r"internal error", ("NCCL failed internally", "rerun with NCCL_DEBUG=INFO"), True),
)


@dataclass(frozen=True)
class Failure:
    """An error that ends the job, named (:func:`classify_failure`).

    Attributes:
        kind: ``"lost_peer"``: a collective failed because a rank is gone (the watchdog names
            it); ``"device"``: CUDA, NCCL or memory failed on this rank (reported at once).
        what: what happened, in one line (``"two ranks share one GPU"``).
        hint: what to do about it, or ``""``.
    """

    kind: str
    what: str
    hint: str = ""


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


def classify_failure(error: BaseException) -> Failure | None:
    """What ``error`` is, if it ends the job for a reason other than a bug of ours.

    A lost peer first (its texts can quote the error the peer died of); then CUDA and NCCL
    errors by their text (torch.OutOfMemoryError, "Duplicate GPU detected", "invalid usage",
    "unhandled cuda error", ...); then any other ``torch.distributed.DistError`` or NCCL error
    counts as a lost peer, as gloo reports a dead peer as a plain connection error. None: not
    a failure of the job (a user error or a bug: the caller decides).
    """
    if not isinstance(error, (RuntimeError, ConnectionError, MemoryError)):
        return None
    text = str(error)
    if not isinstance(error, MemoryError) and _PEER_LOST.search(text):
        return Failure("lost_peer", "a peer was lost")
    oom = getattr(torch, "OutOfMemoryError", None)  # torch >= 2.5 (torch.cuda's before)
    if oom is not None and isinstance(error, oom):
        return Failure("device", *_GPU_OOM)
    if isinstance(error, MemoryError):
        return Failure("device", *_HOST_OOM)
    nccl = bool(_NCCL.search(text))
    for pattern, (what, hint), nccl_only in _DEVICE_ERRORS:
        if (nccl or not nccl_only) and re.search(pattern, text):
            return Failure("device", what, hint)
    dist_error = getattr(dist, "DistError", None)
    if (dist_error is not None and isinstance(error, dist_error)) or "NCCL error" in text:
        return Failure("lost_peer", "a peer was lost")
    return None


def is_comm_failure(error: BaseException) -> bool:
    """Whether ``error`` is a collective failing because a peer is gone (not a bug of ours,
    nor a device error: :func:`classify_failure`)."""
    failure = classify_failure(error)
    return failure is not None and failure.kind == "lost_peer"


def exit_on_failure(error: BaseException, failure: Failure, ctx: DistContext | None
                    ) -> NoReturn:
    """End this rank for ``failure`` (:func:`classify_failure` of ``error``).

    A lost peer: :func:`exit_on_comm_failure` (the watchdog names it). A device error: print
    the traceback and the cause at once, tell every other rank through the watchdog (each
    prints ``rank R failed: <cause>`` within a heartbeat interval or two, without waiting for
    the heartbeat timeout), wait briefly until they have said it, and exit 1.
    """
    if failure.kind == "lost_peer":
        exit_on_comm_failure(error, ctx)
    prefix = f"[rank {ctx.rank}] " if ctx is not None and ctx.world_size > 1 else ""
    cause = f"{failure.what} ({type(error).__name__}: {_cause(error)})"
    sys.stdout.flush()
    traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
    hint = f"; {failure.hint}" if failure.hint else ""
    print(f"{prefix}error: {cause}{hint}", file=sys.stderr, flush=True)
    if ctx is not None and ctx.watchdog is not None:
        ctx.watchdog.abort(f"rank {ctx.rank} failed: {cause}")
    os._exit(1)


def _cause(error: BaseException) -> str:
    """The line of ``error`` that says what happened: NCCL's "Last error:" line when torch
    appended one (``Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1000``),
    else the first line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return "no message"
    for i, line in enumerate(lines[:-1]):
        if line.startswith("Last error:"):
            return lines[i + 1]
    # torch's out-of-memory line: the sizes, without the allocator advice that follows them
    return lines[0].split(" If reserved but unallocated memory is large")[0]


def exit_on_comm_failure(error: BaseException, ctx: DistContext | None) -> NoReturn:
    """A collective failed (a peer vanished): let the watchdog name the lost rank, then exit.

    Gloo and NCCL report a dead peer as a generic connection error on the survivors; the
    context's watchdog (if running) identifies which rank stopped heart-beating within
    ``ctx.heartbeat_timeout_s`` and exits the process with that message (or with the cause a
    failing rank posted: :func:`exit_on_failure`). Without a watchdog, or if it finds nothing,
    exit 1 with the original error.
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

    For errors every rank detects alike (a bad grid, a bad flag): each rank prints the message,
    the ranks meet (through the rendezvous store, at most ``ctx.heartbeat_timeout_s`` s) so no
    launcher kills a peer before it has printed, then all exit with ``code``. An error only
    this rank saw (a file only it read, say) would leave the others waiting in their next
    collective: when they do not come, this rank tells them through the watchdog
    (:meth:`~common.watchdog.Watchdog.abort`), and each exits 1 with the message. Without a
    watchdog the meeting is torch.distributed's barrier, which its timeout ends.
    """
    prefix = f"[rank {ctx.rank}] " if ctx and ctx.world_size > 1 else ""
    print(f"{prefix}error: {message}", file=sys.stderr, flush=True)
    if ctx is not None and ctx.world_size > 1:
        if ctx.watchdog is not None:
            if not ctx.watchdog.meet("user_error", ctx.heartbeat_timeout_s):
                ctx.watchdog.abort(f"rank {ctx.rank} stopped the job: {message}")
        elif dist.is_initialized():
            try:
                dist.barrier()
            except Exception:  # we are exiting with an error anyway
                pass
    if ctx is not None:
        ctx.close()
    else:
        shutdown()
    sys.exit(code)
