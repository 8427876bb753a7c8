"""The planning command's first name, ``python -m common.perf.plan``: it still runs, as
``python -m common.perf`` with the same arguments, warning that names the new command; and the
module that makes it so never shadows the function ``common.perf.plan``."""

import subprocess
import sys

from tests.distributed import launch_env

ARGS = ["gpt", "--vocab", "256", "--layers", "4", "--heads", "4", "--d-model", "128",
        "--d-ff", "512", "--batch", "16", "--seq-len", "64", "--ranks", "4",
        "--machine", "local-cpu", "--top", "3"]


def _run(module, *args):
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          env=launch_env(), timeout=120)


def test_the_old_command_runs_the_new_one_with_a_deprecation_warning():
    old, new = _run("common.perf.plan", *ARGS), _run("common.perf", *ARGS)
    assert old.returncode == new.returncode == 0, old.stderr
    assert old.stdout == new.stdout and "grid" in new.stdout
    assert "DeprecationWarning" in old.stderr
    assert "run python -m common.perf with the same arguments" in old.stderr
    assert "DeprecationWarning" not in new.stderr
    bad = _run("common.perf.plan", "gpt", "--ranks", "4")  # the new command's own refusal
    assert bad.returncode == 2 and "usage: python -m common.perf" in bad.stderr


def test_importing_the_old_command_leaves_plan_the_function():
    code = ("import common.perf.plan, common.perf; from common.perf import choose, plan; "
            "from common.perf import GCNWorkload; "
            "assert plan is choose.plan is common.perf.plan, plan; "
            "work = GCNWorkload(num_nodes=1000, nnz=20000, num_features=16, num_classes=4); "
            "print(common.perf.plan(work, 4, machine='local-cpu').best.label())")
    r = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", code],
                       capture_output=True, text=True, env=launch_env(), timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
