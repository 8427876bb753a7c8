"""GPU tests (``pytest -m gpu``; skipped without CUDA): what one GPU can run of plexus, each
compared with the CPU run of the same configuration.

One CUDA rank (torch.sparse CSR SpMM and cuBLAS instead of the numba kernel) follows the CPU run
to floating-point tolerance with every option: GCN and GraphSAGE, batch and layer norm,
residual connections, dropout, trained and normalised features, AdamW with per-layer decay, a
prepared (memory-mapped) dataset whose distinct blocks are uploaded once, a checkpoint saved on
CUDA and resumed on CUDA and on the CPU, ``--runs 2`` (each run's state freed before the next
sets up), and ``fit`` on a PyG ``Data`` that lives on the GPU. In bf16 the dense products run
on the tensor cores (TF32). The CLI's summary reports the
GPU's peak memory beside the resident one. The training step captured in a CUDA graph and
replayed gives the eager step's numbers, with and without dropout.

Several ranks on the one GPU: NCCL refuses two ranks on one device ("Duplicate GPU detected"),
but torch's gloo backend takes CUDA tensors for every collective we use. ProcessGroupGloo
(torch/csrc/distributed/c10d/ProcessGroupGloo.cpp and ProcessGroupGlooCuda.cpp) has CUDA works
for allreduce (staged through pinned host memory, any reduce op; GPUDirect transports: sum),
allgather (which ``all_gather_into_tensor`` is) and broadcast, and implements
``reduce_scatter_tensor`` as an allreduce of a copy followed by a copy of this rank's chunk. So
ranks of a gloo job (:func:`tests.distributed.run_ranks`) placed on cuda:0 run the
tensor-parallel layers on a GPU even when only one is lent, and follow the serial CPU run on
lopsided grids. The command line cannot ask for this yet (common.dist gives CUDA ranks NCCL),
so these tests start the gloo ranks themselves. With two GPUs a 2-rank NCCL run follows the
CPU run too.
"""

import gc
import json
import shutil

import pytest
import torch

from common.grid import ProcessGrid
from common.memory import GPU_PEAK_KEYS
from common.parallel import ParallelState
from common.run import CheckpointConfig
from plexus.config import aggregation_of, split_config
from plexus.data import InMemorySource
from plexus.data.generators import planted_partition
from plexus.trainer import Trainer, run, train_gcn, upload_adjacency
from tests.distributed import launch, run_ranks

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
ARGS = ["-m", "plexus.train", "--epochs", "5", "--hidden", "32", "--learn-features"]


