"""Other CPUs' code paths on this one: the switches of torch's vendor libraries that make them
sum in another order, so that a test relying on one library's order of summation fails on the
machine it was written on, not first on a user's Intel Xeon.

torch's CPU wheel computes dense products with MKL (``torch.mm``) and oneDNN (``common.dense``),
sparse products with MKL, and reductions, softmax and norms with ATen's own vectorised kernels.
Each picks its code path by the CPU it runs on: MKL by vendor and instruction set (AVX-512 on
an Intel Xeon, AVX2 on an AMD EPYC even where it has AVX-512), oneDNN by the widest
instruction set, ATen by its dispatch level (``default``, ``avx2``, ``avx512``). Each path
blocks its sums differently. The environment variables below select another path on the same
CPU; where one changes the bits of a product here, running the tests under it is the nearest
thing to running them on that other CPU.

    python -m tests.cpu_variants                 # the table: supported here? changes bits here?
    python -m tests.cpu_variants --run           # make test's pytest under every supported one
    python -m tests.cpu_variants --run -- -m cross_shape tests/plexus   # other pytest arguments

The suite itself reruns the ``cross_shape`` tests (those comparing a vendor library's results
across shapes, row sets, grids or kernels) that run in the test process under every variant
that changes bits here, combined into as few runs as that takes (tests/test_cpu_variants.py).
docs/testing.md says what each variant emulates.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# make test's pytest arguments (Makefile), for --run without arguments
SUITE_ARGS = ("-q", "-n", "2", "--dist", "loadgroup")


@dataclass(frozen=True)
class Variant:
    """One environment variable and value, what it makes the libraries do, and the CPU flags
    (as /proc/cpuinfo names them) without which the variant does not apply."""

    var: str
    value: str
    emulates: str
    needs: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.var}={self.value}"

    @property
    def env(self) -> dict[str, str]:
        return {self.var: self.value}


VARIANTS = (
    Variant("MKL_CBWR", "AVX2", "MKL's AVX2 kernels in a fixed order: what MKL runs on an AMD "
            "CPU or an Intel one without AVX-512; on an AVX-512 Intel CPU, its AVX2 neighbour",
            ("avx2",)),
    Variant("MKL_CBWR", "COMPATIBLE", "MKL's generic SSE2 kernels: another blocking of every "
            "GEMM and GEMV, as a CPU of another generation sums them"),
    Variant("MKL_ENABLE_INSTRUCTIONS", "AVX512", "MKL allowed its AVX-512 kernels (an Intel "
            "Xeon's default; MKL keeps AMD CPUs on AVX2 regardless)", ("avx512f",)),
    Variant("ATEN_CPU_CAPABILITY", "default", "ATen's kernels without AVX2 (reductions, "
            "softmax, norms, elementwise maths in another vector width)"),
    Variant("ATEN_CPU_CAPABILITY", "avx2", "ATen's AVX2 kernels: on an AVX-512 CPU, what an "
            "AVX2 CPU computes", ("avx2",)),
    Variant("ATEN_CPU_CAPABILITY", "avx512", "ATen's AVX-512 kernels: what a Xeon computes",
            ("avx512f", "avx512bw", "avx512vl", "avx512dq")),
    Variant("ONEDNN_MAX_CPU_ISA", "AVX2", "oneDNN capped at AVX2: on an AVX-512 CPU, what an "
            "AVX2 CPU's oneDNN products give", ("avx2",)),
    Variant("ONEDNN_MAX_CPU_ISA", "SSE41", "oneDNN's SSE4.1 kernels: another blocking of "
            "common.dense's products"),
)


def cpu_flags() -> set[str]:
    """The instruction-set flags of this CPU (empty where /proc/cpuinfo is not there)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def supported(variant: Variant, flags: set[str] | None = None) -> bool:
    """Whether the CPU has what the variant selects (a library asked for an instruction set
    the CPU lacks ignores the request or refuses to start)."""
    return set(variant.needs) <= (cpu_flags() if flags is None else flags)


