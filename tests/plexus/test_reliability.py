"""Reliability of plexus training: exact resume, re-sharding, preemption, lost ranks, bad input.

Every failure here is injected for real: SIGKILL of a rank, SIGTERM as Slurm sends it,
corrupted and foreign checkpoints, malformed datasets. Each bad input must give a clear message
and a non-zero exit on every rank, and leave no partial output behind.
"""

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed import kill_one_rank_and_collect, run_ranks
from tests.plexus.test_train import MPIEXEC, ROOT, _cli, needs_mpi

SMALL = ["--hidden", "16", "--log-every", "1"]


def _losses(path):
    return {r["epoch"]: r["loss"] for r in map(json.loads, Path(path).read_text().splitlines())
            if "epoch" in r}


@needs_mpi
def test_resume_is_bit_for_bit(tmp_path):
    args = [*SMALL, "--grid", "1x1x2", "--learn-features"]
    a = _cli([*args, "--epochs", "8", "--metrics", str(tmp_path / "a.jsonl")], 2)
    assert a.returncode == 0, a.stderr
    ck = str(tmp_path / "ck")
    b1 = _cli([*args, "--epochs", "4", "--checkpoint-dir", ck], 2)
    assert b1.returncode == 0, b1.stderr
    b2 = _cli([*args, "--epochs", "8", "--checkpoint-dir", ck, "--resume",
               "--metrics", str(tmp_path / "b.jsonl")], 2)
    assert b2.returncode == 0, b2.stderr
    assert "resumed from the checkpoint of epoch 4" in b2.stdout
    full, resumed = _losses(tmp_path / "a.jsonl"), _losses(tmp_path / "b.jsonl")
    assert sorted(resumed) == [5, 6, 7, 8]
    assert all(resumed[e] == full[e] for e in resumed), (full, resumed)  # exact equality


def _train_and_save(ctx, grid, ck):
    from common.grid import ProcessGrid
    from plexus.datasets import planted_partition
    from plexus.trainer import CheckpointConfig, TrainConfig, train_gcn

    graph = planted_partition(num_nodes=301, seed=2)
    res = train_gcn(graph, ProcessGrid.parse(grid), ctx.rank,
                    TrainConfig(epochs=3, hidden=12, learn_features=True, permutation="double"),
                    checkpoint=CheckpointConfig(dir=ck))
    return _full_logits(res.model)


def _load_and_predict(ctx, grid, ck):
    from common.grid import ProcessGrid
    from plexus import checkpoint
    from plexus.datasets import planted_partition
    from plexus.trainer import TrainConfig, setup

    graph = planted_partition(num_nodes=301, seed=2)
    cfg = TrainConfig(epochs=3, hidden=12, learn_features=True, permutation="single", seed=9)
    _, _, model = setup(graph, ProcessGrid.parse(grid), ctx.rank, cfg)
    opt = torch.optim.AdamW(model.parameters())
    checkpoint.load(ck, model, opt, meta=checkpoint.identity(model, graph.name))
    return _full_logits(model)


def _full_logits(model):
    """Full logits [N, C] in original node order, on every rank."""
    from common import collectives as C
    from plexus import partition as part

    with torch.no_grad():
        logits = model()
    o, _, p = part.roles(model.num_layers - 1)
    rows = torch.from_numpy(model.shard.out_rows)
    block = C.all_gather(C.all_gather(logits, model.groups[o], dim=1), model.groups[p])
    rows = C.all_gather(rows, model.groups[p])
    out = torch.zeros(model.shard.num_nodes, model.shard.num_classes)
    out[rows[rows >= 0]] = block[rows >= 0, : model.shard.num_classes]
    return out


@pytest.mark.parametrize("save_grid, load_grid", [("2x2x2", "1x1x1"), ("2x1x2", "1x2x1")])
def test_checkpoint_loads_on_another_grid(tmp_path, save_grid, load_grid):
    ck = str(tmp_path / "ck")
    world = lambda g: int(torch.tensor([int(s) for s in g.split("x")]).prod())  # noqa: E731
    saved = run_ranks(_train_and_save, world(save_grid), save_grid, ck)[0]
    loaded = run_ranks(_load_and_predict, world(load_grid), load_grid, ck)
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