def _cli(tmp_path, tag, args, *, device, ranks=1, grid="1x1x1"):
    """``plexus.train ARGS`` on ``device``: (its metrics rows, its stdout)."""
    path = tmp_path / f"{tag}.jsonl"
    r = launch([*args, "--device", device, "--grid", grid, "--metrics", str(path)],
               ranks=ranks, launcher="single" if ranks == 1 else "torchrun", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return [json.loads(x) for x in path.read_text().splitlines()], r.stdout


def _losses(tmp_path, tag, *, device, ranks=1, grid="1x1x1"):
    rows, _ = _cli(tmp_path, tag, ARGS, device=device, ranks=ranks, grid=grid)
    summary = rows[-1]["summary"]
    assert summary["device"].startswith(device), summary["device"]
    return [row["loss"] for row in rows[:-1]]


def _close(a, b, rel=1e-4):
    return len(a) == len(b) and all(abs(x - y) <= rel * max(abs(x), 1e-8)
                                    for x, y in zip(a, b, strict=True))


@pytest.mark.cross_shape
def test_one_cuda_rank_follows_the_cpu_run(tmp_path):
    cpu = _losses(tmp_path, "cpu", device="cpu")
    gpu = _losses(tmp_path, "gpu", device="cuda")
    assert len(gpu) == 5 and _close(cpu, gpu), (cpu, gpu)


def test_the_summary_reports_the_gpu_peaks_beside_the_resident_one(tmp_path):
    rows, out = _cli(tmp_path, "gpu", ARGS, device="cuda")
    mem = rows[-1]["summary"]["memory_per_rank_max"]
    assert mem["gpu_peak_allocated_bytes"] > 0, mem
    assert mem["gpu_peak_reserved_bytes"] >= mem["gpu_peak_allocated_bytes"], mem
    assert mem["gpu_peak_allocated_bytes_after_setup"] > 0, mem
    assert "MiB resident per rank (max); GPU " in out and "MiB reserved per rank (max)" in out
    rows, out = _cli(tmp_path, "cpu", ARGS, device="cpu")
    mem = rows[-1]["summary"]["memory_per_rank_max"]
    assert not any(k in mem for k in GPU_PEAK_KEYS) and "GPU" not in out


# every model option on one GPU, in this process (no process group: every group has size 1)
OPTIONS = {
    "gcn-trained-features": dict(learn_features=True, dropout=0.0),
    "sage": dict(model="sage", bias=True),
    "batch-norm": dict(norm="batch", bias=True),
    "layer-norm": dict(norm="layer", bias=True),
    "residual": dict(residual=True, num_layers=4, norm="batch"),
    "normalized-features-adamw": dict(normalize_features=True, optimizer="adamw",
                                      weight_decay=(5e-4, 0.0, 0.0)),
    # bf16 H and features: the GPU's SpMM reads them as bf16 (plexus.spmm_triton)
    "bf16": dict(precision="bf16", dropout=0.0),
    # with dropout: layer 0's bf16 features masked from the kept key (no read back)
    "bf16-dropout": dict(precision="bf16", dropout=0.5),
}
# bf16 keeps H rounded to bf16: a sum that lands on another side of a rounding boundary on
# the GPU than on the CPU moves that entry by 2^-8 of itself, which the loss averages down
RELATIVE = {"bf16": 1e-2, "bf16-dropout": 1e-2}


def _train(device, *, source=None, epochs=5, **options):
    graph = planted_partition(num_nodes=301, seed=4)
    cfg = {"num_layers": 3, "hidden": 16, "lr": 0.01, "epochs": epochs, **options}
    source = source or InMemorySource(graph, aggregation=aggregation_of(cfg.get("model",
                                                                                "gcn")))
    res = train_gcn(source, ProcessGrid.plexus(1, 1, 1), 0, device=device, **split_config(**cfg))
    assert next(res.model.parameters()).device.type == torch.device(device).type
    # as planned: no CUDA graph capture (epoch 3 on, with dropout) or Triton kernel failed
    assert res.info["fallbacks"] == [], res.info["fallbacks"]
    return [r["loss"] for r in res.history]


@pytest.mark.cross_shape
@pytest.mark.parametrize("name", OPTIONS)
def test_every_model_option_on_cuda_follows_the_cpu_run(name):
    """... and runs as planned there (:func:`_train`: nothing fell back)."""
    cpu, gpu = _train("cpu", **OPTIONS[name]), _train("cuda", **OPTIONS[name])
    assert len(gpu) == 5 and _close(cpu, gpu, rel=RELATIVE.get(name, 1e-3)), (name, cpu, gpu)


def _waits_of_an_epoch(**options):
    """Where an epoch's synchronizing CUDA operations were called (torch's sync debug mode),
    after a first epoch has made what later ones reuse."""
    import warnings

    cfg = split_config(**{"num_layers": 3, "hidden": 16, "lr": 0.01, "epochs": 2, **options})
    parallel = ParallelState.for_rank(ProcessGrid.plexus(1, 1, 1), 0, transport=None,
                                      device=torch.device("cuda", 0))
    trainer = Trainer(InMemorySource(planted_partition(num_nodes=301, seed=4)), parallel, **cfg)
    trainer.train_step()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            trainer.train_step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return [f"{w.filename}:{w.lineno}" for w in seen if "synchroniz" in str(w.message)]


@pytest.mark.parametrize("options", [{}, {"learn_features": True},
                                     {"dropout": 0.0, "learn_features": False},
                                     {"precision": "bf16"}],
                         ids=["fixed-dropout", "learned-dropout", "fixed-no-dropout",
                              "bf16-fixed-dropout"])
def test_an_epoch_on_cuda_waits_for_the_gpu_once(options):
    """Only the loss's ``.item()`` waits for the GPU: a copy from host memory in the middle
    of an epoch (the ReLU's bit shifts, a dropout mask drawn on the host) made the host wait
    for the GPU's queue to drain each time, four or more times an epoch, so the host could
    not queue the next kernels while the GPU ran the last ones."""
    waits = _waits_of_an_epoch(**options)
    assert len(waits) == 1, waits


def _graphed_run(cuda_graphs, epochs=6, **options):
    """(losses, evaluated accuracies, the trainer) of a one-GPU run with ``cuda_graphs``."""
    cfg = split_config(**{"num_layers": 3, "hidden": 16, "lr": 0.01, "epochs": epochs,
                          "cuda_graphs": cuda_graphs, **options})
    parallel = ParallelState.for_rank(ProcessGrid.plexus(1, 1, 1), 0, transport=None,
                                      device=torch.device("cuda", 0))
    trainer = Trainer(InMemorySource(planted_partition(num_nodes=301, seed=4)), parallel, **cfg)
    history = run(trainer)
    return ([r["loss"] for r in history], [r.get("val_acc") for r in history], trainer)


@pytest.mark.parametrize("options", [{"dropout": 0.5}, {"dropout": 0.5, "learn_features": True},
                                     {"dropout": 0.0}],
                         ids=["fixed-dropout", "learned-dropout", "fixed-no-dropout"])
def test_the_captured_step_gives_the_eager_steps_numbers(options):
    """From the capture on, each epoch is one replay: the masks of each epoch's step (read
    from device memory), the cached first aggregation (no dropout), evaluation between
    replays: the numbers of the eager run."""
    from plexus.cuda_graph import WARMUP

    eager, eager_acc, off = _graphed_run(False, **options)
    graphed, graphed_acc, on = _graphed_run(True, **options)
    assert off.graph is None and on.graph.replaying and on.graph.failed is None
    assert on.graph.eager_steps == WARMUP
    assert len(graphed) == 6 and _close(eager, graphed, rel=1e-6), (eager, graphed)
    assert eager_acc == graphed_acc
    assert len(set(graphed[WARMUP:])) == len(graphed) - WARMUP  # it trains on


def test_cuda_graphs_are_on_by_default_and_off_where_the_masks_cannot_follow(monkeypatch):
    _, _, trainer = _graphed_run(None, epochs=3)
    assert trainer.graph is not None and trainer.graph.replaying
    monkeypatch.setenv("PLEXUS_TRITON", "0")  # the torch hash: its step is a host number
    _, _, trainer = _graphed_run(None, epochs=1)
    assert trainer.graph is None
    with pytest.raises(ValueError, match="with Triton's kernels"):
        _graphed_run(True, epochs=1)
    _, _, trainer = _graphed_run(None, epochs=1, dropout=0.0)  # no masks: no need
    assert trainer.graph is not None


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_bf16_on_cuda_runs_the_dense_products_on_tensor_cores(dropout, monkeypatch):
    """In bf16 on a GPU every dense product of the step (``H W``, ``dQ W^T``, ``dW``, layer
    0's remade ones with dropout) runs in TF32 (common.dense's ``tf32``: a bf16 ``H`` is exact
    there), the setting put back after each; float32 keeps torch's default."""
    from common import dense

    seen = []
    real = dense.tensor_cores
    monkeypatch.setattr(dense, "tensor_cores",
                        lambda backend, t: seen.append((backend, t.device.type))
                        or real(backend, t))
    matmul = torch.backends.cuda.matmul
    before = getattr(matmul, "fp32_precision", None)
    _train("cuda", epochs=2, precision="bf16", dropout=dropout)
    assert seen and set(seen) == {("tf32", "cuda")}, set(seen)
    assert getattr(matmul, "fp32_precision", None) == before
    seen.clear()
    _train("cuda", epochs=2, dropout=dropout)
    assert seen and {backend for backend, _ in seen} == {"auto"}


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_bf16_on_cuda_gathers_bf16_rows_in_every_layer(dropout, monkeypatch):
    """In bf16 on a GPU every forward SpMM reads bf16 rows (the features, and each later
    layer's ``F'`` or ``F' W`` rounded as the SpMM reads it), every backward one a float32
    gradient."""
    from plexus.sparse import BlockSparse
    from plexus.transpose import TransposedSparse

    read = set()
    for cls, which in ((BlockSparse, "A"), (TransposedSparse, "A^T")):
        monkeypatch.setattr(cls, "matmul", lambda self, x, real=cls.matmul, which=which, **kw:
                            read.add((which, x.dtype)) or real(self, x, **kw))
    _train("cuda", epochs=3, precision="bf16", dropout=dropout, cuda_graphs=False)
    assert read == {("A", torch.bfloat16), ("A^T", torch.float32)}, read


@pytest.mark.cross_shape
def test_a_prepared_dataset_uploads_each_block_once_and_follows_the_cpu_run(tmp_path):
    """Three layers on 1x1x1 use the blocks of two matrices (one, transposed, for a symmetric
    graph): the upload costs the distinct blocks' bytes once, the layers share them, and no
    host array is left behind."""
    from plexus.data import PreparedGraph
    from plexus.data.sources import graph_source
    from plexus.data.writer import prepare

    graph = planted_partition(num_nodes=301, seed=4)
    prepare(graph_source(graph), tmp_path / "p", blocks=2, quiet=True)
    source = PreparedGraph(tmp_path / "p")
    grid = ProcessGrid.plexus(1, 1, 1)
    shard = source.shard(grid.shape, grid.coords(0),
                         [graph.num_features, 16, 16, graph.num_classes])
    host_bytes = shard.adjacency_bytes()  # every distinct file once
    num_blocks = len(list(shard.adj[0].a.present()))  # 2x2 file blocks; A and A^T: twice that
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    upload_adjacency(shard, torch.device("cuda", 0))
    grown = torch.cuda.memory_allocated() - before
    assert grown <= host_bytes + 2 * 3 * 512 * num_blocks, (grown, host_bytes)  # + rounding
    for lay in (0, 1, 2):
        for m in (shard.adj[lay].a, shard.adj[lay].a_t._copy):
            assert all(b.indptr.is_cuda for _, _, b in m.present())
    for key, t in shard.adj[0].a._torch.items():
        assert shard.adj[2].a._torch[key] is t
    assert shard.adjacency_bytes() == host_bytes
    cpu = _train("cpu", source=PreparedGraph(tmp_path / "p"))
    gpu = _train("cuda", source=PreparedGraph(tmp_path / "p"))
    assert _close(cpu, gpu, rel=1e-3), (cpu, gpu)


def _trainer(device, epochs, directory, resume=False):
    source = InMemorySource(planted_partition(num_nodes=301, seed=4))
    parallel = ParallelState.single(ProcessGrid.plexus(1, 1, 1), device=device)
    return Trainer(source, parallel, **split_config(epochs=epochs, hidden=16, lr=0.01,
                                                    norm="batch", learn_features=True),
                   checkpoint=CheckpointConfig(dir=directory, resume=resume))


@pytest.mark.cross_shape
def test_a_checkpoint_saved_on_cuda_resumes_on_cuda_and_on_the_cpu(tmp_path):
    straight = _trainer("cuda", 6, None)
    run(straight)
    first = _trainer("cuda", 3, str(tmp_path / "a"))
    run(first)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    for device, directory in (("cuda", "a"), ("cpu", "b")):
        again = _trainer(device, 6, str(tmp_path / directory), resume=True)
        assert again.resume() == 3
        run(again)
        got = [r["loss"] for r in again.history]
        want = [r["loss"] for r in straight.history]
        assert _close(want, got, rel=1e-3), (device, want, got)
        assert again.model.weights[0].device.type == device


def _watched_runs(ctx, argv):
    """plexus.train with ``--runs``, watched at every set-up: the earlier runs' models still
    alive (weak references) and the number of live CUDA tensors."""
    import weakref

    import plexus.train as cli

    seen, refs = [], []

    class Watched(cli.Trainer):
        def __init__(self, *args, **kwargs):
            live = sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.is_cuda)
            seen.append(([ref() is not None for ref in refs], live))
            super().__init__(*args, **kwargs)
            refs.append(weakref.ref(self.model))

    cli.Trainer = Watched
    try:
        assert cli.main(argv) == 0
    finally:
        cli.Trainer = Watched.__base__
    return seen


