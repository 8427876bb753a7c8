"""The planner: one plan and one auto_grid for both workloads, constraints, the command, and
both trainers' --grid (parse_grid, choose_grid)."""

import re
import subprocess
import sys

import pytest

from common.grid import ProcessGrid
from common.perf import GCNWorkload, GPTWorkload, auto_grid, choose, load_profile, plan, plan_gcn
from common.perf.cli import main
from tests.common.perf.machines import tiny_gpu
from tests.distributed import launch_env

GCN = GCNWorkload(num_nodes=50000, nnz=1_000_000, num_features=128, num_classes=16)
# the llm tiny preset's shape, written out (common imports no engine)
TINY = {"vocab_size": 256, "num_layers": 4, "num_heads": 4, "d_model": 128, "d_ff": 512}


def gpt_work(**kw):
    return GPTWorkload(**{**TINY, **kw}, seq_len=64, global_batch=16, micro_batch=8)


def test_plan_is_reexported():
    assert choose.plan is plan and choose.auto_grid is auto_grid


def test_the_command_does_not_shadow_plan():
    """The command is common.perf.cli (``python -m common.perf``): importing it, as llm.plan
    does, leaves ``common.perf.plan`` the function (a submodule of that name replaced it)."""
    code = ("import llm.plan, common.perf.cli; from common.perf import choose, plan; "
            "assert plan is choose.plan, plan")
    subprocess.run([sys.executable, "-c", code], check=True, env=launch_env())


def test_auto_grid_is_the_plans_best_for_a_gcn():
    grid, ranked = auto_grid(GCN, 8, machine="local-cpu")
    assert grid == ProcessGrid.plexus(*ranked.best.shape.values()) and grid.num_ranks == 8
    assert "runner-up" in ranked.describe_choice()
    # a profile object, a name and the default ($HPC_MACHINE_PROFILE, else local-cpu) agree
    same = plan_gcn(GCN, 8, load_profile("local-cpu"))
    assert [p.shape for p in plan(GCN, 8, machine=load_profile("local-cpu")).predictions] == [
        p.shape for p in same.predictions] == [p.shape for p in ranked.predictions]


def test_auto_grid_for_a_gpt():
    grid, ranked = auto_grid(gpt_work(), 8, machine="local-cpu")
    assert grid.axes == ("data", "depth", "row", "col") and grid.num_ranks == 8
    assert grid == ProcessGrid.axonn(*ranked.best.shape.values())
    assert ranked.best.extra["micro_batch"] == 8


def test_machine_from_the_environment(monkeypatch):
    monkeypatch.setenv("HPC_MACHINE_PROFILE", "perlmutter-a100")
    assert "perlmutter-a100" in plan(GCN, 4).title
    monkeypatch.delenv("HPC_MACHINE_PROFILE")
    assert "local-cpu" in plan(GCN, 4).title


def test_constraints_make_grids_not_runnable():
    def no_z(shape):
        return [f"test: z={shape['z']} > 1"] if shape["z"] > 1 else []

    ranked = plan(GCN, 8, machine="local-cpu", constraints=[no_z])
    assert ranked.runnable and all(p.shape["z"] == 1 for p in ranked.runnable)
    assert any(p.invalid == "test: z=2 > 1" for p in ranked.predictions)
    grid, _ = auto_grid(GCN, 8, machine="local-cpu", constraints=[no_z])
    assert grid.size("z") == 1
    # the workload's own problems stay, constraints add to them
    work = gpt_work(num_heads=2, d_model=128)
    ranked = plan(work, 4, machine="local-cpu", constraints=[lambda s: ["never"]])
    assert not ranked.runnable
    assert {p.invalid for p in ranked.predictions if p.shape["row"] == 4} == {
        "heads: num_heads=2 % row=4 = 2; never"}
    with pytest.raises(ValueError, match="no grid of 4 ranks fits: every grid has a problem"):
        auto_grid(work, 4, machine="local-cpu", constraints=[lambda s: ["never"]])


