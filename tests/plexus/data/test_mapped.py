"""plexus.data.mapped: every rank maps exactly the shard the in-memory source builds, for
every layer layout of many grids, symmetric and directed graphs with multi-edges and padding;
training on it gives the same losses bit for bit; grids must divide k; damage stops every rank.
"""

import re
import sys

import pytest
import torch

from common.grid import ProcessGrid
from plexus.config import split_config
from plexus.data import InMemorySource, PreparedGraph
from plexus.data.generators import planted_partition
from plexus.data.sources import graph_source
from plexus.data.writer import prepare
from plexus.trainer import train_gcn
from tests.distributed import run_module, run_ranks
from tests.plexus.data.shards import assert_same_shard, directed_graph, widths

GRIDS = ["1x1x1", "2x1x1", "1x2x1", "1x1x2", "2x2x1", "1x2x4", "4x1x2", "2x2x2"]


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
    oracle = InMemorySource(graph, permutation=permutation, seed=4, pad_multiple=k)
    w = widths(graph, 6, 6)  # 6 layers: every (roles, parity) layout (3 layers use 0-2)
    for spec in GRIDS:
        grid = ProcessGrid.parse(spec)
        for rank in range(grid.num_ranks):
            coords = grid.coords(rank)
            assert_same_shard(pg.shard(grid.shape, coords, w), oracle.shard(grid.shape, coords, w))



@pytest.mark.slow
def test_prepared_training_equals_in_memory_bit_for_bit(tmp_path):
    graph = directed_graph()
    prepare(graph_source(graph), tmp_path / "p", blocks=4, seed=0, quiet=True)
    cfg = split_config(epochs=4, hidden=8, num_layers=3, lr=0.05)
    results = run_ranks(_losses_both, 4, str(tmp_path / "p"), graph, cfg)
    mem, prep = results[0]
    # bits: same grid and rank, same shards, the numba SpMM (fixed order over the blocks)
    assert mem == prep and len(mem) == 4 and mem[0] > mem[-1]


def _losses_both(ctx, path, graph, cfg):
    grid = ProcessGrid.parse("1x2x2")
    mem = train_gcn(InMemorySource(graph, pad_multiple=4), grid, ctx.rank, **cfg).history
    prep = train_gcn(PreparedGraph(path), grid, ctx.rank, **cfg).history
    return [r["loss"] for r in mem], [r["loss"] for r in prep]



@pytest.mark.slow
def test_cli_prepares_and_trains_and_rejects_a_grid_that_does_not_divide_k(tmp_path):
    out = tmp_path / "planted-k4"
    r = run_module("plexus.prepare", ["--source", "planted", "--out", str(out), "--blocks",
                                      "4"])
    assert r.returncode == 0, r.stderr
    assert "in 4x4 blocks" in r.stdout and "1/4 bucket edges" in r.stderr
    r = run_module("plexus.train", ["--dataset", str(out), "--epochs", "2", "--hidden", "8",
                                    "--grid", "1x1x2"], ranks=2)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "(memory-mapped)" in r.stdout and "epoch    2/2" in r.stdout
    r = run_module("plexus.train", ["--dataset", str(out), "--epochs", "1", "--grid",
                                    "3x1x1"], ranks=3)
    assert r.returncode != 0
    ranks = set(re.findall(r"\[rank (\d)\] error: .*?axes x=3 do not divide the 4x4", r.stderr))
    assert ranks == {"0", "1", "2"}, r.stderr



def test_grid_auto_picks_a_grid_whose_axes_divide_k(tmp_path):

    from common.perf import choose_grid, parse_grid
    from plexus.config import ModelConfig, gcn_workload

    prepare(graph_source(directed_graph(n=64, e=400)), tmp_path / "p", blocks=2, quiet=True)
    pg = PreparedGraph(tmp_path / "p")
    work = gcn_workload(ModelConfig(hidden=8), pg)
    grid, _ = choose_grid(parse_grid("auto", 4), work, 4, constraints=[pg.grid_problems])
    assert grid.num_ranks == 4 and all(s in (1, 2) for s in grid.shape.values())
    with pytest.raises(ValueError, match="do not divide the 2x2 blocks"):
        choose_grid(parse_grid("auto", 3), work, 3, constraints=[pg.grid_problems])



