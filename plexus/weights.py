"""The initial weights of a Plexus GCN, full and unsharded, drawn alike by every rank.

Every rank of :class:`plexus.model.PlexusGCN` draws the full matrices and keeps its slice
(plexus.shards), and the serial reference (:class:`plexus.reference.SerialGCN`) draws the same
ones: that is why any grid trains the serial model.
"""

from __future__ import annotations

import itertools
import math

import torch

ROOT_SEED_OFFSET = 7919  # GraphSAGE's root weights R_l come from init_weights(seed + this)


def init_weights(widths: list[int], seed: int) -> list[torch.Tensor]:
    """Full (unsharded, unpadded) weights ``W_l`` [D_l, D_l+1], Glorot-uniform, from ``seed``.

    Every rank of a parallel model and the serial reference draw the same matrices, so any
    grid trains the same model.
    """
    gen = torch.Generator().manual_seed(seed)
    out = []
    for d_in, d_out in itertools.pairwise(widths):
        bound = math.sqrt(6.0 / (d_in + d_out))
        out.append((torch.rand(d_in, d_out, generator=gen) * 2 - 1) * bound)
    return out
