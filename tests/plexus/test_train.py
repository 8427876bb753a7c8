"""End-to-end training: loss curves across grids, accuracy against PyG, the CLI and its errors."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from plexus.datasets import planted_partition
from tests.distributed import run_ranks

ROOT = Path(__file__).resolve().parents[2]
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent))
needs_mpi = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install mpich)")


def _fit_losses(ctx, grid, epochs, config):
    from common.grid import ProcessGrid
    from plexus.trainer import TrainConfig, train_gcn

    graph = planted_partition(num_nodes=1001, seed=1)  # 1001 = 7*11*13: padding on 2x2x2
    res = train_gcn(graph, ProcessGrid.parse(grid), ctx.rank,
                    TrainConfig(epochs=epochs, **config))
    return [(r["loss"], r["train_acc"], r["test_acc"]) for r in res.history]


def test_loss_curve_8_ranks_matches_1_rank():
    config = dict(hidden=32, layers=3, lr=0.01, learn_features=True, permutation="double")
    serial = run_ranks(_fit_losses, 1, "1x1x1", 50, config)[0]
    parallel = run_ranks(_fit_losses, 8, "2x2x2", 50, config)
    for rank_curve in parallel:  # every rank reports the same (replicated) loss
        for epoch, ((l1, a1, t1), (l8, a8, t8)) in enumerate(zip(serial, rank_curve), 1):
            assert abs(l1 - l8) <= 1e-4 * abs(l1) + 1e-6, f"epoch {epoch}: {l1} vs {l8}"
            assert abs(a1 - a8) <= 2e-3 and abs(t1 - t8) <= 2e-3, f"epoch {epoch}"
    assert serial[-1][0] < 0.5 * serial[0][0]  # it learned


def _pyg_test_acc(graph, epochs, hidden, lr, weight_decay, seed):
    from torch_geometric.nn import GCNConv

    torch.manual_seed(seed)
    convs = torch.nn.ModuleList([
        GCNConv(a, b, bias=False)
        for a, b in zip([graph.num_features, hidden, hidden], [hidden, hidden, graph.num_classes])
    ])
    opt = torch.optim.AdamW(convs.parameters(), lr=lr, weight_decay=weight_decay)
    for _ in range(epochs):
        opt.zero_grad()
        h = graph.x
        for i, conv in enumerate(convs):
            h = conv(h, graph.edge_index)
            h = h.relu() if i < len(convs) - 1 else h
        loss = torch.nn.functional.cross_entropy(h[graph.train_idx], graph.y[graph.train_idx])
        loss.backward()
        opt.step()
    with torch.no_grad():
        h = graph.x
        for i, conv in enumerate(convs):
            h = conv(h, graph.edge_index)
            h = h.relu() if i < len(convs) - 1 else h
    pred = h.argmax(1)
    return float((pred[graph.test_idx] == graph.y[graph.test_idx]).float().mean())


def _our_test_acc(ctx, epochs, hidden, lr, weight_decay, seed):
    from common.grid import ProcessGrid
    from plexus.datasets import load_dataset
    from plexus.trainer import TrainConfig, predictions, train_gcn

    graph = load_dataset("planted")
    res = train_gcn(graph, ProcessGrid.parse("1x1x1"), ctx.rank,
                    TrainConfig(epochs=epochs, hidden=hidden, lr=lr, weight_decay=weight_decay,
                                seed=seed))
    pred = predictions(res)  # after the last step, like the PyG evaluation
    return float((pred[graph.test_idx] == graph.y[graph.test_idx]).float().mean())


def test_accuracy_matches_pyg_gcnconv():
    """Built-in default, same hyper-parameters, mean over 3 seeds: within 1 point of PyG."""
    from plexus.datasets import load_dataset

    hp = dict(epochs=100, hidden=64, lr=0.01, weight_decay=5e-4)
    graph = load_dataset("planted")
    seeds = (0, 1, 2)
    ours = run_ranks(_ours_many, 1, seeds, hp)[0]
    pyg = [_pyg_test_acc(graph, seed=s, **hp) for s in seeds]
    mean_ours, mean_pyg = sum(ours) / len(ours), sum(pyg) / len(pyg)
    print(f"test accuracy ours {mean_ours:.4f} PyG GCNConv {mean_pyg:.4f}")
    assert abs(mean_ours - mean_pyg) <= 0.01, (ours, pyg)
    assert mean_pyg > 2.0 / graph.num_classes  # the task is learnable, far above chance


def _ours_many(ctx, seeds, hp):
    return [_our_test_acc(ctx, seed=s, **hp) for s in seeds]


def _cli(args, n=None, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "plexus.train", *args]
    if n is not None:
        cmd = [MPIEXEC, "-n", str(n), *cmd]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


@needs_mpi
def test_cli_four_ranks_writes_metrics(tmp_path):
    path = tmp_path / "m.jsonl"
    r = _cli(["--epochs", "4", "--hidden", "16", "--metrics", str(path), "--log-every", "2"], 4)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "grid 2x2x1 (4 ranks, mpiexec, gloo)" in r.stdout
    assert r.stdout.count("epoch    4/4") == 1  # only rank 0 prints
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    epochs, summary = lines[:-1], lines[-1]["summary"]
    assert [e["epoch"] for e in epochs] == [1, 2, 3, 4]
    for e in epochs:
        for key in ("loss", "train_acc", "val_acc", "test_acc", "epoch_s", "comm_s",
                    "comm_bytes"):
            assert key in e and e[key] >= 0
        assert e["comm_bytes"] > 0
    assert summary["grid"] == "2x2x1" and summary["world_size"] == 4
    assert not (tmp_path / "m.jsonl.tmp").exists()


@needs_mpi
def test_cli_wrong_grid_fails_on_every_rank():
    r = _cli(["--grid", "2x2x1", "--epochs", "1"], 2, timeout=120)
    assert r.returncode != 0
    msg = re.escape("grid x=2 * y=2 * z=1 = 4 ranks, but 2 processes were launched")
    assert set(re.findall(r"\[rank (\d)\] error: " + msg, r.stderr)) == {"0", "1"}, r.stderr


def test_cli_bad_inputs(tmp_path):
    r = _cli(["--dataset", "cora-typo", "--epochs", "1"], timeout=120)
    assert r.returncode != 0 and "cora-typo" in r.stderr and "planted" in r.stderr
    r = _cli(["--dataset", "ogbn-arxiv", "--root", str(tmp_path), "--epochs", "1"], timeout=120)
    assert r.returncode != 0 and str(tmp_path) in r.stderr, r.stderr
    bad = tmp_path / "missing-dir" / "m.jsonl"
    r = _cli(["--epochs", "1", "--metrics", str(bad)], timeout=120)
    assert r.returncode != 0 and "does not exist" in r.stderr
    assert not bad.parent.exists()


def test_help_lists_the_flags():
    r = _cli(["--help"], timeout=60)
    assert r.returncode == 0
    for flag in ("--dataset", "--root", "--grid", "--layers", "--hidden", "--epochs", "--lr",
                 "--weight-decay", "--seed", "--permutation", "--learn-features", "--metrics",
                 "--device"):
        assert flag in r.stdout


@needs_mpi
def test_ogb_format_datasets_train_through_the_real_loaders(tmp_path):
    """Tiny datasets in exact OGB on-disk format (CSV arxiv-like, npz papers100M-like) load
    through the unmodified ogb loaders, train on 2 ranks, and report OGB Evaluator accuracy."""
    from tests.plexus.ogb_format import write_arxiv_like, write_papers100m_like

    write_arxiv_like(tmp_path, num_nodes=300)
    write_papers100m_like(tmp_path, num_nodes=400)
    for name in ("ogbn-arxiv", "ogbn-papers100M"):
        path = tmp_path / f"{name}.jsonl"
        r = _cli(["--dataset", name, "--root", str(tmp_path), "--epochs", "30", "--hidden", "32",
                  "--grid", "1x1x2", "--metrics", str(path)], 2)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "OGB Evaluator" in r.stdout
        summary = json.loads(path.read_text().splitlines()[-1])["summary"]
        ev = summary["ogb_evaluator"]
        # the Evaluator's accuracy of the final model agrees with our own counting ...
        assert set(ev) == {"train", "val", "test"}
        # ... and the model learned the planted labels
        assert ev["train"] > 0.5, (name, ev)
        assert summary["num_nodes"] == (300 if name == "ogbn-arxiv" else 400)
