"""The communication thread of the MPI transport (:mod:`common.mpi`): one per process, it runs
queued calls in issue order while the issuing thread computes.

MPICH advances a non-blocking collective only inside MPI calls, so an asynchronous collective
is run by this thread instead (MPI's blocking call with the GIL released, or a polite
test-and-sleep loop, :func:`poll`); a synchronous one runs on the caller's thread when
nothing is queued. :class:`Work` is a queued call's handle, :data:`DONE` the handle of one
that already ran. Nothing here knows MPI: the calls are plain closures, and :func:`poll` takes
any request with a ``Test()``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["DONE", "POLITE", "Done", "ProgressThread", "Work", "polite_level", "poll"]

# which waits poll (test, sleep, test) instead of spinning in MPI's blocking call: none, the
# progress thread's (async collectives), or all (common.mpi.MPIGroup's ``polite``)
POLITE = ("none", "async", "all")


class Work:
    """A collective in flight on the :class:`ProgressThread`."""

    __slots__ = ("_done", "_error")

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None

    def is_completed(self) -> bool:
        """True once the collective finished (without waiting; no MPI call)."""
        return self._done.is_set()

    def wait(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise self._error


class Done:
    """A collective that ran on the caller's thread and is complete (no Event to pay for)."""

    __slots__ = ()

    def is_completed(self) -> bool:
        return True

    def wait(self) -> None:
        return None


DONE = Done()


class ProgressThread:
    """One communication thread per process: runs queued collectives in issue order.

    The thread blocks inside MPI with the GIL released, so a collective progresses while the
    issuing thread computes. ``pending`` counts queued and running jobs; only the issuing
    thread adds jobs, so ``pending == 0`` means the thread is idle and stays so.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], None], Work] | None] = (
            queue.SimpleQueue())
        self._lock = threading.Lock()
        self.pending = 0
        self._thread = threading.Thread(target=self._run, name="hpc-mpi-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, work = job
            try:
                fn()
            except BaseException as e:  # handed to the waiter
                work._error = e
            with self._lock:
                self.pending -= 1
            work._done.set()

    def submit(self, fn: Callable[[], None]) -> Work:
        work = Work()
        with self._lock:
            self.pending += 1
        self._jobs.put((fn, work))
        return work

    def run(self, fn: Callable[[], None], async_op: bool) -> Work | Done:
        """Run ``fn`` (an MPI call) now on this thread if nothing is queued and the call is
        synchronous; else queue it behind the others."""
        if not async_op and self.pending == 0:
            fn()
            return DONE
        work = self.submit(fn)
        if not async_op:
            work.wait()
        return work

    def stop(self) -> bool:
        """End the thread after the queued jobs (idempotent); True if it is idle and ended.
        With jobs still pending (a failing rank exits) it does not wait for them."""
        if self._thread.is_alive():
            self._jobs.put(None)
            if self.pending:
                return False
            self._thread.join(timeout=10)
        return not self._thread.is_alive()


def poll(request: Any, spin_s: float = 5e-5, max_sleep_s: float = 5e-4) -> None:
    """Complete ``request`` politely: test it (each test drives MPI's progress) for up to
    ``spin_s``, then sleep between tests (20 us, doubling up to ``max_sleep_s``), so that a
    waiting rank or thread gives its core to the work it waits for."""
    end = time.perf_counter() + spin_s
    while not request.Test():
        if time.perf_counter() > end:
            break
    else:
        return
    delay = 2e-5
    while not request.Test():
        time.sleep(delay)
        delay = min(2 * delay, max_sleep_s)


def polite_level(ranks_per_core: float) -> int:
    """Which waits poll (an index in :data:`POLITE`) with ``ranks_per_core`` ranks per core on
    a node; the ranks of a job take the largest over their nodes (they must agree: MPI does not
    match a blocking collective with a non-blocking one).

    MPI's blocking wait spins (then yields): the fastest for the short waits of small
    collectives, up to one rank per core and even at two (make train's job, 4 ranks on 2
    cores, runs faster spinning than sleeping). The progress thread waits politely unless every
    rank has a second core for it: spinning there takes the core from this rank's own compute
    (bench/comm_backends.py). Above two ranks per core every wait sleeps: spinning ranks then
    starve the ranks they wait for (the 8-rank plexus parallel == serial test on 2 cores runs
    several times slower spinning than sleeping).
    """
    return 2 if ranks_per_core > 2 else 1 if ranks_per_core > 0.5 else 0
