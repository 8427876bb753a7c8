"""The shared helpers of every multi-rank test: in-process gloo ranks and real launchers.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` fresh processes (forked from a fork
server that has imported torch and the packages once), each with
the torchrun environment variables set, calls ``common.init_distributed`` and then
``fn(ctx, *args)``; it returns the per-rank results in rank order. ``comm="mpi"`` starts them
under ``mpiexec`` instead (``python -m tests.mpi_worker``), so CPU tensors go through the MPI
transport: parametrize a parallel == serial test over :data:`COMMS` to run it on both. An
exception on any rank is re-raised here with that rank's traceback; a rank that hangs or dies
fails the test after ``timeout`` seconds instead of hanging the suite. ``fn`` must be a
module-level function. Batch several checks into one call: starting ranks costs about a second
each on 2 cores.

``launch(args, ranks=N, launcher=...)`` runs ``python ARGS`` under mpiexec, torchrun or alone
and returns the finished process; :func:`find_mpiexec` finds the launcher (beside
``sys.executable`` first: the mpich wheel's; then ``PATH``) and :data:`needs_mpi` skips a test
without one. tests/conftest.py wraps these as fixtures (``mpiexec``, ``threads``).
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from common.dist import ENV_DEVICE, ENV_MPI_POLITE
from common.mpi import cores_available
from common.spawn import find_mpiexec

ROOT = Path(__file__).resolve().parents[1]
LAUNCHERS = ("mpiexec", "torchrun", "single")
MPIEXEC = find_mpiexec()
needs_mpi = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec beside sys.executable or "
                               "on PATH (pip install mpich)")
# the two transports of CPU tensors, as a parametrization (the MPI one skips without mpiexec)
COMMS = ("torch", pytest.param("mpi", marks=needs_mpi))
# set for the rerun of the cross_shape tests under other CPUs' code paths inside make test
# (tests/test_cpu_variants.py): launches of several ranks skip there, `make test-cpus` runs them
IN_PROCESS_ONLY = "HPC_TEST_IN_PROCESS_ONLY"


def require_mpiexec() -> str:
    """:func:`find_mpiexec`, or skip the running test saying why."""
    found = find_mpiexec()
    if found is None:
        pytest.skip("no mpiexec beside sys.executable or on PATH (pip install mpich)")
    return found


def _skip_launch_of(ranks: int) -> None:
    if ranks > 1 and os.environ.get(IN_PROCESS_ONLY) == "1":
        pytest.skip(f"{ranks} ranks: this rerun keeps to in-process tests ({IN_PROCESS_ONLY})")


def launch_env(env: Mapping[str, str] | None = None, *, pythonpath: str | None = str(ROOT)
               ) -> dict[str, str]:
    """The environment of a launched test process: one OpenMP thread per rank, the CPU as the
    CLIs' default device (``HPC_DEVICE=cpu``: on a host with a GPU a test that means the CPU
    must not pick CUDA; GPU tests pass ``--device cuda``, which wins), the repository on
    ``PYTHONPATH`` (None: no ``PYTHONPATH`` at all), then ``env``."""
    out = {**os.environ, "OMP_NUM_THREADS": "1", ENV_DEVICE: "cpu"}
    out.pop("PYTHONPATH", None)
    if pythonpath is not None:
        out["PYTHONPATH"] = pythonpath
    return {**out, **(env or {})}


def launch_command(args: Sequence[str], *, ranks: int = 1, launcher: str = "mpiexec"
                   ) -> list[str]:
    """``python ARGS`` under ``launcher`` on ``ranks`` processes, as an argument list."""
    if launcher == "mpiexec":
        return [require_mpiexec(), "-n", str(ranks), sys.executable, *args]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(ranks), *args]
    if launcher == "single":
        assert ranks == 1, "a single process is one rank"
        return [sys.executable, *args]
    raise ValueError(f"unknown launcher {launcher!r}; use one of {LAUNCHERS}")


def _polite_at_density(env: Mapping[str, str] | None, ranks: int) -> dict[str, str]:
    """``env`` with ``HPC_MPI_POLITE=all`` added at two or more mpiexec ranks per core (unless
    ``env`` sets it): see :func:`launch`."""
    out = dict(env or {})
    if _crowded(ranks):
        out.setdefault(ENV_MPI_POLITE, "all")
    return out


def _crowded(ranks: int) -> bool:
    """Two or more ranks to a core."""
    return ranks >= 2 * cores_available()


def launch(args: Sequence[str], *, ranks: int = 1, launcher: str = "mpiexec",
           cwd: str | Path = ROOT, env: Mapping[str, str] | None = None,
           pythonpath: str | None = str(ROOT), timeout: float = 180
           ) -> subprocess.CompletedProcess[str]:
    """Run ``python ARGS`` on ``ranks`` processes under ``launcher`` (``"mpiexec"``,
    ``"torchrun"`` or ``"single"``) and wait; skips the test when mpiexec is asked for and
    missing. stdout and stderr are captured as text; stdin is closed (mpiexec forwards it).

    Under mpiexec with two or more ranks per core, every MPI wait sleeps
    (``HPC_MPI_POLITE=all``, unless ``env`` sets it), as in :mod:`tests.mpi_worker`: with
    spinning waits a rank can starve the one it waits for, and the ogbn-arxiv-like job of
    tests/plexus/test_train.py took many times its usual time in full-suite runs."""
    _skip_launch_of(ranks)
    if launcher == "mpiexec":
        env = _polite_at_density(env, ranks)
    return subprocess.run(launch_command(args, ranks=ranks, launcher=launcher), cwd=cwd,
                          env=launch_env(env, pythonpath=pythonpath), capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def _torchrun_env(rank: int, world: int, port: int) -> dict[str, str]:
    """What torchrun gives rank ``rank`` of ``world`` on one node, with the rendezvous store the
    test process owns on ``port`` (``TORCHELASTIC_USE_AGENT_STORE``: connect to it, as to
    torchrun's agent)."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": "True"}


def _worker(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...],
            out: Any) -> None:
    os.environ.update(_torchrun_env(rank, world, port))
    _stacks_on_signal()
    try:
        from common.dist import init_distributed

        # at two or more ranks per core (8 ranks beside another test worker on 2 cores) a
        # rank's heartbeat thread can wait for the CPU for tens of seconds: the test's own
        # timeout, not the watchdog's 30 s, is what catches a hang there
        with init_distributed(device="cpu", timeout_s=120,
                              heartbeat_timeout_s=120 if _crowded(world) else None) as ctx:
            result = fn(ctx, *args)
        # plain pickle: tensors travel by value, not through shared memory that dies with us
        out.put((rank, True, pickle.dumps(result)))
    except BaseException:  # reported to the parent
        out.put((rank, False, traceback.format_exc()))


