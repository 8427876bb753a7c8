"""common.failure: errors named as what they are. A lost peer goes to the watchdog (which names
the rank); a CUDA, NCCL or memory error is reported at once, with its cause, on every rank.
The classifier is checked on the texts NCCL, CUDA, torch and gloo really print (NCCL's
ncclGetErrorString results and the "Last error:" line torch appends, as quoted in public
issue reports), and end to end: an out-of-memory raised in a trainer step of llm.train on one
of two ranks reaches both ranks within seconds, not after the heartbeat timeout."""

import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from common.failure import Failure, _cause, classify_failure, is_comm_failure
from tests.distributed import ROOT, launch, launch_env, needs_mpi

NCCL = "NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1691, "
GPU_OOM = ("CUDA out of memory. Tried to allocate 22.00 MiB. GPU 0 has a total capacity of "
           "23.65 GiB of which 11.06 MiB is free. Including non-PyTorch memory, this process has "
           "23.60 GiB memory in use. Of the allocated memory 22.90 GiB is allocated by PyTorch, "
           "and 194.87 MiB is reserved by PyTorch but unallocated. If reserved but unallocated "
           "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to "
           "avoid fragmentation.  See documentation for Memory Management  "
           "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")
DUPLICATE_GPU = (NCCL + "invalid usage (run with NCCL_DEBUG=WARN for details), NCCL version "
                 "2.19.3\nncclInvalidUsage: This usually reflects invalid usage of NCCL "
                 "library.\nLast error:\nDuplicate GPU detected : rank 0 and rank 1 both on CUDA "
                 "device 2000")
LOST, DEVICE = "lost_peer", "device"

CASES = [
    # a peer is gone
    (RuntimeError, "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by "
     "peer [127.0.0.1]:40021", LOST, "a peer was lost"),
    (dist.DistBackendError, "NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.hpp"
     ":268, remote process exited or there was a network error, NCCL version 2.21.5\n"
     "ncclRemoteError: A call failed possibly due to a network error or a remote process "
     "exiting prematurely.\nLast error:\nsocketProgressOpt: Call to recv from 172.16.0.2<33759> "
     "failed : Connection reset by peer", LOST, "a peer was lost"),
    (dist.DistBackendError, "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL("
     "SeqNum=5, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600013 "
     "milliseconds before timing out.", LOST, "a peer was lost"),
    (RuntimeError, "NCCL communicator was aborted on rank 1. Original reason for failure was: "
     "Work: WorkNCCL(OpType=ALLREDUCE, TensorShape=[1], Timeout(ms)=2000) timed out in call to "
     "wait().", LOST, "a peer was lost"),
    (dist.DistStoreError, "Timed out after 901 seconds waiting for clients. 1/4 clients joined.",
     LOST, "a peer was lost"),
    # NCCL and CUDA errors of this rank or of the set-up: reported at once
    (dist.DistBackendError, DUPLICATE_GPU, DEVICE, "two ranks share one GPU"),
    (dist.DistBackendError, NCCL + "invalid usage (run with NCCL_DEBUG=WARN for details), NCCL "
     "version 2.27.5\nncclInvalidUsage: This usually reflects invalid usage of NCCL library.\n"
     "Last error:\nMismatched NCCL version detected : rank 1 version 22705 rank 0 version 22703",
     DEVICE, "the ranks run different NCCL versions"),
    (dist.DistBackendError, "NCCL error in: /opt/pytorch/pytorch/torch/csrc/distributed/c10d/"
     "ProcessGroupNCCL.cpp:1287, invalid usage, NCCL version 2.17.1\nncclInvalidUsage: This "
     "usually reflects invalid usage of NCCL library.", DEVICE, "NCCL was called wrongly"),
    (torch.OutOfMemoryError, GPU_OOM, DEVICE, "the GPU ran out of memory"),
    (RuntimeError, "CUDA out of memory. Tried to allocate 2.26 GiB (GPU 0; 6.00 GiB total "
     "capacity; 781.59 MiB already allocated; 3.03 GiB free; 1.24 GiB reserved in total by "
     "PyTorch)", DEVICE, "the GPU ran out of memory"),  # torch < 1.13 raised a RuntimeError
    (dist.DistBackendError, NCCL + "unhandled cuda error (run with NCCL_DEBUG=INFO for details), "
     "NCCL version 2.18.1\nncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\n"
     "Cuda failure 'out of memory'", DEVICE, "the GPU ran out of memory"),
    (dist.DistBackendError, "NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275, "
     "unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.20.5\n"
     "ncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\nCuda failure 1 "
     "'invalid argument'", DEVICE, "a CUDA call failed"),
    (torch.AcceleratorError, "CUDA error: an illegal memory access was encountered\nCUDA kernel "
     "errors might be asynchronously reported at some other API call, so the stacktrace below "
     "might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\nCompile with "
     "`TORCH_USE_CUDA_DSA` to enable device-side assertions.\n", DEVICE, "a CUDA call failed"),
    (dist.DistBackendError, NCCL + "unhandled system error (run with NCCL_DEBUG=INFO for "
     "details), NCCL version 2.18.1\nncclSystemError: System call (e.g. socket, malloc) or "
     "external library call failed or device error. \nLast error:\nError while creating shared "
     "memory segment /dev/shm/nccl-vzIpS6 (size 9637888)", DEVICE,
     "a system call or device failed inside NCCL (network interface, shared memory, ...)"),
    (dist.DistBackendError, "NCCL error in: /opt/pytorch/pytorch/torch/csrc/distributed/c10d/"
     "ProcessGroupNCCL.cpp:3763, internal error - please report this issue to the NCCL "
     "developers, NCCL version 2.21.5\nncclInternalError: Internal check failed.", DEVICE,
     "NCCL failed internally"),
    (RuntimeError, "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate "
     "memory: you tried to allocate 137438953472 bytes. Error code 12 (Cannot allocate memory)",
     DEVICE, "the host ran out of memory"),
    (MemoryError, "", DEVICE, "the host ran out of memory"),
]


