"""The CLIs (llm.train, llm.memorization, llm.sample): flags, rank-0 output, metrics,
checkpoints, resume, errors on every rank, and llm.train under injected faults (SIGTERM as
Slurm sends it; a SIGKILLed rank).

Single-process runs go through ``main(argv)`` in this process; a real launcher (mpiexec or
torchrun's environment) runs where it is the point.
"""

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from llm import checkpoint
from llm.memorization import main as memorization_main
from llm.sample import main as sample_main
from llm.train import main as train_main
from llm.train import parse_args
from tests.distributed import (
    ROOT,
    kill_one_rank_and_collect,
    launch,
    launch_env,
    needs_mpi,
    run_module,
)

FAULT_ARGS = ["--preset", "tiny", "--batch-size", "4", "--seq-len", "16", "--log-every", "1"]


def _errors(argv, capsys, main=train_main):
    with pytest.raises(SystemExit) as exc:
        code = main(argv)
        raise SystemExit(code)
    assert exc.value.code not in (0, None)
    return capsys.readouterr().err


def test_checkpoint_flags_and_their_aliases():
    new = parse_args(["--checkpoint-dir", "d", "--checkpoint-every", "5",
                      "--keep-checkpoints", "2", "--resume"])
    old = parse_args(["--out", "d", "--save-every", "5", "--keep-checkpoints", "2", "--resume"])
    for args in (new, old):
        assert (args.checkpoint_dir, args.checkpoint_every, args.keep_checkpoints,
                args.resume) == ("d", 5, 2, True)
    plain = parse_args([])
    assert (plain.checkpoint_dir, plain.checkpoint_every, plain.keep_checkpoints) == \
        (None, 0, 3)