@pytest.mark.cross_shape
def test_runs_on_cuda_follow_the_cpu_runs_and_free_each_run_first(tmp_path):
    args = [*ARGS, "--runs", "2"]
    rows = {d: _cli(tmp_path, d, args, device=d)[0] for d in ("cpu", "cuda")}
    for i in range(2):
        cpu, gpu = ([r["loss"] for r in rows[d] if r.get("run") == i and "loss" in r]
                    for d in ("cpu", "cuda"))
        assert len(gpu) == 5 and _close(cpu, gpu), (i, cpu, gpu)
    assert rows["cuda"][-1]["runs_summary"]["runs"] == 2
    argv = [*ARGS[2:], "--runs", "3", "--device", "cuda", "--log-every", "100"]
    (seen,) = run_ranks(_watched_runs, 1, argv)
    assert [alive for alive, _ in seen] == [[], [False], [False, False]], seen
    assert seen[1][1] == seen[2][1], seen  # nothing piles up from run to run


def _pyg(device):
    from torch_geometric.data import Data

    g = planted_partition(num_nodes=301, seed=4)
    masks = {f"{s}_mask": g.mask(s) for s in ("train", "val", "test")}
    return Data(x=g.x, y=g.y, edge_index=g.edge_index, **masks).to(device)


def _fit_on(ctx, device, grid):
    from plexus import fit

    data = _pyg(device)
    res = fit(data, grid=grid, epochs=5, num_layers=2, hidden=16, lr=0.05)
    return ([r["loss"] for r in res.history], str(next(res.model.parameters()).device),
            data.x.device.type)


