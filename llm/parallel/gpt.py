"""Parallelize a GPT over the 4D grid ``data x depth x row x col``
(docs/design/llm-4d-goldfish.md).

:class:`ParallelGPT` takes a :class:`llm.model.GPT` built on the meta device and draws only
this rank's shard of each weight (:func:`llm.parallel.shards.init_shards`: keyed by seed and
parameter name, never the full tensor), so every grid trains the same model as one process
without any rank holding it all. It also slices a full GPT, identical on every rank. The
model's modules are swapped for those of :mod:`llm.parallel.layers`, each holding its shard as
:mod:`llm.parallel.layout` lays it out, and its own ``forward`` runs unchanged (attention takes
its local heads from the shapes).

Embeddings are untied on a tensor-parallel grid (``ValueError``). The batch is split over data
and depth (:func:`~llm.parallel.layout.batch_shard`). After backward, gradients are all-reduced
over data, and those of the replicated RMSNorm weights over data and depth. On a grid with
depth = row = col = 1 the GPT's modules are kept as they are (the fast path: plain PyTorch,
plus the data-parallel all-reduce when data > 1).

The GPT's ``compute_dtype`` (bf16 mixed precision) and ``activation_checkpointing`` carry
over: the sharded layers cast each float32 shard to the compute dtype before its depth
all-gather and reduce-scatter dW in it (:mod:`llm.parallel.layers`); gradients stay float32 in
``.grad``, so the data-parallel all-reduce and the optimizer see float32.

NEFTune noise (``GPT(neftune_alpha=...)``, :mod:`llm.neftune`) is keyed by the global row,
position and channel: each rank is told where its rows (data, depth) and embedding channels
(col) sit, so every grid adds the serial model's noise; :meth:`ParallelGPT.set_noise` keys it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from common.collectives import all_gather, all_reduce
from common.comm_stats import CommStats
from common.grid import AXONN_AXES, AxisGroup, ProcessGrid
from common.perf.gpt import GPTWorkload
from common.sharded import Slab
from llm.config import Overlap
from llm.model import GPT
from llm.parallel.layers import (
    DepthGrads,
    DepthWeights,
    OverlapCounts,
    ParallelEmbedding,
    ParallelLinear,
    ParallelRMSNorm,
)
from llm.parallel.layout import BLOCK, ShardSpec, batch_shard, is_tensor_parallel, param_specs
from llm.parallel.shards import gather_tensor, init_shards, shard_slab, shard_tensor

# what callers of this module import from it (the layout and the shards have their own modules)
__all__ = ["AXIS_SETS", "ParallelGPT", "ShardSpec", "batch_shard", "init_shards", "make_groups",
           "param_specs", "shard_tensor"]


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


class ParallelGPT(nn.Module):
    """A :class:`~llm.model.GPT` sharded over the 4D grid (see the module docstring).

    Args:
        model: a GPT built on the meta device (``GPT(config, device="meta")``): this rank
            draws only its shards, keyed by ``seed`` (:func:`~llm.parallel.shards.init_shards`);
            or a full GPT, identical on every rank, which is sliced. Its modules are replaced in
            place by sharded ones.
        groups: from :func:`make_groups`.
        seed: key of the initial weights; required for a meta model, refused otherwise.
        overlap: communication overlap switches (default: all on; results are identical
            either way).
        stats: byte accounting for every collective of the model (may be None).
        device: where a meta model's shards are allocated (default cpu); a full model's
            shards stay on its device.

    Attributes:
        overlapped: :class:`~llm.parallel.layers.OverlapCounts` of the collectives that
            overlapped since the caller last reset it.

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
        self._named: tuple[tuple[str, nn.Parameter], ...] | None = None  # shards(), once built
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
        # a rounding or so to the one each bf16 GEMM output already has, which dominates; a
        # float32 reduce-scatter would send twice the bytes and not remove it
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

        def linear(name: str) -> ParallelLinear:
            spec = self.specs[name]
            return ParallelLinear(shard(name), spec.block_shape(self.sizes),
                                  transposed=spec.transposed, groups=g, weights=self.depth_weights,
                                  grads=self.depth_grads, overlap=self.overlap, stats=stats)

        def norm(name: str) -> ParallelRMSNorm:
            return ParallelRMSNorm(shard(name), cfg.d_model, cfg.norm_eps, g["col"], stats)

        model.tok_emb = ParallelEmbedding(shard("tok_emb.weight"),
                                          self.specs["tok_emb.weight"].block_shape(self.sizes),
                                          g["depth"], stats, model.compute_dtype)
        for i, block in enumerate(model.blocks):  # Linears registered in forward order
            for norm_name, module, projections in BLOCK:
                setattr(block, norm_name, norm(f"blocks.{i}.{norm_name}.weight"))
                for proj in projections:
                    setattr(getattr(block, module), proj,
                            linear(f"blocks.{i}.{module}.{proj}.weight"))
        model.norm = norm("norm.weight")
        model.lm_head = linear("lm_head.weight")

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
        """This rank's parameters by their name in the serial GPT's state_dict.

        Named once: the parameters are those the model was built with (``compile_blocks``
        compiles in place, loads copy into them), and walking the module tree costs a small
        model's step a tenth of a millisecond each time (sync, clipping)."""
        if self._named is None:
            self._named = tuple(self.model.named_parameters())
        return dict(self._named)

    def _apply(self, fn, recurse=True):  # .to(), .cuda(), to_empty(): named again
        self._named = None
        return super()._apply(fn, recurse)

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
