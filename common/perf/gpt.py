"""Performance model of one GPT optimizer step on the 4D grid data x depth x row x col
(docs/design/llm-4d-goldfish.md sections 1-3; AxoNN, Singh et al. arXiv 2305.13525;
llm/parallel/layout.py).

Grid ``D x Z x R x C`` (col fastest). A *normal* Linear ``W [out, in]`` keeps the block
``[ceil(out/R), ceil(in/C)]``, flattened and split ``1/Z`` over depth (a flat shard of
``ceil(|block| / Z)`` elements); a *transposed* Linear (o_proj, down_proj) swaps row and col.
The LM head is normal; the embedding keeps ``[V, ceil(d/C)]`` (flat, 1/Z) replicated over row;
RMSNorm weights ``[ceil(d/C)]`` are replicated over row and depth. A micro-step runs
``rows = ceil(micro_batch / (D Z))`` sequences per rank, ``m = rows * T`` tokens, and a step
``k = global_batch / micro_batch`` micro-steps (gradient accumulation). ``M`` is the full
tensor's bytes; ``p``, ``g``, ``a`` the parameter, gradient and activation widths::

    per Linear and micro-step:
      all-gather W over depth, forward and again in backward     2 x  M = Z shard p
      all-reduce y over col (normal) / row (transposed)               M = m out_blk a
      all-reduce dX over row (normal) / col (transposed)              M = m in_blk a
      reduce-scatter dW over depth                                    M = Z shard g
    per micro-step: the embedding's all-gather and reduce-scatter over depth; each of the
      2 L + 1 RMSNorms all-reduces its float32 sum of squares [m] over col, forward and
      backward; the loss all-reduces max, sum-exp and target logit [m] (float32) over row
    per step: one all-reduce over data of every flat shard's gradient, one over data+depth
      of the RMSNorm gradients, a float32 scalar over depth+row+col (gradient norm) and two
      float32 loss sums over data+depth

On a grid with depth = row = col = 1 the trainer keeps plain modules: only the data all-reduce
of all gradients and the loss sums remain. Groups of one rank send nothing.

Compute per rank: each Linear as three roofline GEMMs per micro-step (``y``, ``dX``, ``dW``),
plus attention scores and values, ``12 num_layers (d/R) T`` flops per token, at the profile's
low-precision rate when ``param_bytes == 2``. Memory per rank (:func:`gpt_memory_terms`):
parameter state (``bytes_per_param`` per element of this rank's shards), the largest gathered
block twice (use and prefetch), the dW blocks in flight, one micro-step's activations as the
trainer keeps them (measured coefficients), float32 logits, and a runtime allowance. The planner
refuses grids with problems (:meth:`GPTWorkload.grid_problems`: row must divide the heads and
the key/value heads, data x depth the batch, and tied embeddings need depth = row = col = 1).
The model's sizes are declared once, in :class:`GPTShape`, which ``llm.config.GPTConfig``
extends. Pure Python.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from common.grid import AXONN_AXES, ProcessGrid, ceil_div
from common.perf.machine import MachineProfile
from common.perf.model import (
    Collective,
    Plan,
    Prediction,
    bytes_by_axis,
    comm_seconds,
    factorizations,
    group_size,
    rank_predictions,
)

AXES = AXONN_AXES  # ("data", "depth", "row", "col")
F32 = 4
ORS_WINDOW = 2  # reduce-scatters of dW in flight at once (llm.parallel.layers.DepthGrads)


@dataclass(frozen=True, kw_only=True)
class GPTShape:
    """The sizes of a GPT, declared once: ``llm.config.GPTConfig`` (the model) and
    :class:`GPTWorkload` (the planner's step) both extend it (common imports no engine).

    Attributes:
        vocab_size: number of token ids (V).
        num_layers: number of transformer blocks.
        num_heads: query heads (H).
        num_kv_heads: key/value heads (Hkv); None in the constructor means ``num_heads``
            (plain multi-head attention) and is stored resolved, so the attribute is an int.
            ``dataclasses.replace(shape, num_heads=...)`` keeps the resolved value: pass
            ``num_kv_heads`` too when changing the heads.
        d_model: residual width (D); head_dim = d_model / num_heads.
        d_ff: hidden width of the SwiGLU MLP (F).
        tie_embeddings: share the token embedding with the LM head.
    """

    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int | None = None  # resolved to an int by __post_init__
    d_model: int
    d_ff: int
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.num_kv_heads is None:  # frozen: set through object.__setattr__
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        for name in ("vocab_size", "num_layers", "num_heads", "num_kv_heads", "d_model", "d_ff"):
            if getattr(self, name) < 1:
                raise ValueError(f"{type(self).__name__}.{name} must be >= 1, got "
                                 f"{getattr(self, name)}")
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by num_heads="
                             f"{self.num_heads} ({self.d_model} % {self.num_heads} = "
                             f"{self.d_model % self.num_heads})")
        if self.num_heads % self.kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.kv_heads} (grouped-query attention)")

    @property
    def kv_heads(self) -> int:
        """``num_kv_heads`` as an int (always resolved after construction)."""
        assert self.num_kv_heads is not None
        return self.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    def linears(self) -> list[tuple[int, int, bool, int]]:
        """(in, out, transposed, count) of every Linear: q, k, v, o, gate, up, down per block
        (count = num_layers) and the LM head."""
        d, f, kv = self.d_model, self.d_ff, self.kv_heads * self.head_dim
        block = [(d, d, False), (d, kv, False), (d, kv, False), (d, d, True), (d, f, False),
                 (d, f, False), (f, d, True)]
        return ([(i, o, t, self.num_layers) for i, o, t in block]
                + [(d, self.vocab_size, False, 1)])

    def num_params(self) -> int:
        """Parameters of the model (Linears, embedding, RMSNorm weights; a tied LM head is
        the embedding, counted once)."""
        linear = sum(i * o * n for i, o, _, n in self.linears())
        embed = 0 if self.tie_embeddings else self.vocab_size * self.d_model
        return linear + embed + (2 * self.num_layers + 1) * self.d_model


# the fields GPTWorkload.from_config copies from a model config
MODEL_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(GPTShape))


@dataclass(frozen=True, kw_only=True)
class GPTWorkload(GPTShape):
    """A GPT optimizer step as the model sees it: the model's :class:`GPTShape` and the
    training sizes.

    Attributes:
        name: label for tables.
        seq_len: tokens per sequence T.
        global_batch: sequences per optimizer step, over all ranks.
        micro_batch: sequences per micro-step over all ranks (llm.train's ``--batch-size``;
            ``global_batch / micro_batch`` is its ``--grad-accum``); None lets the planner
            pick, per grid, the largest that fits in memory.
        param_bytes, grad_bytes, activation_bytes: 2 for bf16, 4 for float32 (llm.train).
        bytes_per_param: parameter + gradient + AdamW state per parameter (4 + 4 + 8 = 16;
            with bf16 the master weights, gradients and moments stay float32: still 16).
        activation_checkpointing: each block's activations are recomputed in backward
            (llm.train --activation-checkpointing): only block inputs are kept.
    """

    name: str = "gpt"
    seq_len: int
    global_batch: int
    micro_batch: int | None = None
    param_bytes: int = 4
    grad_bytes: int = 4
    activation_bytes: int = 4
    bytes_per_param: int = 16
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        for f in ("seq_len", "global_batch", "param_bytes", "grad_bytes", "activation_bytes",
                  "bytes_per_param"):
            if getattr(self, f) < 1:
                raise ValueError(f"GPTWorkload.{f} must be >= 1, got {getattr(self, f)}")
        if self.micro_batch is not None and (
                self.micro_batch < 1 or self.global_batch % self.micro_batch):
            raise ValueError(f"micro_batch must divide global_batch: {self.global_batch} % "
                             f"{self.micro_batch} != 0")

    @classmethod
    def from_config(cls, config: Any, *, global_batch: int, seq_len: int | None = None,
                    **sizes: Any) -> GPTWorkload:
        """From an ``llm.model.GPTConfig`` (read by attribute; llm is not imported).

        Copies the same-named model fields (:data:`MODEL_FIELDS`); ``seq_len`` defaults to
        ``config.max_seq_len``; ``sizes`` are the other fields (micro_batch, *_bytes, name).
        """
        model = {f: getattr(config, f) for f in MODEL_FIELDS}
        return cls(**model, seq_len=seq_len or config.max_seq_len, global_batch=global_batch,
                   **sizes)

    def grid_problems(self, shape: Mapping[str, int]) -> list[str]:
        """Why this model and batch cannot run on ``shape`` (data, depth, row, col), with the
        arithmetic; [] when they can. The one GPT grid check: the planner refuses such grids
        and ``ProcessGrid.check(world, work.grid_problems)`` reports them.

        * heads are split over row: ``num_heads % row == 0`` and ``num_kv_heads % row == 0``;
        * tied embeddings need depth = row = col = 1 (the embedding table and the LM head are
          sharded differently on a tensor-parallel grid);
        * sequences are split over data x depth: it must divide the global batch and the
          micro-batch.
        """
        r, dz = shape["row"], shape["data"] * shape["depth"]
        out = []
        if self.num_heads % r:
            out.append(f"heads: num_heads={self.num_heads} % row={r} = {self.num_heads % r}")
        if self.kv_heads % r and self.kv_heads != self.num_heads:
            out.append(f"kv heads: num_kv_heads={self.kv_heads} % row={r} = "
                       f"{self.kv_heads % r}")
        if self.tie_embeddings and _tensor_parallel(shape):
            out.append(f"tied embeddings: tie_embeddings=True needs depth = row = col = 1, got "
                       f"depth={shape['depth']}, row={r}, col={shape['col']}")
        for name, batch in (("global_batch", self.global_batch),
                            ("micro_batch", self.micro_batch)):
            if batch is not None and batch % dz:
                out.append(f"batch: {name}={batch} % (data*depth={dz}) = {batch % dz}")
        return out


def _blocks(work: GPTWorkload, shape: Mapping[str, int]) -> list[tuple[int, int, bool, int]]:
    """(in_blk, out_blk, transposed, count) of every Linear on this grid (padded dims)."""
    r, c = shape["row"], shape["col"]
    return [(ceil_div(i, r if t else c), ceil_div(o, c if t else r), t, n)
            for i, o, t, n in work.linears()]


def _tensor_parallel(shape: Mapping[str, int]) -> bool:
    return any(shape[a] > 1 for a in ("depth", "row", "col"))


def gpt_collectives(work: GPTWorkload, shape: Mapping[str, int]) -> list[Collective]:
    """Every collective one rank issues in one optimizer step (module docstring).

    ``work.micro_batch`` None counts as one micro-step of the whole batch.
    """
    z = shape["depth"]
    micro = work.micro_batch or work.global_batch
    k = work.global_batch // micro
    m = ceil_div(micro, shape["data"] * z) * work.seq_len  # tokens per rank and micro-step
    p, g, a = work.param_bytes, work.grad_bytes, work.activation_bytes
    d_c = ceil_div(work.d_model, shape["col"])
    norms = 2 * work.num_layers + 1
    out: list[Collective] = []
    if not _tensor_parallel(shape):  # plain modules: data-parallel gradients only
        out.append(Collective("data", "all_reduce", work.num_params() * g))
        out.append(Collective("data+depth", "all_reduce", 2 * F32))
        return [c for c in out if group_size(shape, c.axis) > 1]
    flat = 0  # elements of the flat shards (Linears, embedding): the data bucket
    for in_blk, out_blk, transposed, n in _blocks(work, shape):
        shard = ceil_div(in_blk * out_blk, z)
        reduce_axis, grad_axis = ("row", "col") if transposed else ("col", "row")
        out += [Collective("depth", "all_gather", z * shard * p, 2 * n * k),
                Collective(reduce_axis, "all_reduce", m * out_blk * a, n * k),
                Collective(grad_axis, "all_reduce", m * in_blk * a, n * k),
                Collective("depth", "reduce_scatter", z * shard * g, n * k)]
        flat += n * shard
    emb = ceil_div(work.vocab_size * d_c, z)
    flat += emb
    out += [Collective("depth", "all_gather", z * emb * p, k),
            Collective("depth", "reduce_scatter", z * emb * g, k),
            Collective("col", "all_reduce", m * F32, 2 * norms * k),  # RMSNorm statistics
            Collective("row", "all_reduce", m * F32, 3 * k),  # loss: max, sum-exp, target
            Collective("data", "all_reduce", flat * g),
            Collective("data+depth", "all_reduce", norms * d_c * g),
            Collective("depth+row+col", "all_reduce", F32),  # gradient norm
            Collective("data+depth", "all_reduce", 2 * F32)]  # kept and dropped loss sums
    return [c for c in out if group_size(shape, c.axis) > 1]


def gpt_compute(work: GPTWorkload, shape: Mapping[str, int], machine: MachineProfile, *,
                node_ranks: int) -> dict[str, float]:
    """Seconds of GEMMs (roofline per Linear) and attention of one rank in one step."""
    rate = machine.compute_at(node_ranks)
    flops = rate.gemm_flops_low if (work.param_bytes == 2 and rate.gemm_flops_low) \
        else rate.gemm_flops
    micro = work.micro_batch or work.global_batch
    k = work.global_batch // micro
    m = ceil_div(micro, shape["data"] * shape["depth"]) * work.seq_len
    e = work.activation_bytes
    gemm = 0.0
    for in_blk, out_blk, _, n in _blocks(work, shape):
        one = max(2.0 * m * in_blk * out_blk / flops,
                  e * (m * in_blk + in_blk * out_blk + m * out_blk) / rate.memory_bandwidth)
        gemm += 3 * one * n * k
    d_r = work.d_model // shape["row"]
    attention = 12.0 * work.num_layers * d_r * work.seq_len * m * k / flops
    return {"gemm": gemm, "attention": attention}


# Saved for backward per token and transformer block, in elements of the activation width,
# as llm.parallel.gpt keeps them (measured with saved_tensors_hooks on four grids:
# tests/llm/test_plan.py checks the sum against the trainer): tensors split over col (the
# residual stream, the norms' inputs and outputs, the inputs of the normal Linears), over row
# (q, k and v per query head, the attention output and o_proj's input) and d_ff / row (gate,
# up, their product, down_proj's input).
ACT_COL, ACT_ROW, ACT_FF, ACT_OTHER = 6, 4, 4, 4
RUNTIME_BYTES = 1 << 30  # per rank outside the model's tensors (see gpt_memory_terms)


def gpt_memory_terms(work: GPTWorkload, shape: Mapping[str, int]) -> dict[str, float]:
    """Bytes per rank by what holds them, at the peak of a micro-step's backward:

    - ``state``: the shards with gradients and AdamW moments (``bytes_per_param`` each);
    - ``gathered``: the largest depth-gathered weight block twice (in use and prefetched);
    - ``pending_grads``: full dW blocks whose depth reduce-scatter is in flight (ORS keeps
      at most :data:`ORS_WINDOW` + 1; llm.parallel.layers.DepthGrads);
    - ``activations``: what autograd keeps (the ACT_* coefficients per token and block;
      with activation checkpointing, each block's input plus one block recomputed);
    - ``logits``: float32 logits [m, V/R], their softmax and gradient;
    - ``runtime``: memory outside the tensors, :data:`RUNTIME_BYTES` (on a GPU the CUDA
      context and NCCL buffers, an assumption; a CPU rank's interpreter and libraries measure
      about 0.3 GiB resident, bench/memory.py llm).
    """
    z, r, c = shape["depth"], shape["row"], shape["col"]
    blocks = _blocks(work, shape)
    d_c = ceil_div(work.d_model, c)
    elements = sum(n * ceil_div(i * o, z) for i, o, _, n in blocks)
    if not work.tie_embeddings:  # tied: the LM head's block above is the embedding
        elements += ceil_div(work.vocab_size * d_c, z)
    elements += (2 * work.num_layers + 1) * d_c
    biggest = max(max(i * o for i, o, _, _ in blocks), work.vocab_size * d_c)
    micro = work.micro_batch or work.global_batch
    m = ceil_div(micro, shape["data"] * z) * work.seq_len
    per_block = (ACT_COL * d_c + ACT_ROW * ceil_div(work.d_model, r)
                 + ACT_FF * ceil_div(work.d_ff, r) + ACT_OTHER)
    kept = (work.num_layers * d_c + per_block) if work.activation_checkpointing \
        else work.num_layers * per_block
    pending = (ORS_WINDOW + 1) * biggest * work.grad_bytes if z > 1 else 0
    return {"state": elements * work.bytes_per_param,
            "gathered": 2 * biggest * work.param_bytes if z > 1 else 0,
            "pending_grads": pending,
            "activations": m * work.activation_bytes * (kept + 3 * d_c),
            "logits": m * ceil_div(work.vocab_size, r) * F32 * 3,
            "runtime": RUNTIME_BYTES}


def gpt_memory(work: GPTWorkload, shape: Mapping[str, int]) -> float:
    """Bytes per rank: the sum of :func:`gpt_memory_terms`."""
    return float(sum(gpt_memory_terms(work, shape).values()))


def predict_gpt(work: GPTWorkload, shape: Mapping[str, int] | Sequence[int],
                machine: MachineProfile, *, ranks_per_node: int | None = None) -> Prediction:
    """Predicted step of ``work`` on one grid ``{"data", "depth", "row", "col"}``.

    With ``work.micro_batch`` None, the largest micro-batch (a divisor of the global batch
    that data x depth divides) that fits in memory is used; ``Prediction.extra`` says which.
    """
    shape = dict(shape) if isinstance(shape, Mapping) else dict(zip(AXES, shape))
    grid = ProcessGrid.axonn(*(shape[a] for a in AXES))
    num_ranks = grid.num_ranks
    node_ranks = machine.node_ranks(num_ranks, ranks_per_node)
    limit = machine.memory_per_rank(num_ranks, ranks_per_node)
    invalid = "; ".join(work.grid_problems(shape))
    if work.micro_batch is None and not invalid:
        dz = shape["data"] * shape["depth"]
        sizes = [b for b in range(work.global_batch, 0, -1)
                 if work.global_batch % b == 0 and b % dz == 0]
        fitting = [b for b in sizes if gpt_memory(replace(work, micro_batch=b), shape) <= limit]
        work = replace(work, micro_batch=(fitting or sizes[-1:])[0])
    memory = gpt_memory(work, shape)
    if invalid:
        return Prediction(shape=dict(grid.shape), compute={}, comm={}, comm_bytes={},
                          memory=memory, memory_limit=limit, invalid=invalid)
    colls = gpt_collectives(work, shape)
    return Prediction(shape=dict(grid.shape),
                      compute=gpt_compute(work, shape, machine, node_ranks=node_ranks),
                      comm=comm_seconds(colls, grid, machine, node_ranks),
                      comm_bytes=bytes_by_axis(colls, shape), memory=memory,
                      memory_limit=limit, extra={"micro_batch": work.micro_batch})


def plan_gpt(work: GPTWorkload, num_ranks: int, machine: MachineProfile, *,
             ranks_per_node: int | None = None) -> Plan:
    """Every ``D x Z x R x C = num_ranks`` grid, ranked by predicted step time."""
    preds = [predict_gpt(work, s, machine, ranks_per_node=ranks_per_node)
             for s in factorizations(num_ranks, 4)]
    rpn = machine.node_ranks(num_ranks, ranks_per_node)
    title = (f"GPT {work.name}: {work.num_params() / 1e9:.3f}B parameters, L={work.num_layers} "
             f"d={work.d_model} ff={work.d_ff} heads={work.num_heads}/{work.kv_heads}, batch "
             f"{work.global_batch} x {work.seq_len} tokens (micro-batch "
             f"{work.micro_batch or 'auto'}) on {num_ranks} ranks ({rpn} per node) of "
             f"{machine.name}; per step, per rank")
    return rank_predictions(preds, num_ranks, AXES, title)