@pytest.mark.cross_shape
def test_fit_takes_a_pyg_data_on_cuda_and_trains_there():
    (cpu, cpu_dev, _), = run_ranks(_fit_on, 1, "cpu", "1x1x1")
    (gpu, gpu_dev, data_dev), = run_ranks(_fit_on, 1, "cuda", "1x1x1")
    assert cpu_dev == "cpu" and gpu_dev.startswith("cuda") and data_dev == "cuda"
    assert _close(cpu, gpu, rel=1e-3), (cpu, gpu)
    shared = run_ranks(_fit_on, 2, "cuda", "1x1x2")  # two gloo ranks on the one GPU
    for losses, dev, _ in shared:
        assert dev.startswith("cuda") and _close(cpu, losses, rel=1e-3), (cpu, losses)


def test_flat_shards_and_shard_maps_stay_on_cuda():
    from common import flat
    from plexus import shards

    block = torch.arange(15.0, device="cuda").view(3, 5)
    assert flat.flat_shard(block, 2, 1).is_cuda
    grid = ProcessGrid.plexus(1, 1, 1)
    shard = InMemorySource(planted_partition(num_nodes=97, seed=3)).shard(
        grid.shape, grid.coords(0), [4, 8, 3])
    groups = grid.create_groups(0, None, transport=None)
    for spec in shards.shard_maps(shard).values():
        full = torch.randn(spec.shape, device="cuda")
        local = shards.shard(full, spec, groups)
        assert local.is_cuda and torch.equal(shards.gather(local, spec, groups), full)