@needs_mpi
def test_sigterm_checkpoints_and_exits_cleanly(tmp_path):
    ck = str(tmp_path / "preempt-ck")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([MPIEXEC, "-n", "2", sys.executable, "-m", "plexus.train", *SMALL,
                             "--epochs", "100000", "--checkpoint-dir", ck],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
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
    resumed = _cli([*SMALL, "--epochs", str(manifest["step"] + 2), "--checkpoint-dir", ck,
                    "--resume"], 2)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from the checkpoint of epoch {manifest['step']}" in resumed.stdout


def test_a_killed_rank_stops_every_other_rank_with_its_name():
    results = kill_one_rank_and_collect(
        ["plexus.train", "--grid", "2x2x1", "--epochs", "100000", *SMALL], world=4, victim=2,
        ready="epoch    3/")
    for r, (code, err, seconds) in results.items():
        assert code != 0 and seconds < 60, (r, code, seconds)
        assert f"[rank {r}] error: rank 2 was lost" in err, err[-2000:]


def _tree_digest(path):
    h = hashlib.sha256()
    for p in sorted(Path(path).rglob("*")):
        h.update(str(p.relative_to(path)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def test_bad_inputs_fail_clearly_and_lose_nothing(tmp_path):
    """A table of bad inputs; each must exit non-zero with a message naming the problem, write
    no metrics file, and leave an existing checkpoint directory byte-for-byte unchanged."""
    from tests.plexus.ogb_format import write_arxiv_like

    ck = str(tmp_path / "ck")
    ok = _cli([*SMALL, "--epochs", "2", "--checkpoint-dir", ck])
    assert ok.returncode == 0, ok.stderr
    before = _tree_digest(ck)

    def dataset(tag, edit):
        root = tmp_path / tag
        w = write_arxiv_like(root, num_nodes=120)
        edit(w.directory / "raw")
        return str(root)

    def truncate(raw):
        data = (raw / "edge.csv.gz").read_bytes()
        (raw / "edge.csv.gz").write_bytes(data[: len(data) // 2])

    def bad_label(raw):
        import gzip
        with gzip.open(raw / "node-label.csv.gz", "wt") as f:
            f.write("\n".join(["99"] + ["1"] * 119) + "\n")

    def nan_feature(raw):
        import gzip
        with gzip.open(raw / "node-feat.csv.gz", "rt") as f:
            rows = f.read().splitlines()
        rows[5] = ",".join(["nan"] * len(rows[5].split(",")))
        with gzip.open(raw / "node-feat.csv.gz", "wt") as f:
            f.write("\n".join(rows) + "\n")

    (tmp_path / "a-file").write_text("x")
    cases = [
        ("unknown dataset", ["--dataset", "no-such-graph"], "no-such-graph"),
        ("missing files", ["--dataset", "ogbn-arxiv", "--root", str(tmp_path / "empty")],
         "not found"),
        ("truncated file", ["--dataset", "ogbn-arxiv", "--root", dataset("trunc", truncate)],
         "ogbn-arxiv"),
        ("label out of range", ["--dataset", "ogbn-arxiv", "--root",
                                dataset("label", bad_label)], "labels outside [0, C=40)"),
        ("NaN feature", ["--dataset", "ogbn-arxiv", "--root", dataset("nan", nan_feature)],
         "NaN"),
        ("grid does not match", ["--grid", "2x1x1"], "but 1 processes were launched"),
        ("layers 0", ["--layers", "0"], "layers >= 1"),
        ("hidden 0", ["--hidden", "0"], "hidden >= 1"),
        ("unwritable metrics dir", ["--metrics", str(tmp_path / "a-file" / "m.jsonl")],
         "does not exist"),
        ("unwritable checkpoint dir", ["--checkpoint-dir", str(tmp_path / "a-file" / "ck")],
         "cannot create directory"),
        ("checkpoint of another model", ["--hidden", "32", "--checkpoint-dir", ck, "--resume"],
         "different model"),
    ]
    for name, args, fragment in cases:
        metrics = tmp_path / f"{name.replace(' ', '_')}.jsonl"
        extra = [] if "--metrics" in args else ["--metrics", str(metrics)]
        r = _cli(["--epochs", "2", *args, *extra], timeout=120)
        assert r.returncode != 0, f"{name}: exit 0\n{r.stdout}"
        assert fragment in r.stderr, f"{name}: message lacks {fragment!r}:\n{r.stderr[-1500:]}"
        assert "Traceback" not in r.stderr, f"{name}: a traceback instead of a message"
        assert not metrics.exists() and not Path(str(metrics) + ".tmp").exists(), name
    assert _tree_digest(ck) == before  # data lost: 0
    print(f"bad inputs tried: {len(cases)}; rejected with a clear message: {len(cases)}; "
          "data lost: 0")
