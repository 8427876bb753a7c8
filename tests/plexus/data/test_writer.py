"""plexus.data.writer: streaming preparation into k x k block files, and its checks.

A prepared dataset must give every rank exactly the blocks, features, labels and masks the
in-memory source builds (tests/plexus/data/test_mapped.py); here: each source (R-MAT stream,
edge files, OGB raw files) against the in-memory graph, errors, overwrite protection and damage.
"""

import json
import re

import numpy as np
import pytest

from common.grid import ProcessGrid
from plexus.data import SPLITS, DatasetCorruptError, PreparedGraph
from plexus.data.generators import rmat_graph
from plexus.data.schema import verify
from plexus.data.sources import edge_file_source, graph_source, rmat_source
from plexus.data.writer import prepare
from tests.distributed import run_module
from tests.plexus.data.shards import assert_same_shard, directed_graph, memory_shard, widths


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
        mem = memory_shard(g, shape, grid.coords(rank), 3, 8, seed=2, pad_multiple=4)
        assert_same_shard(pg.shard(shape, grid.coords(rank), widths(g, 3, 8)), mem)
    assert not list(tmp_path.glob("features-*.npy"))  # temporary feature file removed


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
    r = run_module("plexus.prepare", ["--verify", str(out)])
    assert r.returncode == 1 and "even/1_0/values.npy" in r.stdout
    (out / "even" / "0_1" / "indices.npy").write_bytes(b"\x93NUMPY")  # truncated
    pg = PreparedGraph(out)
    with pytest.raises(DatasetCorruptError, match="--verify"):
        pg.shard({"x": 1, "y": 1, "z": 1}, {"x": 0, "y": 0, "z": 0}, [9, 4, 6])
    [problem] = pg.grid_problems({"x": 4, "y": 1, "z": 1})
    assert re.search(r"x=4 do not divide the 2x2 blocks.*\[1, 2\]", problem), problem
    assert pg.grid_problems({"x": 2, "y": 1, "z": 2}) == []
    with pytest.raises(FileNotFoundError, match=r"python -m plexus\.prepare"):
        PreparedGraph(tmp_path)


@pytest.mark.parametrize("writer", ["arxiv", "products", "papers100M"])
def test_ogb_raw_files_stream_into_the_same_shards_as_the_ogb_loader(tmp_path, writer):
    from plexus.data.ogb import load_ogb
    from plexus.data.sources import ogb_source
    from tests.plexus.data import ogb_format

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
            mem = memory_shard(graph, grid.shape, grid.coords(rank), 3, 6, pad_multiple=4)
            assert_same_shard(pg.shard(grid.shape, grid.coords(rank), widths(graph, 3, 6)), mem)
    sage, grid = pg.with_aggregation("mean"), ProcessGrid.parse("2x1x2")  # GraphSAGE's blocks
    for rank in range(grid.num_ranks):
        mem = memory_shard(graph, grid.shape, grid.coords(rank), 3, 6, pad_multiple=4,
                           aggregation="mean")
        assert_same_shard(sage.shard(grid.shape, grid.coords(rank), widths(graph, 3, 6)), mem)




def _edit_gz(path, edit):
    import gzip

    with gzip.open(path, "rt") as f:
        lines = f.read().splitlines()
    edit(lines)
    with gzip.open(path, "wt") as f:
        f.write("\n".join(lines) + "\n")


def _set(i, value):
    def edit(lines):
        lines[i] = value
    return edit


def _bad_ogb_inputs():
    """(what, edit of the arxiv folder, words of the error): the in-memory Graph's refusals."""
    return [
        ("label out of range", lambda d: _edit_gz(d / "raw/node-label.csv.gz", _set(5, "57")),
         r"node-label\.csv\.gz: labels outside \[0, C=40\): found min 0, max 57"),
        ("unlabelled split node", lambda d: _edit_gz(d / "raw/node-label.csv.gz",
                                                     _set(_first(d, "train"), "nan")),
         r"1 of \d+ train nodes are unlabeled \(y = -1\); a split may only hold labeled"),
        ("overlapping splits", lambda d: _edit_gz(d / "split/time/test.csv.gz",
                                                  lambda lines: lines.append(
                                                      str(_first(d, "train")))),
         "train/val/test indices overlap or repeat a node"),
        ("split id out of range", lambda d: _edit_gz(d / "split/time/test.csv.gz",
                                                     lambda lines: lines.append("999")),
         r"test_idx holds ids in \[\d+, 999\], outside \[0, N=300\)"),
        ("truncated edges", lambda d: (d / "raw/edge.csv.gz").write_bytes(
            (d / "raw/edge.csv.gz").read_bytes()[:200]),
         r"edge\.csv\.gz could not be read \(EOFError.*truncated or corrupt"),
        ("truncated features", lambda d: (d / "raw/node-feat.csv.gz").write_bytes(
            (d / "raw/node-feat.csv.gz").read_bytes()[:300]),
         r"node-feat\.csv\.gz could not be read \(EOFError.*truncated or corrupt"),
    ]


