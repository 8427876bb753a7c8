"""``--cuda-graphs`` without a GPU: asked for on the CPU it is refused with the reason (by the
CLI before any work, exit 2), left to its default it is off. (The capture and
its numbers against the eager step: tests/plexus/test_gpu.py.)"""

import pytest
import torch

from common.grid import ProcessGrid
from common.parallel import ParallelState
from plexus.config import split_config
from plexus.data import InMemorySource
from plexus.data.generators import planted_partition
from plexus.train import parse_args
from plexus.trainer import Trainer
from tests.distributed import launch


def _trainer(cuda_graphs):
    parallel = ParallelState.for_rank(ProcessGrid.plexus(1, 1, 1), 0, transport=None,
                                      device=torch.device("cpu"))
    return Trainer(InMemorySource(planted_partition(num_nodes=60, seed=1)), parallel,
                   **split_config(num_layers=2, hidden=8, epochs=1, cuda_graphs=cuda_graphs))


def test_cuda_graphs_on_the_cpu_are_refused_when_asked_and_off_by_default():
    with pytest.raises(ValueError, match="--cuda-graphs: it needs a CUDA device"):
        _trainer(True)
    assert _trainer(None).graph is None and _trainer(False).graph is None


def test_the_cli_parses_the_flag_and_refuses_it_on_the_cpu_before_any_work():
    for argv, want in (([], None), (["--cuda-graphs"], True), (["--no-cuda-graphs"], False)):
        assert parse_args(argv).cuda_graphs is want, argv
    r = launch(["-m", "plexus.train", "--cuda-graphs", "--epochs", "1", "--device", "cpu"],
               launcher="single", timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--cuda-graphs: it needs a CUDA device; drop the flag" in r.stderr
    assert "Traceback" not in r.stderr and "epoch" not in r.stdout
