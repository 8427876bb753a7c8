"""plexus.data.cache: big datasets prepared once under ROOT/prepared, then memory-mapped.

The datasets are tiny graphs in the exact OGB on-disk format (tests/plexus/data/ogb_format.py),
so the real streaming readers run; ogbn-papers100M goes through the cache by name whatever its
size. Training on a prepared dataset equals the in-memory source: test_mapped.py.
"""

import json
import re
import shutil
import threading
import time

import numpy as np
import pytest

import plexus.data.writer as writer_module
from common.perf import parse_grid
from plexus.data import DatasetCorruptError, InMemorySource, PreparedGraph, cache, open_source
from plexus.data.cache import PrepareFailedError, prepared_cache
from plexus.data.job import default_blocks
from tests.plexus.data.ogb_format import write_arxiv_like, write_papers100m_like

PAPERS = "ogbn-papers100M"
KW = {"blocks": 2, "permutation": "double", "seed": 0, "symmetrize": False}


def _cache_dir(root, **kw):
    return cache.cache_dir(PAPERS, root, **{**KW, **kw})


def _no_prepare(*args, **kwargs):
    raise AssertionError("prepare() ran, but the cache should have been reused")


def test_auto_prepares_papers100m_once_then_reuses_it(tmp_path, monkeypatch):
    written = write_papers100m_like(tmp_path, num_nodes=400)
    src = open_source(PAPERS, root=tmp_path, blocks=2)
    out = tmp_path / "prepared" / "ogbn-papers100M-k2-double-s0"
    assert isinstance(src, PreparedGraph) and src.path == out
    assert (src.num_nodes, src.blocks, src.num_classes) == (400, 2, 172)
    assert src.split_counts["train"] == written.train_idx.size
    assert not src.symmetric and not list(tmp_path.glob("prepared/*.partial"))
    mtime = (out / "manifest.json").stat().st_mtime_ns
    monkeypatch.setattr(writer_module, "prepare", _no_prepare)
    again = open_source(PAPERS, root=tmp_path, blocks=2, is_writer=False)  # a waiter: no wait
    assert again.path == out and (out / "manifest.json").stat().st_mtime_ns == mtime
    # the name carries every setting: another seed or --symmetrize is another cache
    assert _cache_dir(tmp_path, seed=3, symmetrize=True).name == (
        "ogbn-papers100M-k2-double-s3-sym")
    assert cache.cache_dir("ogbn-products", tmp_path, **{**KW, "symmetrize": True}).name == (
        "ogbn-products-k2-double-s0")  # products is undirected already
    (out.parent / "ogbn-papers100M-k2-double-s1").symlink_to(out)  # another seed's name
    with pytest.raises(ValueError, match=r"does not match this run: seed 0 \(wanted 1\).*delete"):
        open_source(PAPERS, root=tmp_path, blocks=2, seed=1)


def test_the_size_rule_and_the_modes(tmp_path, monkeypatch):
    write_arxiv_like(tmp_path, num_nodes=300, num_features=16)
    write_papers100m_like(tmp_path, num_nodes=400)
    est = cache.estimated_bytes("ogbn-arxiv", tmp_path)
    num_edges = int(np.loadtxt(tmp_path / "ogbn_arxiv/raw/num-edge-list.csv.gz"))
    assert est == 300 * 16 * 4 + num_edges * 16
    assert cache.estimated_bytes("ogbn-arxiv", tmp_path / "nowhere") is None
    assert not cache.wants_cache("ogbn-arxiv", tmp_path)  # small: in memory
    assert cache.wants_cache("ogbn-arxiv", tmp_path, limit_bytes=est - 1)
    assert cache.wants_cache(PAPERS, tmp_path) and cache.wants_cache("ogbn-products", "x")
    assert isinstance(open_source("ogbn-arxiv", root=tmp_path), InMemorySource)
    assert isinstance(open_source(PAPERS, root=tmp_path, prepare="never"), InMemorySource)
    with pytest.raises(ValueError, match="'planted' cannot be prepared automatically"):
        open_source("planted", prepare="always")
    with pytest.raises(ValueError, match="unknown prepare mode"):
        open_source(PAPERS, root=tmp_path, prepare="sometimes")
    assert not (tmp_path / "prepared").exists()
    monkeypatch.setattr(cache, "IN_MEMORY_LIMIT_BYTES", est - 1)  # now arxiv is "big"
    src = open_source("ogbn-arxiv", root=tmp_path, blocks=2, symmetrize=True)
    assert isinstance(src, PreparedGraph) and src.symmetric
    assert src.path.name == "ogbn-arxiv-k2-double-s0-sym"
    # GraphSAGE maps the same cache (its mean blocks), prepared by either model
    sage = open_source("ogbn-arxiv", root=tmp_path, blocks=2, symmetrize=True,
                       aggregation="mean", is_writer=False)
    assert isinstance(sage, PreparedGraph) and sage.path == src.path
    assert sage.aggregation == "mean" and src.aggregation == "gcn"
    assert isinstance(open_source(PAPERS, root=tmp_path, aggregation="mean", blocks=2),
                      PreparedGraph)


