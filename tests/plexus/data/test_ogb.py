"""plexus.data.ogb: the real OGB loaders on tiny files in the exact on-disk format, offline
failures, the Evaluator metric."""

import dataclasses
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from plexus.data import DatasetNotFoundError, load_dataset, ogb
from tests.distributed import ROOT as REPO
from tests.plexus.data.ogb_format import (
    write_arxiv_like,
    write_papers100m_like,
    write_products_like,
)

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
    code = ("from plexus.data import load_dataset, DatasetNotFoundError\n"
            "try:\n    load_dataset('ogbn-papers100M', root=" + repr(str(tmp_path)) + ")\n"
            "except DatasetNotFoundError as e:\n    print('CLEAR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "CLEAR" in out.stdout and "raw/data.npz" in out.stdout
    assert "papers100M-bin.zip" in out.stdout and "(y/N)" not in out.stdout


def test_failed_download_becomes_the_clear_error(tmp_path):
    spec = dataclasses.replace(ogb.OGB_DATASETS["ogbn-arxiv"], url="http://127.0.0.1:9/arxiv.zip")
    start = time.perf_counter()
    with pytest.raises(DatasetNotFoundError, match="Download failed"):
        ogb.download_dataset(spec, tmp_path, ["raw/edge.csv.gz"], timeout_s=5.0)
    assert time.perf_counter() - start < 10.0


# ---------------------------------------------------------------- metric


def test_ogb_accuracy_matches_manual():
    rng = np.random.default_rng(0)
    y_true = rng.integers(0, 40, 500)
    y_pred = np.where(rng.random(500) < 0.7, y_true, rng.integers(0, 40, 500))
    manual = float((y_true == y_pred).mean())
    assert ogb.ogb_accuracy("ogbn-arxiv", y_true.reshape(-1, 1), y_pred.reshape(-1, 1)) == manual
    as_tensors = torch.from_numpy(y_true), torch.from_numpy(y_pred)
    assert ogb.ogb_accuracy("ogbn-arxiv", *as_tensors) == manual
    assert ogb.ogb_accuracy("planted", y_true, torch.from_numpy(y_pred).view(-1, 1)) == manual
    with pytest.raises(ValueError, match="same n > 0"):
        ogb.ogb_accuracy("planted", y_true, y_pred[:10])


def test_a_loader_waits_for_another_that_parses_the_raw_files(tmp_path):
    """The ranks of a job load an in-memory OGB dataset at once, and ogb's loader writes its
    processed/ cache on first use: while one parses (here the test, holding the lock) another
    waits, never reading a half-written cache; then it parses or reads it
    (plexus.data.lock.parse_once; the lock's semantics: tests/plexus/data/test_cache_lock.py)."""
    from plexus.data.lock import preparing_lock

    w = write_arxiv_like(tmp_path, num_nodes=300)
    code = ("import sys, ogb.nodeproppred; from plexus.data import load_dataset; "
            "print('ready', flush=True); "
            "g = load_dataset('ogbn-arxiv', sys.argv[1]); print('nodes', g.num_nodes)")
    cached = w.directory / "processed" / "data_processed"
    with preparing_lock(w.directory / "processed"):
        proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        time.sleep(1.5)
        assert proc.poll() is None and not cached.exists()  # waits for the lock
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert "nodes 300" in out and "Saving..." in out and cached.exists()
