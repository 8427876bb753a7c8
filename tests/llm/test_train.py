"""The trainer and its CLIs: schedule, exact resume, checkpoints, rank-0 output, errors.

Single-process runs need no process group and run in this process; the CLIs run in-process
through ``main(argv)`` except where a real launcher is the point (mpiexec).
"""

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llm import checkpoint
from llm.memorization import main as memorization_main
from llm.sample import main as sample_main
from llm.train import main as train_main
from llm.train import run
from llm.trainer import DataConfig, GoldfishConfig, OptimConfig, TrainConfig, lr_at
from tests.llm.test_parallel import make_trainer, one_rank_groups

ROOT = Path(__file__).resolve().parents[2]
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent))
needs_mpi = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install mpich)")


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_lr_schedule():
    cfg = OptimConfig(lr=1.0, min_lr_ratio=0.1, warmup_steps=4)
    lrs = [lr_at(s, 14, cfg) for s in range(1, 15)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[-1] == pytest.approx(0.1)
    assert lrs[8] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))  # decays monotonically


@pytest.mark.parametrize("kwargs, message", [
    (lambda: DataConfig(docs=0), "--docs"),
    (lambda: OptimConfig(lr=0), "lr > 0"),
    (lambda: GoldfishConfig(strategy="md5"), "strategy"),
    (lambda: TrainConfig(steps=3, epochs=2), "not both"),
    (lambda: TrainConfig(overlap="fast"), "overlap"),
])
def test_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        kwargs()


def test_resume_continues_exactly(tmp_path):
    """6 straight steps == 3 steps, checkpoint through a file, fresh trainer, 3 more steps."""
    straight = make_trainer(one_rank_groups(), steps=6)
    expected = run(straight)
    first = make_trainer(one_rank_groups(), steps=6)
    for _ in range(3):
        first.train_step()
    path = checkpoint.save(first.state_dict(), tmp_path / "ck")
    assert path == tmp_path / "ck" / "step-00000003" / "checkpoint.pt"
    assert os.listdir(tmp_path / "ck") == ["step-00000003"]  # no temporary left behind
    second = make_trainer(one_rank_groups(), steps=6)
    second.load_state_dict(checkpoint.load(tmp_path / "ck"))
    resumed = run(second)
    keys = ("step", "loss", "loss_all", "loss_dropped", "grad_norm", "lr", "num_kept")
    assert [{k: r[k] for k in keys} for r in resumed] == \
        [{k: r[k] for k in keys} for r in expected[3:]]
    assert resumed[-1]["val_loss"] == expected[-1]["val_loss"]
    for name, p in second.model.shards().items():
        assert torch.equal(p, straight.model.shards()[name]), name


def test_overlap_switch_gives_identical_training():
    rows = [run(make_trainer(one_rank_groups(), steps=3, overlap=o)) for o in ("all", "none")]
    assert [r["loss"] for r in rows[0]] == [r["loss"] for r in rows[1]]


def test_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path):
    trainer = make_trainer(one_rank_groups(), steps=4)
    trainer.train_step()
    checkpoint.save(trainer.state_dict(), tmp_path)
    trainer.train_step()
    newest = checkpoint.save(trainer.state_dict(), tmp_path)
    newest.write_bytes(newest.read_bytes()[:100])  # truncated, as by a full disk
    assert checkpoint.load(tmp_path)["step"] == 1


def test_checkpoint_mismatch_is_refused():
    state = make_trainer(one_rank_groups(), steps=1).state_dict()
    state["model_config"]["d_model"] = 64
    with pytest.raises(ValueError, match="different model"):
        make_trainer(one_rank_groups()).load_state_dict(state)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        checkpoint.load("/nonexistent/dir")


def _errors(argv, capsys, main=train_main):
    with pytest.raises(SystemExit) as exc:
        code = main(argv)
        raise SystemExit(code)
    assert exc.value.code not in (0, None)
    return capsys.readouterr().err


