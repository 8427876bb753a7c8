"""GraphSAGE on prepared datasets: the mean adjacency's blocks written by plexus.prepare and
mapped per rank by ``PreparedGraph(path, aggregation="mean")``.

Every rank maps exactly the mean and root blocks the in-memory source builds (symmetric and
directed graphs with multi-edges, self-loop edges and padding; each source's self-loop rule);
training on them gives the in-memory loss, logits and every gradient bit for bit, with batch
norm and residual connections, on the grids 1x2x4, 4x1x2 and 2x2x2; a checkpoint of a
prepared run resumes on another grid; a dataset of the previous format version is refused
with the command that prepares it again; a rank maps no file outside its own blocks.
"""

import dataclasses
import json
import re
import shlex
import shutil

import numpy as np
import pytest
import torch

from common.grid import ProcessGrid
from plexus.data import InMemorySource, PreparedGraph, open_source
from plexus.data.schema import FORMAT_VERSION, StaleFormatError, verify
from plexus.data.sources import graph_source, rmat_source
from plexus.data.writer import mean_self_loops, prepare
from tests.distributed import run_module, run_ranks
from tests.plexus.data.shards import assert_same_shard, directed_graph, widths

K = 4  # blocks per side: every axis of the grids below divides it; 203 nodes pad to 204
GRIDS = ["1x1x1", "1x2x4", "4x1x2", "2x2x2"]


def symmetric_multigraph():
    """directed_graph() with every edge reversed as well: undirected with multiplicities
    (40 duplicated edges) and self-loop edges (each twice), 203 nodes."""
    g = directed_graph()
    ei = torch.cat([g.edge_index, g.edge_index.flip(0)], dim=1)
    return dataclasses.replace(g, edge_index=ei, name="symmetric")


def _graph(kind):
    return directed_graph() if kind == "directed" else symmetric_multigraph()


def _assert_every_rank_maps_the_in_memory_shard(pg, oracle, graph, grids, num_layers=6):
    w = widths(graph, num_layers, 6)  # 6 layers: every (roles, parity) layout
    for spec in grids:
        grid = ProcessGrid.parse(spec)
        for rank in range(grid.num_ranks):
            coords = grid.coords(rank)
            assert_same_shard(pg.shard(grid.shape, coords, w),
                              oracle.shard(grid.shape, coords, w))


@pytest.mark.parametrize("kind", ["directed", "symmetric"])
@pytest.mark.parametrize("permutation", ["none", "double"])
def test_every_rank_maps_the_mean_and_root_blocks_the_in_memory_path_builds(
        tmp_path, kind, permutation):
    graph = _graph(kind)
    assert graph.is_undirected() == (kind == "symmetric")
    loops = int((graph.edge_index[0] == graph.edge_index[1]).sum())
    m = prepare(graph_source(graph, chunk_edges=333), tmp_path / "p", blocks=K,
                permutation=permutation, seed=4, quiet=True)
    assert m["version"] == FORMAT_VERSION and m["multi_edges"] and loops > 0
    assert m["symmetric"] == (kind == "symmetric") and m["mean"]["self_loops"] == loops
    oracle = InMemorySource(graph, permutation=permutation, seed=4, pad_multiple=K,
                            aggregation="mean")
    pg = PreparedGraph(tmp_path / "p", aggregation="mean")
    assert pg.aggregation == "mean" and pg.nnz == m["mean"]["nnz"]
    # A_mean has a nonzero per distinct (s, t) pair; duplicates add to one value
    pairs = np.unique(graph.edge_index.numpy().T, axis=0).shape[0]
    assert pg.nnz == pairs
    _assert_every_rank_maps_the_in_memory_shard(pg, oracle, graph, GRIDS)
    # each block once, no transpose; symmetric graphs store only the values of A_mean''
    # (its structure is A_mean''s transposed)
    for folder in ("even", "mean/even", "odd", "mean/odd"):
        if kind == "symmetric" and folder == "odd":
            assert not (tmp_path / "p" / folder).exists()
            continue
        files = sorted(p.name for p in (tmp_path / "p" / folder / "1_0").iterdir())
        assert files == (["values.npy"] if kind == "symmetric" and folder == "mean/odd"
                         else ["indices.npy", "indptr.npy", "values.npy"]), folder
    assert verify(tmp_path / "p") == []  # the mean files have checksums too
    # the GCN's blocks of the same files are unchanged, and the source serves both
    gcn = pg.with_aggregation("gcn")
    assert gcn.aggregation == "gcn" and gcn.nnz == m["nnz"] and gcn.with_aggregation("gcn") is gcn
    _assert_every_rank_maps_the_in_memory_shard(
        gcn, oracle.with_aggregation("gcn"), graph, ["2x2x2"])


