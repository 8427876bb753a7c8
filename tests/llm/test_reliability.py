"""llm.train under injected faults: SIGTERM (as Slurm sends) and a SIGKILLed rank."""

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.distributed import kill_one_rank_and_collect

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--preset", "tiny", "--batch-size", "4", "--seq-len", "16", "--log-every", "1"]


def _env(**extra):
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **extra}


def test_sigterm_checkpoints_and_exits_cleanly(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "llm.train", *ARGS, "--steps", "100000",
                             "--out", str(out)], cwd=ROOT, env=_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for line in proc.stdout:
        if line.startswith("step     3/"):
            break
    proc.send_signal(signal.SIGTERM)
    rest, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "preempted (SIGTERM/SIGUSR1) at step" in rest
    from llm import checkpoint

    step = checkpoint.load(out)["step"]
    assert step >= 3
    resumed = subprocess.run([sys.executable, "-m", "llm.train", *ARGS, "--steps",
                              str(step + 2), "--out", str(out), "--resume"], cwd=ROOT,
                             env=_env(), capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed at step {step}" in resumed.stdout


def test_a_killed_rank_stops_every_other_rank_with_its_name():
    results = kill_one_rank_and_collect(
        ["llm.train", *ARGS, "--grid", "data=1,depth=2,row=1,col=2", "--steps", "100000"],
        world=4, victim=1, ready="step     3/")
    for r, (code, err, seconds) in results.items():
        assert code != 0 and seconds < 60, (r, code, seconds)
        assert f"[rank {r}] error: rank 1 was lost" in err, err[-2000:]
