"""Parallelize a GPT over the 4D grid ``data x depth x row x col``
(docs/design/llm-4d-goldfish.md).

:class:`ParallelGPT` takes a :class:`llm.model.GPT` built on the meta device and draws only
this rank's shard of each weight (:func:`init_shards`: keyed by seed and parameter name, never
the full tensor), so every grid trains the same model as one process without any rank holding
it all. It also slices a full GPT, identical on every rank. The model's modules are swapped for
those of :mod:`llm.parallel.layers` and its own ``forward`` runs unchanged (attention takes its
local heads from the shapes).

Layout of each parameter (``ShardSpec``; dims zero-padded to a multiple of the axis size):

=====================  =================  ==========================  ====================
parameter              full shape         split (dim 0, dim 1)        then
=====================  =================  ==========================  ====================
q, k, v, gate, up      [out, in]          row, col  (normal)          flat, 1/Z over depth
o_proj, down_proj      [out, in]          col, row  (transposed)      flat, 1/Z over depth
lm_head                [V, D]             row, col  (normal)          flat, 1/Z over depth
tok_emb                [V, D]             -, col                      flat, 1/Z over depth
RMSNorm weights        [D]                col                         replicated on depth
=====================  =================  ==========================  ====================

Embeddings are untied (a tie would couple two differently sharded tensors; ``ValueError``
on a tensor-parallel grid). The batch is split over data and depth. After backward,
gradients are all-reduced over data, and those of the replicated RMSNorm weights over data
and depth. On a grid with depth = row = col = 1 the GPT's modules are kept as they are (the
fast path: plain PyTorch, plus the data-parallel all-reduce when data > 1).

The GPT's ``compute_dtype`` (bf16 mixed precision) and ``activation_checkpointing`` carry
over: the sharded layers cast each float32 shard to the compute dtype before its depth
all-gather and reduce-scatter dW in it (:mod:`llm.parallel.layers`); gradients stay float32 in
``.grad``,
so the data-parallel all-reduce and the optimizer see float32.

NEFTune noise (``GPT(neftune_alpha=...)``, :mod:`llm.neftune`) is keyed by the global row,
position and channel: each rank is told where its rows (data, depth) and embedding channels
(col) sit, so every grid adds the serial model's noise; :meth:`ParallelGPT.set_noise` keys it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from common import flat
from common.collectives import all_gather, all_reduce
from common.comm_stats import CommStats
from common.grid import AXONN_AXES, AxisGroup, ProcessGrid, ceil_div
from common.perf.gpt import GPTWorkload
from common.sharded import Slab
from llm.config import Overlap
from llm.model import GPT, GPTConfig, init_std
from llm.parallel.keyed_init import fill_normal_
from llm.parallel.layers import (
    DepthGrads,
    DepthWeights,
    OverlapCounts,
    ParallelEmbedding,
    ParallelLinear,
    ParallelRMSNorm,
)

# the Linears of a block, in forward order (the order they are registered in)
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
TRANSPOSED = ("o_proj", "down_proj")


# The axis groups the model and the trainer use: each axis, data+depth (the batch split: loss
# sums, replicated gradients) and depth+row+col (the gradient norm). The entry point makes them
# once: ParallelState.create(ctx, grid, AXIS_SETS) (common.parallel).
AXIS_SETS = (*AXONN_AXES, ("data", "depth"), ("depth", "row", "col"))


def make_groups(grid: ProcessGrid, rank: int, transport: Any = None) -> dict[str, AxisGroup]:
    """The :data:`AXIS_SETS` groups of ``grid`` for code handed a rank; collective: every
    rank calls it, in the same order. The entry point uses
    ``ParallelState.create(ctx, grid, AXIS_SETS)`` instead (``common.parallel``).

    Keys: ``data``, ``depth``, ``row``, ``col``, ``data+depth`` and ``depth+row+col``.
    ``transport`` (``DistContext.transport``): CPU tensors go through MPI.
    """
    return grid.create_groups(rank, AXIS_SETS, transport=transport)


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter of the serial GPT is laid out on the grid.

    Attributes:
        shape: full (serial) shape.
        axes: for each tensor dim, the grid axis splitting it, or None.
        flat: the block is flattened and split 1/Z over depth (zero-padded to Z chunks;
            :func:`common.flat.flat_shard`).
        replicated: axes other than data over which every member holds the same shard.
    """

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    flat: bool = False
    replicated: tuple[str, ...] = ()

    def block_shape(self, sizes: Mapping[str, int]) -> tuple[int, ...]:
        """Shape of this rank's block before flattening (padded dims divided by the axis)."""
        return tuple(ceil_div(n, sizes[a]) if a else n for n, a in zip(self.shape, self.axes))

    def shard_numel(self, sizes: Mapping[str, int]) -> int:
        return flat.shard_size(math.prod(self.block_shape(sizes)), sizes["depth"])

    def shard_shape(self, sizes: Mapping[str, int]) -> tuple[int, ...]:
        """Shape of this rank's shard: ``(shard_numel,)`` when flat, else the block's."""
        return (self.shard_numel(sizes),) if self.flat else self.block_shape(sizes)