def test_the_self_loop_rule_of_each_source(tmp_path):
    """The mean aggregation's self-loop messages are those of the graph the in-memory path
    loads: ogb's add_inverse_edge keeps each self-loop and its reverse (products); the R-MAT
    stream is made undirected without them (to_undirected_edges)."""
    assert mean_self_loops(np.array([0, 1, 3]), False, False).tolist() == [0, 1, 3]
    assert mean_self_loops(np.array([0, 1, 3]), True, False).tolist() == [0, 2, 6]
    assert mean_self_loops(np.array([0, 1, 3]), True, True).tolist() == [0, 0, 0]
    assert mean_self_loops(np.array([0, 1, 3]), False, True).tolist() == [0, 1, 1]
    grids = ["2x1x2", "1x4x1"]
    # products-like: each stored edge, self-loops and duplicates included, and its reverse
    stored = directed_graph()
    ei = stored.edge_index.numpy()
    loaded = np.repeat(ei, 2, axis=1)  # as ogb's loader interleaves each edge and its reverse
    loaded[:, 1::2] = ei[::-1]
    graph = dataclasses.replace(stored, edge_index=torch.from_numpy(loaded))
    source = dataclasses.replace(graph_source(stored, chunk_edges=100), symmetrize=True)
    m = prepare(source, tmp_path / "products", blocks=K, seed=1, quiet=True)
    assert m["symmetric"] and m["mean"]["self_loops"] == 2 * int((ei[0] == ei[1]).sum()) > 0
    oracle = InMemorySource(graph, seed=1, pad_multiple=K, aggregation="mean")
    _assert_every_rank_maps_the_in_memory_shard(
        PreparedGraph(tmp_path / "products", aggregation="mean"), oracle, graph, grids, 3)
    # R-MAT: symmetrised, duplicates and the generated self-loops dropped
    from plexus.data.generators import rmat_edges, rmat_graph

    assert sum(int((c[0] == c[1]).sum()) for c in rmat_edges(8, 8, 2)) > 0
    m = prepare(rmat_source(8, 8, seed=2, num_features=5, num_classes=4, chunk_edges=500,
                            tmp_dir=tmp_path), tmp_path / "rmat", blocks=K, seed=2, quiet=True)
    assert m["mean"]["self_loops"] == 0
    graph = rmat_graph(8, 8, seed=2, num_features=5, num_classes=4)
    oracle = InMemorySource(graph, seed=2, pad_multiple=K, aggregation="mean")
    _assert_every_rank_maps_the_in_memory_shard(
        PreparedGraph(tmp_path / "rmat", aggregation="mean"), oracle, graph, grids, 3)


def test_a_damaged_mean_block_is_named(tmp_path):
    """The block check at mapping covers the mean blocks, the values-only ones included."""
    from plexus.data.errors import DatasetCorruptError

    out = tmp_path / "p"
    prepare(graph_source(symmetric_multigraph()), out, blocks=2, quiet=True)
    arr = np.load(out / "mean" / "odd" / "1_0" / "values.npy", mmap_mode="r+")
    arr[0] = np.inf
    arr.flush()
    del arr
    pg = PreparedGraph(out, aggregation="mean")
    grid = ProcessGrid.parse("1x1x1")
    with pytest.raises(DatasetCorruptError, match=r"mean/even/0_1/\{indptr,indices\}\.npy "
                       r"with mean/odd/1_0/values\.npy: a value is NaN or infinite.*--verify"):
        pg.shard(grid.shape, grid.coords(0), widths(symmetric_multigraph(), 2, 4))
    pg.with_aggregation("gcn").shard(grid.shape, grid.coords(0), widths(directed_graph(), 2, 4))