# several ranks sharing the one GPU over gloo (module docstring)
SHARED = {"1x2x2": dict(learn_features=True, norm="batch", dropout=0.0),
          "2x1x2": dict(model="sage", norm="layer", residual=True, num_layers=4)}


def _train_on_cuda0(ctx, grid, options):
    import torch.distributed as dist

    graph = planted_partition(num_nodes=301, seed=4)  # 301 = 7 * 43: every grid pads
    cfg = {"num_layers": 3, "hidden": 16, "lr": 0.01, "epochs": 5, **options}
    source = InMemorySource(graph, aggregation=aggregation_of(cfg.get("model", "gcn")))
    res = train_gcn(source, ProcessGrid.parse(grid), ctx.rank, device=torch.device("cuda", 0),
                    transport=ctx.transport, **split_config(**cfg))
    devices = {str(t.device) for _, t, _, _ in res.model.sharded_state()}
    return [r["loss"] for r in res.history], devices, dist.get_backend()


@pytest.mark.cross_shape
@pytest.mark.parametrize("grid", SHARED)
def test_ranks_sharing_one_gpu_over_gloo_follow_the_serial_cpu_run(grid):
    serial = _train("cpu", **SHARED[grid])
    for losses, devices, backend in run_ranks(_train_on_cuda0, 4, grid, SHARED[grid]):
        assert backend == "gloo" and devices == {"cuda:0"}, (backend, devices)
        assert _close(serial, losses, rel=1e-3), (grid, serial, losses)


@pytest.mark.cross_shape
@pytest.mark.parametrize("grid", SHARED)
def test_the_overlapped_aggregation_on_cuda_gives_the_bits_of_the_blocked_one(grid):
    """Issue 28's overlap on CUDA tensors: each row block's all-reduce (2), (7) and the weight
    all-gathers (3) in flight (async gloo works on cuda:0) while the next block computes give
    the same bits as the same blocks run synchronously, and follow the serial CPU run."""
    serial = _train("cpu", **SHARED[grid])
    runs = {overlap: run_ranks(_train_on_cuda0, 4, grid,
                               {**SHARED[grid], "overlap": overlap, "aggregation_blocks": 3})
            for overlap in (True, False)}
    for (on, devices, _), (off, _, _) in zip(runs[True], runs[False], strict=True):
        assert devices == {"cuda:0"} and on == off, (grid, on, off)
        assert _close(serial, on, rel=1e-3), (grid, serial, on)


@pytest.mark.cross_shape
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_nccl_ranks_follow_one_cpu_rank(tmp_path):
    cpu = _losses(tmp_path, "cpu", device="cpu")
    gpu = _losses(tmp_path, "gpu2", device="cuda", ranks=2, grid="1x1x2")
    assert _close(cpu, gpu), (cpu, gpu)