@pytest.mark.parametrize("kind, text, expected, what", CASES,
                         ids=[f"{i}-{c[2]}" for i, c in enumerate(CASES)])
def test_real_error_texts_are_named(kind, text, expected, what):
    failure = classify_failure(kind(text))
    assert failure is not None and (failure.kind, failure.what) == (expected, what), failure
    assert is_comm_failure(kind(text)) == (expected == LOST)
    assert failure.kind == LOST or failure.hint  # a device error says what to do


@pytest.mark.parametrize("error", [
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x5)"),
    RuntimeError("an internal error of ours, a system error of ours: not NCCL's"),
    ValueError("--grid 3x1x1 does not divide the heads"), KeyError("a bug"),
    FloatingPointError("loss is nan"),
])
def test_bugs_and_user_errors_are_no_failure_of_the_job(error):
    assert classify_failure(error) is None and not is_comm_failure(error)


def test_the_cause_is_nccls_last_error_or_the_first_line():
    assert _cause(RuntimeError(DUPLICATE_GPU)) == ("Duplicate GPU detected : rank 0 and rank 1 "
                                                   "both on CUDA device 2000")
    assert _cause(torch.OutOfMemoryError(GPU_OOM)) == GPU_OOM.split(" If reserved")[0]
    assert _cause(RuntimeError("first\nsecond")) == "first"
    assert _cause(MemoryError()) == "no message"
    assert Failure("device", "x") == Failure("device", "x", "")


# llm.train on 2 ranks (data=2), whose rank 1 runs out of GPU memory in its second step
OOM_IN_A_STEP = f"""
import os, runpy, sys, time
import torch
import llm.trainer

GPU_OOM = {GPU_OOM!r}
train_step, calls = llm.trainer.Trainer.train_step, []

def step(self):
    calls.append(1)
    if os.environ["RANK"] == "1" and len(calls) == 2:  # init_distributed set RANK
        print(f"raising at {{time.time()}}", file=sys.stderr, flush=True)
        raise torch.OutOfMemoryError(GPU_OOM)
    return train_step(self)

llm.trainer.Trainer.train_step = step
sys.argv = ["llm.train", *sys.argv[1:]]
runpy.run_module("llm.train", run_name="__main__")
"""