@pytest.mark.slow
def test_a_damaged_block_stops_every_rank_with_a_clear_error(tmp_path):
    out = tmp_path / "p"
    prepare(graph_source(directed_graph(n=80, e=500)), out, blocks=2, quiet=True)
    (out / "even" / "1_1" / "indices.npy").write_bytes(b"\x93NUMPY")  # truncated
    # 2 layers on 1x1x2: rank z=1 alone maps row block 1, so only it meets the damage
    r = run_module("plexus.train", ["--dataset", str(out), "--epochs", "1", "--layers", "2",
                                    "--grid", "1x1x2"], ranks=2)
    assert r.returncode != 0
    assert re.search(r"\[rank 1\] error: cannot read \S+even/1_1/indices\.npy", r.stderr), \
        r.stderr
    assert "[rank 0] error: another rank could not read its shard" in r.stderr, r.stderr


def _damage(path, index, value):
    """Overwrite one element of a .npy file in place: the file keeps its size."""
    import numpy as np

    arr = np.load(path, mmap_mode="r+")
    arr[index] = value
    arr.flush()
    del arr


@pytest.mark.parametrize("file, value, problem", [
    ("indices.npy", 2**30, "a column index lies outside"),
    ("values.npy", float("nan"), "a value is NaN or infinite"),
    ("indptr.npy", 0, "row pointers"),
])
def test_a_block_damaged_in_place_is_named_not_a_crash(tmp_path, file, value, problem):
    """A file that keeps its size passes the size check; the block check at mapping names it
    (a column index of 2**30 made the SpMM read outside X: a segmentation fault)."""
    from plexus.data.errors import DatasetCorruptError

    out = tmp_path / "p"
    prepare(graph_source(directed_graph(n=80, e=500)), out, blocks=2, quiet=True)
    where = -1 if file == "indptr.npy" else 3
    _damage(out / "even" / "1_0" / file, where, value)
    pg = PreparedGraph(out)
    grid = ProcessGrid.parse("1x1x1")
    with pytest.raises(DatasetCorruptError) as e:
        pg.shard(grid.shape, grid.coords(0), widths(directed_graph(n=80, e=500), 6, 2))
    assert "even/1_0/" in str(e.value) and problem in str(e.value)
    assert "plexus.prepare --verify" in str(e.value)


@pytest.mark.slow
def test_a_column_index_damaged_in_place_stops_every_rank_without_a_signal(tmp_path):
    out = tmp_path / "p"
    prepare(graph_source(directed_graph(n=80, e=500)), out, blocks=2, quiet=True)
    _damage(out / "even" / "1_1" / "indices.npy", 0, 2**30)
    r = run_module("plexus.train", ["--dataset", str(out), "--epochs", "1", "--layers", "2",
                                    "--grid", "1x1x2"], ranks=2)
    assert r.returncode > 0, (r.returncode, r.stderr)  # an exit code, not a signal
    assert re.search(r"\[rank 1\] error: \S+even/1_1/\{indptr,indices,values\}\.npy: a column "
                     r"index lies outside", r.stderr), r.stderr
    assert "[rank 0] error: another rank could not read its shard" in r.stderr, r.stderr


@pytest.mark.parametrize("kind", ["planted", "directed"])
@pytest.mark.parametrize("aggregation", ["gcn", "mean"])
def test_the_transposes_a_device_multiplies_are_made_once_from_the_one_copy(tmp_path, kind,
                                                                           aggregation):
    """The dataset stores no transpose (format 3): where torch multiplies, every layer's
    ``A^T`` is made from the blocks (an odd layer of a symmetric graph: its own forward block
    is made that way), equals the block's transpose exactly, and the GCN's layers of the two
    parities on a symmetric graph share the made blocks instead of holding two copies (the
    mean adjacency's odd blocks have values of their own)."""
    graph = (planted_partition(num_nodes=203, num_classes=5, num_features=7, avg_degree=5,
                               seed=3) if kind == "planted" else directed_graph())
    prepare(graph_source(graph), tmp_path / "p", blocks=4, seed=4, quiet=True)
    assert not any(p.name.startswith("t_") for p in (tmp_path / "p").rglob("*.npy"))
    pg = PreparedGraph(tmp_path / "p", aggregation=aggregation)
    grid = ProcessGrid.parse("2x1x2")
    shard = pg.shard(grid.shape, grid.coords(3), widths(graph, 2, 6))
    made = []
    for layer in (0, 1):
        adj = shard.adj[layer]
        copy = adj.a_t._make_copy()
        a, t = adj.a.to_scipy(), copy.to_scipy()
        assert (a.T != t).nnz == 0 and t.nnz == a.nnz, layer
        assert all(blk.to_scipy().has_sorted_indices for _, _, blk in copy.present())
        made.append({id(blk) for _, _, blk in copy.present()}
                    | {id(blk) for _, _, blk in adj.a.present()})
    shared = made[0] & made[1]  # layer 1's forward blocks are layer 0's transposes
    assert bool(shared) == (kind == "planted" and aggregation == "gcn"), shared