def _first(d, split):
    import gzip

    with gzip.open(d / f"split/time/{split}.csv.gz", "rt") as f:
        return int(f.readline())


@pytest.mark.parametrize("what, edit, words", _bad_ogb_inputs(),
                         ids=[case[0] for case in _bad_ogb_inputs()])
def test_ogb_raw_files_the_in_memory_path_refuses_are_refused_naming_the_file(
        tmp_path, what, edit, words):
    """Preparing applies the in-memory Graph's rules: labels in [0, C) with ogb's C (never
    widened), split nodes labelled, splits in range and disjoint; a damaged raw file is a
    DatasetCorruptError naming it, not a decoder's traceback; nothing is left behind."""
    from plexus.data.sources import ogb_source
    from tests.plexus.data.ogb_format import write_arxiv_like

    w = write_arxiv_like(tmp_path, num_nodes=300)
    edit(w.directory)
    with pytest.raises(DatasetCorruptError, match=words):
        prepare(ogb_source("ogbn-arxiv", tmp_path, chunk_edges=97, tmp_dir=tmp_path),
                tmp_path / "p", blocks=2, quiet=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ogbn_arxiv"]


def test_the_writer_refuses_unlabelled_split_nodes_of_any_source(tmp_path):
    g = rmat_graph(6, seed=0)
    source = graph_source(g)
    node_data = source.node_data

    def unlabelled(deg):
        nd = node_data(deg)
        nd.labels = nd.labels.copy()
        nd.labels[g.val_idx[:3].numpy()] = -1
        return nd

    source.node_data = unlabelled
    with pytest.raises(ValueError, match=r"3 of \d+ val nodes are unlabeled \(y = -1\)"):
        prepare(source, tmp_path / "p", blocks=2, quiet=True)
    assert not (tmp_path / "p").exists()


def test_force_replaces_only_a_prepared_dataset_that_holds_none_of_its_inputs(tmp_path):
    from plexus.data.sources import ogb_source
    from tests.plexus.data.ogb_format import write_arxiv_like

    graph = directed_graph(n=50, e=200)
    mine = tmp_path / "mine"  # a user's folder that happens to be named as --out
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match=r"--force replaces only a prepared dataset, and .*mine "
                       r"holds no manifest\.json"):
        prepare(graph_source(graph), mine, blocks=2, force=True, quiet=True)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    w = write_arxiv_like(tmp_path / "ogb", num_nodes=120)  # the raw folder it reads from
    for out in (w.directory, tmp_path / "ogb"):
        with pytest.raises(ValueError, match="holds the input it would be prepared from"):
            prepare(ogb_source("ogbn-arxiv", tmp_path / "ogb", tmp_dir=tmp_path), out,
                    blocks=2, force=True, quiet=True)
    assert (w.directory / "raw" / "edge.csv.gz").is_file()
    out = tmp_path / "p"  # a prepared dataset holding its own edge file
    prepare(graph_source(graph), out, blocks=2, quiet=True)
    np.save(out / "edges.npy", graph.edge_index.numpy())
    with pytest.raises(ValueError, match="holds the input"):
        prepare(edge_file_source(out / "edges.npy", 50), out, blocks=2, force=True, quiet=True)
    assert (out / "edges.npy").is_file()


def test_prepare_reads_built_in_names_from_root(tmp_path, monkeypatch):
    import argparse

    import plexus.prepare as cli

    seen = {}
    monkeypatch.setattr(cli, "load_dataset", lambda name, **kw: seen.update(kw) or
                        directed_graph(n=50, e=200))
    cli.source_from_args(argparse.Namespace(source="Planetoid/Cora", root=str(tmp_path),
                                            seed=3, chunk_edges=1 << 10), tmp_dir=str(tmp_path))
    assert seen == {"root": str(tmp_path), "seed": 3}


def test_prepare_cli_names_a_truncated_raw_file_without_a_traceback(tmp_path):
    from tests.plexus.data.ogb_format import write_arxiv_like

    w = write_arxiv_like(tmp_path, num_nodes=120)
    edges = w.directory / "raw" / "edge.csv.gz"
    edges.write_bytes(edges.read_bytes()[:200])
    r = run_module("plexus.prepare", ["--source", "ogbn-arxiv", "--root", str(tmp_path),
                                      "--out", str(tmp_path / "p"), "--blocks", "2", "--quiet"])
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"{edges} could not be read (EOFError" in r.stderr and "truncated or corrupt" in (
        r.stderr)
