"""plexus.layer_plan: how each layer runs is decided once, by the performance model's rules, and
the model takes the plan as it is given."""

import pytest

from common.grid import ProcessGrid
from common.parallel import ParallelState
from common.perf.gcn_workload import AGGREGATION_BLOCKS, labelled_rows_pay, overlap_pays
from plexus.config import ModelConfig, gcn_workload
from plexus.data.memory import InMemorySource
from plexus.layer_plan import OPTIONS, LayerPlan, plan_layers
from plexus.layout import layer_widths
from plexus.model import PlexusGCN
from tests.plexus.data.shards import model_source, small_graph
from tests.plexus.test_model import few_labels_graph

# (model, layers, hidden, trainable features, dropout, the ModelConfig options)
CASES = [
    ("gcn", 3, 8, False, 0.5, {}),
    ("gcn", 3, 8, False, 0.0, {}),
    ("gcn", 2, 16, True, 0.5, {"weight_first": True}),
    ("sage", 3, 8, False, 0.5, {"weight_first": True}),
    ("sage", 1, 8, False, 0.5, {"labelled_rows_only": True}),
    ("gcn", 3, 8, False, 0.5, {"recompute_first": False, "overlap": True}),
]
GRIDS = ["1x1x1", "2x1x1", "1x2x2", "4x1x2"]


@pytest.mark.parametrize("graph", ["small", "few"])
def test_the_plan_decides_as_the_performance_model_predicts(graph):
    """On every grid (shards built for rank 0) each choice of the plan is the planner's
    (plexus.config.gcn_workload) for the same run: the rows of the last layer, the order of
    every layer, layer 0's H_0 and the overlap."""
    g = small_graph() if graph == "small" else few_labels_graph()
    for kind, layers, hidden, learn, dropout, options in CASES:
        config = ModelConfig(model=kind, num_layers=layers, hidden=hidden,
                             learn_features=learn, dropout=dropout, **options)
        source = model_source(g, kind)
        work = gcn_workload(config, source)
        for text in GRIDS:
            shape = ProcessGrid.parse(text).shape
            shard = source.shard(shape, dict.fromkeys(shape, 0),
                                 layer_widths(g.num_features, hidden, layers, g.num_classes))
            plan = plan_layers(shard, shape, model=kind, learn_features=learn, dropout=dropout,
                               comm_offloaded=False,
                               **{k: getattr(config, k) for k in OPTIONS})
            tag = f"{graph} {kind} {layers} layers learn {learn} {options} on {text}"
            assert plan.labelled_rows_only == labelled_rows_pay(
                work.labelled_fraction, config.labelled_rows_only), tag
            assert plan.weight_first == tuple(work.weight_first_layer(layer, shape)
                                              for layer in range(layers)), tag
            assert plan.cache_first == (work.cache_first_aggregation and not learn), tag
            # the planner's recomputed H_0 leaves out a one-layer model on labelled rows,
            # whose every pass over its labelled rows keeps H_0 (plexus.model.forward)
            assert plan.recompute_first == work.recomputes_first or (
                layers == 1 and plan.labelled_rows_only), tag
            assert plan.overlap == overlap_pays(shape, config.overlap, comm_offloaded=False)
            assert plan.aggregation_blocks == (AGGREGATION_BLOCKS if plan.overlap else 1), tag


def test_overlap_needs_a_collective_and_resources_of_its_own():
    shard = InMemorySource(small_graph()).shard({"x": 2, "y": 1, "z": 1}, {"x": 0, "y": 0,
                                                                           "z": 0},
                                                layer_widths(7, 6, 2, 5))
    assert plan_layers(shard, {"x": 2, "y": 1, "z": 1}).overlap
    assert not plan_layers(shard, {"x": 2, "y": 1, "z": 1}, comm_offloaded=False).overlap
    assert not plan_layers(shard, {"x": 1, "y": 1, "z": 1}).overlap  # nothing to hide
    assert plan_layers(shard, {"x": 2, "y": 1, "z": 1}, comm_offloaded=False,
                       overlap=True).aggregation_blocks == AGGREGATION_BLOCKS


def _one_rank():
    graph = small_graph()
    shard = InMemorySource(graph).shard({"x": 1, "y": 1, "z": 1}, {"x": 0, "y": 0, "z": 0},
                                        layer_widths(graph.num_features, 6, 3,
                                                     graph.num_classes))
    return shard, dict(ParallelState.single(ProcessGrid.plexus(1, 1, 1)).groups)


def test_the_model_takes_the_plan_it_is_given():
    """A plan given is the model's (the options it would decide from are then refused); one
    made for another model (another depth, trainable features, another dropout) is refused,
    saying which plan_layers makes."""
    shard, groups = _one_rank()
    plan = plan_layers(shard, {"x": 1, "y": 1, "z": 1}, dropout=0.5, overlap=True,
                       aggregation_blocks=3, weight_first=False)
    model = PlexusGCN(shard, groups, dropout=0.5, plan=plan)
    assert model.plan is plan and model.weight_first == (False, False, False)
    assert plan == PlexusGCN(shard, groups, dropout=0.5, overlap=True, aggregation_blocks=3,
                             weight_first=False).plan
    with pytest.raises(TypeError, match="not both"):
        PlexusGCN(shard, groups, dropout=0.5, plan=plan, overlap=False)
    with pytest.raises(TypeError, match="unexpected keyword"):
        PlexusGCN(shard, groups, overlapp=True)
    bad = [(LayerPlan(weight_first=(False,) * 2), {}, "2 weight_first entries for 3"),
           (plan, {"learn_features": True}, "recompute_first with learn_features"),
           (plan, {}, "recompute_first with dropout 0.0"),
           (LayerPlan(weight_first=(False,) * 3, cache_first=True), {"dropout": 0.5},
            "cache_first with dropout 0.5")]
    for wrong, kwargs, what in bad:
        with pytest.raises(ValueError, match=f"{what}.*plan_layers"):
            PlexusGCN(shard, groups, plan=wrong, **kwargs)
