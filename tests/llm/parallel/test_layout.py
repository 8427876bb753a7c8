"""The GPT's layout on the 4D grid (llm.parallel.layout): one spec per parameter of the serial
model, in its order and shapes, each Linear split as the module's table says (padding
included), the fast path's natural shapes, and the batch split over data then depth. Pure: no
ranks are launched."""

import itertools

import torch

from common.grid import AXONN_AXES, AxisGroup
from llm.model import GPT
from llm.parallel.layout import BLOCK_LINEARS, batch_shard, param_specs
from tests.llm.parallel.test_gpt import BASE


def test_one_spec_per_parameter_in_the_models_order_and_shapes():
    model = GPT(BASE, device="meta")
    for sizes in ({"data": 1, "depth": 2, "row": 2, "col": 2}, dict.fromkeys(AXONN_AXES, 1)):
        specs = param_specs(BASE, sizes)
        assert list(specs) == [n for n, _ in model.named_parameters()]
        assert all(specs[n].shape == tuple(p.shape) for n, p in model.named_parameters())
    # the Linears of a block, in the order the model registers them
    linears = [n for n, m in model.blocks[0].named_modules() if isinstance(m, torch.nn.Linear)]
    assert tuple(linears) == BLOCK_LINEARS


def test_layout_of_the_linears():
    sizes = {"data": 2, "depth": 2, "row": 2, "col": 4}
    specs = param_specs(BASE, sizes)
    q, o = specs["blocks.0.attn.q_proj.weight"], specs["blocks.1.attn.o_proj.weight"]
    assert q.axes == ("row", "col") and o.axes == ("col", "row") and q.flat and o.flat
    assert [p for p in BLOCK_LINEARS if specs[f"blocks.0.{p}.weight"].transposed] == [
        "attn.o_proj", "mlp.down_proj"]
    assert specs["blocks.0.attn.k_proj.weight"].shape == (16, 32)  # 2 kv heads of 8
    assert specs["blocks.0.mlp.gate_proj.weight"].block_shape(sizes) == (23, 8)  # 45 -> 46 / 2
    assert specs["blocks.0.mlp.down_proj.weight"].block_shape(sizes) == (8, 23)
    assert specs["lm_head.weight"].block_shape(sizes) == (31, 8)  # vocab 61 -> 62 / 2
    assert specs["blocks.0.mlp.gate_proj.weight"].shard_numel(sizes) == 92
    assert specs["norm.weight"].replicated == ("row", "depth")
    assert specs["tok_emb.weight"].axes == (None, "col")
    one = {a: 1 for a in AXONN_AXES}
    assert all(s.axes == (None,) * len(s.shape) and not s.flat
               for s in param_specs(BASE, one).values())


def test_batch_shard_pads_and_splits_over_data_then_depth():
    batch = torch.arange(5 * 3).view(5, 3)
    rows = []
    for d, z in itertools.product(range(2), range(2)):
        groups = {"data": AxisGroup("data", None, 2, d), "depth": AxisGroup("depth", None, 2, z)}
        rows.append(batch_shard(batch, groups, -1))
    assert all(r.shape == (2, 3) for r in rows)
    assert torch.equal(torch.cat(rows)[:5], batch) and (torch.cat(rows)[5:] == -1).all()
