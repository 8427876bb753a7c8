"""Compile plexus's numba kernels once, into numba's on-disk cache, before ranks need them.

    python -m plexus.precompile            # every signature the trainers call
    python -m plexus.precompile --float64  # and the float64 ones the tests use
    python -m plexus.precompile --shard 0/2 & python -m plexus.precompile --shard 1/2   # 2 cores

Every kernel in :mod:`plexus.kernels` and :mod:`plexus.norm_kernels` (its names prefixed
``norm_kernels.`` below) is cached (``cache=True``), so a signature is compiled by
the first process that calls it and loaded by the rest. Several ranks starting on a cold cache
(a fresh checkout, a new numba, a changed kernel) all compile the same signatures at once,
each compile taking a core, and an oversubscribed node pays that once per rank. Running this once
before the launch (or in a job's set-up step) compiles each signature once; on a warm cache
it only loads them. The cache lives beside the module (``plexus/__pycache__``) or under
``$NUMBA_CACHE_DIR``, which must then be the same for the launch.

Signatures: index arrays int32 or int64 (``I`` below: read-only, as memory-mapped prepared
blocks are), X float32 or bfloat16 (its uint16 bit patterns), the values float32.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# SpMM: indptr, indices (the values share the indices' writeability), X's element type.
# Lower case writable, upper case read-only; f8 (float64 X and output) only with float64=True.
SPMM = ["i4 i4 f4", "i4 i4 u2", "i8 i8 f4", "i8 i8 u2", "i8 i4 f4", "I8 I8 f4"]
SLICED = ["i4 i4 f4", "i4 i4 u2", "i8 i4 f4", "i8 i8 f4", "i8 i8 u2", "I8 I8 f4", "I4 I4 f4",
          "i4 I4 f4", "I4 I4 u2"]
FLOAT64 = ["i4 i4 f8", "i8 i8 f8"]
CUTS = ["i4 i4", "i8 i8", "I4 I4", "I8 I8"]  # indptr, indices; starts and cuts writable
# the cuts: uint16 offsets from each row's start (plexus.slicing.cut_dtype); indptr's own
# dtype in a block with a row of 65,536 nonzeros or more compiles on first use
CUT = "u2"


def signatures(*, float64: bool = False) -> dict[str, list[tuple]]:
    """Kernel name -> the numba signatures (tuples of argument types) to compile."""
    from numba import types

    def array(code: str, ndim: int) -> types.Array:
        dtype = {"i4": types.int32, "i8": types.int64, "f4": types.float32,
                 "u2": types.uint16, "f8": types.float64, "u8": types.uint64,
                 "u4": types.uint32, "b1": types.boolean, "u1": types.uint8}[code.lower()]
        return types.Array(dtype, ndim, "C", readonly=code[0].isupper())

    def operands(spec: str) -> tuple[str, str, str, str, str]:
        """indptr, indices, values (read-only with the indices), X's element code and the
        output's: the parts every SpMM signature shares."""
        ptr, idx, x = spec.split()
        values = "F4" if idx.isupper() else "f4"
        return ptr, idx, values, x, "f8" if x == "f8" else "f4"

    i64, flag = types.int64, types.boolean
    extra = FLOAT64 if float64 else []
    spmm, sliced = [], []
    for ptr, idx, values, x, out in map(operands, SPMM + extra):
        spmm.append((array(ptr, 1), array(idx, 1), array(values, 1), array(x, 2),
                     array(out, 2), flag))
    for ptr, idx, values, x, out in map(operands, SLICED + extra):
        sliced.append((array(ptr, 1), array(CUT, 2), array("i8", 1), array(idx, 1),
                       array(values, 1), array(x, 3), array(out, 3), flag, i64, i64, i64))
    cuts = [(array(ptr, 1), array(idx, 1), array(idx.lower(), 1), array(CUT, 2))
            for ptr, idx in (spec.split() for spec in CUTS)]
    return {
        "csr_spmm": spmm,
        "csr_spmm_sliced": sliced,
        "csr_slice_cuts": cuts,
        "csr_check": [(array("i4", 1), array("i4", 1), array("f4", 1), i64)],
        "csr_transpose": [(array("i4", 1), array("i4", 1), array("f4", 1), array("i4", 1),
                           array("i4", 1), array("f4", 1))],
        "rmat_chunk": [(i64, types.uint64, i64, types.float64, types.float64, types.float64,
                        array("u8", 1), array("i8", 1), array("i8", 1))],
        "keep_mask": [(array("u4", 1), array("u4", 1), types.uint64, types.uint64,
                       array("b1", 2))],
        "relu_pack": [(array("f4", 1), array("u1", 1))],
        "masked_by_bits": [(array("u4", 1), array("u1", 1), array("u4", 1))],
        **_norm_signatures(array),
    }


def _norm_signatures(array) -> dict[str, list[tuple]]:
    """plexus.norm_kernels: the block and gradient float32, the kept block float32 or bf16."""
    from numba import types

    flag, f4, u1 = types.boolean, array("f4", 1), array("u1", 1)
    block = array("f4", 2)
    kept = [array("f4", 2), array("u2", 2)]
    return {
        "norm_kernels.column_sums": [(block, f4, f4, flag, array("f8", 2))],
        "norm_kernels.normalize": [(block, f4, f4, f4, block, k, flag, u1) for k in kept],
        "norm_kernels.gradient_sums": [(block, k, f4, flag, u1, array("f8", 3)) for k in kept],
        "norm_kernels.input_gradient": [(block, k, f4, flag, u1, f4, f4, f4, block)
                                        for k in kept],
    }


def precompile(*, float64: bool = False, shard: tuple[int, int] = (0, 1)) -> int:
    """Compile (or load from the cache) the signatures of :func:`signatures`, or with
    ``shard=(k, n)`` every n-th of them from the k-th (n processes share the work); how many."""
    from plexus import kernels, norm_kernels

    modules = {"": kernels, "norm_kernels": norm_kernels}
    k, n = shard
    todo = [(name, sig) for name, sigs in signatures(float64=float64).items() for sig in sigs]
    for name, sig in todo[k::n]:
        module, _, kernel = name.rpartition(".")
        getattr(modules[module], kernel).compile(sig)
    return len(todo[k::n])


def _shard(text: str) -> tuple[int, int]:
    k, _, n = text.partition("/")
    try:
        shard = int(k), int(n)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: use K/N, e.g. 0/2") from None
    if not 0 <= shard[0] < shard[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: need 0 <= K < N")
    return shard


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m plexus.precompile",
                                description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--float64", action="store_true",
                   help="also the float64 signatures (the tests' serial references)")
    p.add_argument("--shard", type=_shard, default=(0, 1), metavar="K/N",
                   help="only every N-th signature from the K-th (N processes, one per core, "
                   "compile a cold cache N times faster)")
    args = p.parse_args(argv)
    try:
        import numba  # noqa: F401
    except ImportError:
        print("numba is not installed: plexus uses torch's CSR matmul, nothing to compile")
        return 0
    start = time.perf_counter()
    count = precompile(float64=args.float64, shard=args.shard)
    where = os.environ.get("NUMBA_CACHE_DIR") or "plexus/__pycache__"
    print(f"{count} kernel signatures compiled or loaded in {time.perf_counter() - start:.1f} s "
          f"(numba cache: {where})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