def _downgrade(path):
    """Make the prepared dataset at ``path`` look as version 1 wrote it (no mean blocks)."""
    mf = path / "manifest.json"
    m = json.loads(mf.read_text())
    m["version"] = 1
    del m["mean"]
    m["files"] = {k: v for k, v in m["files"].items() if not k.startswith("mean/")}
    mf.write_text(json.dumps(m))
    shutil.rmtree(path / "mean")


def _run_rebuild_command(message, out):
    """Run the ``python -m plexus.prepare ...`` command quoted in ``message``."""
    from plexus.prepare import main

    cmd = re.search(r"python -m plexus\.prepare (.*?--force)", message).group(1)
    args = shlex.split(cmd)
    assert args[args.index("--out") + 1] == str(out)
    assert main([*args, "--quiet"]) == 0


def test_the_previous_format_version_is_refused_with_the_command_that_rebuilds_it(tmp_path):
    from tests.plexus.data.ogb_format import write_papers100m_like

    # a prepared directory (here an R-MAT one): PreparedGraph and --verify refuse it
    out = tmp_path / "rmat"
    prepare(rmat_source(7, 4, seed=3, num_features=6, num_classes=4, tmp_dir=tmp_path), out,
            blocks=2, permutation="single", seed=3, quiet=True)
    _downgrade(out)
    for call in (lambda: PreparedGraph(out, aggregation="mean"), lambda: verify(out),
                 lambda: open_source(str(out))):
        with pytest.raises(StaleFormatError) as e:
            call()
        msg = str(e.value)
        assert f"{out} is a prepared dataset of format version 1" in msg
        assert f"reads version {FORMAT_VERSION}" in msg and "--model sage" in msg
        assert "stores each block once" in msg  # every change since version 1
    assert ("python -m plexus.prepare --source rmat --scale 7 --edge-factor 4 --features 6 "
            f"--classes 4 --blocks 2 --permutation single --seed 3 --out {out} --force") in msg
    _run_rebuild_command(msg, out)
    assert PreparedGraph(out, aggregation="mean").nnz > 0 and verify(out) == []

    # the --prepare auto cache of ogbn-papers100M: every rank stops naming it, nothing is
    # rewritten unasked; the command in the message rebuilds it in place
    write_papers100m_like(tmp_path, num_nodes=300)
    cached = open_source("ogbn-papers100M", root=tmp_path, blocks=2, symmetrize=True)
    _downgrade(cached.path)
    for is_writer in (True, False):
        with pytest.raises(StaleFormatError) as e:
            open_source("ogbn-papers100M", root=tmp_path, blocks=2, symmetrize=True,
                        aggregation="mean", is_writer=is_writer)
        msg = str(e.value)
        assert f"the prepared cache {cached.path} cannot be used" in msg
        assert f"--source ogbn-papers100M --root {tmp_path.resolve()} --symmetrize" in msg
        assert f"delete {cached.path} and run again" in msg
    assert json.loads((cached.path / "manifest.json").read_text())["version"] == 1
    _run_rebuild_command(msg, cached.path)
    again = open_source("ogbn-papers100M", root=tmp_path, blocks=2, symmetrize=True,
                        aggregation="mean", is_writer=False)
    assert again.path == cached.path and again.symmetric and again.aggregation == "mean"
    from plexus.data.ogb import load_ogb

    graph = load_ogb("ogbn-papers100M", tmp_path).to_undirected()  # what --symmetrize trains
    oracle = InMemorySource(graph, pad_multiple=2, aggregation="mean")
    _assert_every_rank_maps_the_in_memory_shard(again, oracle, graph, ["2x1x1"], 3)


# ----------------------------------------------------------------------------- training

SEED = 3  # the permutation seed of the prepared dataset and of its in-memory oracle
# (norm, residual, layers, trainable features, dropout)
CASES = [("batch", True, 4, True, 0.5), ("layer", False, 3, False, 0.0)]


