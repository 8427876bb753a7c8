"""common.run: the trainers' shared flags, checkpoint config, metrics writer, steady-state
mean and exits (the memory meters: tests/common/test_memory.py)."""

import argparse
import json
import os
import subprocess
import sys

import pytest

from common.run import (
    CheckpointConfig,
    MetricsWriter,
    add_checkpoint_args,
    add_launch_args,
    check_checkpoint_dir,
    check_writable,
    checkpoint_config,
    run_or_exit,
    steady_mean,
)
from tests.distributed import launch_env


def parser(unit: str = "steps") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_launch_args(p)
    add_checkpoint_args(p, unit=unit)
    return p


def test_flags_parse_to_the_config(tmp_path, monkeypatch):
    monkeypatch.delenv("HPC_DEVICE")  # the suite pins the CPU (tests/conftest.py)
    args = parser().parse_args([
        "--device", "cpu", "--dist-timeout", "12", "--heartbeat-timeout", "4",
        "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "5", "--keep-checkpoints", "2",
        "--resume"])
    assert (args.device, args.dist_timeout, args.heartbeat_timeout) == ("cpu", 12.0, 4.0)
    assert checkpoint_config(args) == CheckpointConfig(dir=str(tmp_path), every=5, keep=2,
                                                       resume=True)
    defaults = parser().parse_args([])
    assert (defaults.device, defaults.dist_timeout, defaults.heartbeat_timeout) == (
        "auto", None, None)  # None: the environment, then 300 / 30, at start-up
    assert checkpoint_config(defaults) == CheckpointConfig()
    assert CheckpointConfig() == CheckpointConfig(dir=None, every=0, keep=3, resume=False)
    with pytest.raises(SystemExit):
        parser().parse_args(["--device", "tpu"])


def test_help_names_the_unit_and_the_layout():
    text = " ".join(parser("epochs").format_help().split())
    assert "every N epochs" in text and "DIR/step-N/" in text
    assert "every N steps" in " ".join(parser("steps").format_help().split())


@pytest.mark.parametrize("argv, flag", [
    (["--checkpoint-every", "-1"], "--checkpoint-every must be >= 0"),
    (["--keep-checkpoints", "0"], "--keep-checkpoints must be >= 1"),
    (["--resume"], "--resume needs --checkpoint-dir"),
])
def test_bad_configs_name_the_flag(argv, flag):
    with pytest.raises(ValueError, match=flag):
        checkpoint_config(parser().parse_args(argv))


def test_check_checkpoint_dir_refuses_to_hide_or_replace_checkpoints(tmp_path):
    """A new run into a directory that holds an earlier run's checkpoints (its saves would
    replace those steps, and a later --resume would take whichever is newest), and a step
    directory given for the root (its saves would nest inside a checksummed checkpoint)."""
    from common import checkpoint as ckpt

    root = tmp_path / "ck"
    check_checkpoint_dir(str(root), resume=False)  # created, empty: fine
    assert root.is_dir()
    for step in (2, 3):
        ckpt.save(root, step, {"a.bin": b"x"}, {}, keep=3)
    with pytest.raises(ValueError, match=r"^--checkpoint-dir .*ck already holds checkpoints "
                       r"\(steps 2-3\) of an earlier run: pass --resume"):
        check_checkpoint_dir(str(root), resume=False)
    assert ckpt.list_steps(root) == [2, 3]  # nothing touched
    check_checkpoint_dir(str(root), resume=True)
    with pytest.raises(ValueError, match=r"step-00000003 is one checkpoint \(it holds "
                       r"manifest.json\), not a directory of checkpoints: give its parent "
                       rf"{root}"):
        check_checkpoint_dir(str(root / "step-00000003"), resume=True)
    with pytest.raises(ValueError, match=r"\(step 1\)"):
        one = tmp_path / "one"
        ckpt.save(one, 1, {"a.bin": b"x"}, {}, keep=3)
        check_checkpoint_dir(str(one), resume=False, flag="--checkpoint-dir")


def test_check_writable(tmp_path):
    check_writable(str(tmp_path / "m.jsonl"), flag="--metrics")
    with pytest.raises(ValueError, match=r"^--metrics .*missing/m.jsonl: directory .* does not "
                       "exist"):
        check_writable(str(tmp_path / "missing" / "m.jsonl"), flag="--metrics")
    with pytest.raises(ValueError, match=r"--metrics .*: is a directory"):
        check_writable(str(tmp_path), flag="--metrics")
    deep = tmp_path / "a" / "b"
    check_writable(str(deep), flag="--checkpoint-dir", create_dir=True)
    assert deep.is_dir()
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"--checkpoint-dir .*file/sub: cannot create"):
        check_writable(str(tmp_path / "file" / "sub"), flag="--checkpoint-dir", create_dir=True)
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ValueError, match=r"--metrics .*is not writable"):
            check_writable(str(locked / "m.jsonl"), flag="--metrics")
        with pytest.raises(ValueError, match=r"--checkpoint-dir .*is not writable"):
            check_writable(str(locked), flag="--checkpoint-dir", create_dir=True)


def rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_metrics_written_under_a_temporary_name_then_renamed(tmp_path):
    path = tmp_path / "m.jsonl"
    with MetricsWriter(str(path), enabled=True) as m:
        m.write({"step": 1, "loss": 2.5})
        assert not path.exists() and (tmp_path / "m.jsonl.tmp").exists()
        m.write({"step": 2, "loss": 2.0})
    assert rows(path) == [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.0}]
    assert not (tmp_path / "m.jsonl.tmp").exists()
    with MetricsWriter(str(path), enabled=True) as m:  # a new run replaces the file
        m.write({"step": 1})
    assert rows(path) == [{"step": 1}]


@pytest.mark.parametrize("how", ["exception", "abort"])
def test_a_failed_run_leaves_existing_metrics_byte_identical(tmp_path, how):
    path = tmp_path / "m.jsonl"
    path.write_bytes(b'{"step": 1}\n{"step": 2, "note": "kept as is"}\n')
    before = path.read_bytes()
    for resume in (False, True):
        if how == "exception":
            with pytest.raises(FloatingPointError), MetricsWriter(str(path), enabled=True,
                                                                   resume=resume) as m:
                m.write({"step": 3})
                raise FloatingPointError("loss is nan")
        else:
            m = MetricsWriter(str(path), enabled=True, resume=resume)
            m.write({"step": 3})
            m.abort()
            m.close()  # after abort: nothing to rename
        assert path.read_bytes() == before
        assert sorted(os.listdir(tmp_path)) == ["m.jsonl"]


def test_resume_appends_to_the_existing_rows(tmp_path):
    path = tmp_path / "m.jsonl"
    with MetricsWriter(str(path), enabled=True) as m:
        m.write({"step": 1})
    with MetricsWriter(str(path), enabled=True, resume=True) as m:
        m.write({"step": 2})
    assert rows(path) == [{"step": 1}, {"step": 2}]
    with MetricsWriter(str(tmp_path / "new.jsonl"), enabled=True, resume=True) as m:
        m.write({"step": 1})  # nothing to resume from: a fresh file
    assert rows(tmp_path / "new.jsonl") == [{"step": 1}]


def test_disabled_writer_writes_nothing(tmp_path):
    for m in (MetricsWriter(str(tmp_path / "m.jsonl"), enabled=False),
              MetricsWriter(None, enabled=True)):
        assert not m.active
        m.write({"step": 1})
        m.close()
    assert os.listdir(tmp_path) == []


def test_run_or_exit_returns_and_reports_user_errors(capsys):
    assert run_or_exit(None, lambda: 42, user_errors=(ValueError,)) == 42

    def bad() -> None:
        raise ValueError("--grid 3x1x1 does not divide the heads")

    with pytest.raises(SystemExit) as e:
        run_or_exit(None, bad, user_errors=(ValueError,))
    assert e.value.code == 2
    assert "error: --grid 3x1x1 does not divide the heads" in capsys.readouterr().err

    def bug() -> None:
        raise KeyError("a bug: its traceback is wanted")

    with pytest.raises(KeyError):
        run_or_exit(None, bug, user_errors=(ValueError,))


LOST_PEER = """
from common.run import run_or_exit
def collective():
    raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1234")
run_or_exit(None, collective, user_errors=(RuntimeError,))
print("not reached")
"""


def test_run_or_exit_a_lost_peer_is_not_a_user_error():
    r = subprocess.run([sys.executable, "-c", LOST_PEER], capture_output=True, text=True,
                       env=launch_env(), timeout=60)
    assert r.returncode == 1 and "not reached" not in r.stdout, r.stdout + r.stderr
    assert "error: communication failed (RuntimeError: [gloo] Connection closed" in r.stderr


START = """
import argparse, sys
from common.run import add_launch_args, start
p = argparse.ArgumentParser()
add_launch_args(p)
ctx = start(p.parse_args(sys.argv[1:]))
print(ctx.launcher, ctx.device, ctx.heartbeat_timeout_s)
"""


def test_start_from_the_flags():
    def run(*argv):
        return subprocess.run([sys.executable, "-c", START, *argv], capture_output=True,
                              text=True, env=launch_env({"HPC_HEARTBEAT_TIMEOUT": "6"}),
                              timeout=60)

    ok = run("--device", "cpu")
    assert ok.returncode == 0 and ok.stdout.split() == ["single", "cpu", "6.0"], ok.stderr
    assert run("--device", "cpu", "--heartbeat-timeout", "2").stdout.split()[2] == "2.0"
    bad = run("--dist-timeout", "0")
    assert bad.returncode == 2 and "error: --dist-timeout must be > 0 seconds" in bad.stderr



def test_steady_mean_leaves_out_the_warm_up_row():
    rows = [{"s": 10.0}, {"s": 1.0}, {"s": 3.0}]
    assert steady_mean(rows, "s") == 2.0
    assert steady_mean(rows[:1], "s") == 10.0  # one row: it is the steady state
    assert steady_mean([], "s") == 0.0