def test_an_edge_file_goes_through_the_cache(tmp_path):
    rng = np.random.default_rng(0)
    edges = rng.integers(0, 100, (2, 600))
    edges[:, 0] = 99  # the largest id: 100 nodes
    np.save(tmp_path / "edges.npy", edges)
    src = open_source(str(tmp_path / "edges.npy"), root=tmp_path, blocks=2, symmetrize=True)
    assert isinstance(src, PreparedGraph) and src.num_nodes == 100 and src.symmetric
    assert src.path == tmp_path / "prepared" / "edges-k2-double-s0-sym"
    assert open_source("edges.npy", root=tmp_path, blocks=2, symmetrize=True).path == src.path
    with pytest.raises(ValueError, match="edge file, which is read only through the prepared"):
        open_source(str(tmp_path / "edges.npy"), prepare="never")
    with pytest.raises(FileNotFoundError, match=r"edge file nope\.npy not found"):
        open_source("nope.npy", root=tmp_path)


def test_a_partial_directory_of_a_killed_writer_is_not_used(tmp_path):
    write_papers100m_like(tmp_path, num_nodes=400)
    out = _cache_dir(tmp_path)
    partial = out.parent / f"{out.name}.partial"
    partial.mkdir(parents=True)
    (partial / "manifest.json").write_text("{}")  # looks done, but was never renamed
    with pytest.raises(TimeoutError, match="waited"):  # a waiter does not take it
        prepared_cache(PAPERS, tmp_path, **KW, is_writer=False, timeout_s=0.2, poll_s=0.05)
    assert prepared_cache(PAPERS, tmp_path, **KW, is_writer=True) == out
    assert PreparedGraph(out).num_nodes == 400 and not partial.exists()


def test_a_failed_writer_stops_the_waiters_with_its_message(tmp_path, monkeypatch):
    write_papers100m_like(tmp_path, num_nodes=400)
    out = _cache_dir(tmp_path)
    failed = out.parent / f"{out.name}.failed"

    def broken(*args, **kwargs):
        raise OSError("disk on fire")

    monkeypatch.setattr(writer_module, "prepare", broken)
    with pytest.raises(OSError, match="disk on fire"):
        prepared_cache(PAPERS, tmp_path, **KW, is_writer=True, token="job-1")
    assert json.loads(failed.read_text()) == {"token": "job-1", "error": "OSError: disk on fire"}
    with pytest.raises(PrepareFailedError, match=re.escape(
            f"rank 0 failed to prepare {out}: OSError: disk on fire")):
        prepared_cache(PAPERS, tmp_path, **KW, is_writer=False, token="job-1", poll_s=0.05)
    # a later job's waiters ignore this job's marker (their writer removes it)
    with pytest.raises(TimeoutError):
        prepared_cache(PAPERS, tmp_path, **KW, is_writer=False, token="job-2", timeout_s=0.2,
                       poll_s=0.05)
    monkeypatch.undo()
    assert prepared_cache(PAPERS, tmp_path, **KW, is_writer=True, token="job-2") == out
    assert not failed.exists()


