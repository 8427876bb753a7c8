"""The one helper every multi-rank test uses: run a function on N gloo ranks in subprocesses.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` fresh processes (spawn), each with
the torchrun environment variables set, calls ``common.init_distributed`` and then
``fn(ctx, *args)``; it returns the per-rank results in rank order. An exception on any rank is
re-raised here with that rank's traceback; a rank that hangs or dies fails the test after
``timeout`` seconds instead of hanging the suite. ``fn`` must be a module-level function.

Batch several checks into one call: starting ranks costs about a second each on 2 cores.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import traceback
from collections.abc import Callable
from typing import Any


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, out: mp.Queue) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",  # connect to the parent's store, as under torchrun
    )
    try:
        from common.dist import init_distributed, shutdown

        ctx = init_distributed(device="cpu", timeout_s=120)
        try:
            result = fn(ctx, *args)
        finally:
            shutdown()
        # plain pickle: tensors travel by value, not through shared memory that dies with us
        out.put((rank, True, pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        out.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 240) -> list[Any]:
    """Run ``fn(ctx, *args)`` on ``world_size`` gloo ranks; return results by rank."""
    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    # The parent owns the rendezvous store on an OS-chosen port (like torchrun's agent), so
    # concurrent test runs can never race for a port.
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    port = store.port
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, out), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            rank, ok, value = out.get(timeout=timeout)
            if ok:
                results[rank] = pickle.loads(value)
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
                break
    except queue.Empty:
        missing = sorted(set(range(world_size)) - set(results))
        errors.append(f"ranks {missing} did not finish within {timeout} s")
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
    del store
    if errors:
        raise AssertionError("distributed run failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]


def kill_one_rank_and_collect(args: list[str], world: int, victim: int, ready: str,
                              heartbeat_s: int = 8, timeout: float = 60) -> dict[int, tuple]:
    """Fault injection shared by the trainers' tests: start ``python -m <args>`` on ``world``
    ranks with torchrun's environment (no launcher that would kill the job for us), wait until
    rank 0 prints a line starting with ``ready``, SIGKILL rank ``victim``, and return
    ``{rank: (returncode, stderr, seconds after the kill)}`` for every other rank."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    import torch.distributed as dist

    root = Path(__file__).resolve().parents[1]
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    procs = []
    for r in range(world):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True",
               "OMP_NUM_THREADS": "1", "HPC_HEARTBEAT_TIMEOUT": str(heartbeat_s),
               "PYTHONPATH": str(root)}
        procs.append(subprocess.Popen([sys.executable, "-m", *args], cwd=root, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = {}
    try:
        for line in procs[0].stdout:
            if line.startswith(ready):
                break
        start = time.monotonic()
        procs[victim].kill()
        for r, p in enumerate(procs):
            if r != victim:
                _, err = p.communicate(timeout=timeout)
                out[r] = (p.returncode, err, time.monotonic() - start)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        del store
    return out
