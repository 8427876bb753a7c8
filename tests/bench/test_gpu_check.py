"""bench/gpu_check.py (``make gpu-check``) without a GPU: the commands it runs, the key numbers
and targets read from the two benches' real output (run here on the CPU with ``--device
cpu``), the rows read from a real pytest JUnit report, the table, the no-GPU message, and that
``pytest -m gpu`` collects the GPU tests of both packages."""

import re
import subprocess
import sys
import textwrap

import pytest

from tests.bench.scripts import load_bench
from tests.distributed import ROOT, launch_env

# the GPU tests tests/llm/test_gpu.py holds (its parametrizations counted), at least
NUM_LLM_GPU_TESTS = 23


gpu_check = load_bench("gpu_check")


def test_the_commands_are_every_gpu_test_and_the_benches_on_cuda_within_the_budget(tmp_path):
    junit = tmp_path / "r.xml"
    pytest_run, gcn_100k, gcn_1m, llm, llm_1b = gpu_check.checks(junit)
    assert pytest_run.kind == "pytest" and pytest_run.args[:4] == ["-m", "pytest", "-m", "gpu"]
    assert f"--junitxml={junit}" in pytest_run.args and pytest_run.args[-1] == "tests"
    for gcn, nodes, target in ((gcn_100k, "100000", gpu_check.DROPOUT_TARGET),
                               (gcn_1m, "1000000", gpu_check.DROPOUT_1M_TARGET)):
        assert gcn.args[0] == "bench/gcn_epoch.py" and gcn.target is target
        assert gcn.args[gcn.args.index("--nodes") + 1] == nodes
        assert gcn.args[gcn.args.index("--dropout") + 1] == "0.5"  # OGB's recipe
        assert gcn.args[gcn.args.index("--variants") + 1] == "fixed,learn"
    # at 1M nodes ours in bf16 too, judged against PyG in float32
    assert gcn_1m.args[gcn_1m.args.index("--precision") + 1] == "fp32,bf16"
    assert "--precision" not in gcn_100k.args
    assert llm.args[0] == llm_1b.args[0] == "bench/llm_throughput.py"
    assert llm.target is gpu_check.LLM_TARGET and llm_1b.target is gpu_check.MFU_TARGET
    one_b = llm_1b.args
    assert one_b[one_b.index("--preset") + 1] == "gpt1b" and "--compile" in one_b
    assert one_b[one_b.index("--precision") + 1] == "bf16"
    for bench in (gcn_100k, gcn_1m, llm, llm_1b):
        assert bench.kind == "bench" and bench.key is not None
        assert bench.args[bench.args.index("--device") + 1] == "cuda"
        assert (ROOT / bench.args[0]).is_file()
    # each command's limit and the grace it gets when interrupted, together within 10 minutes
    limits = [c.timeout_s + gpu_check.GRACE_S for c in gpu_check.checks(junit)]
    assert sum(limits) <= gpu_check.BUDGET_S <= 600 - 60  # a minute to spare in ten
    assert "-n" not in pytest_run.args  # no workers asked: no pytest-xdist
    parallel = gpu_check.checks(junit, 3)[0].args
    assert parallel[parallel.index("-n") + 1] == "3" and parallel[-1] == "tests"
    assert 0 <= gpu_check.default_workers() <= 4


