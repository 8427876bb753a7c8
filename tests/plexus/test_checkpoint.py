"""plexus.checkpoint: exact resume, loading on another grid, preemption by SIGTERM."""

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from tests.distributed import launch_command, launch_env, needs_mpi, run_ranks
from tests.plexus.test_train import SMALL, cli


def _losses(path):
    return {r["epoch"]: r["loss"] for r in map(json.loads, Path(path).read_text().splitlines())
            if "epoch" in r}


@pytest.mark.slow
def test_resume_is_bit_for_bit(tmp_path):
    args = [*SMALL, "--grid", "1x1x2", "--learn-features"]
    a = cli([*args, "--epochs", "8", "--metrics", str(tmp_path / "a.jsonl")], 2)
    assert a.returncode == 0, a.stderr
    ck = str(tmp_path / "ck")
    b1 = cli([*args, "--epochs", "4", "--checkpoint-dir", ck], 2)
    assert b1.returncode == 0, b1.stderr
    b2 = cli([*args, "--epochs", "8", "--checkpoint-dir", ck, "--resume",
               "--metrics", str(tmp_path / "b.jsonl")], 2)
    assert b2.returncode == 0, b2.stderr
    assert "resumed from the checkpoint of epoch 4" in b2.stdout
    full, resumed = _losses(tmp_path / "a.jsonl"), _losses(tmp_path / "b.jsonl")
    assert sorted(resumed) == [5, 6, 7, 8]
    assert all(resumed[e] == full[e] for e in resumed), (full, resumed)  # exact equality


def _train_and_save(ctx, grid, ck, model):
    from common.grid import ProcessGrid
    from common.run import CheckpointConfig
    from plexus.config import aggregation_of, split_config
    from plexus.data import InMemorySource
    from plexus.data.generators import planted_partition
    from plexus.trainer import train_gcn

    source = InMemorySource(planted_partition(num_nodes=301, seed=2), permutation="double",
                            aggregation=aggregation_of(model["model"]))
    res = train_gcn(source, ProcessGrid.parse(grid), ctx.rank,
                    **split_config(epochs=3, hidden=12, **{"learn_features": True, **model}),
                    checkpoint=CheckpointConfig(dir=ck))
    return _full_logits(res.model)


def _load_and_predict(ctx, grid, ck, model):
    from common.grid import ProcessGrid
    from common.parallel import ParallelState
    from plexus import checkpoint
    from plexus.config import ModelConfig, aggregation_of
    from plexus.data import InMemorySource
    from plexus.data.generators import planted_partition
    from plexus.trainer import shard_and_model

    source = InMemorySource(planted_partition(num_nodes=301, seed=2), permutation="single",
                            seed=9, aggregation=aggregation_of(model["model"]))
    _, net = shard_and_model(source, ParallelState.create(ctx, ProcessGrid.parse(grid)),
                             ModelConfig(hidden=12, **{"learn_features": True, **model}), seed=9)
    opt = torch.optim.AdamW(net.parameters())
    checkpoint.load(ck, net, opt, meta=checkpoint.identity(
        net, source.name, num_edges=source.num_edges, storage=source.storage))
    return _full_logits(net)


def _full_logits(model):
    """Full logits [N, C] in original node order, on every rank."""
    from common import collectives as coll
    from plexus import layout

    model.eval()  # no dropout
    with torch.no_grad():
        logits = model()
    o, _, p = layout.roles(model.num_layers - 1)
    rows = torch.from_numpy(model.shard.out_rows)
    block = coll.all_gather(coll.all_gather(logits, model.groups[o], dim=1), model.groups[p])
    rows = coll.all_gather(rows, model.groups[p])
    out = torch.zeros(model.shard.num_nodes, model.shard.num_classes)
    out[rows[rows >= 0]] = block[rows >= 0, : model.shard.num_classes]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("save_grid, load_grid, model", [
    ("2x2x2", "1x1x1", {"model": "gcn", "norm": "none"}),
    ("2x1x2", "1x2x1", {"model": "sage", "norm": "batch"}),  # root weights, norm statistics
    # attention vectors, W over I only; heads over every layer's I (y, x, z)
    ("1x2x4", "2x1x1", {"model": "gat", "norm": "batch", "heads": 4, "learn_features": False,
                        "attention_dropout": 0.3}),
])
def test_checkpoint_loads_on_another_grid(tmp_path, save_grid, load_grid, model):
    ck = str(tmp_path / "ck")
    world = lambda g: int(torch.tensor([int(s) for s in g.split("x")]).prod())  # noqa: E731
    saved = run_ranks(_train_and_save, world(save_grid), save_grid, ck, model)[0]
    # sharded: one file per rank, none much above its 1/G share (vectors are written once)
    from common import sharded

    manifest = sharded.load_latest(ck).manifest
    sizes = [v["bytes"] for k, v in manifest["files"].items() if k.startswith("shard-")]
    assert len(sizes) == world(save_grid)
    if model["model"] != "gat":  # (GAT's W is whole over O, written once: by its first rank)
        assert max(sizes) < 1.5 * sum(sizes) / len(sizes), sizes
    loaded = run_ranks(_load_and_predict, world(load_grid), load_grid, ck, model)
    for out in loaded:
        err = float((out - saved).norm() / saved.norm())
        assert err < 1e-5, f"{save_grid} -> {load_grid}: outputs differ by {err}"


