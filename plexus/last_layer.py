"""The last layer on the labelled rows only (:attr:`plexus.layer_plan.LayerPlan.
labelled_rows_only`; docs/design/plexus-3d.md section 5).

The loss and the accuracies read only the output rows of nodes in a split (train, val or
test). Where few nodes are labelled the last layer computes those R rows alone: its SpMM runs
over those rows of ``A`` (and ``S``), gathered once (:meth:`plexus.data.shard.GraphShard.
restrict_last_layer`), and its H, Q, logits and collectives (2), (4), (7) shrink from N/P
rows to R. ``forward(all_rows=True)`` still computes every row (plexus.trainer.predictions).
"""

from __future__ import annotations

from typing import Any

import torch

from plexus import layout


class LastLayer:
    """Mixed into :class:`plexus.model.PlexusGCN`, which keeps :meth:`_restrict_last_layer`'s
    rows as its buffer :attr:`labelled_rows` and reads :meth:`_rows_only` and
    :meth:`_labelled_blocks` in its pass."""

    shard: Any
    kind: str
    num_layers: int
    labelled_rows: torch.Tensor | None  # int64 [R]: the output rows the logits hold

    def _restrict_last_layer(self, labelled_rows_only: bool) -> torch.Tensor | None:
        """The rows the logits hold, :attr:`labelled_rows`: the labelled ones, with the last
        layer's blocks restricted to them, or None: every row."""
        if not labelled_rows_only:
            return None
        self.shard.restrict_last_layer(root=self.kind == "sage")
        return self.shard.labelled_rows()

    def _rows_only(self, layer: int, all_rows: bool) -> bool:
        """Whether ``layer`` computes the labelled rows only in a pass of ``all_rows``."""
        return self.labelled_rows is not None and not all_rows and layer == self.num_layers - 1

    def _labelled_blocks(self, layer: int) -> dict:
        """{layout_of(layer): the labelled rows of A_l}, on the device and with the kernel of
        the full block (moved on first use: ``BlockSparse.to`` after the trainer uploads the
        full ones). GraphSAGE's labelled rows of S_l stay on the host: plexus.root_rows reads
        only their pattern, once."""
        sub, key = self.shard.labelled_adj, layout.layout_of(layer)
        ref = self.shard.adj[key].a
        for m in (sub.a_t, sub.a):  # the transpose first: a copy is made from host blocks
            if m.device != ref.device or m.kernel != ref.kernel:
                m.to(ref.device, kernel=ref.kernel)
        return {key: sub}

    def output_rows(self, t: torch.Tensor, *, all_rows: bool = False) -> torch.Tensor:
        """The rows of a per-output-row tensor ``t`` [N/P, ...] (labels, split masks) that the
        logits of ``forward(all_rows=all_rows)`` hold: ``t`` itself, or its labelled rows.

        Shapes: [N/P, ...] -> [R, ...]
        """
        if all_rows or self.labelled_rows is None:
            return t
        return t.index_select(0, self.labelled_rows.to(t.device))