def is_tensor_parallel(sizes: Mapping[str, int]) -> bool:
    return any(sizes[a] > 1 for a in ("depth", "row", "col"))


def param_specs(config: GPTConfig, sizes: Mapping[str, int]) -> dict[str, ShardSpec]:
    """Layout of every GPT parameter (module docstring), keyed by its state_dict name. Pure."""
    d, v, f = config.d_model, config.vocab_size, config.d_ff
    kv = config.num_kv_heads * config.head_dim
    tp = is_tensor_parallel(sizes)  # if not: the fast path, full tensors in natural shapes
    specs: dict[str, ShardSpec] = {}

    def add(name: str, shape: tuple[int, ...], axes: tuple[str | None, ...], flat: bool,
            replicated: tuple[str, ...]) -> None:
        specs[name] = ShardSpec(shape, axes if tp else (None,) * len(shape), flat and tp,
                                replicated if tp else ())

    add("tok_emb.weight", (v, d), (None, "col"), True, ("row",))
    out_features = {"q_proj": d, "k_proj": kv, "v_proj": kv, "o_proj": d,
                    "gate_proj": f, "up_proj": f, "down_proj": d}
    in_features = {"q_proj": d, "k_proj": d, "v_proj": d, "o_proj": d,
                   "gate_proj": d, "up_proj": d, "down_proj": f}
    for i in range(config.num_layers):
        add(f"blocks.{i}.attn_norm.weight", (d,), ("col",), False, ("row", "depth"))
        for proj in ATTENTION_PROJECTIONS:
            add(f"blocks.{i}.attn.{proj}.weight", (out_features[proj], in_features[proj]),
                ("col", "row") if proj in TRANSPOSED else ("row", "col"), True, ())
        add(f"blocks.{i}.mlp_norm.weight", (d,), ("col",), False, ("row", "depth"))
        for proj in MLP_PROJECTIONS:
            add(f"blocks.{i}.mlp.{proj}.weight", (out_features[proj], in_features[proj]),
                ("col", "row") if proj in TRANSPOSED else ("row", "col"), True, ())
    add("norm.weight", (d,), ("col",), False, ("row", "depth"))
    if not config.tie_embeddings:
        add("lm_head.weight", (v, d), ("row", "col"), True, ())
    return specs


def shard_tensor(full: Tensor, spec: ShardSpec, sizes: Mapping[str, int],
                 coords: Mapping[str, int]) -> Tensor:
    """This rank's shard of a full tensor (pure slicing, no communication).

    Shapes:
        full: spec.shape -> spec.block_shape(sizes), or [spec.shard_numel(sizes)] when flat
    """
    if tuple(full.shape) != spec.shape:
        raise ValueError(f"expected a tensor of shape {spec.shape}, got {tuple(full.shape)}")
    block = spec.block_shape(sizes)
    x = full.detach()
    for dim, axis in enumerate(spec.axes):
        if axis:
            start = coords[axis] * block[dim]
            stop = min(start + block[dim], x.shape[dim])  # the last block may be all padding
            x = x.narrow(dim, min(start, stop), max(0, stop - start))
    out = torch.zeros(block, dtype=full.dtype, device=full.device)  # zero padding
    out[tuple(slice(0, n) for n in x.shape)] = x
    return flat.flat_shard(out, sizes["depth"], coords["depth"]) if spec.flat else out