def _loss_logits_grads(ctx, grid, source, case):
    from common.comm_stats import CommStats
    from plexus.layout import layer_widths, roles
    from plexus.loss import sharded_cross_entropy
    from plexus.model import PlexusGCN

    norm, residual, num_layers, learn, dropout = case
    groups = ctx.create_groups(grid)
    w = layer_widths(source.num_features, 6, num_layers, source.num_classes)
    shard = source.shard(grid.shape, grid.coords(ctx.rank), w)
    model = PlexusGCN(shard, groups, model="sage", norm=norm, residual=residual,
                      learn_features=learn, dropout=dropout, seed=5, bias=True)
    stats = CommStats()
    logits = model(stats, step=2)
    o_ax, _, p_ax = roles(num_layers - 1)
    loss = sharded_cross_entropy(logits, model.output_rows(shard.labels),
                                 model.output_rows(shard.masks["train"]),
                                 num_classes=source.num_classes,
                                 count=shard.split_counts["train"],
                                 group_o=groups[o_ax], group_p=groups[p_ax], stats=stats)
    loss.backward()
    return {"loss": loss.detach(), "logits": logits.detach(), "bytes": stats.total_bytes,
            "grads": {n: t.grad.clone() for n, t, _, _ in model.sharded_state()
                      if t.grad is not None}}


def _prepared_and_in_memory(ctx, path, grids):
    graph = directed_graph()
    out = []
    for spec in grids:
        grid = ProcessGrid.parse(spec)
        for case in CASES:
            mem = InMemorySource(graph, seed=SEED, pad_multiple=K, aggregation="mean")
            prep = PreparedGraph(path, aggregation="mean")
            out.append(((spec, case), _loss_logits_grads(ctx, grid, mem, case),
                        _loss_logits_grads(ctx, grid, prep, case)))
    return out


@pytest.mark.slow
def test_sage_on_prepared_blocks_equals_in_memory_bit_for_bit(tmp_path):
    prepare(graph_source(directed_graph()), tmp_path / "p", blocks=K, seed=SEED, quiet=True)
    results = run_ranks(_prepared_and_in_memory, 8, str(tmp_path / "p"),
                        ["1x2x4", "4x1x2", "2x2x2"], timeout=900)
    # bits: each rank runs both on the same grid, so the same shards (assert_same_shard), the
    # numba SpMM (fixed order over the blocks) and the same dense ops on the same shapes
    for per_rank in results:
        for tag, mem, prep in per_rank:
            assert torch.equal(mem["loss"], prep["loss"]), tag
            assert torch.equal(mem["logits"], prep["logits"]), tag
            assert mem["bytes"] == prep["bytes"] > 0, tag
            assert sorted(mem["grads"]) == sorted(prep["grads"]) and mem["grads"], tag
            assert any(n.startswith("root") for n in mem["grads"]), tag
            for name, want in mem["grads"].items():
                assert torch.equal(prep["grads"][name], want), f"{tag}: grad of {name} differs"


SAGE = {"model": "sage", "norm": "batch", "residual": True, "num_layers": 3, "hidden": 8,
        "lr": 0.05}


def _train_and_save(ctx, path, grid, ck):
    from common.run import CheckpointConfig
    from plexus.config import split_config
    from plexus.trainer import train_gcn

    res = train_gcn(PreparedGraph(path, aggregation="mean"), ProcessGrid.parse(grid),
                    ctx.rank, **split_config(epochs=3, **SAGE),
                    checkpoint=CheckpointConfig(dir=ck, every=1))
    return [r["loss"] for r in res.history]


def _resume_both_and_straight(ctx, path, grid, ck_prepared, ck_memory):
    from common.run import CheckpointConfig
    from plexus.config import split_config
    from plexus.trainer import train_gcn

    grid = ProcessGrid.parse(grid)
    memory = InMemorySource(directed_graph(), seed=SEED, pad_multiple=K, aggregation="mean")
    out = {}
    for name, source, ck in (("prepared", PreparedGraph(path, aggregation="mean"), ck_prepared),
                             ("memory", memory, ck_memory), ("straight", memory, None)):
        res = train_gcn(source, grid, ctx.rank, **split_config(epochs=6, **SAGE),
                        checkpoint=CheckpointConfig(dir=ck, resume=ck is not None))
        out[name] = ([r["loss"] for r in res.history], res.info.get("resumed_from"))
    return out