def test_no_grid_fits_in_memory():
    tiny = tiny_gpu(35e6)
    work = GCNWorkload(num_nodes=20000, nnz=200000, num_features=64, num_classes=8)
    with pytest.raises(ValueError, match="no grid of 1 ranks fits in memory"):
        auto_grid(work, 1, machine=tiny)
    with pytest.raises(TypeError, match="GCNWorkload or a GPTWorkload"):
        plan("graph", 4)  # type: ignore[arg-type]


def test_plan_cli_prints_a_ranked_table(capsys):
    assert main(["gcn", "--nodes", "1000", "--nnz", "20000", "--features", "16",
                 "--classes", "4", "--ranks", "8", "--machine", "perlmutter-a100"]) == 0
    out = capsys.readouterr().out
    assert "comm x" in out and "GiB/rank" in out and "runner-up" in out
    assert len([ln for ln in out.splitlines() if " yes" in ln]) == 10  # every grid of 8 fits
    # the best grid's memory by part, largest first, adding up to its GiB/rank
    assert main(["gcn", "--dataset", "ogbn-papers100M", "--model", "sage", "--ranks", "64",
                 "--machine", "icelake-hdr200", "--top", "1"]) == 0
    out = capsys.readouterr().out
    (line,) = [ln for ln in out.splitlines() if ln.startswith("memory per rank of ")]
    sizes = [float(v) for v in re.findall(r" ([\d.]+) GiB", line)]
    assert len(sizes) == 7 and sizes == sorted(sizes, reverse=True) and sizes[0] > 1, line
    assert "adjacency" in line and "transients" in line and "kept H" in line
    best = re.search(r"grid auto: \S+ .*?; ([\d.]+) GiB per rank", out)
    assert best and sum(sizes) == pytest.approx(float(best.group(1)), abs=0.01 * 6), out
    # a size given beside --dataset replaces the preset's: SAR's symmetrised papers100M
    from common.perf.cli import gcn_workload, parse_args
    from common.perf.sar import PAPERS_SYMMETRIC_NNZ, sar_workload

    args = parse_args(["gcn", "--dataset", "ogbn-papers100M", "--nnz", str(PAPERS_SYMMETRIC_NNZ),
                       "--model", "sage", "--norm", "batch", "--hidden", "256", "--ranks", "64"])
    assert gcn_workload(args) == sar_workload()
    assert main(["gcn", "--ranks", "4"]) == 2
    assert "--nodes" in capsys.readouterr().err
    assert main(["gpt", "--vocab", "256", "--layers", "4", "--heads", "4", "--d-model", "128",
                 "--d-ff", "512", "--batch", "16", "--seq-len", "64", "--ranks", "8",
                 "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "comm row" in out and "grid auto: data=" in out
    assert "17 more grids" in out  # 20 grids of 8 ranks on 4 axes
    assert main(["gpt", "--vocab", "256", "--batch", "16", "--seq-len", "64",
                 "--ranks", "8"]) == 2
    assert "missing --layers --heads --d-model --d-ff" in capsys.readouterr().err
    # counts below one are refused by name, not read as the profile's default or a slice
    for flag, value in (("--ranks-per-node", "-1"), ("--ranks-per-node", "0"), ("--top", "-1")):
        with pytest.raises(SystemExit) as exc:
            main(["gcn", "--nodes", "1000", "--nnz", "20000", "--features", "16", "--classes",
                  "4", "--ranks", "8", flag, value])
        assert exc.value.code == 2
        assert f"argument {flag}: must be at least 1, got {value}" in capsys.readouterr().err


def test_plan_cli_takes_dropout_and_the_recompute_of_h0():
    from common.perf.cli import gcn_workload, parse_args

    base = ["gcn", "--nodes", "1000", "--nnz", "20000", "--features", "16", "--classes", "4",
            "--ranks", "2"]
    bare = gcn_workload(parse_args(base))
    assert bare.dropout == 0 and not bare.recomputes_first  # the paper's bare model: H_0 cached
    recipe = gcn_workload(parse_args([*base, "--dropout", "0.5"]))
    assert recipe.dropout == 0.5 and recipe.recomputes_first  # plexus.train's default
    kept = gcn_workload(parse_args([*base, "--dropout", "0.5", "--keep-first-aggregation"]))
    assert not kept.recomputes_first


def test_plan_command_runs_as_a_module():
    r = subprocess.run([sys.executable, "-m", "common.perf", "profiles"],
                       capture_output=True, text=True, env=launch_env(), timeout=60)
    assert r.returncode == 0 and "perlmutter-a100" in r.stdout, r.stderr
    assert r.stderr == ""  # no runpy warning about the re-exported module


def test_plan_cli_compares_ring_and_two_level_collectives(capsys):
    assert main(["gcn", "--dataset", "ogbn-papers100M", "--learn-features", "--ranks", "64",
                 "--machine", "frontier-mi250x", "--collectives", "both", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "collectives: ring\n" in out and "collectives: two-level\n" in out
    verdict = out.splitlines()[-1]
    assert verdict.startswith("collectives: ring ") and "two-level" in verdict
    assert main(["gpt", "--vocab", "256", "--layers", "4", "--heads", "4", "--d-model", "128",
                 "--d-ff", "512", "--batch", "16", "--seq-len", "64", "--ranks", "8",
                 "--machine", "perlmutter-a100", "--collectives", "two-level",
                 "--top", "1"]) == 0
    assert "grid auto: data=" in capsys.readouterr().out


# ------------------------------------------------------------------ --grid, both trainers
def test_default_grid_is_the_most_cubic_for_plexus_and_data_parallel_for_llm():
    from common.grid import AXONN_AXES
    from common.perf import default_grid

    assert str(default_grid(8)) == "2x2x2" and str(default_grid(4)) == "2x2x1"
    assert str(default_grid(6)) == "2x3x1" and str(default_grid(1)) == "1x1x1"
    assert default_grid(4, AXONN_AXES) == ProcessGrid.axonn(4, 1, 1, 1)


def test_parse_grid_once():
    from common.grid import AXONN_AXES
    from common.perf import GridSpec, parse_grid

    assert parse_grid("2x1x2", 4) == GridSpec(ProcessGrid.plexus(2, 1, 2))
    assert parse_grid(None, 4) == parse_grid("", 4) == GridSpec(ProcessGrid.plexus(2, 2, 1))
    assert parse_grid("data=2,row=2", 4, AXONN_AXES).grid == ProcessGrid.axonn(2, 1, 2, 1)
    spec = parse_grid("auto:perlmutter-a100", 4)
    assert spec.auto and spec.profile == "perlmutter-a100" and parse_grid("auto", 4).profile is None
    with pytest.raises(ValueError, match="3 sizes but the grid has 4 axes"):
        parse_grid("2x2x1", 4, AXONN_AXES)


def test_choose_grid_checks_a_fixed_grid_and_notes_an_auto_one():
    from common.grid import AXONN_AXES
    from common.perf import choose_grid, parse_grid

    grid, note = choose_grid(parse_grid("2x1x2", 4), GCN, 4)
    assert grid == ProcessGrid.plexus(2, 1, 2) and note is None
    with pytest.raises(ValueError, match=r"grid x=2 \* y=1 \* z=2 = 4 ranks, but 8 processes"):
        choose_grid(parse_grid("2x1x2", 4), GCN, 8)
    with pytest.raises(ValueError, match="heads: num_heads=2 % row=4"):  # the workload's check
        choose_grid(parse_grid("row=4", 4, AXONN_AXES), gpt_work(num_heads=2, d_model=128), 4)
    grid, note = choose_grid(parse_grid("auto:local-cpu", 8), GCN, 8)
    assert grid == auto_grid(GCN, 8, machine="local-cpu")[0]
    assert note.startswith("grid auto: ") and note.endswith("[profile local-cpu]")

    def no_z(shape):
        return ["no z"] if shape["z"] > 1 else []

    grid, _ = choose_grid(parse_grid("auto:local-cpu", 8), GCN, 8, constraints=[no_z])
    assert grid.size("z") == 1
    with pytest.raises(ValueError, match="no z"):  # constraints apply to a fixed grid too
        choose_grid(parse_grid("1x1x8", 8), GCN, 8, constraints=[no_z])
