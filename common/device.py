"""Which device a rank computes on: a GPU of its own, or the CPU; never two ranks on one GPU.

Pure (the caller reads the launcher and torch: :func:`common.dist.init_distributed`), so every
case is tested without a GPU (tests/common/test_device.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

__all__ = ["DEVICES", "choose_device", "gpus_bound_to_rank"]

DEVICES = ("auto", "cpu", "cuda")


def choose_device(request: str, *, local_rank: int, local_world_size: int, num_gpus: int,
                  bound: bool = False) -> tuple[torch.device, str]:
    """This rank's device and why: a GPU of its own, or the CPU; never two ranks on one GPU.

    NCCL refuses two ranks on one GPU ("Duplicate GPU detected" at the first collective), so
    ranks use GPUs only when their node has one per rank. Pure: the caller reads the launcher
    and torch (:func:`init_distributed`).

    Args:
        request: ``--device``: ``"auto"``, ``"cpu"`` or ``"cuda"``.
        local_rank, local_world_size: this rank among the ranks of its node.
        num_gpus: the CUDA devices this rank sees (0 without CUDA).
        bound: the launcher gave this rank GPUs of its own (:func:`gpus_bound_to_rank`): the
            ``num_gpus`` it sees are no other rank's, and it takes the first.

    Returns:
        (device, reason). ``"auto"``: ``cuda:<local_rank>`` when the node has a GPU per rank
        (``local_world_size <= num_gpus``), else the CPU and the arithmetic that sent it there
        (``"4 local ranks but 1 GPU: running on CPU ..."``).

    Raises:
        ValueError: an unknown request; ``"cuda"`` without a GPU, or with fewer GPUs than ranks
            on the node (``"4 ranks on this node but torch sees 1 GPU (4 > 1) ..."``).
    """
    if request not in DEVICES:
        raise ValueError(f"unknown device {request!r}; use auto, cpu or cuda")
    if not 0 <= local_rank < local_world_size:
        raise ValueError(f"local rank {local_rank} is not among the {local_world_size} ranks of "
                         "this node: the launcher's local rank and ranks per node disagree "
                         "(LOCAL_RANK vs LOCAL_WORLD_SIZE under torchrun; SLURM_LOCALID vs this "
                         "node's entry of SLURM_STEP_TASKS_PER_NODE under srun)")
    assert num_gpus >= 0, num_gpus
    cpu = torch.device("cpu")
    if request == "cpu":
        return cpu, "--device cpu"
    if num_gpus == 0:
        if request == "cuda":
            raise ValueError("--device cuda was asked for, but torch sees no CUDA device")
        return cpu, "torch sees no CUDA device"
    if bound:
        return torch.device("cuda", 0), f"GPU 0 of the {_count(num_gpus, 'GPU')} bound to the rank"
    if local_world_size <= num_gpus:
        return (torch.device("cuda", local_rank),
                f"local rank {local_rank} of {local_world_size} on GPU {local_rank} of {num_gpus}")
    gpus, at_most = _count(num_gpus, "GPU"), _count(num_gpus, "rank")
    if request == "cuda":
        raise ValueError(
            f"--device cuda: {local_world_size} ranks on this node but torch sees {gpus} "
            f"({local_world_size} > {num_gpus}; NCCL needs one GPU per rank): launch at most "
            f"{at_most} per node, or use --device cpu")
    return cpu, (f"{local_world_size} local ranks but {gpus}: running on CPU (NCCL needs one "
                 f"GPU per rank); launch at most {at_most} per node to use "
                 f"{'it' if num_gpus == 1 else 'them'}, or pass --device cpu")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def gpus_bound_to_rank(num_gpus: int, env: Mapping[str, str] | None = None) -> bool:
    """Whether the launcher bound the GPUs this rank sees to it alone.

    Slurm's ``srun --gpus-per-task N`` (``SLURM_GPUS_PER_TASK``, ``N`` or ``type:N``) binds N
    GPUs to each task, which then sees only its own: all its ranks see ``cuda:0``, each a
    different GPU. A rank that sees more than its N (``--gpu-bind=none``) sees the node's, and
    its local rank picks one.
    """
    env = os.environ if env is None else env
    count = env.get("SLURM_GPUS_PER_TASK", "").rpartition(":")[2]
    return "SLURM_STEP_ID" in env and count.isdigit() and num_gpus == int(count) > 0