@torch.no_grad()
def init_shard_(out: Tensor, config: GPTConfig, name: str, spec: ShardSpec,
                sizes: Mapping[str, int], coords: Mapping[str, int], *, seed: int) -> Tensor:
    """Fill ``out`` with this rank's shard of parameter ``name`` of ``GPT(config, seed=seed)``.

    Bit for bit ``shard_tensor(full, spec, sizes, coords)`` of the full initial parameter, but
    only the row blocks that the shard touches are drawn, one at a time
    (:func:`llm.parallel.keyed_init.fill_normal_`): memory beyond ``out`` is one chunk. Pure.

    Shapes:
        out: spec.shard_shape(sizes) -> returns out
    """
    std = init_std(config, name)
    if std is None:  # an RMSNorm weight: ones, D elements at most
        return out.copy_(shard_tensor(torch.ones(spec.shape), spec, sizes, coords))
    block = spec.block_shape(sizes)
    origin = [coords[a] * n if a else 0 for n, a in zip(block, spec.axes)]
    start = coords["depth"] * out.numel() if spec.flat else 0  # in the block's row-major order
    fill_normal_(out.view(-1), seed=seed, name=name, shape=spec.shape, std=std, origin=origin,
                 block=block, start=start)
    return out


def init_shards(config: GPTConfig, seed: int, sizes: Mapping[str, int],
                coords: Mapping[str, int], device: torch.device | str | None = None
                ) -> dict[str, Tensor]:
    """Every shard of the rank at ``coords`` on a grid of ``sizes`` (:func:`init_shard_`).

    A pure function of (config, seed, grid sizes, coords): the shards of every coordinate
    assemble into ``GPT(config, seed=seed)``'s parameters. Keys: state_dict names. Peak
    memory: the shards plus one chunk.
    """
    specs = param_specs(config, sizes)
    # all shards first: the drawn chunks, freed one by one, then leave no holes between
    # shards that the allocator could not give back (glibc kept much more on CPU otherwise)
    shards = {name: torch.empty(spec.shard_shape(sizes), device=device)
              for name, spec in specs.items()}
    for name, spec in specs.items():
        init_shard_(shards[name], config, name, spec, sizes, coords, seed=seed)
    return shards


def shard_slab(spec: ShardSpec, sizes: Mapping[str, int], coords: Mapping[str, int]) -> Slab:
    """Where :func:`shard_tensor`'s output sits in the full tensor (a sharded checkpoint's
    description of this rank's piece; pure)."""
    block = spec.block_shape(sizes)
    ranges = [(coords[a] * b, (coords[a] + 1) * b) if a else (0, n)
              for n, b, a in zip(spec.shape, block, spec.axes)]
    rows, cols = ranges if len(ranges) == 2 else ((0, 1), ranges[0])
    flat_range = (flat.shard_range(math.prod(block), sizes["depth"], coords["depth"])
                  if spec.flat else None)
    return Slab(spec.shape, rows, cols, flat_range)


def gather_tensor(local: Tensor, spec: ShardSpec, groups: Mapping[str, AxisGroup],
                  stats: CommStats | None = None) -> Tensor:
    """The full tensor from every rank's shard; collective over depth, row and col.

    Shapes:
        local: a shard as returned by :func:`shard_tensor` -> spec.shape
    """
    sizes = {a: groups[a].size for a in AXONN_AXES}
    x = local.detach()
    if spec.flat:
        x = flat.gather(x, groups["depth"], spec.block_shape(sizes), stats=stats)
    for dim, axis in enumerate(spec.axes):
        if axis:
            x = all_gather(x.contiguous(), groups[axis], dim=dim, stats=stats)
    return x[tuple(slice(0, n) for n in spec.shape)].clone()