def test_waiters_poll_until_the_writer_is_done(tmp_path, capsys):
    write_papers100m_like(tmp_path, num_nodes=400)

    def writer():
        time.sleep(0.5)
        prepared_cache(PAPERS, tmp_path, **KW, is_writer=True)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        got = prepared_cache(PAPERS, tmp_path, **KW, is_writer=False, poll_s=0.05,
                             report_every_s=0.2, verbose=True, timeout_s=120)
    finally:
        thread.join()
    assert got == _cache_dir(tmp_path) and PreparedGraph(got).num_nodes == 400
    assert f"waiting for rank 0 to prepare {got} (elapsed " in capsys.readouterr().out


def test_a_damaged_cache_is_an_error_naming_the_file(tmp_path, monkeypatch):
    write_papers100m_like(tmp_path, num_nodes=400)
    out = prepared_cache(PAPERS, tmp_path, **KW, is_writer=True)
    monkeypatch.setattr(writer_module, "prepare", _no_prepare)  # never silently rewritten
    victim = out / "features" / "1.npy"
    victim.write_bytes(victim.read_bytes()[:-8])
    with pytest.raises(DatasetCorruptError, match=rf"{re.escape(str(victim))} has \d+ bytes, "
                       rf"the manifest says \d+ bytes; delete {re.escape(str(out))} .*--verify"):
        open_source(PAPERS, root=tmp_path, blocks=2)
    victim.unlink()
    with pytest.raises(DatasetCorruptError, match=re.escape(f"{victim} is missing")):
        prepared_cache(PAPERS, tmp_path, **KW, is_writer=False)
    (out / "manifest.json").unlink()  # no manifest: not a cache, and not overwritten
    with pytest.raises(ValueError, match=re.escape(f"{out} exists but is not a prepared dataset")):
        prepared_cache(PAPERS, tmp_path, **KW, is_writer=True)


def test_default_blocks_fit_the_grid():
    def blocks(spec, world):
        return default_blocks(parse_grid(spec, world))

    assert blocks("2x2x2", 8) == 8 and blocks("4x1x2", 8) == 8
    assert blocks("3x1x1", 3) == 9 and blocks("1x2x3", 6) == 12
    assert blocks("16x1x1", 16) == 16
    assert blocks("auto", 6) == blocks("auto:local-cpu", 6) == 8
    assert blocks(None, 3) == 9 and blocks(None, 1) == 8


