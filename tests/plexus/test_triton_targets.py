"""plexus's Triton kernels compile for the GPUs users run, on a machine without one: every launch
that plexus.dropout_triton, plexus.relu_triton and plexus.spmm_triton make (every dtype, bf16
included, which Triton's interpreter cannot run) is compiled by Triton's own runtime path down
to the target's binary, for an A100 and an H100/H200 (sm_80, sm_90) and AMD's MI250X and MI300X
(gfx90a, gfx942), in a process of its own (tests/plexus/triton_targets.py). The interpreter
tests check the kernels' numbers; these check that the compiler takes them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
KERNELS = {"_keep_kernel", "_dropout_kernel", "_relu_pack_kernel", "_masked_kernel",
           "_spmm_kernel"}
# target: (its binary's stage, the most shared memory a block of it may take, in bytes)
TARGETS = {"cuda:80": ("cubin", 163 * 1024), "cuda:90": ("cubin", 227 * 1024),
           "hip:gfx90a": ("hsaco", 64 * 1024), "hip:gfx942": ("hsaco", 64 * 1024)}


def _compiling_env(cache: Path, **more: str) -> dict[str, str]:
    """This environment without Triton's interpreter, with its own kernel cache."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return {**env, "TRITON_CACHE_DIR": str(cache), "TRITON_DEFAULT_FP_FUSION": "1", **more}


def _compile(target: str, cache: Path) -> list[dict]:
    run = subprocess.run([sys.executable, "-W", "ignore", "-m", "tests.plexus.triton_targets",
                          target], cwd=ROOT, env=_compiling_env(cache), capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, f"compiling for {target} failed:\n{run.stderr[-4000:]}"
    return [json.loads(line) for line in run.stdout.splitlines()]


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_every_launch_compiles_for_the_target(target, tmp_path):
    from triton.backends import backends

    binary, shared_limit = TARGETS[target]
    backend = {"cuda": "nvidia", "hip": "amd"}[target.split(":")[0]]
    if backend not in backends:
        pytest.skip(f"this Triton has no {backend} backend")
    records = _compile(target, tmp_path / "cache")
    # 2 sizes x (1 mask + 9 dropouts + 1 ReLU + 2 masked + 8 SpMMs)
    assert len(records) == 42
    assert {r["kernel"] for r in records} == KERNELS
    for r in records:
        assert r["stages"].get(binary, 0) > 0, (r["kernel"], r["stages"])
        assert r["shared"] <= shared_limit, r
    spmm_x = {(r["signature"]["indices"], r["signature"]["x_ptr"])
              for r in records if r["kernel"] == "_spmm_kernel"}
    assert spmm_x == {(i, x) for i in ("*i32", "*i64") for x in ("*fp32", "*bf16")}
    dropout_x = {r["signature"]["x_ptr"] for r in records if r["kernel"] == "_dropout_kernel"}
    assert dropout_x == {"*fp32", "*bf16", "*fp16"}


def test_a_kernel_the_compiler_refuses_fails_the_compile(tmp_path):
    """What these tests catch and the interpreter does not: a loop-carried sum whose type
    changes in the loop runs in numpy, and the compiler refuses it."""
    source = (ROOT / "plexus" / "spmm_triton.py").read_text()
    wrong = "acc = (acc + tl.sum(vals[:, None] * xs, axis=0)).to(tl.float64)"
    assert source.count("acc += tl.sum(vals[:, None] * xs, axis=0)") == 1
    package = tmp_path / "plexus"
    package.mkdir()
    for name in ("__init__.py", "dropout_triton.py", "relu_triton.py"):
        (package / name).write_text((ROOT / "plexus" / name).read_text())
    (package / "spmm_triton.py").write_text(
        source.replace("acc += tl.sum(vals[:, None] * xs, axis=0)", wrong))
    env = _compiling_env(tmp_path / "cache",
                         PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    run = subprocess.run([sys.executable, "-W", "ignore", "-c",
                          "import sys; sys.path.insert(0, sys.argv[1]); "
                          "from tests.plexus.triton_targets import compile_all, parse_target; "
                          "compile_all(parse_target('cuda:90'))", str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode != 0
    assert "Loop-carried variable acc" in run.stderr, run.stderr[-3000:]
