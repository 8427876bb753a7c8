"""python -m plexus.train: the command line, its output, its errors and failures.

Every failure here is injected for real: SIGKILL of a rank, malformed datasets, unwritable
paths. Each bad input must give a clear message and a non-zero exit on every rank, and leave
no partial output behind.
"""

import hashlib
import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.distributed import kill_one_rank_and_collect, launch, needs_mpi, run_module

SMALL = ["--hidden", "16", "--log-every", "1"]


def cli(args, n=None, timeout=300, *, mpiexec=False):
    """``python -m plexus.train ARGS`` on ``n`` ranks (default 1) forked from the tests' fork
    server (:func:`tests.distributed.run_module`: gloo under torchrun's environment), or with
    ``mpiexec=True`` under mpiexec (the MPI transport), for the tests about the launcher."""
    if not mpiexec:
        return run_module("plexus.train", args, ranks=n or 1, timeout=timeout)
    return launch(["-m", "plexus.train", *args], ranks=n, launcher="mpiexec", timeout=timeout)


@pytest.mark.slow
@needs_mpi
def test_cli_four_ranks_writes_metrics(tmp_path):
    path = tmp_path / "m.jsonl"
    r = cli(["--epochs", "4", "--hidden", "16", "--metrics", str(path), "--log-every", "2"], 4,
            mpiexec=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "grid 2x2x1 (4 ranks, mpiexec, mpi)" in r.stdout
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


@pytest.mark.slow
def test_cli_wrong_grid_fails_on_every_rank():
    r = cli(["--grid", "2x2x1", "--epochs", "1"], 2, timeout=120)
    assert r.returncode != 0
    msg = re.escape("grid x=2 * y=2 * z=1 = 4 ranks, but 2 processes were launched")
    assert set(re.findall(r"\[rank (\d)\] error: " + msg, r.stderr)) == {"0", "1"}, r.stderr


def test_cli_bad_inputs(tmp_path):
    r = cli(["--dataset", "cora-typo", "--epochs", "1"], timeout=120)
    assert r.returncode != 0 and "cora-typo" in r.stderr and "planted" in r.stderr
    r = cli(["--dataset", "ogbn-arxiv", "--root", str(tmp_path), "--epochs", "1"], timeout=120)
    assert r.returncode != 0 and str(tmp_path) in r.stderr, r.stderr
    bad = tmp_path / "missing-dir" / "m.jsonl"
    r = cli(["--epochs", "1", "--metrics", str(bad)], timeout=120)
    assert r.returncode != 0 and "does not exist" in r.stderr
    assert not bad.parent.exists()


def test_help_lists_the_flags():
    r = cli(["--help"], timeout=60)
    assert r.returncode == 0
    for flag in ("--dataset", "--root", "--grid", "--layers", "--hidden", "--epochs", "--lr",
                 "--weight-decay", "--seed", "--permutation", "--learn-features", "--metrics",
                 "--device", "--spmm", "--no-retain-freed-memory", "--dist-timeout",
                 "--checkpoint-dir", "--checkpoint-every", "--keep-checkpoints", "--resume",
                 "--model", "--dropout", "--no-bias", "--norm", "--normalize-features",
                 "--symmetrize", "--optimizer", "--runs", "--eval-every", "--labelled-rows",
                 "--weight-first", "--keep-first-aggregation"):
        assert flag in r.stdout


def test_labelled_rows_on_and_off_print_the_same_run(tmp_path):
    """--labelled-rows on and off: the same losses and accuracies on the built-in graph (its
    nodes outside every split make the row subset real); a bad value exits 2. Both with
    --weight-first off (one layer order); --weight-first on says which layers multiply first."""
    rows = {}
    for mode in ("on", "off"):
        path = tmp_path / f"{mode}.jsonl"
        r = cli(["--epochs", "3", "--labelled-rows", mode, "--weight-first", "off", "--metrics",
                 str(path)], timeout=120)
        assert r.returncode == 0, r.stderr
        assert "multiply first" not in r.stdout
        rows[mode] = [json.loads(line) for line in path.read_text().splitlines()]
    keys = ("loss", "train_acc", "val_acc", "test_acc")
    epochs = {m: [[row[k] for k in keys] for row in rs if "epoch" in row and "loss" in row]
              for m, rs in rows.items()}
    assert len(epochs["on"]) == 3 and epochs["on"][0] == epochs["off"][0]
    for a, b in zip(epochs["on"], epochs["off"]):  # later epochs: dW to float rounding
        assert b[1:] == a[1:] and abs(a[0] - b[0]) <= 1e-5 * abs(b[0])
    assert cli(["--labelled-rows", "sometimes"], timeout=60).returncode == 2
    r = cli(["--epochs", "1", "--labelled-rows", "off", "--weight-first", "on"], timeout=120)
    assert r.returncode == 0, r.stderr
    # fixed features with dropout (the default 0.5): layer 0 too, its F' remade in backward
    assert "multiply first, A (F W): layer 0, 1, 2\n" in r.stdout, r.stdout


def test_eval_every_evaluates_every_nth_and_the_last_epoch_and_says_so(tmp_path):
    """--eval-every 3 over 7 epochs and 2 runs: the same losses as evaluating every epoch, the
    same accuracies at epochs 3, 6 and 7 and none at the others (in the metrics and the printed
    lines), the best validation epoch one of those, the summary counting them, and the mean
    +- std over the runs; --eval-every 0 is refused (exit 2, no traceback, no metrics)."""
    base = ["--hidden", "16", "--epochs", "7", "--runs", "2", "--log-every", "1"]
    jobs = {n: [*base, "--eval-every", str(n), "--metrics", str(tmp_path / f"{n}.jsonl")]
            for n in (1, 3)}
    jobs[0] = ["--eval-every", "0", "--metrics", str(tmp_path / "0.jsonl")]
    with ThreadPoolExecutor(max_workers=2) as pool:
        out = dict(zip(jobs, pool.map(lambda args: cli(args, timeout=120), jobs.values())))
    assert out[0].returncode == 2, out[0].stdout + out[0].stderr
    assert "need eval_every >= 1" in out[0].stderr and "Traceback" not in out[0].stderr
    assert not (tmp_path / "0.jsonl").exists()
    lines = {}
    for n in (1, 3):
        assert out[n].returncode == 0, out[n].stdout + out[n].stderr
        lines[n] = [json.loads(x) for x in (tmp_path / f"{n}.jsonl").read_text().splitlines()]
    rows = {n: {(r["run"], r["epoch"]): r for r in lines[n] if "epoch" in r} for n in (1, 3)}
    assert sorted(rows[3]) == sorted(rows[1]) == [(r, e) for r in (0, 1) for e in range(1, 8)]
    accs = ("train_acc", "val_acc", "test_acc")
    for key, row in rows[3].items():
        assert row["loss"] == rows[1][key]["loss"], key  # evaluating does not change training
        if key[1] in (3, 6, 7):
            assert [row[k] for k in accs] == [rows[1][key][k] for k in accs], key
        else:
            assert not set(row) & {*accs, "eval_s"}, row
    assert out[3].stdout.count("(not evaluated)") == 8
    assert out[3].stdout.count("(over the 3 evaluated epochs, every 3)") == 2
    assert out[1].stdout.count("(over the 7 evaluated epochs, every epoch)") == 2
    summaries = [x["summary"] for x in lines[3] if "summary" in x]
    for run_index, s in enumerate(summaries):
        best = s["best_val"]
        assert best["evaluated_epochs"] == 3 and best["eval_every"] == 3
        assert best["epoch"] in (3, 6, 7)
        pick = max((rows[3][(run_index, e)] for e in (3, 6, 7)), key=lambda r: r["val_acc"])
        assert (best["val_acc"], best["test_acc"]) == (pick["val_acc"], pick["test_acc"])
        assert s["final"]["val_acc"] == rows[3][(run_index, 7)]["val_acc"]
    overall = lines[3][-1]["runs_summary"]
    tests = [s["best_val"]["test_acc"] for s in summaries]
    assert overall["runs"] == 2 and overall["best_val.test_acc"]["mean"] == pytest.approx(
        sum(tests) / 2)
    assert "2 runs:" in out[3].stdout and "at best val" in out[3].stdout


@pytest.mark.slow
def test_ogb_format_datasets_train_through_the_real_loaders(tmp_path):
    """Tiny datasets in exact OGB on-disk format (CSV arxiv-like, npz papers100M-like) load
    through the unmodified ogb loaders and report OGB Evaluator accuracy (final and at the best
    validation epoch): papers100M-like with the GCN on 2 ranks; arxiv-like (directed) with the
    issue's recipe on 4 ranks: GraphSAGE, dropout, batch norm, symmetrized, two runs.
    ogbn-papers100M goes through the prepared cache whatever its size: rank 0 prepares it
    (k = 8 for grid 1x1x2) while rank 1 waits, and both map it."""
    from plexus.data import PreparedGraph
    from tests.plexus.data.ogb_format import write_arxiv_like, write_papers100m_like

    write_arxiv_like(tmp_path, num_nodes=300)
    write_papers100m_like(tmp_path, num_nodes=400)
    jobs = {"ogbn-arxiv": (["--grid", "2x1x2", "--model", "sage", "--dropout", "0.5", "--norm",
                            "batch", "--symmetrize", "--runs", "2", "--epochs", "8"], 4),
            "ogbn-papers100M": (["--grid", "1x1x2", "--epochs", "15"], 2)}
    for name, (extra, ranks) in jobs.items():
        path = tmp_path / f"{name}.jsonl"
        r = cli(["--dataset", name, "--root", str(tmp_path), "--hidden", "32",
                  "--metrics", str(path), *extra], ranks)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "OGB Evaluator" in r.stdout
        lines = [json.loads(x) for x in path.read_text().splitlines()]
        summaries = [x["summary"] for x in lines if "summary" in x]
        assert len(summaries) == (2 if ranks == 4 else 1)
        for summary in summaries:
            for key in ("ogb_evaluator", "ogb_evaluator_best_val"):
                ev = summary[key]  # tests/plexus/test_trainer.py checks its values
                assert set(ev) == {"train", "val", "test"}
                assert ev["train"] > 0.5, (name, ev)  # the model learned the planted labels
            assert summary["ogb_evaluator_best_val"]["test"] == pytest.approx(
                summary["best_val"]["test_acc"])  # the Evaluator agrees with our counts
            assert summary["num_nodes"] == (300 if name == "ogbn-arxiv" else 400)
        if ranks == 4:
            assert summary["config"]["model"]["model"] == "sage"
            assert "2 runs:" in r.stdout and "at best val" in r.stdout
            assert lines[-1]["runs_summary"]["runs"] == 2
        else:  # prepared once, by one rank, then memory-mapped by both
            out = tmp_path / "prepared" / "ogbn-papers100M-k8-double-s0"
            assert r.stdout.count(f"preparing {name} into {out}") == 1 and PreparedGraph(out)
            assert "(memory-mapped)" in r.stdout


@pytest.mark.slow
@needs_mpi
def test_a_lost_rank_stops_every_other_rank_with_its_name():
    """The MPI transport under mpiexec, a hung rank (SIGSTOP; tests/distributed.py says why not
    SIGKILL there). Both trainers start through common.run, so the other launcher (gloo under
    torchrun's environment, a SIGKILLed rank) is tested with llm.train (tests/llm/test_train.py)."""
    results = kill_one_rank_and_collect(
        ["plexus.train", "--grid", "2x2x1", "--epochs", "100000", *SMALL], world=4, victim=2,
        ready="epoch    3/", launcher="mpiexec")
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


def test_gat_trains_a_prepared_dataset_and_resumes_on_another_grid(tmp_path):
    """``--model gat`` end to end on an OGB-format papers100M-like graph, prepared into the
    cache (GCN's blocks: GAT reads their pattern) on 2 ranks: it learns; resumed from its
    epoch-3 checkpoint on the same grid it continues bit for bit, on another grid to float
    rounding; heads that do not split over a layer's inner axis stop every rank clearly."""
    from tests.plexus.data.ogb_format import write_papers100m_like

    write_papers100m_like(tmp_path, num_nodes=400)
    base = ["--dataset", "ogbn-papers100M", "--root", str(tmp_path), "--model", "gat",
            "--heads", "2", "--hidden", "8", "--attention-dropout", "0.3", "--dropout", "0.3",
            "--norm", "batch", "--lr", "0.01", "--log-every", "1"]
    ck = str(tmp_path / "ck")
    runs = {"full": ["--grid", "1x1x2", "--epochs", "6"],
            "first": ["--grid", "1x1x2", "--epochs", "3", "--checkpoint-dir", ck],
            "same": ["--grid", "1x1x2", "--epochs", "6", "--checkpoint-dir", ck, "--resume",
                     "--checkpoint-every", "100"],
            "other": ["--grid", "2x1x1", "--epochs", "6", "--checkpoint-dir", ck + "-copy",
                      "--resume", "--checkpoint-every", "100"]}
    losses = {}
    for name, extra in runs.items():
        if name == "same":  # "other" resumes from the epoch-3 checkpoint too
            shutil.copytree(ck, ck + "-copy")
        path = tmp_path / f"{name}.jsonl"
        r = cli([*base, *extra, "--metrics", str(path)], 2)
        assert r.returncode == 0, r.stdout + r.stderr
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        losses[name] = {x["epoch"]: x["loss"] for x in rows if "loss" in x}
        if name == "full":
            summary = next(x["summary"] for x in rows if "summary" in x)
            assert summary["config"]["model"]["model"] == "gat"
            assert summary["ogb_evaluator"]["train"] > 0.5, summary  # it learned
            assert losses[name][6] < losses[name][1]
    assert sorted(losses["same"]) == sorted(losses["other"]) == [4, 5, 6], losses
    assert all(losses["same"][e] == losses["full"][e] for e in (4, 5, 6)), losses
    assert all(abs(losses["other"][e] - losses["full"][e]) <= 1e-5 * losses["full"][e]
               for e in (4, 5, 6)), losses
    r = cli([*base, "--grid", "1x1x2", "--heads", "3", "--epochs", "1"], 2, timeout=120)
    assert r.returncode != 0
    assert set(re.findall(r"\[rank (\d)\] error: .*heads: 3 % z=2 = 1", r.stderr)) == {"0", "1"}, \
        r.stderr


@pytest.mark.slow
def test_bad_inputs_fail_clearly_and_lose_nothing(tmp_path):
    """A table of bad inputs; each must exit non-zero with a message naming the problem, write
    no metrics file, and leave an existing checkpoint directory byte-for-byte unchanged."""
    from tests.plexus.data.ogb_format import write_arxiv_like

    ck = str(tmp_path / "ck")
    ok = cli([*SMALL, "--epochs", "2", "--checkpoint-dir", ck])
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
         "truncated or corrupt"),
        ("label out of range", ["--dataset", "ogbn-arxiv", "--root",
                                dataset("label", bad_label)], "labels outside [0, C=40)"),
        ("NaN feature", ["--dataset", "ogbn-arxiv", "--root", dataset("nan", nan_feature)],
         "NaN"),
        ("grid does not match", ["--grid", "2x1x1"], "but 1 processes were launched"),
        ("layers 0", ["--layers", "0"], "layers >= 1"),
        ("hidden 0", ["--hidden", "0"], "hidden >= 1"),
        ("heads 0", ["--model", "gat", "--heads", "0"], "heads >= 1"),
        ("gat in bf16", ["--model", "gat", "--precision", "bf16"], "runs in precision 'fp32'"),
        ("attention dropout 1", ["--model", "gat", "--attention-dropout", "1"],
         "attention_dropout < 1"),
        ("unwritable metrics dir", ["--metrics", str(tmp_path / "a-file" / "m.jsonl")],
         "does not exist"),
        ("unwritable checkpoint dir", ["--checkpoint-dir", str(tmp_path / "a-file" / "ck")],
         "cannot create the directory"),
        ("checkpoint of another model", ["--hidden", "32", "--checkpoint-dir", ck, "--resume"],
         "different model"),
    ]
    def attempt(case):
        name, args, _ = case
        metrics = tmp_path / f"{name.replace(' ', '_')}.jsonl"
        extra = [] if "--metrics" in args else ["--metrics", str(metrics)]
        return metrics, cli(["--epochs", "2", *args, *extra], timeout=120)

    # two single-process jobs at a time: each is mostly one core's start-up (imports)
    with ThreadPoolExecutor(max_workers=2) as pool:
        outcomes = list(pool.map(attempt, cases))
    for (name, _, fragment), (metrics, r) in zip(cases, outcomes, strict=True):
        assert r.returncode != 0, f"{name}: exit 0\n{r.stdout}"
        assert fragment in r.stderr, f"{name}: message lacks {fragment!r}:\n{r.stderr[-1500:]}"
        assert "Traceback" not in r.stderr, f"{name}: a traceback instead of a message"
        assert not metrics.exists() and not Path(str(metrics) + ".tmp").exists(), name
    assert _tree_digest(ck) == before  # data lost: 0
    print(f"bad inputs tried: {len(cases)}; rejected with a clear message: {len(cases)}; "
          "data lost: 0")