def test_preparing_reads_ogbs_class_counts_without_importing_its_loaders(tmp_path):
    """The writer rank prepares in the training process: it reads "num classes" from ogb's
    master.csv without importing ogb.nodeproppred (torch_geometric, scikit-learn: seconds, and
    memory kept through training), and fixes glibc's thresholds first (common.alloc), so that
    the heap does not keep what preparing freed."""
    import subprocess
    import sys

    from tests.distributed import ROOT

    write_papers100m_like(tmp_path, num_nodes=300)
    code = (
        "import sys\n"
        "import common.alloc, plexus.data.cache as c\n"
        "calls = []\n"
        "c.retain_freed_memory = lambda on: calls.append(on)\n"
        "out = c.prepared_cache('ogbn-papers100M', sys.argv[1], blocks=2, permutation='double',"
        " seed=0, symmetrize=False, is_writer=True)\n"
        "import json; meta = json.loads((out / 'manifest.json').read_text())\n"
        "print(calls, meta['num_classes'], sorted(m for m in ('ogb.nodeproppred', "
        "'torch_geometric', 'sklearn') if m in sys.modules))\n")
    run = subprocess.run([sys.executable, "-W", "ignore", "-c", code, str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split("\n")[-2] == "[False] 172 []"


def test_the_class_counts_are_ogbs_own():
    from plexus.data.ogb import OGB_DATASETS, import_ogb_nodeproppred
    from plexus.data.sources import _ogb_num_classes

    master = import_ogb_nodeproppred().__file__.replace("__init__.py", "master.csv")
    import pandas as pd

    table = pd.read_csv(master, index_col=0, keep_default_na=False)
    for name in OGB_DATASETS:
        assert _ogb_num_classes(name) == int(table[name]["num classes"])


def _edges(path, num_nodes, seed=0):
    path.parent.mkdir(parents=True, exist_ok=True)
    edges = np.random.default_rng(seed).integers(0, num_nodes, (2, 6 * num_nodes))
    edges[:, 0] = num_nodes - 1  # the largest id: num_nodes nodes
    np.save(path, edges)
    return path


def test_an_edge_file_cache_is_not_reused_for_another_file_or_a_missing_one(tmp_path,
                                                                           monkeypatch):
    """Edge files of one stem share a cache name: the manifest's path, size and time tell
    them apart, and the edge file is required before its cache is used."""
    a, b = _edges(tmp_path / "a" / "edges.npy", 200), _edges(tmp_path / "b" / "edges.npy", 400)
    root = tmp_path / "r1"
    out = open_source(str(a), root=root, blocks=2).path
    assert PreparedGraph(out).num_nodes == 200
    monkeypatch.setattr(writer_module, "prepare", _no_prepare)  # never silently rewritten
    assert open_source(str(a), root=root, blocks=2).path == out  # the same file: reused
    with pytest.raises(ValueError, match=rf"the prepared cache {re.escape(str(out))} does not "
                       rf"match this run: edge file {re.escape(str(a.resolve()))} "
                       rf"\(wanted {re.escape(str(b.resolve()))}\); delete {re.escape(str(out))}"):
        open_source(str(b), root=root, blocks=2)
    with pytest.raises(FileNotFoundError, match=r"edge file .*zz.edges\.npy not found"):
        open_source(str(tmp_path / "zz" / "edges.npy"), root=root, blocks=2)
    _edges(a, 300, seed=1)  # rewritten in place: same path, another graph
    with pytest.raises(ValueError, match=r"does not match this run: edge file .*edges\.npy "
                       r"\d+ bytes modified .* when prepared, \d+ bytes modified .* now"):
        open_source(str(a), root=root, blocks=2, is_writer=False)
    # an older plexus's manifest (the file's path, no size or time): reused with a warning
    manifest = json.loads((out / "manifest.json").read_text())
    for key in ("bytes", "mtime_ns"):
        manifest["source"].pop(key, None)
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.warns(UserWarning, match="records no sizes and times of its inputs"):
        assert open_source(str(a), root=root, blocks=2, verbose=True).path == out


def test_an_ogb_cache_is_not_reused_once_its_raw_files_change(tmp_path, monkeypatch):
    write_papers100m_like(tmp_path, num_nodes=400)
    out = prepared_cache(PAPERS, tmp_path, **KW, is_writer=True)
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest["source"]["inputs"]) == {
        "raw/data.npz", "raw/node-label.npz", *(f"split/time/{s}.csv.gz"
                                                 for s in ("train", "valid", "test"))}
    monkeypatch.setattr(writer_module, "prepare", _no_prepare)
    write_papers100m_like(tmp_path / "new", num_nodes=500)  # new raw data, the same name
    shutil.copytree(tmp_path / "new" / "ogbn_papers100M", tmp_path / "ogbn_papers100M",
                    dirs_exist_ok=True)
    with pytest.raises(ValueError, match=r"does not match this run: raw file raw/data\.npz "
                       r"\d+ bytes modified .* when prepared, \d+ bytes modified .* now.*"
                       rf"delete {re.escape(str(out))}"):
        open_source(PAPERS, root=tmp_path, blocks=2)
    with pytest.raises(ValueError, match=r"raw file raw/data\.npz"):  # waiters check it too
        prepared_cache(PAPERS, tmp_path, **KW, is_writer=False)
    # raw files deleted once prepared: nothing left to compare, the cache is what remains
    for path in (tmp_path / "ogbn_papers100M").rglob("*.*"):
        path.unlink()
    assert open_source(PAPERS, root=tmp_path, blocks=2).path == out
    # a cache of an older plexus records no inputs: whether they changed cannot be told, and
    # rebuilding papers100M's takes hours, so it is reused with a warning that says so
    del manifest["source"]["inputs"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.warns(UserWarning, match=r"records no sizes and times of its inputs .* delete "
                      "it to prepare it anew if they did"):
        assert open_source(PAPERS, root=tmp_path, blocks=2, verbose=True).path == out
