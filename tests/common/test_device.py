"""common.device.choose_device: a GPU of its own for every rank or the CPU, never two ranks on one
GPU (NCCL's "Duplicate GPU detected"); checked exhaustively on the pure function, then on the
start-up path with torch's device count faked to one GPU for four local ranks (in process, and
four real ranks under torchrun): ``--device auto`` runs on the CPU and says why, ``--device
cuda`` exits 2 on every rank before any collective. With ``-m gpu``, the same with plexus.train
on a real GPU host and one rank more than its GPUs."""

import argparse
import itertools
import re

import pytest
import torch

from common.device import DEVICES, choose_device, gpus_bound_to_rank
from common.dist import ENV_DEVICE
from common.run import add_launch_args, start
from tests.distributed import launch, launch_env


def _choice(request, local_rank, local_world, num_gpus, bound=False):
    return choose_device(request, local_rank=local_rank, local_world_size=local_world,
                         num_gpus=num_gpus, bound=bound)


@pytest.mark.parametrize("request_, local_world, num_gpus, bound", list(itertools.product(
    DEVICES, range(1, 6), range(0, 6), (False, True))))
def test_every_node_shape(request_, local_world, num_gpus, bound):
    """Every request on every node of 1-5 ranks and 0-5 GPUs: the ranks of a node never share
    a GPU unless the launcher bound each its own; ``auto`` takes the GPUs exactly when there
    are enough and otherwise gives the arithmetic; ``cuda`` refuses the same nodes by name."""
    enough = num_gpus >= 1 and (bound or num_gpus >= local_world)
    outcomes = []
    for local_rank in range(local_world):
        try:
            outcomes.append(_choice(request_, local_rank, local_world, num_gpus, bound))
        except ValueError as e:
            outcomes.append(e)
    if request_ == "cpu" or (request_ == "auto" and not enough):
        assert all(d == torch.device("cpu") for d, _ in outcomes), outcomes
        reasons = {r for _, r in outcomes}
        if request_ == "cpu":
            assert reasons == {"--device cpu"}
        elif num_gpus == 0:
            assert reasons == {"torch sees no CUDA device"}
        else:  # GPUs, but too few: the same arithmetic on every rank of the node
            gpus = "1 GPU" if num_gpus == 1 else f"{num_gpus} GPUs"
            assert reasons == {f"{local_world} local ranks but {gpus}: running on CPU (NCCL "
                               f"needs one GPU per rank); launch at most {num_gpus} "
                               f"rank{'s' * (num_gpus > 1)} per node to use "
                               f"{'it' if num_gpus == 1 else 'them'}, or pass --device cpu"}
        return
    if request_ == "cuda" and not enough:
        assert all(isinstance(e, ValueError) for e in outcomes), outcomes
        messages = {str(e) for e in outcomes}
        assert len(messages) == 1  # every rank of the node says the same
        if num_gpus == 0:
            assert messages == {"--device cuda was asked for, but torch sees no CUDA device"}
        else:
            assert f"{local_world} ranks on this node but torch sees" in messages.pop()
        return
    devices = [d for d, _ in outcomes]  # auto with enough GPUs, or cuda with enough
    assert all(d.type == "cuda" and d.index < num_gpus for d in devices), devices
    if bound:
        assert {d.index for d in devices} == {0}  # each sees only its own: its cuda:0
    else:
        assert [d.index for d in devices] == list(range(local_world))  # one each, distinct


def test_the_messages_of_four_ranks_on_one_gpu():
    device, reason = _choice("auto", 2, 4, 1)
    assert device == torch.device("cpu")
    assert reason == ("4 local ranks but 1 GPU: running on CPU (NCCL needs one GPU per rank); "
                      "launch at most 1 rank per node to use it, or pass --device cpu")
    with pytest.raises(ValueError) as e:
        _choice("cuda", 2, 4, 1)
    assert str(e.value) == ("--device cuda: 4 ranks on this node but torch sees 1 GPU (4 > 1; "
                            "NCCL needs one GPU per rank): launch at most 1 rank per node, or "
                            "use --device cpu")
    assert _choice("cuda", 3, 4, 4) == (torch.device("cuda", 3),
                                        "local rank 3 of 4 on GPU 3 of 4")
    assert _choice("auto", 1, 2, 8)[0] == torch.device("cuda", 1)  # spare GPUs stay idle
    assert _choice("cuda", 3, 4, 1, bound=True) == (torch.device("cuda", 0),
                                                    "GPU 0 of the 1 GPU bound to the rank")


