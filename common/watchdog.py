"""A heartbeat thread that turns a lost peer into a prompt, named exit on every other rank.

Gloo and NCCL report a dead peer as a generic connection error (or hang); the watchdog,
started by :func:`common.dist.init_distributed` with several ranks and owned by its
``DistContext``, names the rank that stopped heart-beating and exits every other rank non-zero.
A rank that finishes is not lost: it says so (``hpc/done/<rank>``), and the rank that hosts the
rendezvous store waits for the others to finish before taking the store away with it.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

# a rank whose heartbeat stalls this long is declared lost (detection within ~this + 2 s)
DEFAULT_HEARTBEAT_TIMEOUT_S = 30.0


class Watchdog:
    """Heartbeats through the rendezvous store; turns a lost peer into a prompt, named exit.

    Every ``interval_s`` each rank bumps its counter ``hpc/hb/<rank>`` and watches its ring
    successor's. If the successor's counter has not moved for ``timeout_s``, the rank posts
    ``hpc/abort`` naming it; every rank polls that key and exits with status 1 and the message.
    If the store itself is gone (its host died), the rank exits naming the store's host.
    Before exiting, each rank waits briefly for the other survivors to print the abort too
    (launchers kill the whole job as soon as one rank exits non-zero).

    Finished ranks are not lost: :meth:`stop` posts ``hpc/done/<rank>``, and the ring closes
    over them (a rank watches the next rank that has not finished), so a rank is watched for as
    long as any other rank runs. The rank whose process hosts the store (``store_host``) does
    not take it away as it finishes (a rank finishing later would lose the store and exit 1 as
    if the host had been lost): its clean :meth:`stop` waits, heart-beating, until every other
    rank has finished or failed (stopped with ``clean=False``: ``hpc/quit/<rank>``), at most
    ``timeout_s + 2 * interval_s``; ranks still running then are told (``hpc/closing``) and run
    on unwatched. A rank that loses the store after its host finished
    ends its heartbeat quietly too: the host was not lost, it finished first.

    Owned by the :class:`~common.dist.DistContext` that :func:`~common.dist.init_distributed`
    returns; closing the context stops it.

    Args:
        store: a connection to the rendezvous store for this thread alone.
        rank, world: this rank and the number of ranks.
        interval_s: time between heartbeats.
        timeout_s: a peer whose heartbeat stalls this long is lost.
        store_host: the rank whose process hosts the store (0 under mpiexec and srun, whose
            rank 0 hosts it), or None where no rank does (torchrun's agent hosts it).
    """

    def __init__(self, store: Any, rank: int, world: int, *, interval_s: float = 2.0,
                 timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S, store_host: int | None = None
                 ) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.store_host = store_host
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="hpc-watchdog", daemon=True)
        self.thread.start()

    def _die(self, message: str, lost: int | None = None, *, grace: bool = True) -> None:
        # grace: a clean shutdown may race a rank declared lost; stay quiet if it wins. A rank
        # that failed and said why (abort) needs none.
        if self.stopped.wait(2 * self.interval_s if grace else 0):
            return
        self._wait_for_peers(lost, "told")
        print(f"[rank {self.rank}] error: {message}; exiting", file=sys.stderr, flush=True)
        self._wait_for_peers(lost, "said")
        os._exit(1)

    def abort(self, message: str) -> None:
        """This rank failed (an out-of-memory, a CUDA or NCCL error): tell every other rank to
        exit 1 with ``message`` now, and wait until they have said it (at most
        ``4 * interval_s + 1`` s), so that no launcher ends a rank before it has spoken.

        Each other rank's heartbeat thread sees the message within ``interval_s`` and prints
        ``[rank R] error: <message>; exiting``, without the heartbeat timeout. This rank's
        heartbeat stops; the first rank to abort names the cause, and only it waits.
        """
        self.stopped.set()
        try:
            first = not self.store.check(["hpc/abort"])
            if first:
                self.store.set("hpc/lost", str(self.rank))  # before the abort its readers need
                self.store.set("hpc/failed", str(self.rank))
                self.store.set("hpc/abort", message)
            for stage in ("told", "said"):  # this rank has spoken: no peer waits for it
                self.store.set(f"hpc/{stage}/{self.rank}", "1")
        except Exception:  # the store's host is gone: the peers find out by themselves
            return
        if first:  # a later one (all ranks fail alike: a duplicate GPU) leaves it to the first
            self._wait_for_peers(self.rank, "said", seconds=4 * self.interval_s + 1)

    def _wait_for_peers(self, lost: int | None, stage: str, seconds: float | None = None
                        ) -> None:
        """Wait (at most ``seconds``, default ``2 * interval_s``) until every other surviving
        rank has reached ``stage`` too: ``"told"`` (about to report the abort, so that all
        report at once) and ``"said"`` (reported it, so that none exits before the others have
        spoken). Launchers end the whole job as soon as one rank exits (torchrun, mpiexec's
        Hydra with ``-disable-auto-cleanup``) or, for Hydra, writes output after a rank died; a
        rank that had not reported by then would die without a word."""
        if lost is None:  # the store is gone: nothing to coordinate through
            return
        self.meet(stage, 2 * self.interval_s if seconds is None else seconds, absent=lost)

    def meet(self, stage: str, seconds: float, absent: int | None = None) -> bool:
        """Mark this rank as at ``stage`` (``hpc/<stage>/<rank>`` in the store) and wait at most
        ``seconds`` for every other rank but ``absent`` to get there too. True when they all
        did, or when the store's host has exited (every rank is on its way out then)."""
        others = [f"hpc/{stage}/{r}" for r in range(self.world) if r not in (self.rank, absent)]
        deadline = time.monotonic() + seconds
        try:
            self.store.set(f"hpc/{stage}/{self.rank}", "1")
            while others:
                others = [k for k in others if not self.store.check([k])]
                if others and time.monotonic() >= deadline:
                    return False
                time.sleep(0.05)
        except Exception:  # the store's host exited first
            pass
        return True

    def _run(self) -> None:
        succ = (self.rank + 1) % self.world
        beat, seen, since = 0, None, time.monotonic()
        host_done = False
        while not self.stopped.is_set():
            try:
                beat += 1
                self.store.set(f"hpc/hb/{self.rank}", str(beat))
                if self.store.check(["hpc/abort"]):
                    lost = (int(self.store.get("hpc/lost").decode())
                            if self.store.check(["hpc/lost"]) else None)
                    return self._die(self.store.get("hpc/abort").decode(), lost,
                                     grace=not self.store.check(["hpc/failed"]))
                if self.store_host is not None and self.store_host != self.rank:
                    host_done = host_done or self.store.check([f"hpc/done/{self.store_host}"])
                    if host_done and self.store.check(["hpc/closing"]):
                        return self._leave()
                # a finished successor is not watched: the next unfinished rank is, so that
                # every running rank keeps a watcher while any other rank runs
                while succ != self.rank and self.store.check([f"hpc/done/{succ}"]):
                    succ, seen, since = (succ + 1) % self.world, None, time.monotonic()
                key = f"hpc/hb/{succ}"
                value = (self.store.get(key) if succ != self.rank and self.store.check([key])
                         else None)
            except Exception as e:  # the store's host is gone
                if host_done:  # it had finished and took the store along: nothing was lost
                    self.stopped.set()
                    return None
                return self._die(f"lost contact with the rendezvous store ({type(e).__name__}"
                                 "); rank 0 or the launcher that hosts it was probably lost")
            now = time.monotonic()
            if value != seen or succ == self.rank:
                seen, since = value, now
            elif now - since > self.timeout_s:
                msg = f"rank {succ} was lost (no heartbeat for {self.timeout_s:.0f} s)"
                try:
                    self.store.set("hpc/lost", str(succ))  # before the abort its readers need
                    self.store.set("hpc/abort", msg)
                except Exception:
                    pass
                return self._die(msg, succ)
            self.stopped.wait(self.interval_s)

    def _leave(self) -> None:
        """The store's host is closing while this rank runs on: stop heart-beating, and say so
        (``hpc/left/<rank>``) so that the host takes the store down only after this thread has
        made its last request (a request to a vanished store fails noisily in torch's log)."""
        self.stopped.set()
        try:
            self.store.set(f"hpc/left/{self.rank}", "1")
        except Exception:  # the host did not wait: nothing left to tell
            pass

    def _linger(self) -> None:
        """(The store's host, finished.) Keep the store up until every other rank has finished
        or failed, so that a rank finishing later is not cut off from it; then
        :meth:`_close_on` the ranks still running. At most ``timeout_s + 2 * interval_s``: long
        enough for the heartbeat thread, which keeps running, to name a rank lost as this one
        finished. One counter (``hpc/ended``) rather than a key per rank: the store answers
        the polls of a large job in one request each."""
        deadline = time.monotonic() + self.timeout_s + 2 * self.interval_s
        try:
            while self.store.add("hpc/ended", 0) < self.world:
                if time.monotonic() >= deadline:
                    return self._close_on()
                time.sleep(0.05)
        except Exception:  # this process's own store failed: nothing to wait through
            pass

    def _close_on(self) -> None:
        """Tell the ranks still running that the store goes (``hpc/closing``) and wait up to
        ``2 * interval_s + 1`` s for their heartbeat threads to let go of it."""
        running = [r for r in range(self.world) if not self._ended(r)]
        self.store.set("hpc/closing", "1")
        deadline = time.monotonic() + 2 * self.interval_s + 1
        while running and time.monotonic() < deadline:
            time.sleep(0.05)
            running = [r for r in running
                       if not (self._ended(r) or self.store.check([f"hpc/left/{r}"]))]

    def _ended(self, rank: int) -> bool:
        return any(self.store.check([f"hpc/{end}/{rank}"]) for end in ("done", "quit"))

    def stop(self, *, clean: bool = True) -> None:
        """Stop heart-beating (idempotent). ``clean``: tell the peers this rank finished, so
        they do not report it lost; a failing rank stops with ``clean=False`` and its peers
        name it within ``timeout_s`` (only the store's host, finished, stops waiting for it).
        The store's host (``store_host``) first waits for the other ranks to end (see the
        class docstring)."""
        if self.stopped.is_set():
            return
        hosts_store = self.rank == self.store_host
        if clean and hosts_store:
            self._post_end("done")
            self._linger()
        self.stopped.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=5)
        # posted after the thread has ended: the host may take the store down as soon as it
        # sees this, and the thread must not be halfway through a request then
        if not (clean and hosts_store):
            self._post_end("done" if clean else "quit")

    def _post_end(self, end: str) -> None:
        try:
            self.store.set(f"hpc/{end}/{self.rank}", "1")
            self.store.add("hpc/ended", 1)
        except Exception:  # shutting down anyway
            pass