def _resident_kib(paths: set[str]) -> int:
    """This process's resident KiB of its mappings of the files ``paths``."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                inside = len(head) > 5 and head[5] in paths
            elif inside and head[0] == "Rss:":
                total += int(head[1])
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
@pytest.mark.parametrize("spec, coords", [("2x1x2", 3), ("1x2x2", 1), ("1x1x1", 0)])
def test_the_last_layers_full_block_gives_its_pages_back_once_restricted(tmp_path, spec,
                                                                         coords):
    """Restricting the last layer to the labelled rows reads the rows of its full block, then
    gives the block's pages back where no other layer maps the same arrays (the step never
    reads it); an all-rows product maps them again and is unchanged."""
    graph = planted_partition(num_nodes=203, num_classes=5, num_features=7, avg_degree=5,
                              seed=3, split_fractions=(0.1, 0.05, 0.05))
    prepare(graph_source(graph), tmp_path / "p", blocks=4, seed=4, quiet=True)
    grid = ProcessGrid.parse(spec)
    shard = PreparedGraph(tmp_path / "p", aggregation="mean").shard(
        grid.shape, grid.coords(coords), widths(graph, 3, 6))
    full = shard.adj[2].a
    others = {id(a) for k in (0, 1) for a in shard.adj[k].a.arrays()}
    own = {str(a.filename) for a in full.arrays() if id(a) not in others}
    assert own or spec == "1x1x1"  # one rank: layers 0 and 2 share one block
    x = torch.randn(full.shape[1], 3, dtype=torch.float64)
    before = full.matmul(x)  # reads every page of the block
    assert _resident_kib(own) > 0 or not own
    shard.restrict_last_layer(root=True)
    assert _resident_kib(own) == 0
    assert _resident_kib({str(a.filename) for a in full.arrays() if id(a) in others}) > 0 or (
        spec != "1x1x1")  # a block other layers read stays mapped
    assert torch.equal(full.matmul(x), before)
    assert shard.labelled_adj is not None and shard.labelled_adj.a.shape[0] < full.shape[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_the_permutations_are_not_kept_resident(tmp_path):
    """The [N] permutations of a prepared dataset are read whole to build GraphSAGE's root
    blocks, and in chunks for the dropout masks' node ids: neither leaves their pages in the
    rank's resident size (a full-size object per rank, at scale), and the ids read are the
    permutation's."""
    import numpy as np

    from common.grid import AxisGroup
    from plexus.shards import node_chunk

    graph = planted_partition(num_nodes=203, num_classes=5, num_features=7, avg_degree=5,
                              seed=3)
    prepare(graph_source(graph), tmp_path / "p", blocks=4, seed=4, quiet=True)
    grid = ProcessGrid.parse("2x1x2")
    shard = PreparedGraph(tmp_path / "p", aggregation="mean").shard(
        grid.shape, grid.coords(1), widths(graph, 3, 6))
    perms = {str((tmp_path / "p" / "perm" / f"{name}.npy").resolve()) for name in ("pr", "pc")}
    assert shard.root is not None and _resident_kib(perms) == 0
    assert int(np.asarray(shard.pc)[:64].sum()) >= 0  # a read maps the pages again
    assert _resident_kib(perms) > 0
    group = AxisGroup(name="x", group=None, size=2, rank=1)
    ids = node_chunk(shard.pc, group)
    assert _resident_kib(perms) == 0
    n = shard.pc.size // 2
    assert torch.equal(ids, torch.from_numpy(np.array(shard.pc[n:], dtype=np.int64)))
