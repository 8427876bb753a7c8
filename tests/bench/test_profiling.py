"""bench/profiling.py: the benches' ``--profile`` (one step after the timed ones under
torch.profiler, its costliest entries) on the CPU."""

import torch

from bench import profiling


def test_profile_after_covers_only_the_step_after_the_timed_ones():
    """The profiler starts after the last timed step and stops after the next, so it slows
    none of the timed ones; its table is the costliest operators (kernels on a GPU) by self
    time, costliest first."""
    hook = profiling.ProfileAfter(2, torch.device("cpu"))
    a = torch.randn(300, 300)
    for step in (1, 2, 3):
        if step == 3:
            assert hook.prof is not None  # on for the third step only
            for _ in range(5):
                a @ a
        else:
            assert hook.prof is None
        hook(step)
    assert hook.prof is None and hook.top
    names = [name for name, _, _ in hook.top]
    assert "aten::mm" in names and "aten::randn" not in names  # (made before it started)
    ms = [t for _, t, _ in hook.top]
    assert ms == sorted(ms, reverse=True) and all(t >= 0 for t in ms)
    assert dict((n, c) for n, _, c in hook.top)["aten::mm"] == 5


def test_profile_step_times_one_call_and_names_its_operators():
    a = torch.randn(200, 200)
    calls = []

    def step():
        calls.append(1)
        for _ in range(3):
            a @ a

    got = profiling.profile_step(step, torch.device("cpu"))
    assert calls == [1]
    assert dict((n, c) for n, _, c in got.top)["aten::mm"] == 3
    assert got.wall_ms > 0
    # the CPU's operators nest: no busy time is claimed there
    assert got.busy_ms is None and got.busy_share() is None


def test_busy_share_is_the_kernels_time_over_the_wall_time_at_most_one():
    one = profiling.StepProfile([], wall_ms=10.0, busy_ms=4.0)
    assert one.busy_share() == 0.4
    assert profiling.StepProfile([], wall_ms=10.0, busy_ms=12.0).busy_share() == 1.0


def test_print_top_prints_a_line_per_entry(capsys):
    profiling.print_top("title:", [("aten::mm", 1.5, 3), ("x" * 120, 0.25, 1)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "title:"
    assert lines[1].split() == ["1.50", "ms", "3", "calls", "aten::mm"]
    assert lines[2].endswith("x" * 90) and "x" * 91 not in lines[2]  # names cut at 90