def test_bad_requests_and_ranks_are_refused():
    with pytest.raises(ValueError, match="unknown device 'gpu'; use auto, cpu or cuda"):
        _choice("gpu", 0, 1, 1)
    with pytest.raises(ValueError, match="local rank 4 is not among the 4 ranks of this node"):
        _choice("auto", 4, 4, 8)


def test_gpus_bound_by_slurm_per_task():
    step = {"SLURM_STEP_ID": "0"}
    assert gpus_bound_to_rank(1, {**step, "SLURM_GPUS_PER_TASK": "1"})
    assert gpus_bound_to_rank(2, {**step, "SLURM_GPUS_PER_TASK": "a100:2"})
    # --gpu-bind=none: the rank sees the node's GPUs, its local rank picks one
    assert not gpus_bound_to_rank(4, {**step, "SLURM_GPUS_PER_TASK": "1"})
    assert not gpus_bound_to_rank(1, {"SLURM_GPUS_PER_TASK": "1"})  # no job step: no srun
    assert not gpus_bound_to_rank(1, step)
    assert not gpus_bound_to_rank(0, {**step, "SLURM_GPUS_PER_TASK": "0"})


def _parse(*argv):
    p = argparse.ArgumentParser()
    add_launch_args(p)
    return p.parse_args(list(argv))