def batch_shard(batch: Tensor, groups: Mapping[str, AxisGroup], pad_value: int | bool) -> Tensor:
    """This rank's rows of a global batch, split over data then depth (depth fastest).

    Rows are padded with ``pad_value`` up to a multiple of data * depth (padding rows carry
    ignored targets, so they change no loss or gradient).

    Shapes:
        batch: [B, T] -> [ceil(B / (D * Z)), T]
    """
    parts = groups["data"].size * groups["depth"].size
    index = groups["data"].rank * groups["depth"].size + groups["depth"].rank
    rows = ceil_div(batch.shape[0], parts)
    if rows * parts != batch.shape[0]:
        pad = batch.new_full((rows * parts - batch.shape[0], *batch.shape[1:]), pad_value)
        batch = torch.cat((batch, pad))
    return batch[index * rows : (index + 1) * rows]


class ParallelGPT(nn.Module):
    """A :class:`~llm.model.GPT` sharded over the 4D grid (see the module docstring).

    Args:
        model: a GPT built on the meta device (``GPT(config, device="meta")``): this rank
            draws only its shards, keyed by ``seed`` (:func:`init_shards`); or a full GPT,
            identical on every rank, which is sliced. Its modules are replaced in place by
            sharded ones.
        groups: from :func:`make_groups`.
        seed: key of the initial weights; required for a meta model, refused otherwise.
        overlap: communication overlap switches (default: all on; results are identical
            either way).
        stats: byte accounting for every collective of the model (may be None).
        device: where a meta model's shards are allocated (default cpu); a full model's
            shards stay on its device.

    Attributes:
        overlapped: :class:`~llm.parallel.layers.OverlapCounts` of the collectives that overlapped
        since
            the caller last reset it.

    Raises:
        ValueError: the model does not split over the grid (heads over row, tied
            embeddings on a tensor-parallel grid; :meth:`GPTWorkload.grid_problems`), or
            ``seed`` is missing for a meta model or given for a full one.

    Shapes:
        forward: idx int64 [B/(D*Z), T] -> logits [B/(D*Z), T, V_pad/R] (vocab split over row,
        padded vocab ids >= V hold zero weights), replicated over col.

    The logits are sharded over row, so decoding here is greedy only
    (:meth:`generate_greedy`, which gathers the last position's logits); for sampling, the KV
    cache and the decode-time methods use a plain GPT loaded with :meth:`full_state_dict` (or
    from a checkpoint, ``python -m llm.sample``).
    """

    def __init__(self, model: GPT, groups: Mapping[str, AxisGroup], *, seed: int | None = None,
                 overlap: Overlap | None = None, stats: CommStats | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        meta = any(p.is_meta for p in model.parameters())
        if meta != (seed is not None):
            raise ValueError("a GPT on the meta device needs seed= (this rank draws its shards)"
                             if meta else "seed= is for a GPT built on the meta device")
        overlap = Overlap() if overlap is None else overlap
        self.config, self.groups = model.config, dict(groups)
        self.overlap, self.stats = overlap, stats
        self.sizes = {a: groups[a].size for a in AXONN_AXES}
        self.coords = {a: groups[a].rank for a in AXONN_AXES}
        grid = ProcessGrid.axonn(*(self.sizes[a] for a in AXONN_AXES))
        # the planner's check; every batch size pads to data x depth, so only the model counts
        work = GPTWorkload.from_config(self.config, global_batch=grid.size("data") *
                                       grid.size("depth"), seq_len=self.config.max_seq_len)
        grid.check(grid.num_ranks, work.grid_problems)
        self.specs = param_specs(self.config, self.sizes)
        self.overlapped = OverlapCounts()
        dtype = model.compute_dtype
        self.depth_weights = DepthWeights(groups["depth"], prefetch=overlap.oag, stats=stats,
                                          counts=self.overlapped, dtype=dtype)
        # dW is reduce-scattered over depth in the compute dtype: summing Z bf16 partials adds
        # a rounding or so to the one each bf16 GEMM output already has (on 1x2x2x1 an fp32
        # reduce-scatter left the bf16 loss as far from serial's: 3.7e-4 vs 4.0e-4, 8 steps)
        self.depth_grads = DepthGrads(groups["depth"], defer=overlap.ors, stats=stats,
                                      counts=self.overlapped, dtype=dtype)
        device = torch.device("cpu" if device is None else device)
        if is_tensor_parallel(self.sizes):
            self._swap_modules(model, seed, device)
        elif meta:  # the fast path: this rank holds the whole model
            model.materialize(device, seed)
        self.model = model
        assert not any(p.is_meta for p in self.parameters()), "a parameter left on meta"
        # NEFTune: this rank's block of batch rows (batch_shard's order) and of d_model
        model.neftune.shard_index = self.coords["data"] * self.sizes["depth"] + self.coords["depth"]
        model.neftune.channel_offset = (self.coords["col"] *
                                        self.specs["tok_emb.weight"].block_shape(self.sizes)[1])

    def _swap_modules(self, model: GPT, seed: int | None, device: torch.device) -> None:
        g, cfg, stats = self.groups, self.config, self.stats
        if seed is None:  # a full model: slice it
            full = dict(model.named_parameters())
            shards = {n: shard_tensor(full[n], s, self.sizes, self.coords)
                      for n, s in self.specs.items()}
        else:
            shards = init_shards(cfg, seed, self.sizes, self.coords, device)

        def shard(name: str) -> Tensor:
            return shards.pop(name)

        def linear(name: str, transposed: bool) -> ParallelLinear:
            return ParallelLinear(shard(name), self.specs[name].block_shape(self.sizes),
                                  transposed=transposed, groups=g, weights=self.depth_weights,
                                  grads=self.depth_grads, overlap=self.overlap, stats=stats)

        def norm(name: str) -> ParallelRMSNorm:
            return ParallelRMSNorm(shard(name), cfg.d_model, cfg.norm_eps, g["col"], stats)

        model.tok_emb = ParallelEmbedding(shard("tok_emb.weight"),
                                          self.specs["tok_emb.weight"].block_shape(self.sizes),
                                          g["depth"], stats, model.compute_dtype)
        for i, block in enumerate(model.blocks):  # Linears registered in forward order
            block.attn_norm = norm(f"blocks.{i}.attn_norm.weight")
            for proj in ATTENTION_PROJECTIONS:
                setattr(block.attn, proj,
                        linear(f"blocks.{i}.attn.{proj}.weight", proj in TRANSPOSED))
            block.mlp_norm = norm(f"blocks.{i}.mlp_norm.weight")
            for proj in MLP_PROJECTIONS:
                setattr(block.mlp, proj,
                        linear(f"blocks.{i}.mlp.{proj}.weight", proj in TRANSPOSED))
        model.norm = norm("norm.weight")
        model.lm_head = linear("lm_head.weight", False)

    # ----------------------------------------------------------------- training
    def set_noise(self, *, step: int, row_offset: int = 0, seed: int = 0) -> None:
        """Key the NEFTune noise of the next forwards (:meth:`llm.neftune.NEFTune.set_noise`);
        ``row_offset`` is the global row of the global micro-batch's first row, the same on
        every rank (this rank's own offset is added)."""
        self.model.set_noise(step=step, row_offset=row_offset, seed=seed)

    def forward(self, idx: Tensor) -> Tensor:
        self.depth_weights.begin_forward()
        return self.model(idx)

    @torch.no_grad()
    def generate_greedy(self, idx: Tensor, max_new_tokens: int) -> Tensor:
        """Append ``max_new_tokens`` greedy tokens, as :meth:`GPT.generate` with temperature
        0 (no KV cache); collective, every rank passes the same ``idx`` and gets the result.

        Each rank runs its rows of the batch; the vocabulary-split logits of the last position
        are gathered over row (``[b, V_pad]``, a few KiB) and the rows over data and depth.

        Shapes:
            idx: int64 [B, T0] -> int64 [B, T0 + max_new_tokens]
        """
        g, vocab = self.groups, self.config.vocab_size
        for _ in range(max_new_tokens):
            local = batch_shard(idx[:, -self.config.max_seq_len:], g, 0)
            logits = all_gather(self(local.to(self._device()))[:, -1, :].float(), g["row"],
                                dim=-1)  # [b, V_pad]
            nxt = logits[:, :vocab].argmax(dim=-1, keepdim=True).cpu()  # [b, 1]
            nxt = all_gather(all_gather(nxt, g["depth"]), g["data"])[: idx.shape[0]]
            idx = torch.cat((idx, nxt.to(idx.dtype)), dim=1)
        return idx

    def _device(self) -> torch.device:
        return next(self.parameters()).device

    def shards(self) -> dict[str, nn.Parameter]:
        """This rank's parameters by their name in the serial GPT's state_dict."""
        return dict(self.model.named_parameters())

    def finish_backward(self) -> None:
        """Wait for the deferred depth reduce-scatters (ORS) and drop any weights gathered for
        the backward; call after each backward."""
        self.depth_grads.finish()
        self.depth_weights.end_pass()

    def sync_gradients(self) -> None:
        """All-reduce gradients over data, and the replicated RMSNorm weights' over data+depth.

        One flat buffer per group. Call once per optimizer step, after the last backward.
        """
        self.finish_backward()
        buckets: dict[str, list[nn.Parameter]] = {"data": [], "data+depth": []}
        for name, p in self.shards().items():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            buckets["data+depth" if "depth" in self.specs[name].replicated else "data"].append(p)
        for key, params in buckets.items():
            if self.groups[key].size == 1 or not params:
                continue
            grads = [p.grad for p in params]
            summed = all_reduce(_flatten_dense_tensors(grads), self.groups[key],
                                stats=self.stats, inplace=True)
            for p, synced in zip(params, _unflatten_dense_tensors(summed, grads)):
                p.grad.copy_(synced)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Scale gradients so their global L2 norm over the grid is at most ``max_norm``.

        Each shard counts once: replicated copies count only on the member with coordinate 0.
        ``max_norm <= 0`` only measures. Returns the norm before clipping (same on all ranks)
        as a float32 device scalar: reading it waits for the device, so the trainer reads it
        after the optimizer step is queued. Norms and scaling are one multi-tensor call each,
        as in ``torch.nn.utils.clip_grad_norm_``: a small model's GPU step is launch-bound
        (docs/benchmarks.md); on the CPU the same bits as per-tensor calls.
        """
        counted = [p.grad for name, p in self.shards().items() if p.grad is not None
                   and all(self.coords[a] == 0 for a in self.specs[name].replicated)]
        if counted:
            norms = torch._foreach_norm(counted, 2, dtype=torch.float32)
            sq = torch.stack(norms).square().sum()
        else:
            sq = torch.zeros((), device=self._device())
        total = all_reduce(sq, self.groups["depth+row+col"], stats=self.stats).sqrt()
        if max_norm > 0:
            coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
            by_dtype: dict[torch.dtype, list[Tensor]] = {}
            for p in self.shards().values():
                if p.grad is not None:
                    by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
            for dtype, grads in by_dtype.items():
                torch._foreach_mul_(grads, coef.to(dtype))
        return total

    # ----------------------------------------------------------------- full tensors
    def shard(self, name: str, full: Tensor) -> Tensor:
        """This rank's shard of a full tensor laid out like parameter ``name``."""
        return shard_tensor(full, self.specs[name], self.sizes, self.coords)

    def slab(self, name: str) -> Slab:
        """Where this rank's shard of parameter ``name`` sits in the full tensor."""
        return shard_slab(self.specs[name], self.sizes, self.coords)

    def gather(self, name: str, local: Tensor) -> Tensor:
        """The full tensor of a shard laid out like parameter ``name`` (collective)."""
        return gather_tensor(local, self.specs[name], self.groups)

    @torch.no_grad()
    def full_state_dict(self, grads: bool = False) -> dict[str, Tensor]:
        """The serial GPT's state_dict (or its gradients) on every rank; collective."""
        out = {}
        for name, p in self.shards().items():
            src = p.grad if grads else p
            out[name] = self.gather(name, src if src is not None else torch.zeros_like(p))
        return out

    @torch.no_grad()
    def load_full_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Load a serial GPT's state_dict (from any grid's checkpoint) into the shards."""
        missing = sorted(set(self.shards()) - set(state))
        if missing:
            raise ValueError(f"state_dict lacks {missing[:3]}{'...' if len(missing) > 3 else ''}")
        for name, p in self.shards().items():
            p.copy_(self.shard(name, state[name].to(p.dtype)))