# sent to a rank that outlived its test's timeout: it writes every thread's stack to its
# stderr (faulthandler), which the test's failure then shows
HUNG_SIGNAL = signal.SIGUSR2  # SIGUSR1 is the trainers' preemption signal


def _stacks_on_signal() -> None:
    faulthandler.register(HUNG_SIGNAL, all_threads=True)


def _report_hung(children: Sequence[Any], errs: Sequence[str] | None = None) -> str:
    """Ask the children still alive for their stacks (:data:`HUNG_SIGNAL`) and return, for
    each, what it has written to its stderr file (``errs``; else the stacks go to the stderr
    the children share with the test). Called before they are killed."""
    import time

    hung = [(r, c) for r, c in enumerate(children) if c.is_alive()]
    for _, child in hung:
        try:
            os.kill(child.pid, HUNG_SIGNAL)
        except ProcessLookupError:
            pass
    time.sleep(2.0)
    lines = [f"ranks {[r for r, _ in hung]} still running; their stacks:"]
    ended = [(r, c) for r, c in enumerate(children) if (r, c) not in hung]
    for r, child in hung + ended:  # a rank that ended first is often why the others wait
        if errs is not None and os.path.exists(errs[r]):
            tail = Path(errs[r]).read_text(errors="replace")[-6000:]
            how = "" if (r, child) in hung else f", ended with exit code {child.exitcode}"
            lines.append(f"--- rank {r}{how} (the end of its stderr) ---\n{tail}")
    return "\n".join(lines)


# What every rank imports anyway, imported once into the fork server that starts the ranks:
# each rank is spared importing them, most of a small test's CPU time at 8 ranks on 2 cores.
_PRELOAD = ["torch", "torch.distributed", "numpy", "common.dist", "common.collectives",
            "plexus.data", "plexus.trainer", "llm.parallel.gpt", "llm.trainer"]