@pytest.mark.slow
@pytest.mark.cross_shape
def test_a_prepared_sage_run_resumes_on_another_grid(tmp_path):
    """3 epochs on 1x2x2 with checkpoints, resumed to 6 on 2x1x2 (both 4 ranks: x and y trade
    sizes, so every layer's blocks are cut differently; 8 ranks would take longer on 2 cores
    and add no other case): from the prepared
    dataset exactly as from the in-memory graph, continuing the saved history; close to 6
    epochs straight on 2x1x2 (the first three ran on another grid: float rounding)."""
    path = tmp_path / "p"
    prepare(graph_source(directed_graph()), path, blocks=K, seed=SEED, quiet=True)
    ck = tmp_path / "ck"
    saved = run_ranks(_train_and_save, 4, str(path), "1x2x2", str(ck), timeout=900)[0]
    shutil.copytree(ck, tmp_path / "ck-memory")
    got = run_ranks(_resume_both_and_straight, 4, str(path), "2x1x2", str(ck),
                    str(tmp_path / "ck-memory"), timeout=900)[0]
    prepared, memory, straight = got["prepared"], got["memory"], got["straight"]
    assert prepared[1] == memory[1] == 3 and straight[1] is None
    assert len(prepared[0]) == 6 and prepared[0][:3] == saved  # the history went along
    assert prepared[0] == memory[0]  # exact equality on the new grid: same ranks, same shapes
    # another grid for 3 epochs: products of other heights, rounding carried on by 3 Adam steps
    # (no bound derived: 1e-4 is ~1700 u of float32, generous for 3 to 6 steps)
    np.testing.assert_allclose(prepared[0][3:], straight[0][3:], rtol=1e-4)
    assert prepared[0][-1] < prepared[0][0]


@pytest.mark.slow
def test_cli_trains_sage_on_a_prepared_dataset(tmp_path):
    out = tmp_path / "planted-k4"
    r = run_module("plexus.prepare", ["--source", "planted", "--out", str(out), "--blocks",
                                      "4", "--quiet"])
    assert r.returncode == 0, r.stderr
    assert "in the mean aggregation's" in r.stdout
    r = run_module("plexus.train", ["--dataset", str(out), "--model", "sage", "--norm",
                                    "batch", "--residual", "--epochs", "2", "--hidden", "8",
                                    "--grid", "1x1x2"], ranks=2)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "(memory-mapped)" in r.stdout and "epoch    2/2" in r.stdout


@pytest.mark.parametrize("aggregation", ["gcn", "mean"])
def test_a_rank_maps_only_its_own_blocks(tmp_path, aggregation):
    """Layer l with roles (O, I, P) on rank coordinates c reads file blocks rows
    [c_P k/P, (c_P+1) k/P) x columns [c_O k/O, (c_O+1) k/O) of its matrix and nothing else
    (for a symmetric graph's odd layers: the blocks of A' whose transposes they are);
    features only its row chunk of layer 0's O axis, labels and splits only the output rows'
    chunk (the permutations, O(N), whole: they are small)."""
    from plexus import layout

    graph = symmetric_multigraph()
    prepare(graph_source(graph), tmp_path / "p", blocks=K, seed=4, quiet=True)
    num_layers = 3
    for spec in GRIDS:
        grid = ProcessGrid.parse(spec)
        for rank in range(grid.num_ranks):
            c = grid.coords(rank)
            pg = PreparedGraph(tmp_path / "p", aggregation=aggregation)
            pg.shard(grid.shape, c, widths(graph, num_layers, 6))

            def chunk(axis, c=c, shape=grid.shape):
                per = K // shape[axis]
                return range(c[axis] * per, (c[axis] + 1) * per)

            want = set()
            for layer in range(num_layers):
                o, _, p = layout.roles(layer)
                mat = "odd" if layer % 2 else "even"
                for r in chunk(p):
                    for col in chunk(o):
                        pre, values, _, _ = pg._files(mat, r, col, False)
                        want |= {pre + "indptr.npy", pre + "indices.npy", values}
            blocks = {f for f in pg.files_read if re.search(r"(even|odd)/\d+_\d+/", f)}
            assert blocks == want, (spec, rank)
            o0, p_last = layout.roles(0)[0], layout.roles(num_layers - 1)[2]
            rest = pg.files_read - blocks
            assert rest == ({f"features/{i}.npy" for i in chunk(o0)} | {"perm/pr.npy",
                            "perm/pc.npy"} | {f"{d}/pr_{i}.npy" for d in ("labels", "split")
                                              for i in chunk(p_last)}), (spec, rank)
            if grid.num_ranks > 1:  # a strict part of the dataset's block files
                read = {re.search(r"\d+_\d+", f).group() for f in blocks}
                assert len(read) < K * K, (spec, rank)
