"""common.dist: start-up under real launchers (mpiexec with mpich + mpi4py, torchrun, alone),
Slurm's environment read as pure functions (mpiexec inside a step, uneven nodes, a port per
step), a wrong grid reported on every rank, timeouts read at call time (finite ones only), the
context that closes itself, and the watchdog that names a lost rank (more in
tests/common/test_watchdog.py)."""

import ast
import json
import re
import subprocess
import sys

import pytest
import torch

from common.device import choose_device
from common.dist import (
    DistContext,
    _rendezvous,
    _slurm_local_world,
    _slurm_port,
    _slurm_tasks_per_node,
    detect_launcher,
    first_slurm_host,
    resolve_timeouts,
)
from common.grid import ProcessGrid
from tests.distributed import ROOT, launch, launch_command, launch_env, needs_mpi

CHECKS = ["-m", "tests.common.collective_checks"]


@pytest.mark.slow
def test_mpiexec_four_ranks():
    r = launch([*CHECKS, "--grid", "1x2x2"], ranks=4, launcher="mpiexec")
    assert r.returncode == 0, r.stdout + r.stderr
    # mpiexec merges the ranks' stdout, so lines may run together: count in the whole text
    assert r.stdout.count("launcher=mpiexec OK 0 failures") == 4, r.stdout


@pytest.mark.slow
def test_mpiexec_wrong_grid_fails_on_every_rank():
    r = launch([*CHECKS, "--grid", "2x2x2"], ranks=4, launcher="mpiexec", timeout=120)
    assert r.returncode != 0
    msg = "grid x=2 * y=2 * z=2 = 8 ranks, but 4 processes were launched"
    # mpiexec merges the ranks' stderr, so lines may run together: search the whole text
    ranks = set(re.findall(r"\[rank (\d+)\] error: " + re.escape(msg), r.stderr))
    assert ranks == {"0", "1", "2", "3"}, r.stderr


@pytest.mark.slow
def test_torchrun_two_ranks():
    r = launch([*CHECKS, "--grid", "data=2"], ranks=2, launcher="torchrun")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("launcher=torchrun OK 0 failures") == 2, r.stdout


def test_single_process():
    r = launch([*CHECKS, "--grid", "1x1x1"], launcher="single")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rank 0/1 launcher=single OK" in r.stdout
    bad = launch([*CHECKS, "--grid", "1x2x1"], launcher="single")
    assert bad.returncode == 2
    assert "grid x=1 * y=2 * z=1 = 2 ranks, but 1 processes were launched" in bad.stderr


def test_launcher_detection():
    assert detect_launcher({}) == "single"
    assert detect_launcher({"PMI_SIZE": "4", "PMI_RANK": "0"}) == "mpiexec"
    assert detect_launcher({"OMPI_COMM_WORLD_SIZE": "2"}) == "mpiexec"
    assert detect_launcher({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h",
                            "MASTER_PORT": "1"}) == "torchrun"
    slurm = {"SLURM_PROCID": "3", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "8"}
    assert detect_launcher(slurm) == "srun"
    # an sbatch shell (no job step) running one process is not an srun launch
    assert detect_launcher({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}) == "single"
    assert first_slurm_host("nid[001-004,010],gpu7") == "nid001"
    assert first_slurm_host("node17") == "node17"
    assert first_slurm_host("a[7,9]") == "a7"


def test_mpiexec_inside_a_slurm_step_is_mpiexec_on_every_rank():
    """The ranks of an mpiexec run inside a Slurm step (an `srun --pty bash`, or Hydra's
    proxies started by srun) inherit the step's SLURM_PROCID, SLURM_STEP_ID and SLURM_NTASKS;
    read as srun, both ranks of the proxy would be rank 0."""
    step = {"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2"}
    for rank in ("0", "1"):  # Hydra (MPICH, Intel MPI): rank 0 agrees with Slurm on everything
        hydra = {"PMI_RANK": rank, "PMI_SIZE": "2", "MPI_LOCALRANKID": rank,
                 "MPI_LOCALNRANKS": "2"}
        assert detect_launcher({**step, **hydra}) == "mpiexec", rank
        # Open MPI's mpirun
        assert detect_launcher({**step, "OMPI_COMM_WORLD_RANK": rank,
                                "OMPI_COMM_WORLD_SIZE": "2", "PMIX_RANK": rank}) == "mpiexec"
    # another MPI: a rank or a size that disagrees with Slurm's
    assert detect_launcher({**step, "PMIX_RANK": "1"}) == "mpiexec"
    assert detect_launcher({**step, "PMI_RANK": "0", "PMI_SIZE": "4"}) == "mpiexec"
    # srun's own tasks under its PMI-2 or PMIx plugin: the MPI variables agree with Slurm's
    task3 = {"SLURM_PROCID": "3", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "8"}
    assert detect_launcher({**task3, "PMI_RANK": "3", "PMI_SIZE": "8"}) == "srun"
    assert detect_launcher({**task3, "PMIX_RANK": "3"}) == "srun"