def _probe_results() -> dict[str, str]:
    """A digest of each kind of product and reduction the project calls, on inputs made by
    numpy (torch's own random draws change with ATEN_CPU_CAPABILITY)."""
    import warnings

    import numpy as np
    import torch

    from common import dense

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.from_numpy(rng.standard_normal(shape).astype(np.float32))

    a, b, c = randn(2000, 96), randn(96, 40), randn(203, 8)
    tall, w = randn(20000, 64), randn(64, 64)
    coo = torch.sparse_coo_tensor(torch.from_numpy(rng.integers(0, 2000, (2, 20000))),
                                  randn(20000), (2000, 2000)).coalesce()
    q, k, v = randn(2, 4, 64, 16), randn(2, 4, 64, 16), randn(2, 4, 64, 16)
    outs = {
        "mm": a @ b, "mm rows": a[7:300] @ b, "mm small": c @ randn(8, 5),
        "mv": a @ b[:, 0], "bmm": torch.bmm(q[0], k[0].transpose(1, 2)),
        "linear": torch.nn.functional.linear(a, b.T, randn(40)),
        "csr mm": coo.to_sparse_csr() @ randn(2000, 40),
        "dense.mm": dense.mm(tall, w), "dense.tn": dense.tn(tall, randn(20000, 64)),
        "sum": a.sum(0), "log_softmax": torch.log_softmax(a, 1), "softmax": a.softmax(1),
        "layer_norm": torch.nn.functional.layer_norm(a, (96,)),
        "sdpa": torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
        "bf16 mm": (a.bfloat16() @ b.bfloat16()).float(),
    }
    return {name: hashlib.sha1(t.contiguous().numpy().tobytes()).hexdigest()
            for name, t in outs.items()}


def probe(env: dict[str, str] | None = None) -> dict[str, str]:
    """:func:`_probe_results` in a fresh process under ``env`` (the libraries read their
    variables once, when they load)."""
    run = subprocess.run([sys.executable, "-m", "tests.cpu_variants", "--probe"], cwd=ROOT,
                         env={**os.environ, **(env or {})}, capture_output=True, text=True,
                         timeout=300, check=False)
    if run.returncode != 0:
        raise RuntimeError(f"the probe under {env} failed ({run.returncode}):\n{run.stderr}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def bits_changed(variant: Variant, base: dict[str, str]) -> list[str]:
    """The probe's products whose bits ``variant`` changes on this CPU."""
    got = probe(variant.env)
    return [name for name, digest in base.items() if got.get(name) != digest]


def rounds(variants: list[Variant]) -> list[list[Variant]]:
    """``variants`` combined into as few runs as keep each one: round ``i`` takes the ``i``-th
    value of every variable (the libraries read different variables, so one run can take
    MKL, oneDNN and ATen down other paths at once; two values of one variable need two)."""
    by_var: dict[str, list[Variant]] = {}
    for v in variants:
        by_var.setdefault(v.var, []).append(v)
    depth = max((len(vs) for vs in by_var.values()), default=0)
    return [[vs[i] for vs in by_var.values() if i < len(vs)] for i in range(depth)]


def clean_env(*variants: Variant) -> dict[str, str]:
    """The environment for a pytest run under ``variants``: this one, less pytest-xdist's
    worker variables (the run is a pytest of its own), plus the variants'."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env.pop("PYTEST_CURRENT_TEST", None)
    for v in variants:
        env.update(v.env)
    return env


def _table() -> int:
    flags, base = cpu_flags(), probe()
    print(f"{'variant':34} {'here':9} changes bits of")
    for v in VARIANTS:
        if not supported(v, flags):
            print(f"{v.name:34} {'no':9} (needs {', '.join(v.needs)})")
            continue
        changed = bits_changed(v, base)
        print(f"{v.name:34} {'yes':9} {', '.join(changed) or 'nothing'}")
    return 0


def _run(pytest_args: list[str]) -> int:
    flags, failed = cpu_flags(), []
    for v in VARIANTS:
        if not supported(v, flags):
            print(f"== {v.name}: not on this CPU (needs {', '.join(v.needs)})", flush=True)
            continue
        print(f"== {v.name}: {v.emulates}", flush=True)
        start = time.monotonic()
        rc = subprocess.run([sys.executable, "-m", "pytest", *(pytest_args or SUITE_ARGS)],
                            cwd=ROOT, env=clean_env(v), check=False).returncode
        print(f"== {v.name}: exit {rc} in {time.monotonic() - start:.0f} s", flush=True)
        if rc != 0:
            failed.append(v.name)
    print("failed under: " + ", ".join(failed) if failed else "passed under every variant")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.cpu_variants", description=__doc__.split("\n\n")[0],
        epilog="Arguments after -- go to pytest (default: make test's).")
    parser.add_argument("--run", action="store_true",
                        help="run pytest under every variant this CPU supports")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args(argv)
    rest = rest[1:] if rest[:1] == ["--"] else rest
    if args.probe:
        print(json.dumps(_probe_results()))
        return 0
    return _run(rest) if args.run else _table()


if __name__ == "__main__":
    sys.exit(main())
