"""One rank's share of a run, built before the first epoch: its shard of the graph and its shards
of the model (:func:`shard_and_model`, where the layer plan is decided), its adjacency where the
SpMMs run (:func:`upload_adjacency`) and its optimizer (:func:`make_optimizer`).
:class:`plexus.trainer.Trainer` calls them in this order.
"""

from __future__ import annotations

import torch

from common.exchange import any_rank
from common.parallel import ParallelState
from plexus.config import ModelConfig, OptimConfig
from plexus.data import DatasetCorruptError, GraphShard, ShardSource
from plexus.layer_plan import OPTIONS as PLAN_OPTIONS
from plexus.layer_plan import plan_layers
from plexus.model import PlexusGCN

__all__ = ["make_optimizer", "shard_and_model", "upload_adjacency"]


def shard_and_model(source: ShardSource, parallel: ParallelState, model: ModelConfig, *,
                    seed: int = 0, gemm: str = "auto") -> tuple[GraphShard, PlexusGCN]:
    """This rank's shard of ``source`` and its shards of the model (on the CPU); ``gemm``:
    the dense products' backend (:class:`~plexus.config.RunConfig`).

    If reading the shard fails on any rank (a damaged file may touch some ranks only), every
    rank raises: the failing ones their own error, the others a DatasetCorruptError saying so,
    so that no rank waits in a collective for one that stopped.
    """
    grid = parallel.grid
    widths = model.widths(source.num_features, source.num_classes)
    error: Exception | None = None
    try:
        shard = source.shard(grid.shape, grid.coords(parallel.rank), widths)
    except (ValueError, OSError) as e:
        error = e
    if any_rank(error is not None, parallel.device, parallel.transport):
        raise error or DatasetCorruptError(f"another rank could not read its shard of "
                                           f"{source.name} (its error is above)")
    # how each layer runs, decided once here (the planner's rules, this run's resources)
    plan = plan_layers(shard, grid.shape, model=model.model, learn_features=model.learn_features,
                       dropout=model.dropout, comm_offloaded=parallel.comm_offloaded(),
                       **{name: getattr(model, name) for name in PLAN_OPTIONS})
    net = PlexusGCN(shard, dict(parallel.groups), model=model.model,
                    learn_features=model.learn_features, seed=seed, dropout=model.dropout,
                    bias=model.bias, norm=model.norm,
                    normalize_features=model.normalize_features, residual=model.residual,
                    precision=model.precision, gemm=gemm, plan=plan, heads=model.heads,
                    attention_dropout=model.attention_dropout)
    # the model keeps its 1/Z slice of the [N/X, D_0/Y] block: release the block itself
    shard.features_block = shard.features_block.new_empty((0, shard.features_block.shape[1]))
    # and once H_0 is cached, layer 0's adjacency (the trainer never moves the model again)
    net.release_first_blocks = True
    return shard, net


def upload_adjacency(shard: GraphShard, device: torch.device | str, *,
                     kernel: str | None = None) -> None:
    """Put every adjacency and root block of ``shard`` where the SpMMs run.

    Off the CPU each distinct block is copied once and shared by every layer that uses it (a
    3-layer 1x1x1 run holds the two matrices of the two parities, not one per layer), and
    its host arrays are let go (a prepared dataset's maps are unmapped, an in-memory one's
    arrays freed). On the CPU nothing is copied; ``kernel`` picks the CPU SpMM
    (:meth:`plexus.sparse.BlockSparse.to`).
    """
    uploaded: dict = {}  # dropped on return: then nothing holds the host blocks any more
    for blk in shard.adj.values():
        blk.a_t.to(device, kernel=kernel, uploaded=uploaded)  # (its copy, from host blocks)
        blk.a.to(device, kernel=kernel, uploaded=uploaded)
    for root in (shard.root or {}).values():  # its CSR where made, else when it is
        root.to(device, kernel=kernel, uploaded=uploaded)


def make_optimizer(net: PlexusGCN, optim: OptimConfig) -> torch.optim.Optimizer:
    """Adam or AdamW over ``net``'s parameters, one group per layer with that layer's weight
    decay (the input features, if trained, join layer 0).

    torch's fused implementation where every parameter is a float32 tensor on the CPU or a
    GPU: one pass over each tensor instead of one per operation (several times faster on a
    trained [200K, 128] feature block), the same update to float rounding."""
    decays = optim.layer_decays(net.num_layers)
    groups: list[list[torch.nn.Parameter]] = [[] for _ in decays]
    for _name, t, _kind, layer in net.sharded_state():
        if isinstance(t, torch.nn.Parameter):
            groups[layer or 0].append(t)
    fused = all(p.device.type in ("cpu", "cuda") and p.dtype == torch.float32
                for ps in groups for p in ps)
    cls = torch.optim.Adam if optim.optimizer == "adam" else torch.optim.AdamW
    # on a GPU capturable (a CUDA graph may capture the step, plexus.cuda_graph): the fused
    # kernel counts its steps on the device either way, so the numbers do not change
    cuda = all(p.device.type == "cuda" for ps in groups for p in ps)
    return cls([{"params": ps, "weight_decay": wd} for ps, wd in zip(groups, decays) if ps],
               lr=optim.lr, fused=fused or None, capturable=cuda and fused)
