"""``--cuda-graphs`` without a GPU: asked for on the CPU it is refused with the reason (by the
CLI before any work, exit 2), left to its default it is off; StepGraph's order of warm-up,
capture and replays, and its fallback when a capture fails, against stand-ins for torch.cuda's
streams and graphs. (The capture and
its numbers against the eager step: tests/plexus/test_gpu.py.)"""

import contextlib

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


class _FakeCuda:
    """Stands in for torch.cuda's streams and graphs on a host without CUDA (the real capture
    runs in tests/plexus/test_gpu.py): records what StepGraph asks of them, and a capture that
    raises where ``fail`` says."""

    def __init__(self, log, fail=False):
        self.log, self.fail = log, fail
        outer = self

        class Graph:
            def replay(self):
                outer.log.append("replay")

        class Stream:
            def wait_stream(self, other):
                pass

        class Entered:
            """A context that logs ``name`` on entry; a capture (``fails``) raises as it
            ends, as CUDA does when an operation broke it."""

            def __init__(self, name, fails=False):
                self.name, self.fails = name, fails

            def __enter__(self):
                outer.log.append(self.name)

            def __exit__(self, *exc):
                if self.fails and exc[0] is None:
                    raise RuntimeError("operation not permitted when stream is capturing")
                return False

        self.CUDAGraph, self.Stream, self.current_stream = Graph, Stream, Stream
        self.graph = lambda graph: Entered("capture", fails=outer.fail)
        self.stream = lambda stream: Entered("side stream")
        # (a failed capture leaves its stream current: StepGraph puts the caller's back)
        self.set_stream = lambda stream: outer.log.append("stream put back")


@pytest.mark.parametrize("fail", [None, "capture", "ready"])
def test_the_step_graph_warms_up_captures_once_then_replays(monkeypatch, fail):
    """Two eager steps on a side stream, then the capture (nothing computed: the first replay
    computes that epoch), then a replay an epoch after writing what it reads. A capture that
    fails, or a step that cannot be captured any more when its turn comes (``ready``), warns,
    puts back the state taken before the capture and runs every later step eagerly."""
    from plexus import cuda_graph

    log, state = [], {"cache": "H_0 of the warm-up"}
    monkeypatch.setattr(cuda_graph.torch, "cuda", _FakeCuda(log, fail == "capture"))
    losses = iter(torch.tensor(float(i)) for i in range(10))

    def body():
        log.append("body")
        state["cache"] = "recorded, not computed"  # what a capture may leave behind
        return next(losses)

    def restore(kept):
        log.append("restore")
        state["cache"] = kept

    graph = cuda_graph.StepGraph(body, zero_grad=lambda: log.append("zero_grad"),
                                 before_replay=lambda: log.append("write step"),
                                 keep=lambda: "H_0 of the warm-up", restore=restore,
                                 ready=lambda: "Triton failed" if fail == "ready" else None)
    seen = []
    warns = (pytest.warns(RuntimeWarning, match="could not be captured in a CUDA graph")
             if fail else contextlib.nullcontext())
    with warns:
        for _ in range(4):
            seen.append(float(graph()))
    warm = ["side stream", "zero_grad", "body"] * cuda_graph.WARMUP
    if fail is None:
        assert log == [*warm, "zero_grad", "capture", "body", "write step", "replay",
                       "write step", "replay"]
        assert seen == [0.0, 1.0, 2.0, 2.0]  # the captured loss, read after each replay
        assert graph.replaying and graph.failed is None and graph._kept == "H_0 of the warm-up"
    elif fail == "capture":
        assert log[:len(warm) + 5] == [*warm, "zero_grad", "capture", "body",
                                       "stream put back", "restore"]
        assert log[len(warm) + 5:] == ["zero_grad", "body"] * 2
        assert seen == [0.0, 1.0, 3.0, 4.0]  # the capture's body computed nothing used
        assert not graph.replaying and "not permitted" in graph.failed
    else:
        assert log == [*warm, "zero_grad", "body", "zero_grad", "body"]  # no capture tried
        assert seen == [0.0, 1.0, 2.0, 3.0] and graph.failed == "Triton failed"