def _bench(args):
    out = subprocess.run([sys.executable, *args], cwd=ROOT, env=launch_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.mark.slow
def test_key_numbers_are_read_from_the_benches_real_output():
    """The GPU commands with the CPU and tiny sizes swapped in: the same printing code, and
    ``--device`` of both benches."""
    def on_cpu(args):
        args = list(args)
        args[args.index("--device") + 1] = "cpu"
        return args

    one_m = on_cpu(gpu_check.GCN_1M_ARGS)
    one_m[one_m.index("--nodes") + 1] = "2000"
    gcn = _bench(["bench/gcn_epoch.py", *one_m, "--epochs", "2", "--threads", "1"])
    assert "on cpu" in gcn and "dropout 0.5" in gcn
    for case in ("fixed", "learn", "fixed-bf16"):  # --profile: each side's costliest ops
        assert f"{case}: our costliest operators" in gcn
    assert "fixed: PyG's costliest operators" in gcn
    key = gpu_check.gcn_key(gcn)
    assert re.fullmatch(r"ours/PyG fixed [\d.]+ learn [\d.]+ fixed-bf16 [\d.]+, ours [\d.]+ "
                        r"s/epoch, dropout fixed [\d.]+% learn [\d.]+%", key), key
    assert list(gpu_check._ratios(key)) == ["fixed", "learn", "fixed-bf16"]
    assert len(gpu_check._shares(key)) == 2
    assert all(0 < f < 1 for f in gpu_check._shares(key))
    llm = _bench(["bench/llm_throughput.py", *on_cpu(gpu_check.LLM_ARGS), "--preset", "tiny",
                  "--batch-size", "2", "--seq-len", "32", "--steps", "2", "--warmup", "1",
                  "--threads", "1"])
    assert "on cpu" in llm
    for side in ("ours", "plain"):  # --profile: a step of each (no busy share on the CPU)
        assert re.search(rf"^{side}: one profiled step [\d.]+ ms; its costliest operators",
                         llm, re.M), llm
    assert re.fullmatch(r"ours [\d,]+ tok/s, ours/plain [\d.]+", gpu_check.llm_key(llm)), \
        gpu_check.llm_key(llm)
    # with the device's peak (a GPU the table knows, or the flag): MFU beside tokens/s
    llm = _bench(["bench/llm_throughput.py", *on_cpu(gpu_check.LLM_ARGS), "--preset", "tiny",
                  "--batch-size", "2", "--seq-len", "32", "--steps", "2", "--warmup", "1",
                  "--threads", "1", "--peak-tflops", "0.05"])
    assert re.fullmatch(r"ours [\d,]+ tok/s, MFU [\d.]+%, ours/plain [\d.]+",
                        gpu_check.llm_key(llm)), gpu_check.llm_key(llm)
    assert gpu_check.gcn_key("crashed") == gpu_check.llm_key("") == "?"


def test_a_workload_whose_step_fell_back_meets_no_target():
    """bench/gcn_epoch.py prints ``CASE: FALLBACK: ...`` where ours ran eagerly (a failed CUDA
    graph capture) or on torch's kernels (a failed Triton kernel): its numbers are not of what
    the targets judge."""
    out = ("fixed: ours/PyG 0.400 against PyG GCNConv\n"
           "ours (Plexus 1x1x1), THP  0.010\n")
    key = gpu_check.gcn_key(out)
    assert key == "ours/PyG fixed 0.400, ours 0.010 s/epoch"
    assert gpu_check.DROPOUT_TARGET[1](key)
    fell = gpu_check.gcn_key(out + "fixed: FALLBACK: ours did not run as planned: plexus: the "
                             "training step could not be captured\n")
    assert fell == key + ", FALLBACK in fixed"
    assert not gpu_check.DROPOUT_TARGET[1](fell)


def test_rows_are_read_from_pytests_junit_report(tmp_path):
    (tmp_path / "test_sample.py").write_text(textwrap.dedent("""\
        import pytest

        def test_ok():
            pass

        @pytest.mark.parametrize("x", [1, 2])
        def test_param(x):
            assert x == 1, "two is not one"

        @pytest.mark.skip(reason="needs two GPUs")
        def test_skipped():
            pass
    """))
    junit = tmp_path / "r.xml"
    junit.write_text("<stale/>")  # an earlier run's report is never read
    check = gpu_check.Check("pytest", ["-m", "pytest", "-q", "-p", "no:cacheprovider",
                                       f"--junitxml={junit}", "--rootdir", str(tmp_path),
                                       str(tmp_path)], 120, "pytest")
    got, out = gpu_check.run_check(check, 600, tmp_path, junit)
    assert "1 failed, 2 passed, 1 skipped" in out
    rows = {r.name.rpartition("::")[2]: r for r in got}
    assert [r.name for r in got] == [r.name for r in gpu_check.junit_rows(junit.read_text())]
    assert set(rows) == {"test_ok", "test_param[1]", "test_param[2]", "test_skipped"}
    assert rows["test_ok"].status == rows["test_param[1]"].status == "passed"
    assert rows["test_param[2]"].status == "failed" and "two is not one" in rows[
        "test_param[2]"].key
    assert rows["test_skipped"].status == "skipped" and "needs two GPUs" in rows[
        "test_skipped"].key
    assert rows["test_ok"].name.endswith("test_sample.py::test_ok")
    assert all(r.seconds >= 0 for r in rows.values())
    assert gpu_check.failed(list(rows.values()))
    assert not gpu_check.failed([rows["test_ok"], rows["test_skipped"]])  # a skip is no failure


def test_the_table_aligns_and_sums():
    rows = [gpu_check.Row("tests/llm/test_gpu.py::test_a", "passed", "", 1.25),
            gpu_check.Row("bench/llm_throughput.py --device cuda", "passed",
                   "ours 1,234 tok/s, ours/plain 0.98", 30.0),
            gpu_check.Row("x", "timeout", "", 75.04)]
    lines = gpu_check.format_table(rows).splitlines()
    assert lines[0].split() == ["check", "status", "key", "seconds"]
    assert len({len(line) for line in lines[:4]}) == 1  # header and rows equally wide
    assert lines[2].startswith("bench/llm_throughput.py --device cuda  passed    ours 1,234")
    assert lines[1].endswith("     1.2") and lines[3].endswith("    75.0")
    assert lines[4] == "3 rows: 2 passed, 1 timeout; 106 s in all"
    assert gpu_check.format_table([]).splitlines()[-1] == "0 rows: nothing run; 0 s in all"


def test_run_check_reads_a_bench_and_keeps_its_log(tmp_path):
    ok = gpu_check.Check("ok", ["-c", "print('throughput ratio ours / plain = 0.5')"], 60, "bench",
                  lambda out: out.split()[-1])
    rows, out = gpu_check.run_check(ok, 600, tmp_path, tmp_path / "r.xml")
    assert [(r.name, r.status, r.key) for r in rows] == [("ok", "passed", "0.5")]
    assert "ratio" in out and (tmp_path / "ok.log").read_text() == out
    bad = gpu_check.Check("bad", ["-c", "raise SystemExit(3)"], 60, "bench", lambda out: "x")
    assert gpu_check.run_check(bad, 600, tmp_path, tmp_path / "r.xml")[0][0].status == "failed"
    left = gpu_check.GRACE_S + 5  # 5 s of the budget left
    late = gpu_check.run_check(ok, left, tmp_path, tmp_path / "r.xml")[0][0]
    assert (late.status, late.seconds) == ("not run", 0.0)


def test_a_bench_cut_off_after_its_result_keeps_it_as_a_timeout(tmp_path, monkeypatch):
    """A bench interrupted in its profiled step, after its result lines: the table shows the
    numbers, but the row stays a timeout with no verdict, and the check fails (``_run``'s
    interruption itself: the test above)."""
    out = ("ours, grid 1x1x1x1  1.0 ms  1.0-1.0 ms  1,000\n"
           "throughput ratio ours / plain = 0.97\n")
    check = gpu_check.Check("llm", ["-c", "pass"], 60, "bench", gpu_check.llm_key,
                            gpu_check.LLM_TARGET)
    monkeypatch.setattr(gpu_check, "_run", lambda argv, limit: (out, None))  # past its limit
    (row,), _ = gpu_check.run_check(check, 600, tmp_path, tmp_path / "r.xml")
    assert (row.status, row.key) == ("timeout", "ours 1,000 tok/s, ours/plain 0.97, then cut off")
    assert gpu_check.failed([row])
    monkeypatch.setattr(gpu_check, "_run", lambda argv, limit: ("started\n", None))
    (row,), _ = gpu_check.run_check(check, 600, tmp_path, tmp_path / "r.xml")
    assert (row.status, row.key) == ("timeout", "")  # nothing printed: nothing to show


def test_the_llm_key_carries_each_sides_gpu_busy_share_where_profiled():
    out = ("ours, grid 1x1x1x1  1.0 ms  1.0-1.0 ms  1,000  41.20%\n"
           "throughput ratio ours / plain = 0.97 (target >= 0.95: met)\n"
           "ours: one profiled step 80.1 ms, GPU busy 72.9 ms: 91% of it; its costliest GPU "
           "kernels, device ms:\n"
           "    40.00 ms     12 calls  sm90_xmma_gemm_bf16\n"
           "plain: one profiled step 79.0 ms, GPU busy 74.3 ms: 94% of it; its costliest GPU "
           "kernels, device ms:\n")
    key = gpu_check.llm_key(out)
    assert key == "ours 1,000 tok/s, MFU 41.20%, ours/plain 0.97, GPU busy ours 91% plain 94%"
    assert gpu_check.MFU_TARGET[1](key) and gpu_check.LLM_TARGET[1](key)


def test_a_bench_that_misses_its_target_is_missed_and_fails_the_check(tmp_path):
    def bench(ratio):
        out = ("ours, grid 1x1x1x1  1.0 ms  1.0-1.0 ms  1,000\n"
               f"throughput ratio ours / plain = {ratio}")
        return gpu_check.Check("llm", ["-c", f"print({out!r})"], 60, "bench",
                               gpu_check.llm_key, gpu_check.LLM_TARGET)

    (ok,), _ = gpu_check.run_check(bench(0.97), 600, tmp_path, tmp_path / "r.xml")
    (miss,), _ = gpu_check.run_check(bench(0.90), 600, tmp_path, tmp_path / "r.xml")
    assert ok.status == "passed" and ok.key.endswith("(target ours/plain >= 0.95: met)")
    assert miss.status == "missed" and "NOT met" in miss.key
    assert not gpu_check.failed([ok]) and gpu_check.failed([ok, miss])
    met, met_1m = gpu_check.DROPOUT_TARGET[1], gpu_check.DROPOUT_1M_TARGET[1]
    assert met("ours/PyG fixed 0.84 learn 0.97, ours 0.012 s/epoch, dropout fixed 12.0% "
               "learn 11.0%")
    assert not met("ours/PyG fixed 0.84 learn 1.37, ours 0.012 s/epoch")  # every workload
    assert not met("?")
    assert met_1m("ours/PyG fixed 0.70 learn 0.79 fixed-bf16 0.48, ours 0.09 s/epoch, "
                  "dropout fixed 8.1% learn 9.9%")
    assert not met_1m("ours/PyG fixed 0.70 learn 0.79 fixed-bf16 0.48, ours 0.09 s/epoch, "
                      "dropout fixed 8.1% learn 10.5%")  # the masks' share too
    assert not met_1m("ours/PyG fixed 0.70 learn 0.82 fixed-bf16 0.48, ours 0.09 s/epoch, "
                      "dropout fixed 8.1% learn 9.5%")
    assert not met_1m("ours/PyG fixed 0.70 learn 0.79 fixed-bf16 0.48, ours 0.09 s/epoch")
    # bf16 against its own target (0.5, not float32's 0.8), and read
    assert not met_1m("ours/PyG fixed 0.70 learn 0.79 fixed-bf16 0.62, ours 0.09 s/epoch, "
                      "dropout fixed 8.1% learn 9.9%")
    assert not met_1m("ours/PyG fixed 0.70 learn 0.79, ours 0.09 s/epoch, dropout fixed 8.1% "
                      "learn 9.9%")
    mfu = gpu_check.MFU_TARGET[1]
    assert mfu("ours 20,000 tok/s, MFU 41.20%, ours/plain 0.99")
    assert not mfu("ours 20,000 tok/s, MFU 39.90%, ours/plain 0.99")
    assert not mfu("ours 20,000 tok/s, ours/plain 0.99")  # no peak known: no MFU, not met


def test_a_command_past_its_limit_is_interrupted_then_reported():
    """SIGINT first (pytest writes its report on it), so the command can say what it did."""
    # 'started' is printed inside the try, so that a SIGINT that comes before it (an
    # interpreter slow to start on a loaded machine) fails on 'started', not on 'interrupted'
    code = ("import time\ntry:\n    print('started', flush=True)\n    time.sleep(60)\n"
            "except KeyboardInterrupt:\n    print('interrupted')\n")
    out, status = gpu_check._run([sys.executable, "-c", code], 5.0)
    assert status is None and "started" in out and "interrupted" in out
    out, status = gpu_check._run([sys.executable, "-c", "raise SystemExit(4)"], 30.0)
    assert status == 4


def test_without_a_gpu_it_says_so_and_exits_0(capsys, monkeypatch, tmp_path):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--log-dir", str(tmp_path / "logs")]) == 0
    assert capsys.readouterr().out == gpu_check.NO_GPU + "\n"
    assert not (tmp_path / "logs").exists()
    assert gpu_check.main(["--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert len(listed) == 5 and "-m pytest -m gpu" in listed[0]
    assert all("bench/gcn_epoch.py --device cuda --dropout 0.5" in line
               for line in listed[1:3])
    assert "bench/llm_throughput.py" in listed[3] and "--preset gpt1b" in listed[4]


def test_make_gpu_check_runs_the_driver():
    makefile = (ROOT / "Makefile").read_text()
    target = re.search(r"^gpu-check:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert target and "bench/gpu_check.py" in target[1]
    assert re.search(r"^\.PHONY:.*\bgpu-check\b", makefile, re.M)


@pytest.mark.slow
def test_pytest_collects_the_gpu_tests_of_both_packages():
    """Skipped without a GPU, but collected: ``-m gpu`` selects them in llm and plexus."""
    out = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q",
                          "-p", "no:cacheprovider", "tests"], cwd=ROOT, env=launch_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    ids = [line for line in out.stdout.splitlines() if "::" in line]
    llm = [i for i in ids if i.startswith("tests/llm/")]
    plexus = [i for i in ids if i.startswith("tests/plexus/")]
    assert len(llm) >= NUM_LLM_GPU_TESTS, llm
    assert len(plexus) >= 2, plexus
    for name in ("test_tensor_parallel_layers_on_one_gpu_over_gloo",
                 "test_every_decoding_method_on_cuda_follows_the_cpu_run[sift]",
                 "test_quantspec_on_cuda_accepts_a_draft_that_must_agree",
                 "test_evaluate_cli_on_cuda_follows_the_cpu_run[loki]",
                 "test_bf16_on_cuda_follows_the_cpu_bf16_run"):
        assert f"tests/llm/test_gpu.py::{name}" in ids, name
    assert {i.partition("::")[0] for i in ids} >= {"tests/llm/test_gpu.py",
                                                   "tests/plexus/test_gpu.py"}
    # the GPU paths no CPU test runs compiled: the captured step, Triton's kernels, flash
    for name in ("tests/plexus/test_gpu.py::test_the_captured_step_gives_the_eager_steps_"
                 "numbers[fixed-dropout]",
                 "tests/plexus/test_gpu.py::test_every_model_option_on_cuda_follows_the_cpu_"
                 "run[bf16]",
                 "tests/plexus/test_dropout_triton.py::test_layer_dropout_on_a_gpu_hashes_in_"
                 "the_kernel_with_the_masks_numbers",
                 "tests/plexus/test_relu_triton.py::test_ops_relu_on_a_gpu_takes_the_kernels_"
                 "with_torchs_numbers",
                 "tests/plexus/test_spmm_triton.py::test_a_bf16_x_on_a_gpu_gives_the_float32_"
                 "product_and_blocksparse_takes_it",
                 "tests/llm/test_gpu.py::test_bf16_attention_runs_the_flash_kernel_forward_and_"
                 "backward",
                 "tests/llm/test_gpu.py::test_compiled_blocks_on_cuda_follow_the_eager_run"):
        assert name in ids, name


def test_the_header_names_the_host_cpu_and_its_avx512():
    """The host CPU of a lent GPU machine decides which code paths MKL, oneDNN and ATen take
    (docs/testing.md), so the check's header names it, as /proc/cpuinfo does."""
    from tests.cpu_variants import cpu_flags

    text = gpu_check.host_cpu()
    want = "with AVX-512" if "avx512f" in cpu_flags() else "no AVX-512"
    assert text.endswith(want) and not text.startswith("unknown"), text


def test_each_command_is_summed_up_in_a_line_as_it_ends():
    row = gpu_check.Row
    assert gpu_check.summary([row("bench", "missed", "ours/PyG fixed 0.9", 3.0)]) == \
        "missed ours/PyG fixed 0.9"
    tests = [row("a.py::t1", "passed", "", 1.0), row("a.py::t2", "skipped", "two GPUs", 0.0),
             row("b.py::t3", "failed", "assert", 2.0), row("b.py::t4", "passed", "", 1.0)]
    assert gpu_check.summary(tests) == "1 failed, 2 passed, 1 skipped; not passed: b.py::t3"