def _rank_context() -> Any:
    """Processes forked from a fork server that has imported :data:`_PRELOAD` (no threads run
    there, so forking is safe): like spawn's, they inherit nothing of the test process (its
    threads, process groups or state), but start with the imports done."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _module_as_main(module: str, argv: list[str], env: dict[str, str], cwd: str,
                    out: str, err: str) -> None:
    """``python -m MODULE ARGV`` in this forked process: ``env`` as the whole environment,
    stdout and stderr into files, the exit status as the interpreter would set it."""
    import atexit
    import runpy

    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        with open(path, "wb") as f:
            os.dup2(f.fileno(), fd)
    _stacks_on_signal()
    sys.argv = [module, *argv]
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:  # sys.exit("message"): printed, status 1
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_module(module: str, argv: Sequence[str], *, ranks: int = 1,
               env: Mapping[str, str] | None = None, cwd: str | Path = ROOT,
               timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """``python -m MODULE ARGV`` as ``ranks`` processes forked from the fork server that has
    imported torch and the packages (:data:`_PRELOAD`), instead of fresh interpreters, so
    that no rank imports them again. The environment is :func:`launch_env`'s; with ``ranks``
    > 1 each rank also gets torchrun's (the parent owns the rendezvous store, as in
    :func:`run_ranks`), so the job runs over gloo. The ranks' stdout and stderr are
    captured and joined in rank order; the exit status is a signal's (negative) if any rank
    died of one, else the largest. For the CLI tests that are not about the launcher or the
    MPI transport."""
    _skip_launch_of(ranks)
    import tempfile
    import time

    envs = [launch_env(env)]
    store = None
    if ranks > 1:
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", 0, ranks, is_master=True, wait_for_workers=False)
        envs = [{**envs[0], **_torchrun_env(r, ranks, store.port)} for r in range(ranks)]
    command = ["-m", module, *argv]
    with tempfile.TemporaryDirectory() as tmp:
        files = [(os.path.join(tmp, f"out{r}"), os.path.join(tmp, f"err{r}"))
                 for r in range(ranks)]
        context = _rank_context()
        children = [context.Process(target=_module_as_main, args=(
            module, list(argv), rank_env, str(cwd), out, err), daemon=True)
            for rank_env, (out, err) in zip(envs, files, strict=True)]
        for child in children:
            child.start()
        deadline = time.monotonic() + timeout
        try:
            for child in children:
                child.join(max(0.0, deadline - time.monotonic()))
            if any(child.is_alive() for child in children):
                print(_report_hung(children, [e for _, e in files]), file=sys.stderr)
                raise subprocess.TimeoutExpired(command, timeout)
        finally:
            for child in children:
                if child.is_alive():
                    child.kill()
                    child.join(5)
            del store
        text = ["".join(Path(p).read_text(errors="replace") if os.path.exists(p) else ""
                        for p in paths) for paths in zip(*files, strict=True)]
        codes = [child.exitcode for child in children]
        code = min(codes) if min(codes) < 0 else max(codes)
        return subprocess.CompletedProcess(command, code, *text)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240,
              comm: str = "torch") -> list[Any]:
    """Run ``fn(ctx, *args)`` on ``world_size`` ranks; return results by rank.

    ``comm="torch"``: spawned processes over gloo; ``"mpi"``: under mpiexec with the MPI
    transport (``ctx.transport``; use ``ctx.create_groups(grid)`` in ``fn``)."""
    _skip_launch_of(world_size)
    if comm == "mpi":
        return _run_ranks_mpi(fn, world_size, args, timeout)
    if comm != "torch":
        raise ValueError(f"comm {comm!r}: use torch or mpi")
    import torch.distributed as dist

    ctx = _rank_context()
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
        errors.append(_report_hung(procs))  # the stacks go to the test's captured stderr
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
                              heartbeat_s: int = 8, timeout: float = 60,
                              launcher: str = "torchrun") -> dict[int, tuple]:
    """Fault injection shared by the trainers' tests: start ``python -m <args>`` on ``world``
    ranks, wait until rank 0 prints a line starting with ``ready``, take rank ``victim`` away
    and return ``{rank: (returncode, stderr, seconds after that)}`` for every other rank.

    ``launcher="torchrun"``: torchrun's environment with no launcher that would end the job
    for us (gloo); the victim is SIGKILLed. ``"mpiexec"`` (the MPI transport): the victim is
    SIGSTOPped, a hung rank. A SIGKILLed one is not left to the watchdog under MPICH: Hydra
    kills the survivors at once, and even with ``-disable-auto-cleanup`` MPICH aborts the job
    when a shared-memory copy from the dead process fails (tests/common/test_mpi.py checks
    that such a job ends). The ranks share mpiexec's stderr and return code; ranks prefix
    their messages with ``[rank N]``."""
    import tempfile
    import time

    if launcher == "mpiexec":
        with tempfile.TemporaryDirectory(prefix="stop_one_") as tmp:
            return _stop_one_mpi_rank(args, world, victim, ready, heartbeat_s, timeout,
                                      Path(tmp))
    assert launcher == "torchrun", launcher
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    procs = []
    for r in range(world):
        env = {**os.environ, **_torchrun_env(r, world, store.port), "OMP_NUM_THREADS": "1",
               "HPC_HEARTBEAT_TIMEOUT": str(heartbeat_s), ENV_DEVICE: "cpu",
               "PYTHONPATH": str(ROOT)}
        procs.append(subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, env=env,
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


def _stop_one_mpi_rank(args: list[str], world: int, victim: int, ready: str, heartbeat_s: int,
                       timeout: float, tmp: Path) -> dict[int, tuple]:
    import shlex
    import signal
    import time

    command = " ".join(shlex.quote(a) for a in (sys.executable, "-m", *args))
    rank_cmd = f"echo $$ >{tmp}/pid.$PMI_RANK; exec {command}"  # exec keeps the shell's PID
    out_path, err_path = tmp / "stdout", tmp / "stderr"
    env = _polite_at_density({"HPC_HEARTBEAT_TIMEOUT": str(heartbeat_s)}, world)
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen([require_mpiexec(), "-n", str(world), "sh", "-c", rank_cmd],
                                cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                env=launch_env(env))
    try:
        deadline = time.monotonic() + 120
        while not any(x.startswith(ready) for x in out_path.read_text().splitlines()):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"rank 0 never printed {ready!r}: "
                                     f"{err_path.read_text()[-2000:]}")
            time.sleep(0.2)
        os.kill(int((tmp / f"pid.{victim}").read_text()), signal.SIGSTOP)
        start = time.monotonic()
        code = proc.wait(timeout=timeout)
        seconds = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
        # mpiexec normally ends every rank; after a failure here none may outlive the test
        for path in tmp.glob("pid.*"):
            for sig in (signal.SIGKILL, signal.SIGCONT):
                try:
                    os.kill(int(path.read_text()), sig)
                except (ProcessLookupError, ValueError):
                    break
    text = err_path.read_text()
    return {r: (code, text, seconds) for r in range(world) if r != victim}


def _run_ranks_mpi(fn: Callable[..., Any], world_size: int, args: tuple[Any, ...],
                   timeout: float) -> list[Any]:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="run_ranks_") as tmp:
        job = Path(tmp)
        (job / "job.pkl").write_bytes(pickle.dumps((fn, args)))
        try:
            proc = subprocess.run(
                launch_command(["-m", "tests.mpi_worker", str(job)], ranks=world_size),
                # a heavily loaded CI machine can stall a busy rank past the default 30 s
                cwd=ROOT, env=launch_env({"HPC_HEARTBEAT_TIMEOUT": "120"}), capture_output=True,
                text=True, timeout=timeout,
                stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"mpiexec ranks did not finish within {timeout} s") from None
        results, errors = [], []
        for r in range(world_size):
            path = job / f"rank{r}.pkl"
            if not path.exists():
                errors.append(f"--- rank {r} wrote no result ---")
                continue
            ok, value = pickle.loads(path.read_bytes())
            if ok:
                results.append(value)
            else:
                errors.append(f"--- rank {r} ---\n{value}")
        if errors or proc.returncode:
            raise AssertionError("distributed run (mpiexec) failed:\n" + "\n".join(errors)
                                 + f"\nexit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
        return results
