"""Tests of plexus.datasets: generated graphs, the real OGB loaders on tiny files, the metric."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from plexus import ogb_io
from plexus.datasets import (
    DatasetNotFoundError,
    available_datasets,
    load_dataset,
    ogb_accuracy,
    planted_partition,
    rmat_edges,
    rmat_graph,
)
from tests.plexus.ogb_format import (
    write_arxiv_like,
    write_papers100m_like,
    write_products_like,
)

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- planted partition


def _nearest_centroid_acc(h: torch.Tensor, g) -> float:
    """Test accuracy of a nearest-class-mean classifier fitted on the train nodes."""
    means = torch.stack([h[g.train_idx][g.y[g.train_idx] == c].mean(0)
                         for c in range(g.num_classes)])
    pred = torch.cdist(h[g.test_idx], means).argmin(1)
    return float((pred == g.y[g.test_idx]).float().mean())


def test_planted_is_deterministic_fast_and_sized():
    start = time.perf_counter()
    g = planted_partition(seed=5)
    assert time.perf_counter() - start < 1.0
    h = planted_partition(seed=5)
    assert torch.equal(g.edge_index, h.edge_index) and torch.equal(g.x, h.x)
    assert torch.equal(g.y, h.y) and torch.equal(g.train_idx, h.train_idx)
    assert not torch.equal(planted_partition(seed=6).edge_index, g.edge_index)
    assert (g.num_nodes, g.num_features, g.num_classes) == (3000, 64, 8)
    assert [len(g.train_idx), len(g.val_idx), len(g.test_idx)] == [900, 600, 1500]
    assert torch.bincount(g.y).tolist() == [375] * 8
    assert 9.0 < g.num_edges / g.num_nodes <= 10.0  # avg_degree 10 less a few duplicates
    assert g.is_undirected() and not bool((g.edge_index[0] == g.edge_index[1]).any())
    assert abs(g.edge_homophily() - 0.6) < 0.03  # p_in: most edges stay inside the class


def test_planted_is_learnable_mostly_through_the_graph():
    g = planted_partition()
    n = g.num_nodes
    loops = torch.arange(n).repeat(2, 1)
    ei = torch.cat([g.edge_index, loops], 1)
    deg = torch.bincount(ei[1], minlength=n).float()
    w = (deg[ei[0]] * deg[ei[1]]).rsqrt()
    a_hat = torch.sparse_coo_tensor(ei.flip(0), w, (n, n), check_invariants=True)  # t <- s
    h = g.x
    raw = _nearest_centroid_acc(h, g)
    for _ in range(2):
        h = a_hat @ h
    smoothed = _nearest_centroid_acc(h, g)
    assert 0.2 < raw < 0.6 < 0.85 < smoothed, (raw, smoothed)


# ---------------------------------------------------------------- R-MAT


def test_rmat_chunks_are_deterministic_and_independent_of_chunk_size():
    a = list(rmat_edges(10, 8, seed=3, chunk_edges=1000))
    assert all(c.shape == (2, 1000) for c in a[:-1]) and a[-1].shape == (2, 8192 % 1000)
    assert all(c.dtype == np.int64 for c in a)
    whole = np.concatenate(a, axis=1)
    assert whole.shape == (2, 8 * 2**10) and whole.min() >= 0 and whole.max() < 2**10
    for chunk in (1, 777, 1 << 16, 1 << 20):
        assert np.array_equal(np.concatenate(list(rmat_edges(10, 8, 3, chunk_edges=chunk)), 1),
                              whole)
    other = np.concatenate(list(rmat_edges(10, 8, seed=4)), axis=1)
    assert not np.array_equal(other, whole)


def test_rmat_numba_kernel_equals_the_numpy_twin_and_ranges_compose(monkeypatch):
    from plexus import datasets

    fast = np.concatenate(list(rmat_edges(12, 4, seed=7, chunk_edges=3000)), axis=1)
    monkeypatch.setattr(datasets, "_rmat_kernel", lambda: None)  # the numpy arithmetic
    slow = np.concatenate(list(rmat_edges(12, 4, seed=7, chunk_edges=5000)), axis=1)
    assert np.array_equal(fast, slow)
    piece = np.concatenate(list(rmat_edges(12, 4, seed=7, first_edge=1234, num_edges=999,
                                           chunk_edges=100)), axis=1)
    assert np.array_equal(piece, fast[:, 1234:1234 + 999])
    # quadrant frequencies of the top level follow (a, b, c, d) = (.57, .19, .19, .05)
    plain = np.concatenate(list(rmat_edges(12, 16, seed=1, scramble=False)), axis=1)
    top = (plain[0] >> 11) * 2 + (plain[1] >> 11)  # the last level drawn sets the top bit
    freq = np.bincount(top, minlength=4) / plain.shape[1]
    np.testing.assert_allclose(freq, [0.57, 0.19, 0.19, 0.05], atol=0.01)


def test_rmat_degrees_are_skewed_and_scramble_is_a_relabeling():
    edges = np.concatenate(list(rmat_edges(14, 16, seed=0)), axis=1)
    assert edges.shape[1] == 16 * 2**14
    deg = np.bincount(edges.ravel(), minlength=2**14)
    assert deg.max() > 50 * deg.mean()  # power-law hubs
    assert (deg == 0).mean() > 0.1  # and many isolated nodes, as in Graph500
    plain = np.concatenate(list(rmat_edges(14, 16, seed=0, scramble=False)), axis=1)
    plain_deg = np.bincount(plain.ravel(), minlength=2**14)
    assert plain_deg.argmax() == 0 and deg.argmax() != 0  # hubs moved away from id 0
    assert np.array_equal(np.sort(plain_deg), np.sort(deg))  # same graph up to relabeling


def test_rmat_graph_task_has_equal_degree_buckets():
    g = rmat_graph(10, 8, seed=1)
    assert (g.num_nodes, g.num_features, g.num_classes, g.name) == (1024, 128, 32, "rmat-10")
    assert torch.bincount(g.y, minlength=32).tolist() == [32] * 32
    deg = g.in_degree()
    bucket_max = torch.zeros(32, dtype=torch.int64).scatter_reduce(0, g.y, deg, "amax")
    bucket_min = torch.full((32,), 1 << 30).scatter_reduce(0, g.y, deg, "amin")
    assert bool((bucket_max[:-1] <= bucket_min[1:]).all())  # buckets ordered by degree
    assert g.is_undirected() and not bool((g.edge_index[0] == g.edge_index[1]).any())
    assert float(g.x.min()) >= 0.0 and float(g.x.max()) < 1.0
    assert g.num_edges <= 2 * 8 * 1024
    with pytest.raises(ValueError, match="fewer than num_classes=32"):
        rmat_graph(4)


def test_registry_names():
    assert {"planted", "rmat", "ogbn-arxiv", "ogbn-products", "ogbn-papers100M"} <= set(
        available_datasets())
    assert load_dataset("rmat-8", seed=2).num_nodes == 256
    assert load_dataset("planted", seed=1).name == "planted"
    with pytest.raises(ValueError, match="available: planted, rmat"):
        load_dataset("cora")


# ---------------------------------------------------------------- OGB, through the real loader


def _assert_matches(g, w) -> None:
    assert np.array_equal(g.edge_index.numpy(), w.edge_index)
    assert np.array_equal(g.x.numpy(), w.x)
    assert np.array_equal(g.y.numpy(), w.y)
    for ours, theirs in ((g.train_idx, w.train_idx), (g.val_idx, w.valid_idx),
                         (g.test_idx, w.test_idx)):
        assert np.array_equal(ours.numpy(), theirs)


def test_arxiv_like_loads_directed_and_writes_release_marker(tmp_path):
    w = write_arxiv_like(tmp_path, release_file=False)
    g = load_dataset("ogbn-arxiv", tmp_path)
    _assert_matches(g, w)
    assert (g.name, g.num_classes) == ("ogbn-arxiv", 40)
    assert not g.is_undirected()  # direction kept
    assert (w.directory / "RELEASE_v1.txt").exists()
    assert (w.directory / "processed" / "data_processed").exists()
    _assert_matches(load_dataset("ogbn-arxiv", tmp_path), w)  # second load: the torch cache


def test_products_like_loader_adds_inverse_edges(tmp_path):
    w = write_products_like(tmp_path)
    g = load_dataset("ogbn-products", str(tmp_path))
    _assert_matches(g, w)
    assert g.num_classes == 47 and g.is_undirected()
    assert g.num_edges == 2 * int((w.edge_index[0] < w.edge_index[1]).sum())


def test_papers100m_like_maps_nan_labels_to_unlabeled(tmp_path):
    w = write_papers100m_like(tmp_path, labeled_fraction=0.4)
    g = load_dataset("ogbn-papers100M", tmp_path)
    _assert_matches(g, w)
    assert g.num_classes == 172 and not g.is_undirected()
    assert 0 < int((g.y == -1).sum()) < g.num_nodes
    assert bool((g.y[torch.cat([g.train_idx, g.val_idx, g.test_idx])] >= 0).all())
    assert g.edge_homophily() > 0.7  # learnable: the writers plant classes


def test_missing_dataset_fails_fast_with_instructions(tmp_path):
    (tmp_path / "ogbn_arxiv").mkdir()  # a bare dir: ogb itself would ask y/N on stdin
    (tmp_path / "arxiv" / "raw").mkdir(parents=True)  # unzipped but not renamed
    start = time.perf_counter()
    with pytest.raises(DatasetNotFoundError) as info:
        load_dataset("ogbn-arxiv", tmp_path)
    assert time.perf_counter() - start < 1.0
    msg = str(info.value)
    for part in ("raw/edge.csv.gz", "raw/node_year.csv.gz", "split/time/train.csv.gz",
                 "http://snap.stanford.edu/ogb/data/nodeproppred/arxiv.zip",
                 str(tmp_path / "ogbn_arxiv"), "rename it", "download=True"):
        assert part in msg, part
    assert isinstance(info.value, FileNotFoundError)


def test_missing_dataset_in_a_batch_job_with_stdin_closed(tmp_path):
    (tmp_path / "ogbn_papers100M").mkdir()
    code = ("from plexus.datasets import load_dataset, DatasetNotFoundError\n"
            "try:\n    load_dataset('ogbn-papers100M', root=" + repr(str(tmp_path)) + ")\n"
            "except DatasetNotFoundError as e:\n    print('CLEAR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "CLEAR" in out.stdout and "raw/data.npz" in out.stdout
    assert "papers100M-bin.zip" in out.stdout and "(y/N)" not in out.stdout


def test_failed_download_becomes_the_clear_error(tmp_path):
    spec = dataclasses.replace(ogb_io._OGB["ogbn-arxiv"], url="http://127.0.0.1:9/arxiv.zip")
    start = time.perf_counter()
    with pytest.raises(DatasetNotFoundError, match="Download failed"):
        ogb_io._download(spec, tmp_path, ["raw/edge.csv.gz"], timeout_s=5.0)
    assert time.perf_counter() - start < 10.0


# ---------------------------------------------------------------- metric


def test_ogb_accuracy_matches_manual():
    rng = np.random.default_rng(0)
    y_true = rng.integers(0, 40, 500)
    y_pred = np.where(rng.random(500) < 0.7, y_true, rng.integers(0, 40, 500))
    manual = float((y_true == y_pred).mean())
    assert ogb_accuracy("ogbn-arxiv", y_true.reshape(-1, 1), y_pred.reshape(-1, 1)) == manual
    assert ogb_accuracy("ogbn-arxiv", torch.from_numpy(y_true), torch.from_numpy(y_pred)) == manual
    assert ogb_accuracy("planted", y_true, torch.from_numpy(y_pred).view(-1, 1)) == manual
    with pytest.raises(ValueError, match="same n > 0"):
        ogb_accuracy("planted", y_true, y_pred[:10])