@needs_mpi
def test_mpiexec_inside_a_slurm_step_under_a_real_mpiexec(tmp_path):
    """The same with the environment a real mpiexec gives its ranks (written to a file per
    rank, so that the ranks need not import torch)."""
    code = ("import json, os, sys; json.dump(dict(os.environ), "
            "open(os.path.join(sys.argv[1], os.environ['PMI_RANK']), 'w'))")
    step = {"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2"}
    r = subprocess.run(launch_command(["-c", code, str(tmp_path)], ranks=2), capture_output=True,
                       text=True, env=launch_env(step), timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    envs = [json.loads((tmp_path / rank).read_text()) for rank in ("0", "1")]
    assert all(e["SLURM_PROCID"] == "0" for e in envs)
    assert [detect_launcher(e) for e in envs] == ["mpiexec", "mpiexec"]


def test_slurm_tasks_per_node():
    assert _slurm_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert _slurm_tasks_per_node("4") == [4]
    assert _slurm_tasks_per_node("1,2") == [1, 2]
    assert _slurm_tasks_per_node("3(x2)") == [3, 3]
    with pytest.raises(ValueError, match=r"cannot parse SLURM_TASKS_PER_NODE='2\(x\)'"):
        _slurm_tasks_per_node("2(x)", "SLURM_TASKS_PER_NODE")


def test_slurm_local_world_of_uneven_nodes():
    """srun -n3 -N2: two tasks on node 0, one on node 1; each rank counts its own node's."""
    step = {"SLURM_NTASKS": "3", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "2,1"}
    assert _slurm_local_world({**step, "SLURM_NODEID": "0"}) == 2
    assert _slurm_local_world({**step, "SLURM_NODEID": "1"}) == 1
    job = {"SLURM_NTASKS": "7", "SLURM_NNODES": "4", "SLURM_TASKS_PER_NODE": "2(x3),1"}
    assert [_slurm_local_world({**job, "SLURM_NODEID": str(n)}) for n in range(4)] == [2, 2, 2, 1]
    assert _slurm_local_world({"SLURM_NTASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "4"}) == 4
    # without the counts (or this node's id): as evenly as they go, never fewer than LOCALID + 1
    assert _slurm_local_world({"SLURM_NTASKS": "3", "SLURM_STEP_NUM_NODES": "2"}) == 2
    assert _slurm_local_world({**step, "SLURM_LOCALID": "2"}) == 3
    assert _slurm_local_world({"SLURM_NTASKS": "4", "SLURM_NNODES": "2"}) == 2


def test_srun_start_up_of_uneven_nodes(monkeypatch):
    """Every rank of srun -n3 -N2 gets a local world that holds its local rank (the rank with
    SLURM_LOCALID=1 used to raise, the others to wait for it until the timeout)."""
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for rank, (node, local) in enumerate([(0, 0), (0, 1), (1, 0)]):
        env = {"SLURM_PROCID": rank, "SLURM_LOCALID": local, "SLURM_NODEID": node,
               "SLURM_STEP_ID": 0, "SLURM_NTASKS": 3, "SLURM_STEP_NUM_NODES": 2,
               "SLURM_STEP_TASKS_PER_NODE": "2,1", "SLURM_JOB_ID": 11,
               "SLURM_STEP_NODELIST": "n[1-2]"}
        for name, value in env.items():
            monkeypatch.setenv(name, str(value))
        got = _rendezvous("srun")
        assert got[:5] == (rank, 3, local, 2 - node, "n1"), got
        assert choose_device("auto", local_rank=local, local_world_size=got[3],
                             num_gpus=0)[0] == torch.device("cpu")


def test_concurrent_srun_steps_get_their_own_port():
    ports = [_slurm_port({"SLURM_JOB_ID": "5", "SLURM_STEP_ID": str(step)}) for step in range(16)]
    assert len(set(ports)) == 16 and all(15000 <= p < 35000 for p in ports)
    # neighbouring jobs too
    assert _slurm_port({"SLURM_JOB_ID": "6", "SLURM_STEP_ID": "0"}) not in ports
    assert _slurm_port({"SLURM_JOB_ID": "5", "SLURM_STEP_ID": "1", "MASTER_PORT": "29500"}) == 29500


def test_timeouts_are_read_at_call_time(monkeypatch):
    monkeypatch.delenv("HPC_DIST_TIMEOUT", raising=False)
    monkeypatch.delenv("HPC_HEARTBEAT_TIMEOUT", raising=False)
    assert resolve_timeouts() == (300.0, 30.0)
    monkeypatch.setenv("HPC_DIST_TIMEOUT", "7")
    monkeypatch.setenv("HPC_HEARTBEAT_TIMEOUT", "3.5")
    assert resolve_timeouts() == (7.0, 3.5)
    assert resolve_timeouts(11, 2) == (11.0, 2.0)  # arguments win over the environment
    monkeypatch.setenv("HPC_DIST_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="HPC_DIST_TIMEOUT='soon' is not a number"):
        resolve_timeouts()
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        resolve_timeouts(5, 0)
    # nothing is read at import: a bad value breaks only the call that reads it
    code = "import common.dist, common.run"
    env = launch_env({"HPC_DIST_TIMEOUT": "soon", "HPC_HEARTBEAT_TIMEOUT": "x"})
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e400", "1e300"])
def test_timeouts_must_be_finite(monkeypatch, value):
    """An infinite timeout passed a plain `> 0` and ended in an OverflowError of timedelta, with
    a traceback on every rank."""
    monkeypatch.delenv("HPC_HEARTBEAT_TIMEOUT", raising=False)
    monkeypatch.setenv("HPC_DIST_TIMEOUT", value)
    with pytest.raises(ValueError, match=f"HPC_DIST_TIMEOUT='{value}': the timeout must be > 0 "
                       "seconds and finite"):
        resolve_timeouts()
    monkeypatch.delenv("HPC_DIST_TIMEOUT")
    with pytest.raises(ValueError, match=r"^timeout_s \(--dist-timeout\) must be > 0 seconds "
                       r"and finite \(at most 8.64e\+13\), got"):
        resolve_timeouts(float(value))
    with pytest.raises(ValueError, match=r"^heartbeat_timeout_s \(--heartbeat-timeout\) must"):
        resolve_timeouts(None, float(value))


def test_a_wrong_grid_fails_on_every_rank_before_any_group():
    """A grid smaller than the world: the rank outside it used to raise alone while the ranks
    inside waited in the group creation (then reported as "rank 2 was lost")."""
    messages = set()
    for rank in range(3):
        ctx = DistContext(rank, 3, rank, 3, torch.device("cpu"), "gloo", "mpiexec")
        with pytest.raises(ValueError) as e:
            ctx.create_groups(ProcessGrid.parse("1x2x1"))
        messages.add(str(e.value))
    assert messages == {"grid x=1 * y=2 * z=1 = 2 ranks, but 3 processes were launched; pass a "
                        "grid whose sizes multiply to 3"}


def test_a_bad_mpi_polite_setting_is_refused_before_anything_starts(monkeypatch):
    import torch.distributed as dist

    from common.dist import init_distributed

    monkeypatch.setenv("HPC_MPI_POLITE", "sometimes")
    with pytest.raises(ValueError, match="HPC_MPI_POLITE='sometimes': use none, async or all"):
        init_distributed(device="cpu", launcher="single")
    assert not dist.is_initialized()


def test_no_module_level_mutable_state():
    """No module of common/ keeps process state in a global (the watchdog belongs to the
    DistContext): no `global` statement, no module-level list or set."""
    offenders = []
    for path in sorted((ROOT / "common").rglob("*.py")):
        tree = ast.parse(path.read_text())
        offenders += [f"{path.name}:{n.lineno} global" for n in ast.walk(tree)
                      if isinstance(n, ast.Global)]
        for node in tree.body:
            value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target",
                                                                                 None)]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                continue
            mutable = isinstance(value, (ast.List, ast.Set, ast.ListComp, ast.SetComp)) or (
                isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
                and value.func.id in ("list", "set", "defaultdict"))
            if mutable:
                offenders.append(f"{path.name}:{node.lineno}")
    assert not offenders, offenders


def test_bad_arguments_fail_before_start_up():
    from common.dist import init_distributed

    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        init_distributed(device="tpu")
    with pytest.raises(ValueError, match=r"timeout_s \(--dist-timeout\) must be > 0"):
        init_distributed(timeout_s=-1)


CONTEXT = """
import torch.distributed as dist
from common.dist import init_distributed
with init_distributed(device="cpu") as ctx:
    assert dist.is_initialized() and ctx.watchdog is None and ctx.heartbeat_timeout_s == 4.0
    print(ctx.launcher, ctx.rank, ctx.world_size, ctx.is_main)
assert not dist.is_initialized()
ctx.close()  # idempotent
again = init_distributed(device="cpu", heartbeat_timeout_s=9)
print("again", again.heartbeat_timeout_s, dist.is_initialized())
# no close: the exit hook does it
"""


def test_context_manager_close_and_exit_hook():
    r = subprocess.run([sys.executable, "-c", CONTEXT], capture_output=True, text=True,
                       env=launch_env({"HPC_HEARTBEAT_TIMEOUT": "4"}), timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["single 0 1 True", "again 9.0 True"], r.stdout


WATCHDOG = """
import sys, time
import torch.distributed as dist
from common.watchdog import Watchdog
store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
mine = Watchdog(store, 0, 2, interval_s=0.1, timeout_s=1.0)
peer = Watchdog(store, 1, 2, interval_s=0.1, timeout_s=1.0)
time.sleep(1.5)
print("both alive", flush=True)
peer.stop(clean=sys.argv[1] == "clean")
time.sleep(2.0)
print("survived", flush=True)
mine.stop()
"""


@pytest.mark.parametrize("how", ["clean", "failed"])
def test_watchdog_names_a_lost_rank_but_not_a_finished_one(how):
    """Rank 1 stops heart-beating: after a clean stop (it finished) rank 0 carries on; after a
    failure (clean=False) rank 0 exits 1 within the heartbeat timeout, naming rank 1."""
    r = subprocess.run([sys.executable, "-c", WATCHDOG, how], capture_output=True, text=True,
                       env=launch_env(), timeout=60)
    assert "both alive" in r.stdout, r.stdout + r.stderr
    if how == "clean":
        assert r.returncode == 0 and "survived" in r.stdout, r.stdout + r.stderr
    else:
        assert r.returncode == 1 and "survived" not in r.stdout, r.stdout + r.stderr
        assert "[rank 0] error: rank 1 was lost (no heartbeat for 1 s)" in r.stderr, r.stderr


@pytest.mark.parametrize("stage", ["told", "said"])
def test_watchdog_survivors_report_together_within_a_bound(stage):
    """A survivor waits for the other survivors to be ready to report ("told") and, after
    reporting, for them to have reported ("said") before it exits; never for the lost rank,
    and at most 2 intervals."""
    import time

    import torch.distributed as dist

    from common.watchdog import Watchdog

    def survivor(store, rank):
        w = Watchdog.__new__(Watchdog)  # no heartbeat thread: only the reporting step
        w.store, w.rank, w.world, w.interval_s = store, rank, 4, 0.5
        return w

    store = dist.HashStore()
    store.set(f"hpc/{stage}/3", "1")
    start = time.monotonic()
    survivor(store, 0)._wait_for_peers(2, stage)  # rank 1 never gets there: the bound ends it
    waited = time.monotonic() - start
    assert 0.9 < waited < 3, waited
    store.set(f"hpc/{stage}/1", "1")
    start = time.monotonic()
    survivor(store, 0)._wait_for_peers(2, stage)  # 1 and 3 there, 2 is the lost one
    assert time.monotonic() - start < 0.5
    assert store.check([f"hpc/{stage}/0"])


def test_dist_context_fields():
    names = list(DistContext.__dataclass_fields__)
    assert names == ["rank", "world_size", "local_rank", "local_world_size", "device",
                     "backend", "launcher", "heartbeat_timeout_s", "device_reason", "watchdog",
                     "transport"]