def _run_two_ranks(script, args, heartbeat_s):
    """Rank processes with torchrun's environment and no launcher: each one's stderr, return
    code and the time it ended."""
    import torch.distributed as dist

    world = 2
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    procs = []
    try:
        for r in range(world):
            env = launch_env({"RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r),
                              "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                              "MASTER_PORT": str(store.port),
                              "TORCHELASTIC_USE_AGENT_STORE": "True",
                              "HPC_HEARTBEAT_TIMEOUT": str(heartbeat_s)})
            procs.append(subprocess.Popen([sys.executable, str(script), *args], cwd=ROOT,
                                          env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        ended: dict[int, float] = {}
        deadline = time.monotonic() + 150
        while len(ended) < world and time.monotonic() < deadline:
            for r, p in enumerate(procs):
                if r not in ended and p.poll() is not None:
                    ended[r] = time.time()
            time.sleep(0.05)
        errs = [p.communicate(timeout=30)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        del store
    return [(p.returncode, err, ended.get(r)) for r, (p, err) in enumerate(zip(procs, errs))]


CAUSE = "the GPU ran out of memory (OutOfMemoryError: CUDA out of memory. Tried to allocate"
LLM_ARGS = ["--preset", "tiny", "--batch-size", "4", "--seq-len", "16", "--log-every", "1",
            "--grid", "data=2", "--steps", "20"]


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", pytest.param("mpiexec", marks=needs_mpi)])
def test_an_out_of_memory_in_a_trainer_step_is_reported_at_once_on_every_rank(tmp_path,
                                                                               launcher):
    """Rank 1 raises torch.OutOfMemoryError in a step while rank 0 waits for it in a
    collective (gloo under torchrun's environment; MPI under mpiexec): both ranks exit 1
    naming the cause within seconds of the error, with the heartbeat timeout at 60 s; nothing
    says "identifying the lost rank"."""
    script = tmp_path / "oom_in_a_step.py"
    script.write_text(OOM_IN_A_STEP)
    if launcher == "mpiexec":  # the ranks share mpiexec's stderr and return code
        r = launch([str(script), *LLM_ARGS], ranks=2, launcher="mpiexec",
                   env={"HPC_HEARTBEAT_TIMEOUT": "60"}, timeout=150)
        ended = time.time()
        results = [(r.returncode, r.stderr, ended)] * 2
    else:
        results = _run_two_ranks(script, LLM_ARGS, heartbeat_s=60)
    raised = float(results[1][1].split("raising at ")[1].split()[0])
    assert f"[rank 1] error: {CAUSE}" in results[1][1], results[1][1][-3000:]
    assert f"[rank 0] error: rank 1 failed: {CAUSE}" in results[0][1], results[0][1][-3000:]
    for r, (code, err, ended) in enumerate(results):
        assert code == 1, (r, code, err[-3000:])
        assert "identifying the lost rank" not in err, err[-3000:]
        assert ended - raised < 20, (r, ended - raised)  # the heartbeat timeout is 60 s


ABORT = """
import threading, time
import torch.distributed as dist
from common.watchdog import Watchdog
store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
peer = Watchdog(store, 0, 2, interval_s=0.1, timeout_s=30.0)
failing = Watchdog(store, 1, 2, interval_s=0.1, timeout_s=30.0)
time.sleep(0.5)
print("both alive", flush=True)
threading.Thread(target=failing.abort, args=("rank 1 failed: the GPU ran out of memory",)).start()
time.sleep(5)
print("survived", flush=True)
"""


def test_a_failing_rank_tells_its_peers_at_once():
    """Watchdog.abort posts the cause; the peer's heartbeat thread prints it and exits 1 well
    within its 30 s heartbeat timeout (here: before the 5 s the script would survive)."""
    r = subprocess.run([sys.executable, "-c", ABORT], capture_output=True, text=True,
                       env=launch_env(), timeout=60)
    assert "both alive" in r.stdout and "survived" not in r.stdout, r.stdout + r.stderr
    assert r.returncode == 1
    assert "[rank 0] error: rank 1 failed: the GPU ran out of memory; exiting" in r.stderr
    assert "[rank 1]" not in r.stderr  # the failing rank's own watchdog stays quiet


def test_a_later_failing_rank_does_not_wait():
    """When every rank fails alike (a duplicate GPU), the first names the cause; a later one
    marks itself as having spoken (so no peer waits for it) and returns at once."""
    from common.watchdog import Watchdog

    store = dist.HashStore()
    store.set("hpc/abort", "rank 0 failed: two ranks share one GPU")
    w = Watchdog.__new__(Watchdog)  # no heartbeat thread: only the abort
    w.store, w.rank, w.world, w.interval_s = store, 2, 4, 1.0
    w.stopped = threading.Event()
    start = time.monotonic()
    w.abort("rank 2 failed: two ranks share one GPU")
    assert time.monotonic() - start < 0.5
    assert store.get("hpc/abort") == b"rank 0 failed: two ranks share one GPU"
    assert store.check(["hpc/told/2", "hpc/said/2"]) and w.stopped.is_set()


USER_ERROR = """
import sys
import torch
import torch.distributed as dist
from common.dist import init_distributed
from common.run import run_or_exit

ctx = init_distributed(device="cpu")

def body():
    if ctx.rank == 1 or sys.argv[1] == "every":
        raise ValueError(f"cannot read data/part-{ctx.rank}")
    if sys.argv[1] == "one, in a new group":  # waits on the store for rank 1's address
        dist.new_group([0, 1])
    dist.all_reduce(torch.ones(1))  # rank 0 alone: waits for rank 1 here

run_or_exit(ctx, body, user_errors=(ValueError,))
"""


@pytest.mark.parametrize("who", ["every", "one", "one, in a new group"])
def test_a_user_error_on_one_rank_alone_ends_every_rank(tmp_path, who):
    """A user error every rank sees: each prints its own and exits 2. One that only rank 1
    sees, while rank 0 waits in a collective, or in creating a group (on the store, which the
    watchdog reaches through a connection of its own): rank 1 waits the heartbeat timeout for
    the others, then tells rank 0, which exits 1 naming it, long before the collective's
    timeout."""
    script = tmp_path / "user_error.py"
    script.write_text(USER_ERROR)
    start = time.time()
    results = _run_two_ranks(script, [who], heartbeat_s=4)
    for r, (code, err, ended) in enumerate(results):
        mine = f"[rank {r}] error: cannot read data/part-{r}\n"
        if who == "every" or r == 1:
            assert code == 2 and mine in err and "stopped the job" not in err, (r, err[-3000:])
        else:
            assert code == 1, (r, code, err[-3000:])
            assert ("[rank 0] error: rank 1 stopped the job: cannot read data/part-1; "
                    "exiting") in err, err[-3000:]
        assert ended is not None and ended - start < 40, (r, ended - start)