def test_cli_single_process_train_checkpoint_memorize_sample(tmp_path, capsys):
    out, metrics = tmp_path / "run", tmp_path / "m.jsonl"
    common = ["--docs", "4", "--seq-len", "40", "--batch-size", "4", "--goldfish-k", "4",
              "--out", str(out), "--metrics", str(metrics), "--log-every", "1"]
    assert train_main([*common, "--epochs", "2"]) == 0
    assert train_main([*common, "--epochs", "3", "--resume"]) == 0
    text = capsys.readouterr().out
    assert "4 documents x 41 tokens; goldfish k=4 h=13 hash" in text
    assert "resumed at step 2" in text and "step     3/3" in text
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r["step"] for r in rows if "step" in r]
    assert steps == [1, 2, 3] and sum("summary" in r for r in rows) == 2
    for key in ("loss", "loss_all", "loss_dropped", "tokens_per_s", "lr", "grad_norm"):
        assert all(key in r for r in rows if "step" in r), key
    assert "val_loss" in rows[-2] and rows[-2]["num_dropped"] > 0
    assert sorted(os.listdir(out))[-1] == "step-00000003"
    assert all(name.startswith("step-") for name in os.listdir(out))
    assert memorization_main(["--checkpoint", str(out), "--suffix-len", "8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["num_docs"] == 4 and result["suffix_len"] == 8 and result["seq_len"] == 40
    assert 0 <= result["exact_match"] <= 1 and 0 <= result["rouge_l"] <= 1
    assert result["step"] == 3 and result["goldfish"]["k"] == 4
    assert sample_main(["--checkpoint", str(out), "--prompt", "The ", "--tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("The ")


def test_cli_errors(tmp_path, capsys):
    assert "--resume needs --out" in _errors(["--resume"], capsys)
    assert "no checkpoint at" in _errors(["--resume", "--out", str(tmp_path)], capsys)
    assert "num_docs must be in [1, " in _errors(["--docs", "500"], capsys)
    assert "exceeds the model's max_seq_len=128" in _errors(["--seq-len", "500"], capsys)
    assert "does not exist" in _errors(["--metrics", str(tmp_path / "x" / "m.jsonl")], capsys)
    assert "text file" in _errors(["--text", str(tmp_path / "missing.txt")], capsys)
    assert "not both" in _errors(["--steps", "2", "--epochs", "1"], capsys)
    assert "1 processes were launched" in _errors(["--grid", "data=1,row=2"], capsys)
    assert "no checkpoint" in _errors(["--checkpoint", str(tmp_path)], capsys,
                                      memorization_main)
    assert "no checkpoint" in _errors(["--checkpoint", str(tmp_path)], capsys, sample_main)


def _mpiexec(n, args, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([MPIEXEC, "-n", str(n), sys.executable, "-m", "llm.train", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


@needs_mpi
@pytest.mark.slow
def test_cli_four_ranks_prints_on_rank_0_and_checkpoints_for_any_grid(tmp_path, capsys):
    out, metrics = tmp_path / "run", tmp_path / "m.jsonl"
    r = _mpiexec(4, ["--grid", "data=1,depth=2,row=2,col=1", "--steps", "3", "--seq-len", "32",
                     "--batch-size", "4", "--out", str(out), "--metrics", str(metrics),
                     "--log-every", "1", "--eval-batches", "1"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("GPT tiny: 139,584 parameters") == 1  # rank 0 only
    assert "grid data=1,depth=2,row=2,col=1 (4 ranks, mpiexec, gloo)" in r.stdout
    assert r.stdout.count("step     3/3") == 1
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows if "step" in r] == [1, 2, 3]
    assert all(r["comm_bytes"] > 0 for r in rows if "step" in r)
    # the 4-rank checkpoint loads into one process and continues there
    assert train_main(["--steps", "4", "--seq-len", "32", "--batch-size", "4", "--out",
                       str(out), "--resume", "--eval-batches", "1"]) == 0
    assert "step     4/4" in capsys.readouterr().out


@needs_mpi
@pytest.mark.slow
def test_cli_wrong_grid_fails_on_every_rank():
    r = _mpiexec(2, ["--grid", "1x1x1x1", "--steps", "1"], timeout=120)
    assert r.returncode != 0
    msg = re.escape("grid data=1 * depth=1 * row=1 * col=1 = 1 ranks, but 2 processes were "
                    "launched")
    assert set(re.findall(r"\[rank (\d)\] error: " + msg, r.stderr)) == {"0", "1"}, r.stderr