def test_cli_single_process_train_checkpoint_memorize_sample(tmp_path, capsys):
    out, metrics = tmp_path / "run", tmp_path / "m.jsonl"
    common = ["--docs", "4", "--seq-len", "40", "--batch-size", "4", "--goldfish-k", "4",
              "--out", str(out), "--metrics", str(metrics), "--log-every", "1",
              "--keep-checkpoints", "2", "--checkpoint-every", "1"]
    assert train_main([*common, "--epochs", "2"]) == 0
    assert train_main([*common, "--epochs", "3", "--resume"]) == 0
    text = capsys.readouterr().out
    assert "4 documents x 41 tokens; goldfish k=4 h=13 hash" in text
    assert "resumed at step 2" in text and "step     3/3" in text
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r["step"] for r in rows if "step" in r]
    assert steps == [1, 2, 3] and sum("summary" in r for r in rows) == 2  # resume appends
    for r in rows:  # peak resident memory per rank, max over ranks, in every summary
        if "summary" in r:
            assert r["summary"]["peak_bytes_per_rank_max"] > 10 * 2**20
    assert "MiB resident per rank (max)" in text
    for key in ("loss", "loss_all", "loss_dropped", "tokens_per_s", "lr", "grad_norm"):
        assert all(key in r for r in rows if "step" in r), key
    assert "val_loss" in rows[-2] and rows[-2]["num_dropped"] > 0
    assert not (tmp_path / "m.jsonl.tmp").exists()
    assert sorted(os.listdir(out)) == ["step-00000002", "step-00000003"]  # keep 2 of 3
    # a new run where this one saved, or one step of it given as the root: refused, untouched
    assert "already holds checkpoints (steps 2-3) of an earlier run: pass --resume" in \
        _errors([*common, "--epochs", "4"], capsys)
    step_dir = str(out / "step-00000003")
    assert "is one checkpoint (it holds manifest.json)" in _errors(
        [*common[:common.index("--out")], "--out", step_dir, "--epochs", "4", "--resume"],
        capsys)
    assert sorted(os.listdir(out)) == ["step-00000002", "step-00000003"]
    assert memorization_main(["--checkpoint", str(out), "--suffix-len", "8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["num_docs"] == 4 and result["suffix_len"] == 8 and result["seq_len"] == 40
    assert 0 <= result["exact_match"] <= 1 and 0 <= result["rouge_l"] <= 1
    assert result["step"] == 3 and result["goldfish"]["k"] == 4
    assert sample_main(["--checkpoint", str(out), "--prompt", "The ", "--tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("The ")


def test_cli_resume_without_a_checkpoint_starts_fresh(tmp_path, capsys):
    """As in plexus.train: --resume continues when there is a checkpoint, else starts."""
    args = ["--steps", "1", "--seq-len", "16", "--batch-size", "2", "--eval-batches", "0",
            "--checkpoint-dir", str(tmp_path / "new"), "--resume"]
    assert train_main(args) == 0
    assert f"no checkpoint in {tmp_path / 'new'} yet: starting at step 0" in \
        capsys.readouterr().out
    assert checkpoint.open_checkpoint(tmp_path / "new").step == 1


def test_cli_resume_refuses_other_settings_and_warns_of_another_optimizer(tmp_path, capsys):
    """A resumed run with another loss, data or precision would silently be another run (a
    goldfish run continued without goldfish, then evaluated as one): refused, naming each
    setting; other optimizer settings may be meant (a lower learning rate after a spike):
    warned, naming each."""
    base = ["--docs", "4", "--batch-size", "4", "--seq-len", "16", "--eval-batches", "0",
            "--checkpoint-dir", str(tmp_path / "ck")]
    assert train_main([*base, "--epochs", "1", "--goldfish-k", "4"]) == 0
    err = _errors([*base, "--epochs", "2", "--resume"], capsys)
    assert "cannot resume from" in err and "goldfish.k 4 -> 0" in err
    err = _errors([*base, "--epochs", "2", "--resume", "--goldfish-k", "4", "--seq-len", "14",
                   "--seed", "3"], capsys)
    assert "data.seq_len 16 -> 14" in err and "seed 0 -> 3" in err
    assert checkpoint.open_checkpoint(tmp_path / "ck").step == 1  # nothing written
    with pytest.warns(UserWarning, match=r"other optimizer settings .*: optim.lr 0.003 -> 0.001"):
        assert train_main([*base, "--epochs", "2", "--resume", "--goldfish-k", "4",
                           "--lr", "1e-3"]) == 0
    assert "resumed at step 1" in capsys.readouterr().out


def test_cli_errors(tmp_path, capsys):
    assert "--resume needs --checkpoint-dir" in _errors(["--resume"], capsys)
    assert "--keep-checkpoints must be >= 1" in _errors(["--keep-checkpoints", "0"], capsys)
    (tmp_path / "file").write_text("")
    assert "--checkpoint-dir" in _errors(["--out", str(tmp_path / "file")], capsys)
    assert "num_docs must be in [1, " in _errors(["--docs", "500"], capsys)
    assert "exceeds the model's max_seq_len=128" in _errors(["--seq-len", "500"], capsys)
    assert "does not exist" in _errors(["--metrics", str(tmp_path / "x" / "m.jsonl")], capsys)
    assert "text file" in _errors(["--text", str(tmp_path / "missing.txt")], capsys)
    assert "not both" in _errors(["--steps", "2", "--epochs", "1"], capsys)
    assert "give one of them" in _errors(["--docs", "4", "--token-cache",
                                          str(tmp_path / "cache")], capsys)
    # a goldfish loss that could drop nothing, and NaN settings, are refused by name
    assert "--goldfish-h 13 exceeds --seq-len 8: no window" in _errors(
        ["--goldfish-k", "4", "--seq-len", "8"], capsys)
    assert "--weight-decay and --grad-clip must be finite" in _errors(
        ["--grad-clip", "nan"], capsys)
    assert "--weight-decay and --grad-clip must be finite" in _errors(
        ["--weight-decay", "nan"], capsys)
    assert "1 processes were launched" in _errors(["--grid", "data=1,row=2"], capsys)
    assert "no checkpoint" in _errors(["--checkpoint", str(tmp_path)], capsys,
                                      memorization_main)
    assert "no checkpoint" in _errors(["--checkpoint", str(tmp_path)], capsys, sample_main)


@needs_mpi
@pytest.mark.slow
def test_cli_four_ranks_prints_on_rank_0_and_checkpoints_for_any_grid(tmp_path, capsys):
    out, metrics = tmp_path / "run", tmp_path / "m.jsonl"
    r = launch(["-m", "llm.train", "--grid", "data=1,depth=2,row=2,col=1", "--steps", "3",
                "--seq-len", "32", "--batch-size", "4", "--checkpoint-dir", str(out),
                "--metrics", str(metrics), "--log-every", "1", "--eval-batches", "1"],
               ranks=4, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("GPT tiny: 139,584 parameters") == 1  # rank 0 only
    assert "grid data=1,depth=2,row=2,col=1 (4 ranks, mpiexec, mpi)" in r.stdout
    assert r.stdout.count("step     3/3") == 1
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows if "step" in r] == [1, 2, 3]
    assert all(r["comm_bytes"] > 0 for r in rows if "step" in r)
    assert all(min(r["overlapped"].values()) > 0 for r in rows if "step" in r)
    # the 4-rank checkpoint loads into one process and continues there
    assert train_main(["--steps", "4", "--seq-len", "32", "--batch-size", "4", "--out",
                       str(out), "--resume", "--eval-batches", "1"]) == 0
    assert "step     4/4" in capsys.readouterr().out


@pytest.mark.slow
def test_cli_grid_problems_fail_on_every_rank():
    r = run_module("llm.train", ["--grid", "1x1x1x1", "--steps", "1"], ranks=2, timeout=120)
    assert r.returncode != 0
    msg = re.escape("grid data=1 * depth=1 * row=1 * col=1 = 1 ranks, but 2 processes were "
                    "launched")
    assert set(re.findall(r"\[rank (\d)\] error: " + msg, r.stderr)) == {"0", "1"}, r.stderr
    r = run_module("llm.train", ["--grid", "2x1x1x1", "--batch-size", "3", "--steps", "1"],
                   ranks=2, timeout=120)
    assert r.returncode != 0  # the batch is split over data x depth
    msg = re.escape("grid data=2,depth=1,row=1,col=1: batch: global_batch=3 % "
                    "(data*depth=2) = 1")
    assert set(re.findall(r"\[rank (\d)\] error: " + msg, r.stderr)) == {"0", "1"}, r.stderr


def test_sigterm_checkpoints_and_exits_cleanly(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "llm.train", *FAULT_ARGS, "--steps",
                             "100000", "--out", str(out)], cwd=ROOT, env=launch_env(),
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for line in proc.stdout:
        if line.startswith("step     3/"):
            break
    proc.send_signal(signal.SIGTERM)
    rest, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "preempted (SIGTERM/SIGUSR1) at step" in rest
    step = checkpoint.open_checkpoint(out).step
    assert step >= 3
    resumed = subprocess.run([sys.executable, "-m", "llm.train", *FAULT_ARGS, "--steps",
                              str(step + 2), "--out", str(out), "--resume"], cwd=ROOT,
                             env=launch_env(), capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed at step {step}" in resumed.stdout


def test_a_lost_rank_stops_every_other_rank_with_its_name():
    """gloo under torchrun's environment, a SIGKILLed rank. Both trainers start through
    common.run, so the other launcher (the MPI transport under mpiexec, a hung rank) is tested
    with plexus.train (tests/plexus/test_train.py)."""
    results = kill_one_rank_and_collect(
        ["llm.train", *FAULT_ARGS, "--grid", "data=1,depth=2,row=1,col=2", "--steps", "100000"],
        world=4, victim=1, ready="step     3/", launcher="torchrun")
    for r, (code, err, seconds) in results.items():
        assert code != 0 and seconds < 60, (r, code, seconds)
        assert f"[rank {r}] error: rank 1 was lost" in err, err[-2000:]