def _rank_pids(marker):
    """PIDs of the python ranks whose command line contains ``marker`` (not mpiexec/proxies)."""
    out = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    pids = []
    for pid in map(int, out):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmd and Path(cmd[0].decode()).name.startswith("python") and b"plexus.train" in cmd:
            pids.append(pid)
    return pids


@pytest.mark.slow
@needs_mpi
def test_sigterm_checkpoints_and_exits_cleanly(tmp_path):
    ck = str(tmp_path / "preempt-ck")
    from tests.distributed import ROOT

    cmd = launch_command(["-m", "plexus.train", *SMALL, "--epochs", "100000",
                          "--checkpoint-dir", ck], ranks=2)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=launch_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("epoch    3/"):
            break
    pids = _rank_pids(ck)
    assert len(pids) == 2, pids
    for pid in pids:  # as Slurm does: every task gets SIGTERM
        os.kill(pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "preempted (SIGTERM/SIGUSR1): checkpoint written at epoch" in out
    from common import checkpoint as ckpt

    _, manifest, _ = ckpt.load_latest(ck)
    assert manifest["step"] >= 3
    resumed = cli([*SMALL, "--epochs", str(manifest["step"] + 2), "--checkpoint-dir", ck,
                    "--resume"], 2)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from the checkpoint of epoch {manifest['step']}" in resumed.stdout


def test_resume_refuses_another_graph_naming_the_setting(tmp_path):
    """A checkpoint records what made its graph (the seed where it generates or randomly
    splits the dataset, --symmetrize, --normalize-features, the edge count): a resume with
    other settings would continue the weights on another graph of the same name and size."""
    from common.checkpoint import CheckpointError
    from common.grid import ProcessGrid
    from common.parallel import ParallelState
    from common.run import CheckpointConfig
    from plexus.config import split_config
    from plexus.data import open_source
    from plexus.data.registry import _seeded
    from plexus.trainer import Trainer, run

    def trainer(epochs, seed=0, symmetrize=False, normalize=False, resume=False):
        source = open_source("planted", seed=seed, symmetrize=symmetrize)
        return Trainer(source, ParallelState.single(ProcessGrid.plexus(1, 1, 1)),
                       **split_config(epochs=epochs, hidden=8, num_layers=2, seed=seed,
                                      normalize_features=normalize),
                       checkpoint=CheckpointConfig(dir=str(tmp_path), resume=resume))

    run(trainer(3))
    with pytest.raises(CheckpointError, match=r"is from a different graph: .*--seed "
                       r"\(dataset_seed\) 0 != 7, --symmetrize \(symmetrize\) False != True, "
                       r"--normalize-features \(normalize_features\) False != True \(checkpoint "
                       r"!= this run\); resume with the checkpoint's settings"):
        trainer(5, seed=7, symmetrize=True, normalize=True, resume=True).resume()
    with pytest.raises(CheckpointError, match=r"different graph: --normalize-features"):
        trainer(5, normalize=True, resume=True).resume()
    assert trainer(5, resume=True).resume() == 3  # the same graph: resumed
    # the seed counts only where it makes the graph: OGB's and PyG's own splits ignore it
    assert _seeded("planted") and _seeded("rmat-10") and _seeded("x/edges.npy")
    assert _seeded("Amazon/Photo") and not _seeded("Planetoid/Cora")
    assert not _seeded("ogbn-arxiv")
