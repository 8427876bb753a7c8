"""Compile every launch of plexus's Triton kernels for a GPU that this machine does not have:
``python -m tests.plexus.triton_targets cuda:90`` (an H100 or H200; ``cuda:80`` an A100,
``hip:gfx942`` an MI300X) prints one JSON line per compiled launch.

Triton's interpreter (which the other kernel tests run on the CPU) executes a kernel's Python
with numpy: it does not type-check the kernel as the compiler does, has no bfloat16, and never
lowers it to a GPU's code. Here each public function of the kernel modules runs on CPU tensors
with its kernel objects swapped for recorders; every launch it makes (the grid, the arguments,
the constexprs) is then handed to the kernel's own ``warmup``, with Triton's driver reporting
the target, so that the runtime's own argument specialization decides what is compiled, down
to the target's binary (a cubin, an hsaco), as at the first launch on such a GPU. Nothing is
launched, so what only a launch checks (the grid's limits, registers against the device's) is
not.

Run in a process without ``TRITON_INTERPRET`` (the interpreter replaces the kernels' JIT).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

__all__ = ["compile_all", "launches"]


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` is recorded."""

    def __init__(self, name: str, kernel: Any, log: list) -> None:
        self.name, self.kernel, self.log = name, kernel, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            # (the arguments as they are now: a later call may write over a tensor)
            self.log.append((self.name, self.kernel, tuple(grid), args, kwargs))
        return launch


def launches() -> list[tuple[str, Any, tuple, tuple, dict]]:
    """(kernel name, kernel, grid, args, kwargs) of each launch that the kernel modules' public
    functions make, over the cases the trainer runs: every dtype a function takes, in place or
    not, with a mask or without, int32 and int64 indices, added into an existing product or
    not, and sizes that fill a block and sizes that do not (the runtime specializes on sizes
    divisible by 16)."""
    from plexus import dropout_triton, relu_triton, spmm_triton

    log: list = []
    saved = []
    for module in (dropout_triton, relu_triton, spmm_triton):
        for name in [n for n in vars(module) if n.endswith("_kernel")]:
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, _Recorder(name, getattr(module, name), log))
    try:
        key = dropout_triton.MaskKey(seed_key=0x9E3779B9, step=torch.tensor([7]), layer=1,
                                     threshold=1 << 31)
        for n, d in ((100, 37), (64, 128)):
            rows, cols = torch.arange(n) * 3, torch.arange(d)
            dropout_triton.keep_mask_triton(rows, cols, key)
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                x = torch.randn(n, d).to(dtype)
                for with_mask in (True, False):
                    dropout_triton.fused_dropout(x, rows, cols, key, 0.5, with_mask=with_mask)
                dropout_triton.fused_dropout(x, rows, cols, key, 0.5, out=x, with_mask=False)
            q = torch.randn(n * d)
            bits = relu_triton.relu_pack(q)
            relu_triton.masked_by_bits(q, bits)
            relu_triton.masked_by_bits(q, bits, out=q)
            dense = torch.rand(n, n) * (torch.rand(n, n) < 0.1)
            csr = dense.to_sparse_csr()
            for index in (torch.int32, torch.int64):
                a = torch.sparse_csr_tensor(csr.crow_indices().to(index),
                                            csr.col_indices().to(index), csr.values(), csr.shape)
                for dtype in (torch.float32, torch.bfloat16):
                    for accumulate in (False, True):
                        spmm_triton.csr_spmm(a, torch.randn(n, d).to(dtype),
                                             torch.zeros(n, d), accumulate=accumulate)
    finally:
        for module, name, kernel in saved:
            setattr(module, name, kernel)
    return log


def _driver_for(target: Any) -> Any:
    """A Triton driver that reports ``target`` and device 0, for compiling only (it loads and
    launches nothing)."""
    from triton.backends.driver import DriverBase

    class CompileOnly(DriverBase):
        @classmethod
        def is_active(cls) -> bool:
            return False

        def map_python_to_cpp_type(self, ty: str) -> str:
            raise NotImplementedError("compile only: nothing is launched")

        def get_current_target(self):
            return target

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_benchmarker(self):
            raise NotImplementedError("compile only: nothing is launched")

        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

    return CompileOnly()


def parse_target(text: str) -> Any:
    """``cuda:90`` -> GPUTarget("cuda", 90, 32); ``hip:gfx942`` -> GPUTarget("hip", "gfx942",
    64)."""
    from triton.backends.compiler import GPUTarget

    backend, _, arch = text.partition(":")
    if backend == "cuda" and arch.isdigit():
        return GPUTarget("cuda", int(arch), 32)
    if backend == "hip" and arch.startswith("gfx"):
        return GPUTarget("hip", arch, 64)
    raise ValueError(f"a target is cuda:<compute capability, e.g. 90> or hip:<gfx arch>, "
                     f"not {text!r}")


def compile_all(target: Any) -> list[dict]:
    """Compile every launch of :func:`launches` for ``target``; one record per launch: the
    kernel, its specialized signature and constexprs, and the sizes of what was produced."""
    from triton.runtime import driver

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("TRITON_INTERPRET is set: the kernels are interpreted, not compiled")
    records = []
    before = getattr(driver, "_active", None)  # (reset_active() would look for a GPU's driver)
    driver.set_active(_driver_for(target))
    try:
        for name, kernel, grid, args, kwargs in launches():
            compiled = kernel.warmup(*args, grid=grid, **kwargs)
            records.append({
                "kernel": name,
                "signature": {k: str(v) for k, v in compiled.src.signature.items()},
                "constexprs": {str(k): str(v) for k, v in compiled.src.constants.items()},
                "stages": {k: len(v) for k, v in compiled.asm.items()},
                "shared": int(compiled.metadata.shared),
            })
    finally:
        driver.set_active(before)
    return records


if __name__ == "__main__":
    for record in compile_all(parse_target(sys.argv[1] if len(sys.argv) > 1 else "cuda:90")):
        print(json.dumps(record), flush=True)
