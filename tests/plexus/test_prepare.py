"""Streaming preparation (plexus.prepare) and sharded loading (plexus.prepared).

The prepared path must give every rank exactly the blocks, features, labels and masks the
in-memory path builds (same permutations when the in-memory run pads to the same k), for
every layer layout of many grids, for symmetric and directed graphs with multi-edges and
padding; training on it must give the same losses bit for bit.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from common.grid import ProcessGrid
from plexus.datasets import planted_partition, rmat_graph
from plexus.graph import Graph
from plexus.ogb_io import DatasetCorruptError
from plexus.prepare import prepare, verify
from plexus.prepared import PreparedGraph
from plexus.shard import SPLITS, shard_graph
from plexus.sources import edge_file_source, graph_source, rmat_source
from plexus.sparse import BlockSparse, CSRBlock
from plexus.trainer import TrainConfig, train_gcn
from tests.distributed import run_ranks

ROOT = Path(__file__).resolve().parents[2]
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent))
GRIDS = ["1x1x1", "2x1x1", "1x2x1", "1x1x2", "2x2x1", "1x2x4", "4x1x2", "2x2x2"]


def directed_graph(n=203, e=1500, seed=5):
    """Directed, with self-loops, duplicate edges, unlabeled nodes; 203 nodes pad to 208."""
    rng = np.random.default_rng(seed)
    ei = rng.integers(0, n, (2, e))
    ei[:, :40] = ei[:, 40:80]  # 40 duplicated edges
    ei[1, 80:90] = ei[0, 80:90]  # 10 self-loops
    y = rng.integers(-1, 6, n)
    return Graph.from_edge_index(ei, rng.standard_normal((n, 9)), y, num_classes=6,
                                 name="directed")


def assert_same_shard(a, b):
    assert a.num_nodes_padded == b.num_nodes_padded
    assert a.widths_padded == b.widths_padded
    assert np.array_equal(a.pr, b.pr) and np.array_equal(a.pc, b.pc)
    assert sorted(a.adj) == sorted(b.adj)
    for layer in a.adj:
        for m in ("a", "a_t"):
            x, y = getattr(a.adj[layer], m).to_scipy(), getattr(b.adj[layer], m).to_scipy()
            assert x.shape == y.shape
            d = (x != y)
            assert d.nnz == 0, f"layer {layer} {m}: {d.nnz} entries differ"
            assert x.nnz == y.nnz
        assert a.adj[layer].balance == b.adj[layer].balance
    assert torch.equal(a.features_block, b.features_block)
    assert torch.equal(a.labels, b.labels)
    for s in SPLITS:
        assert torch.equal(a.masks[s], b.masks[s])
    assert a.split_counts == b.split_counts
    assert np.array_equal(a.out_rows, b.out_rows)


@pytest.mark.parametrize("kind", ["planted", "directed"])
@pytest.mark.parametrize("permutation", ["none", "double"])
def test_every_rank_maps_the_blocks_the_in_memory_path_builds(tmp_path, kind, permutation):
    graph = (planted_partition(num_nodes=203, num_classes=5, num_features=7, avg_degree=5,
                               seed=3) if kind == "planted" else directed_graph())
    k = 8
    m = prepare(graph_source(graph, chunk_edges=333), tmp_path / "p", blocks=k,
                permutation=permutation, seed=4, quiet=True)
    assert m["symmetric"] == (kind == "planted")
    assert m["multi_edges"] == (kind == "directed")
    assert (tmp_path / "p" / "odd").is_dir() == (kind == "directed")
    pg = PreparedGraph(tmp_path / "p")
    for spec in GRIDS:
        grid = ProcessGrid.parse(spec)
        for rank in range(grid.num_ranks):
            coords = grid.coords(rank)
            for layers in (3, 6):  # 6: every (roles, parity) layout
                mem = shard_graph(graph, grid.shape, coords, num_layers=layers, hidden=6,
                                  permutation=permutation, seed=4, pad_multiple=k)
                got = pg.shard(grid.shape, coords, num_layers=layers, hidden=6)
                assert_same_shard(got, mem)


def test_rmat_stream_gives_the_in_memory_rmat_graph(tmp_path):
    m = prepare(rmat_source(10, 8, seed=1, num_features=16, chunk_edges=1000,
                            tmp_dir=tmp_path), tmp_path / "r", blocks=4, seed=2, quiet=True)
    g = rmat_graph(10, 8, seed=1, num_features=16)
    assert (m["num_nodes"], m["num_edges"]) == (g.num_nodes, g.num_edges)
    assert m["edges_read"] == 8 * 1024 and m["symmetric"] and not m["multi_edges"]
    pg = PreparedGraph(tmp_path / "r")
    shape = {"x": 2, "y": 1, "z": 2}
    grid = ProcessGrid.plexus(2, 1, 2)
    for rank in range(4):
        mem = shard_graph(g, shape, grid.coords(rank), num_layers=3, hidden=8, seed=2,
                          pad_multiple=4)
        assert_same_shard(pg.shard(shape, grid.coords(rank), num_layers=3, hidden=8), mem)
    assert not list(tmp_path.glob("features-*.npy"))  # temporary feature file removed


def test_prepared_training_equals_in_memory_bit_for_bit(tmp_path):
    graph = directed_graph()
    prepare(graph_source(graph), tmp_path / "p", blocks=4, seed=0, quiet=True)
    cfg = TrainConfig(epochs=4, hidden=8, layers=3, lr=0.05, pad_multiple=4)
    results = run_ranks(_losses_both, 4, str(tmp_path / "p"), graph, cfg)
    mem, prep = results[0]
    assert mem == prep and len(mem) == 4 and mem[0] > mem[-1]


def _losses_both(ctx, path, graph, cfg):
    grid = ProcessGrid.parse("1x2x2")
    mem = train_gcn(graph, grid, ctx.rank, cfg).history
    prep = train_gcn(PreparedGraph(path), grid, ctx.rank, cfg).history
    return [r["loss"] for r in mem], [r["loss"] for r in prep]


def test_edge_file_in_either_layout_and_clear_errors(tmp_path):
    rng = np.random.default_rng(0)
    ei = rng.integers(0, 100, (2, 700))
    np.save(tmp_path / "e2.npy", ei.astype(np.int32))
    np.save(tmp_path / "e1.npy", ei.T.copy())
    ms = [prepare(edge_file_source(tmp_path / f, 100, num_features=4, num_classes=3,
                                   tmp_dir=tmp_path), tmp_path / f"o{f}", blocks=2, quiet=True)
          for f in ("e2.npy", "e1.npy")]
    assert ms[0]["block_nnz"] == ms[1]["block_nnz"] and not ms[0]["symmetric"]
    assert sorted(ms[0]["block_nnz"]) == ["even", "odd"]
    # ids beyond --num-nodes: clear error, nothing left behind
    with pytest.raises(ValueError, match=r"edge ids must be in \[0, 50\).*--num-nodes"):
        prepare(edge_file_source(tmp_path / "e2.npy", 50, num_classes=3, tmp_dir=tmp_path),
                tmp_path / "bad", blocks=2, quiet=True)
    assert not (tmp_path / "bad").exists() and not (tmp_path / "bad.partial").exists()
    np.save(tmp_path / "f.npy", rng.random((3, 3)))
    with pytest.raises(ValueError, match="expected integers shaped"):
        edge_file_source(tmp_path / "f.npy", 10)


def test_existing_output_is_never_overwritten_without_force(tmp_path):
    graph = directed_graph(n=50, e=200)
    out = tmp_path / "p"
    prepare(graph_source(graph), out, blocks=2, quiet=True)
    before = (out / "manifest.json").read_bytes()
    with pytest.raises(FileExistsError, match="--force"):
        prepare(graph_source(graph), out, blocks=2, permutation="none", quiet=True)
    assert (out / "manifest.json").read_bytes() == before
    m = prepare(graph_source(graph), out, blocks=2, permutation="none", force=True, quiet=True)
    assert m["permutation"] == "none" and json.loads((out / "manifest.json").read_text()) == m


def test_damage_is_detected(tmp_path):
    out = tmp_path / "p"
    prepare(graph_source(directed_graph(n=60, e=300)), out, blocks=2, quiet=True)
    assert verify(out) == []
    vals = out / "even" / "1_0" / "values.npy"
    raw = bytearray(vals.read_bytes())
    raw[-1] ^= 0xFF
    vals.write_bytes(raw)
    assert verify(out) == ["even/1_0/values.npy"]
    r = subprocess.run([sys.executable, "-m", "plexus.prepare", "--verify", str(out)],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 1 and "even/1_0/values.npy" in r.stdout
    (out / "even" / "0_1" / "indices.npy").write_bytes(b"\x93NUMPY")  # truncated
    pg = PreparedGraph(out)
    with pytest.raises(DatasetCorruptError, match="--verify"):
        pg.shard({"x": 1, "y": 1, "z": 1}, {"x": 0, "y": 0, "z": 0}, num_layers=2, hidden=4)
    with pytest.raises(ValueError, match=r"do not divide the 2x2 blocks.*\[1, 2\]"):
        pg.check_grid({"x": 4, "y": 1, "z": 1})
    with pytest.raises(ValueError, match="prepared with --permutation double"):
        pg.check_config("single")
    with pytest.raises(FileNotFoundError, match="python -m plexus.prepare"):
        PreparedGraph(tmp_path)


def test_block_sparse_matmul_matches_scipy(monkeypatch):
    rng = np.random.default_rng(0)
    row_sizes, col_sizes = [5, 0, 7], [4, 6]
    blocks = [[None, CSRBlock.from_scipy(sp.random(5, 6, 0.4, format="csr", random_state=1))],
              [None, None],
              [CSRBlock.from_scipy(sp.random(7, 4, 0.3, format="csr", random_state=2)), None]]
    m = BlockSparse(blocks, row_sizes, col_sizes)
    full = m.to_scipy().toarray()
    for dtype in (torch.float32, torch.float64):
        x = torch.from_numpy(rng.standard_normal((10, 3))).to(dtype)
        want = full @ x.double().numpy()
        for backend in ("numba", "torch"):
            monkeypatch.setenv("PLEXUS_SPMM", backend)
            got = m.matmul(x)
            assert got.dtype == dtype
            np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-5, atol=1e-6)
    wide = sp.random(3, 5, 0.5, format="csr", random_state=3)
    one = CSRBlock(wide.indptr.astype(np.int64), wide.indices.astype(np.int64),
                   wide.data.astype(np.float32), (3, 5))
    np.testing.assert_allclose(BlockSparse([[one]], [3], [5]).matmul(torch.ones(5, 2)).numpy(),
                               wide @ np.ones((5, 2)), rtol=1e-6)
    with pytest.raises(ValueError, match="has shape"):
        BlockSparse([[one]], [4], [5])


needs_mpi = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install mpich)")


@needs_mpi
def test_cli_prepares_and_trains_and_rejects_a_grid_that_does_not_divide_k(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = tmp_path / "planted-k4"
    r = subprocess.run([sys.executable, "-m", "plexus.prepare", "--source", "planted",
                        "--out", str(out), "--blocks", "4"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "in 4x4 blocks" in r.stdout and "1/4 bucket edges" in r.stderr
    r = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "plexus.train", "--dataset",
                        str(out), "--epochs", "2", "--hidden", "8", "--grid", "1x1x2"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=180,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "(memory-mapped)" in r.stdout and "epoch    2/2" in r.stdout
    r = subprocess.run([MPIEXEC, "-n", "3", sys.executable, "-m", "plexus.train", "--dataset",
                        str(out), "--epochs", "1", "--grid", "3x1x1"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert r.returncode != 0
    ranks = set(re.findall(r"\[rank (\d)\] error: grid axes \{'x': 3\} do not divide", r.stderr))
    assert ranks == {"0", "1", "2"}, r.stderr


def test_grid_auto_picks_a_grid_whose_axes_divide_k(tmp_path):
    from types import SimpleNamespace

    from plexus.train import auto_grid

    prepare(graph_source(directed_graph(n=64, e=400)), tmp_path / "p", blocks=2, quiet=True)
    pg = PreparedGraph(tmp_path / "p")
    ctx = SimpleNamespace(world_size=4, local_world_size=4, is_main=False)
    grid = auto_grid("auto", pg, TrainConfig(hidden=8), ctx)
    assert grid.num_ranks == 4 and all(s in (1, 2) for s in grid.shape.values())
    with pytest.raises(ValueError, match="dividing the 2x2 blocks"):
        auto_grid("auto", pg, TrainConfig(hidden=8), SimpleNamespace(
            world_size=3, local_world_size=3, is_main=False))


@pytest.mark.parametrize("writer", ["arxiv", "products", "papers100M"])
def test_ogb_raw_files_stream_into_the_same_shards_as_the_ogb_loader(tmp_path, writer):
    from plexus.datasets import load_ogb
    from plexus.sources import ogb_source
    from tests.plexus import ogb_format

    write = getattr(ogb_format, f"write_{writer.lower()}_like")
    write(tmp_path)
    name = f"ogbn-{writer}"
    m = prepare(ogb_source(name, tmp_path, chunk_edges=97, tmp_dir=tmp_path),
                tmp_path / "p", blocks=4, quiet=True)
    graph = load_ogb(name, tmp_path)
    assert m["symmetric"] == (writer == "products")
    pg = PreparedGraph(tmp_path / "p")
    assert pg.split_counts == {s: int(graph.split_idx(s).numel()) for s in SPLITS}
    for spec in ("1x1x1", "2x1x2", "1x4x1"):
        grid = ProcessGrid.parse(spec)
        for rank in range(grid.num_ranks):
            mem = shard_graph(graph, grid.shape, grid.coords(rank), num_layers=3, hidden=6,
                              pad_multiple=4)
            assert_same_shard(pg.shard(grid.shape, grid.coords(rank), num_layers=3,
                                       hidden=6), mem)


@needs_mpi
def test_a_damaged_block_stops_every_rank_with_a_clear_error(tmp_path):
    out = tmp_path / "p"
    prepare(graph_source(directed_graph(n=80, e=500)), out, blocks=2, quiet=True)
    (out / "even" / "1_1" / "indices.npy").write_bytes(b"\x93NUMPY")  # truncated
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    # 2 layers on 1x1x2: rank z=1 alone maps row block 1, so only it meets the damage
    r = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "plexus.train", "--dataset",
                        str(out), "--epochs", "1", "--layers", "2", "--grid", "1x1x2"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=180,
                       stdin=subprocess.DEVNULL)
    assert r.returncode != 0
    assert re.search(r"\[rank 1\] error: cannot read \S+even/1_1/indices\.npy", r.stderr), \
        r.stderr
    assert "[rank 0] error: another rank could not read its blocks" in r.stderr, r.stderr
