"""plexus.weights: the full initial weights every rank slices and the serial reference holds."""

import itertools
import math

import torch

from common.grid import ProcessGrid
from common.parallel import ParallelState
from plexus.data.memory import InMemorySource
from plexus.layout import layer_widths
from plexus.model import PlexusGCN
from plexus.reference import SerialGCN
from plexus.weights import ROOT_SEED_OFFSET, init_weights
from tests.plexus.data.shards import model_source, small_graph


def test_glorot_uniform_and_drawn_from_the_seed_alone():
    widths = [7, 6, 6, 5]
    first, again = init_weights(widths, 3), init_weights(widths, 3)
    assert [tuple(w.shape) for w in first] == [(7, 6), (6, 6), (6, 5)]
    for w, same, (d_in, d_out) in zip(first, again, itertools.pairwise(widths), strict=True):
        assert torch.equal(w, same)
        bound = math.sqrt(6.0 / (d_in + d_out))
        assert w.abs().max() <= bound and w.abs().max() > bound / 2
    assert not torch.equal(init_weights(widths, 4)[0], first[0])


def test_the_model_and_the_reference_start_from_the_same_weights():
    """One rank's model (padded, flat shards) gathers back the reference's full weights, and
    GraphSAGE's root weights are those of seed + ROOT_SEED_OFFSET."""
    graph = small_graph()
    widths = layer_widths(graph.num_features, 6, 3, graph.num_classes)
    groups = dict(ParallelState.single(ProcessGrid.plexus(1, 1, 1)).groups)
    for kind in ("gcn", "sage"):
        source = model_source(graph, kind) if kind == "sage" else InMemorySource(graph)
        shard = source.shard({"x": 1, "y": 1, "z": 1}, {"x": 0, "y": 0, "z": 0}, widths)
        model = PlexusGCN(shard, groups, model=kind, seed=9)
        ref = SerialGCN(graph, widths, model=kind, seed=9, dtype=torch.float32)
        for got, want in zip(model.full_weights(), ref.weights, strict=True):
            assert torch.equal(got, want.detach())
        if kind == "sage":
            roots = init_weights(widths, 9 + ROOT_SEED_OFFSET)
            for layer, want in enumerate(roots):
                assert torch.equal(model.gather_weight(model.root_weights[layer].detach(),
                                                       layer), want)