@pytest.fixture
def one_gpu_four_local_ranks(monkeypatch):
    """torch sees one GPU (faked; nothing may touch CUDA); the torchrun environment of a
    4-rank job on one node, with a store nobody listens on (start-up must not reach it)."""
    import common.dist

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    def no_cuda(*_):
        raise AssertionError("a GPU was taken")

    monkeypatch.setattr(torch.cuda, "set_device", no_cuda)
    monkeypatch.setattr(common.dist, "split_threads", lambda *_: 1)  # this process's threads

    def at(local_rank):
        monkeypatch.setenv("RANK", str(local_rank))
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        for name, value in (("WORLD_SIZE", "4"), ("LOCAL_WORLD_SIZE", "4"),
                            ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")):
            monkeypatch.setenv(name, value)

    class GroupStartError(Exception):
        """Raised where the process group would start, with its backend."""

    def init_process_group(backend, **_):
        raise GroupStartError(backend)

    monkeypatch.setattr(common.dist.dist, "init_process_group", init_process_group)
    return at, GroupStartError


def test_auto_on_one_gpu_for_four_local_ranks_starts_on_cpu_and_says_why(
        one_gpu_four_local_ranks, capsys):
    """The start-up path of local ranks 0 and 2 of 4 with one GPU: the process group starts
    as gloo (CPU), no GPU is taken, and the node's first rank says why."""
    at, started = one_gpu_four_local_ranks
    for local_rank, says in ((2, False), (0, True)):
        at(local_rank)
        with pytest.raises(started, match=r"^gloo$"):
            start(_parse("--device", "auto"))
        err = capsys.readouterr().err
        note = (f"[rank {local_rank}] note: 4 local ranks but 1 GPU: running on CPU (NCCL "
                "needs one GPU per rank)")
        assert (note in err) == says, err


def test_cuda_on_one_gpu_for_four_local_ranks_exits_2_before_any_collective(
        one_gpu_four_local_ranks, capsys):
    import torch.distributed as dist

    at, _ = one_gpu_four_local_ranks
    at(2)
    with pytest.raises(SystemExit) as e:
        start(_parse("--device", "cuda"))  # init_process_group would raise
    assert e.value.code == 2
    assert ("error: --device cuda: 4 ranks on this node but torch sees 1 GPU (4 > 1; NCCL needs "
            "one GPU per rank)") in capsys.readouterr().err
    assert not dist.is_initialized()


def test_device_default_comes_from_the_environment(monkeypatch, capsys):
    monkeypatch.delenv(ENV_DEVICE, raising=False)
    assert _parse().device == "auto"
    monkeypatch.setenv(ENV_DEVICE, "cpu")
    assert _parse().device == "cpu"
    assert _parse("--device", "cuda").device == "cuda"  # the flag wins
    monkeypatch.setenv(ENV_DEVICE, "gpu")
    with pytest.raises(SystemExit) as e:
        start(_parse())
    assert e.value.code == 2
    assert "error: HPC_DEVICE='gpu': use auto, cpu or cuda" in capsys.readouterr().err
    # test launches mean the CPU unless they say --device cuda
    assert launch_env()[ENV_DEVICE] == "cpu"
    assert launch_env({ENV_DEVICE: "auto"})[ENV_DEVICE] == "auto"


# Four real ranks under torchrun, each with torch's device count faked to one GPU.
FAKE_ONE_GPU = """
import argparse, sys
import torch
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
import torch.distributed as dist
from common.run import add_launch_args, start
p = argparse.ArgumentParser()
add_launch_args(p)
ctx = start(p.parse_args(sys.argv[1:]))
print(f"rank {ctx.rank} before the first collective", flush=True)
t = torch.ones(1, device=ctx.device)
dist.all_reduce(t)
print(f"rank {ctx.rank} on {ctx.device} ({ctx.device_reason}) sum {t.item():g}", flush=True)
"""


@pytest.mark.slow
def test_two_ranks_on_one_gpu_under_torchrun(tmp_path):
    """More local ranks than GPUs (two on one fake GPU; the 4-rank texts are checked in
    process above): ``auto`` runs on the CPU and says why once per node, ``cuda`` refuses on
    every rank."""
    script = tmp_path / "fake_one_gpu.py"
    script.write_text(FAKE_ONE_GPU)
    auto = launch([str(script), "--device", "auto"], ranks=2, launcher="torchrun")
    assert auto.returncode == 0, auto.stdout + auto.stderr
    why = "2 local ranks but 1 GPU: running on CPU (NCCL needs one GPU per rank)"
    for rank in range(2):
        assert f"rank {rank} on cpu ({why}" in auto.stdout and "sum 2" in auto.stdout, auto.stdout
    assert len(re.findall(r"\[rank 0\] note: " + re.escape(why), auto.stderr)) == 1, auto.stderr
    assert "note:" not in auto.stderr.replace("[rank 0] note:", "")  # once per node

    cuda = launch([str(script), "--device", "cuda"], ranks=2, launcher="torchrun")
    assert cuda.returncode != 0
    assert "before the first collective" not in cuda.stdout, cuda.stdout
    refusal = ("error: --device cuda: 2 ranks on this node but torch sees 1 GPU (2 > 1; NCCL "
               "needs one GPU per rank): launch at most 1 rank per node, or use --device cpu")
    _every_rank_refused_or_stopped(cuda.stderr, refusal, 2)


def _every_rank_refused_or_stopped(stderr: str, refusal: str, ranks: int) -> None:
    """Every rank refuses; torchrun stops the others (SIGTERM) as soon as the first has
    exited, so a rank still importing torch then is reported terminated instead of printing
    (as seen on an H100 host: one rank exit code 2, the other -15)."""
    codes = [int(c) for c in re.findall(r"exitcode\s+:\s*(-?\d+)", stderr)]  # torchrun's report
    assert len(codes) == ranks and set(codes) <= {2, -15} and 2 in codes, stderr
    assert stderr.count(refusal) >= codes.count(2), stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_more_local_ranks_than_gpus_on_a_real_gpu_host():
    """The issue as it was met: plexus.train with one rank more than the host's GPUs. ``auto``
    trains on the CPU and says why (it died of "Duplicate GPU detected"); ``cuda`` exits 2 on
    every rank with the arithmetic, before NCCL starts."""
    gpus = torch.cuda.device_count()
    ranks = gpus + 1
    args = ["-m", "plexus.train", "--epochs", "1", "--hidden", "16", "--grid", f"{ranks}x1x1"]
    auto = launch([*args, "--device", "auto"], ranks=ranks, launcher="torchrun", timeout=300)
    assert auto.returncode == 0, auto.stdout + auto.stderr
    assert f"note: {ranks} local ranks but {gpus} GPU" in auto.stderr, auto.stderr
    assert "Duplicate GPU" not in auto.stderr
    cuda = launch([*args, "--device", "cuda"], ranks=ranks, launcher="torchrun", timeout=300)
    assert cuda.returncode != 0
    refusal = f"error: --device cuda: {ranks} ranks on this node but torch sees {gpus} GPU"
    _every_rank_refused_or_stopped(cuda.stderr, refusal, ranks)
