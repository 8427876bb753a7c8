"""llm.train under injected faults: SIGTERM (as Slurm sends) and a SIGKILLed rank."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(4):
        env = _env(RANK=str(r), WORLD_SIZE="4", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="4",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HPC_HEARTBEAT_TIMEOUT="8")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "llm.train", *ARGS, "--grid", "data=1,depth=2,row=1,col=2",
             "--steps", "100000"], cwd=ROOT, env=env, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    try:
        for line in procs[0].stdout:
            if line.startswith("step     3/"):
                break
        start = time.monotonic()
        procs[1].kill()
        for r in (0, 2, 3):
            _, err = procs[r].communicate(timeout=60)
            assert procs[r].returncode != 0
            assert f"[rank {r}] error: rank 1 was lost" in err, err[-2000:]
        assert time.monotonic() - start < 60
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