def test_runs_without_epochs_is_refused_naming_both_flags():
    """--runs 2 --epochs 0 has no accuracy to average: refused before any data is read."""
    from types import SimpleNamespace

    from plexus.train import build, parse_args

    ctx = SimpleNamespace(world_size=1, rank=0, local_rank=0, is_main=True)
    with pytest.raises(ValueError, match=r"--runs 2 reports the mean .*--epochs 0 trains and "
                       r"evaluates nothing"):
        build(parse_args(["--runs", "2", "--epochs", "0"]), ctx)


def test_the_prepare_help_says_every_model_maps_the_cache(capsys):
    from plexus.train import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "excepted" not in text and "for every --model (a prepared dataset serves" in text


@pytest.mark.parametrize("flags,message", [
    (["--heads", "4"], r"--heads is GAT's: model 'gcn' has no attention heads"),
    (["--model", "sage", "--heads", "1"], r"--heads is GAT's: model 'sage'"),
    (["--residual", "--layers", "2"], r"--residual adds a layer's input to its output in the "
     r"hidden-to-hidden layers \(1 \.\. L-2.*--layers 2 has none"),
    (["--model", "gat", "--keep-first-aggregation"],
     r"model 'gat' does not run recompute_first=False \(--keep-first-aggregation\)"),
    (["--model", "gat", "--gemm", "torch"], r"--gemm torch picks the backend of GCN's"),
    (["--model", "gat", "--spmm", "torch"], r"--spmm torch .* only for --residual"),
])
def test_options_a_model_would_ignore_are_refused_naming_the_flag(flags, message):
    """Refused before any data is read, not trained with and recorded in the checkpoint."""
    from types import SimpleNamespace

    from plexus.train import build, parse_args

    ctx = SimpleNamespace(world_size=1, rank=0, local_rank=0, is_main=True)
    with pytest.raises(ValueError, match=message):
        build(parse_args(["--epochs", "1", *flags]), ctx)
