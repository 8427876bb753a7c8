"""plexus.data.pyg: PyG's own dataset classes on tiny raw files in PyG's raw formats, offline
failures, names.

The writers follow what torch_geometric 2.x reads: io/planetoid.py (pickled ind.<name>.* files)
and io/npz.py (the Shchur et al. npz of Amazon/Coauthor/CitationFull).

Shapes: N nodes, F features, C classes.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from plexus.data import (
    DatasetCorruptError,
    DatasetNotFoundError,
    InMemorySource,
    available_datasets,
    load_dataset,
    open_source,
)
from plexus.data.pyg import PYG_DATASETS

NUM_TRAIN, NUM_VAL, NUM_UNLABELED, NUM_TEST = 12, 500, 20, 40  # PyG's Planetoid: 500 val
N, F, C = NUM_TRAIN + NUM_VAL + NUM_UNLABELED + NUM_TEST, 8, 4
PLANETOID_RAW = ("x", "tx", "allx", "y", "ty", "ally", "graph", "test.index")


def write_planetoid(root: Path, name: str = "Cora", seed: int = 0) -> Path:
    """root/<name>/raw/ind.<name>.{x,tx,allx,y,ty,ally,graph,test.index} as Planetoid reads
    them: allx/ally the first N - NUM_TEST nodes (of which x/y the first NUM_TRAIN), tx/ty the
    test nodes in test.index order (shuffled), graph a dict of neighbour lists (with a
    duplicate and a self-loop, which PyG drops)."""
    rng = np.random.default_rng(seed)
    feats = sp.csr_matrix(rng.random((N, F)) * (rng.random((N, F)) < 0.3))
    onehot = np.eye(C)[rng.integers(0, C, N)]
    test_index = rng.permutation(np.arange(N - NUM_TEST, N))
    src, dst = rng.integers(0, N, 3 * N), rng.integers(0, N, 3 * N)
    graph: dict[int, list[int]] = {i: [] for i in range(N)}
    for s, t in zip(src.tolist(), dst.tolist(), strict=True):
        graph[s].append(t)
        graph[t].append(s)
    graph[0] += [0, graph[0][0] if graph[0] else 1]
    n_all = N - NUM_TEST
    items = {"x": feats[:NUM_TRAIN], "y": onehot[:NUM_TRAIN], "allx": feats[:n_all],
             "ally": onehot[:n_all], "tx": feats[test_index], "ty": onehot[test_index],
             "graph": graph}
    raw = root / name / "raw"
    raw.mkdir(parents=True)
    for key, value in items.items():
        with open(raw / f"ind.{name.lower()}.{key}", "wb") as f:
            pickle.dump(value, f)
    np.savetxt(raw / f"ind.{name.lower()}.test.index", test_index, fmt="%d")
    return raw


def write_amazon(root: Path, name: str = "Computers", seed: int = 0) -> Path:
    """root/<Name>/raw/amazon_electronics_<name>.npz: CSR attributes and adjacency, labels."""
    rng = np.random.default_rng(seed)
    n = 60
    attr = sp.csr_matrix((rng.random((n, F)) < 0.3).astype(np.float32))
    adj = sp.csr_matrix((np.ones(150), (rng.integers(0, n, 150), rng.integers(0, n, 150))),
                        shape=(n, n))
    raw = root / name / "raw"
    raw.mkdir(parents=True)
    path = raw / f"amazon_electronics_{name.lower()}.npz"
    np.savez(path, attr_data=attr.data, attr_indices=attr.indices, attr_indptr=attr.indptr,
             attr_shape=attr.shape, adj_data=adj.data, adj_indices=adj.indices,
             adj_indptr=adj.indptr, adj_shape=adj.shape, labels=rng.integers(0, 3, n))
    return path


def test_planetoid_matches_pyg_and_loads_from_the_cache_alone(tmp_path):
    from torch_geometric.datasets import Planetoid

    raw = write_planetoid(tmp_path)
    g = load_dataset("Planetoid/Cora", root=tmp_path)
    data = Planetoid(str(tmp_path), "Cora")[0]
    assert g.x.dtype == torch.float32 and g.y.dtype == torch.int64
    assert torch.equal(g.x, data.x) and torch.equal(g.y, data.y)
    assert torch.equal(g.edge_index, data.edge_index) and g.is_undirected()
    for split in ("train", "val", "test"):
        assert torch.equal(g.mask(split), getattr(data, f"{split}_mask"))
    assert (g.num_nodes, g.num_classes, g.name) == (N, C, "Planetoid/Cora")
    assert (g.train_idx.numel(), g.val_idx.numel(), g.test_idx.numel()) == (12, 500, 40)
    for f in raw.iterdir():  # the processed cache suffices; PyG must not try to download
        f.unlink()
    again = load_dataset("Planetoid/Cora", root=tmp_path, seed=5)
    assert torch.equal(again.edge_index, g.edge_index) and torch.equal(again.test_idx, g.test_idx)


def test_open_source_reads_pyg_names(tmp_path):
    write_planetoid(tmp_path, "PubMed")
    src = open_source("Planetoid/PubMed", root=tmp_path, permutation="none")
    assert isinstance(src, InMemorySource) and src.num_nodes == N


def test_missing_files_name_the_files_folder_and_command(tmp_path):
    with pytest.raises(DatasetNotFoundError) as err:
        load_dataset("Planetoid/CiteSeer", root=tmp_path)
    msg = str(err.value)
    assert f"{tmp_path / 'CiteSeer' / 'raw'} lacks " in msg
    assert all(f"ind.citeseer.{f}" in msg for f in PLANETOID_RAW)
    assert "processed data.pt" in msg
    assert f"Planetoid(\"{tmp_path}\", \"CiteSeer\")" in msg
    assert not (tmp_path / "CiteSeer").exists()  # the check wrote nothing (no PyG makedirs)
    with pytest.raises(DatasetNotFoundError, match=r"(?s)Reddit/raw lacks reddit_data.npz, "
                       r"reddit_graph.npz .*Reddit\(\"\S*/Reddit\"\)"):
        load_dataset("Reddit", root=tmp_path)
    with pytest.raises(DatasetNotFoundError, match=r"Photo/raw lacks amazon_electronics_photo"):
        load_dataset("Amazon/Photo", root=tmp_path)


def test_unreadable_raw_files_are_reported_as_corrupt(tmp_path):
    raw = write_planetoid(tmp_path)
    (raw / "ind.cora.graph").write_bytes(b"not a pickle")
    with pytest.raises(DatasetCorruptError, match=r"Planetoid/Cora under .*delete the processed"):
        load_dataset("Planetoid/Cora", root=tmp_path)


def test_unknown_names_list_the_choices():
    with pytest.raises(ValueError, match="unknown Planetoid dataset 'Planetoid/Corra'; "
                       "choices: Planetoid/Cora, Planetoid/CiteSeer, Planetoid/PubMed"):
        load_dataset("Planetoid/Corra")
    with pytest.raises(ValueError, match="did you mean Amazon/Photo"):
        load_dataset("amazon/photo")
    with pytest.raises(ValueError, match=r"available: .*Planetoid/<Cora\|CiteSeer\|PubMed>"):
        load_dataset("Nope/Cora")
    names = available_datasets()
    assert {"Amazon/<Computers|Photo>", "Coauthor/<CS|Physics>", "Reddit"} <= set(names)
    assert {"Planetoid/Cora", "Coauthor/CS", "Reddit", "WikiCS"} <= set(PYG_DATASETS)


def test_amazon_gets_a_seeded_disjoint_random_split(tmp_path):
    from torch_geometric.datasets import Amazon

    write_amazon(tmp_path)
    a = load_dataset("Amazon/Computers", root=tmp_path, seed=1)
    data = Amazon(str(tmp_path), "Computers")[0]
    assert torch.equal(a.x, data.x) and torch.equal(a.y, data.y)
    assert torch.equal(a.edge_index, data.edge_index) and a.is_undirected()
    b = load_dataset("Amazon/Computers", root=tmp_path, seed=1)
    c = load_dataset("Amazon/Computers", root=tmp_path, seed=2)
    assert all(torch.equal(a.split_idx(s), b.split_idx(s)) for s in ("train", "val", "test"))
    assert not torch.equal(a.train_idx, c.train_idx)
    every = torch.cat([a.train_idx, a.val_idx, a.test_idx])
    assert torch.unique(every).numel() == every.numel() == 60  # disjoint, all labeled nodes
    assert (a.train_idx.numel(), a.val_idx.numel()) == (18, 12)  # 0.3 and 0.2 of 60


def test_single_graph_classes_live_under_their_name_and_keep_their_splits(tmp_path):
    """Reddit (node_types 1/2/3 = train/val/test) and WikiCS (20 split columns: the first)."""
    import json

    rng = np.random.default_rng(0)
    n = 30
    raw = tmp_path / "Reddit" / "raw"
    raw.mkdir(parents=True)
    types = np.arange(n) % 4  # 0: in no split
    np.savez(raw / "reddit_data.npz", feature=rng.random((n, F)), label=rng.integers(0, 3, n),
             node_types=types)
    sp.save_npz(raw / "reddit_graph.npz",
                sp.coo_matrix((np.ones(n), (np.arange(n), (np.arange(n) + 1) % n)), (n, n)))
    reddit = load_dataset("Reddit", root=tmp_path)
    assert reddit.train_idx.tolist() == np.flatnonzero(types == 1).tolist()
    assert reddit.test_idx.tolist() == np.flatnonzero(types == 3).tolist()
    assert reddit.num_edges == n and not reddit.is_undirected()  # as PyG stores it

    raw = tmp_path / "WikiCS" / "raw"
    raw.mkdir(parents=True)
    masks = [[bool((i + s) % 3 == 0) for i in range(n)] for s in range(20)]
    json.dump({"features": rng.random((n, F)).tolist(), "labels": (np.arange(n) % 3).tolist(),
               "links": [[(i + 1) % n] for i in range(n)], "train_masks": masks,
               "val_masks": [[bool((i + s) % 3 == 1) for i in range(n)] for s in range(20)],
               "test_mask": [i % 3 == 2 for i in range(n)], "stopping_masks": masks},
              open(raw / "data.json", "w"))
    wiki = load_dataset("WikiCS", root=tmp_path)
    assert wiki.train_idx.tolist() == list(range(0, n, 3)) and wiki.is_undirected()
    assert wiki.val_idx.tolist() == list(range(1, n, 3))
