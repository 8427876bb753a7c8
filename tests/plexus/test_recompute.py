"""Layer 0's aggregation recomputed in backward (PlexusGCN(recompute_first=True), the default
with fixed features and dropout) against keeping it, and the masks kept as bits.

What must hold: the forward passes, training and evaluation, are the kept path's (the same
rows of H_0, multiplied row block by row block), the weight gradients agree to float rounding
(dW_0 summed over the row blocks), nothing of H_0's size is kept for backward, the
communication is the planner's (collectives 1 and 2 run again in backward), and the planner's
memory phases count it.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from common import dense
from common.comm_stats import CommStats
from plexus import ops
from plexus.layout import layer_widths, roles
from tests.distributed import run_ranks
from tests.plexus.bounds import BACKWARD_SUMS, assert_gradients_agree, assert_loss_agrees
from tests.plexus.data.shards import model_source, small_graph
from tests.rounding import assert_orders_agree, assert_product_orders_agree

HIDDEN, SEED, STEP = 6, 5, 3
# the sums in turn a layer's forward adds to the logits' path: the SpMM, its all-reduce over
# O, H W (GraphSAGE: + R W_r) and its all-reduce over I
FORWARD_SUMS = 4


def _check_bit_mask(shape, device):
    mask = (torch.rand(shape, generator=torch.Generator().manual_seed(1)) > 0.4).to(device)
    bits = ops.BitMask(mask)
    assert bits.bits.dtype == torch.uint8 and bits.bits.numel() == -(-mask.numel() // 8)
    assert bits.bits.device == mask.device
    assert torch.equal(bits.unpack(), mask)
    assert torch.equal(bits.unpack(invert=True), ~mask)


SHAPES = [(5, 7), (8, 8), (1, 3), (0, 4), (13,)]


@pytest.mark.parametrize("shape", SHAPES)
def test_a_bit_mask_gives_back_the_mask_and_its_negation(shape):
    _check_bit_mask(shape, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_bit_mask_on_cuda_gives_back_the_mask_and_its_negation():
    for shape in SHAPES:  # torch's bit operations instead of numpy's
        _check_bit_mask(shape, "cuda")


def test_relu_and_dropout_keep_their_masks_as_bits():
    """The two activations' gradients are those of torch's, from a mask 8x smaller."""
    from plexus.dropout import apply_dropout

    x = torch.randn(37, 11, requires_grad=True)
    keep = torch.rand(37, 11, generator=torch.Generator().manual_seed(2)) > 0.5
    y = apply_dropout(ops.ReLU.apply(x * 1.0), keep, 0.5)
    y.backward(torch.ones_like(y))
    assert torch.equal(x.grad, ((x > 0) & keep).float() * 2.0)
    assert torch.equal(y, torch.relu(x) * keep * 2.0)


class _Probe(torch.autograd.Function):
    """Identity both ways; records the address of the gradient it passes back."""

    seen: ClassVar[list[int]] = []

    @staticmethod
    def forward(ctx, x):
        return dense.empty_like(x).copy_(x)  # a block the trainer's ops would make

    @staticmethod
    def backward(ctx, dy):
        _Probe.seen.append(dy.data_ptr())
        return dy


class _Fresh(torch.autograd.Function):
    """``x * w``, returning a fresh gradient that it keeps (so no other block can take its
    address)."""

    made: ClassVar[list[torch.Tensor]] = []

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(w)
        return x * w

    @staticmethod
    def backward(ctx, dy):
        (w,) = ctx.saved_tensors
        dx = torch.mul(dy, w, out=dense.empty_like(dy))
        _Fresh.made.append(dx)
        return dx, None


@pytest.mark.parametrize("shape", [(37, 11), (4099, 64)])
def test_spent_relu_and_dropout_write_over_their_inputs_with_the_same_values(shape):
    """``ReLU.apply(q, True)`` and ``apply_dropout(..., spent=True)`` (plexus.model's layers):
    forward writes over the ReLU's output, backward over the incoming gradient, so the block
    that reaches the ReLU's input is the one the consumer made; values and gradients equal
    the out-of-place ones bit for bit (torch's ops on a small block, the numba pass on a large
    one; there in buffers of common.dense.empty, as the trainer's ops make them)."""
    from plexus.dropout import apply_dropout

    g = torch.Generator().manual_seed(7)
    x0 = torch.randn(shape, generator=g)
    keep = torch.rand(shape, generator=g) > 0.3
    w = torch.randn(shape, generator=g)
    got = {}
    for spent in (False, True):
        _Probe.seen.clear()
        _Fresh.made.clear()
        x = x0.clone().requires_grad_(True)
        q = _Probe.apply(x)
        r = ops.ReLU.apply(q, spent)
        y = apply_dropout(r, keep, 0.3, spent=spent)
        assert (y.data_ptr() == q.data_ptr()) == spent  # dropout wrote over relu(q)
        _Fresh.apply(y, w).sum().backward()
        made = [t.data_ptr() for t in _Fresh.made]
        assert (_Probe.seen == made) == spent  # the consumer's gradient, overwritten
        got[spent] = (y.detach(), x.grad)
    assert torch.equal(got[True][0], got[False][0]) and torch.equal(got[True][1], got[False][1])
    factor = torch.ones(()) / (1.0 - 0.3)  # dropout's scale, as plexus.dropout.dropped has it
    assert torch.equal(got[False][1], (w * factor).masked_fill(~((x0 > 0) & keep), 0.0))


def test_a_view_is_not_written_over_but_its_gradient_is():
    """Autograd forbids writing over a custom Function's view output: forward makes a new
    block (:func:`plexus.dropout.can_spend`), backward still writes over the gradient."""
    from plexus.dropout import apply_dropout, can_spend

    x = torch.randn(64, 8, requires_grad=True)
    view = x.view(8, 64)
    assert not can_spend(view) and not can_spend(x) and can_spend(x * 1.0)
    keep = torch.ones(8, 64, dtype=torch.bool)
    y = apply_dropout(view, keep, 0.5, spent=True)
    assert y.data_ptr() != view.data_ptr() and torch.equal(y, view.detach() * 2.0)
    y.sum().backward()
    assert torch.equal(x.grad, torch.full((64, 8), 2.0))


@pytest.mark.parametrize("shape", [(300, 257), (8192, 8), (70001, 1)])
def test_the_fused_relu_kernels_give_torchs_values_and_mask_bits(shape):
    """Blocks of 2^16 entries or more take plexus.kernels.relu_pack / masked_by_bits (one
    pass each way); every value, NaN and -0 included, the bits and the gradient are those of
    torch.relu_, numpy's packbits and masked_fill (a last partial byte in two shapes)."""
    pytest.importorskip("numba")
    q = torch.randn(shape, generator=torch.Generator().manual_seed(4))
    flat = q.view(-1)
    flat[::977] = float("nan")
    flat[5::1013] = -0.0
    assert q.numel() >= 1 << 16 and ops._relu_kernels(q) is not None
    want = torch.relu_(q.clone())
    x = q.clone().requires_grad_(True)
    y = ops.ReLU.apply(x * 1.0)
    assert torch.equal(y.isnan(), want.isnan())
    assert torch.equal(torch.nan_to_num(y.detach()), torch.nan_to_num(want))
    assert torch.equal(torch.signbit(y.detach()), torch.signbit(want))  # -0 stays -0
    assert torch.equal(y.grad_fn.keep.bits, ops.BitMask(want > 0).bits)
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(5))
    y.backward(dy)
    assert torch.equal(x.grad, dy.masked_fill(~(want > 0), 0.0))


@pytest.mark.parametrize("shape", [(4099, 64), (3, 5)])
def test_a_bit_mask_clears_what_masked_fill_clears(shape):
    """BitMask.clear_ (the remade layer 0's dropout, FirstLayer._q0_remade): the numba
    pass on a large float32 block, masked_fill on a small one; the same bits either way, in
    place, -0 and NaN kept where the mask keeps them."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(shape, generator=g)
    x.view(-1)[::7] = float("nan")
    x.view(-1)[3::11] = -0.0
    keep = torch.rand(shape, generator=g) > 0.4
    want = x.masked_fill(~keep, 0.0)
    got = x.clone()
    if got.numel() >= 1 << 16:
        pytest.importorskip("numba")
        assert ops._relu_kernels(got) is not None  # the numba pass runs
    out = ops.BitMask(keep).clear_(got)
    assert out.data_ptr() == got.data_ptr()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # bit for bit


@pytest.mark.parametrize("spent", [False, True])
def test_dropout_forward_on_a_large_block_is_torchs_bit_for_bit(spent):
    """apply_dropout's forward on a large float32 CPU block clears the dropped entries from
    the packed bits (numba) instead of masked_fill_ with the negated mask: the same bits as
    ``x * keep / (1 - p)`` written by torch, -0 and NaN kept where kept, in place or not."""
    from plexus.dropout import apply_dropout

    pytest.importorskip("numba")
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4099, 64, generator=g)
    x.view(-1)[::7] = float("nan")
    x.view(-1)[3::11] = -0.0
    keep = torch.rand(x.shape, generator=g) > 0.5
    want = (x * (torch.ones(()) / 0.5)).masked_fill_(~keep, 0.0)
    src = x.clone().requires_grad_(True)
    y = apply_dropout(src * 1.0 if spent else src, keep, 0.5, spent=spent)  # spent: a fresh x
    assert torch.equal(y.detach().view(torch.int32), want.view(torch.int32))
    y.backward(torch.ones_like(y))
    assert torch.equal(src.grad, keep.float() * 2.0)


def _saved_bytes(fn):
    """(result of fn(), bytes of the tensors autograd saves while it runs)."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total[0]


def train_and_eval(model, shard, groups, num_classes: int, step: int) -> dict:
    """One training pass of ``model`` (dropout mask of ``step``), the sharded loss on the
    training split, backward, then an evaluation pass: logits, loss, evaluation logits, the
    bytes autograd saved in the training pass, the bytes the model's collectives moved per
    axis (the loss is given no stats) and every full gradient. Also used by
    tests/plexus/test_weight_first.py."""
    from plexus.loss import sharded_cross_entropy

    o_ax, _, p_ax = roles(model.num_layers - 1)
    stats = CommStats()
    logits, saved = _saved_bytes(lambda: model(stats, step=step))
    loss = sharded_cross_entropy(logits, shard.labels, shard.masks["train"],
                                 num_classes=num_classes, count=shard.split_counts["train"],
                                 group_o=groups[o_ax], group_p=groups[p_ax])
    loss.backward()
    model.eval()
    with torch.no_grad():
        eval_logits = model()
    return {"logits": logits.detach(), "loss": loss.item(), "eval": eval_logits,
            "saved": saved, "bytes": {ax: r.bytes - r.padding for ax, r in stats.by_axis().items()},
            "grads": {n: model.gather(k, t.grad, layer)
                      for n, t, k, layer in model.sharded_state() if t.grad is not None}}


CASES = [("gcn", 3, "fp32"), ("sage", 2, "fp32"), ("gcn", 3, "bf16")]


def _runs(ctx, grids):
    """Per grid and case: one training pass and backward with recompute_first on and off:
    logits, loss, gradients, the bytes autograd saved and the bytes moved by axis."""
    from common.grid import ProcessGrid
    from plexus.model import PlexusGCN

    graph = small_graph()
    out = []
    for grid_text in grids:
        grid = ProcessGrid.parse(grid_text)
        groups = ctx.create_groups(grid)
        for kind, num_layers, precision in CASES:
            widths = layer_widths(graph.num_features, HIDDEN, num_layers, graph.num_classes)
            source = model_source(graph, kind)
            per = {}
            for recompute in (True, False):
                shard = source.shard(grid.shape, grid.coords(ctx.rank), widths)
                # (weight_first off: a narrowing layer 0 would otherwise multiply first and
                # remake F' instead of recomputing H_0, tests/plexus/test_weight_first.py)
                model = PlexusGCN(shard, groups, model=kind, seed=SEED, dropout=0.5,
                                  labelled_rows_only=False, precision=precision,
                                  recompute_first=recompute, weight_first=False)
                assert model.plan.recompute_first == recompute
                # (the evaluation pass runs layer 0 in row blocks too, without dropout)
                per[recompute] = {
                    **train_and_eval(model, shard, groups, graph.num_classes, STEP),
                    # H_0 [N/P, D_0/I] as GatheredMatmul keeps it (bf16: 2 bytes)
                    "h0_bytes": model.shard.adj[0].a.shape[0] * model.block_shapes[0][0]
                    * (2 if precision == "bf16" else 4),
                    "n_pad": shard.num_nodes_padded, "train": shard.split_counts["train"]}
            out.append({"case": (grid_text, kind, num_layers, precision),
                        "shape": grid.shape, "on": per[True], "off": per[False]})
    return out


def _assert_recompute_equals_keep(results):
    """Layer 0's H_0 W_0 runs row block by row block against one product of every row: a
    vendor GEMM (torch.mm, MKL) of other heights, which may sum a row in another order (its
    edge kernels take the last M mod 8 rows), and dW_0 sums over the row blocks. So the logits,
    the loss and the gradients agree to float rounding: each sum on the path at most N_pad
    terms (the rows a dW or a batch norm sums; the in-degrees and widths are shorter), FORWARD_
    SUMS per layer to the logits, then the loss's gradient and BACKWARD_SUMS per layer;
    normwise against the largest |logit| (these untrained logits do not cancel far below their
    terms) and the largest |gradient| of the model (a gradient near zero rounds as its terms
    do). The loss moves by at most twice the largest logit's change, plus its own rounding
    (tests/plexus/bounds.py's assert_loss_agrees)."""
    from common.perf.gcn import GCNWorkload, gcn_collectives
    from common.perf.model import bytes_by_axis

    graph = small_graph()
    for per_rank in zip(*results):
        logit_max = max(r["off"][k].abs().max().item() for r in per_rank
                        for k in ("logits", "eval"))
        for r in per_rank:
            tag = f"case {r['case']}"
            on, off = r["on"], r["off"]
            _, _, num_layers, precision = r["case"]
            # in bf16 each stored H (and F_0) may also round to the neighbouring bf16 value
            stored = torch.bfloat16 if precision == "bf16" else None
            terms, sums = off["n_pad"], FORWARD_SUMS * num_layers
            for key in ("logits", "eval"):
                assert_orders_agree(on[key], off[key], terms=terms, products=sums,
                                    scale=logit_max, stored=stored, what=f"{tag}: {key}")
            assert_loss_agrees(on["loss"], off["loss"], terms=terms, sums=sums,
                               logit_max=logit_max, train=off["train"],
                               classes=graph.num_classes, stored=stored, what=tag)
            assert_gradients_agree(on["grads"], off["grads"], terms=terms,
                                   sums=sums + 1 + BACKWARD_SUMS * num_layers, stored=stored,
                                   what=tag)
            # H_0 (and GraphSAGE's R_0) is no longer kept: at least its bytes less are saved
            terms = 2 if r["case"][1] == "sage" else 1
            assert off["saved"] - on["saved"] >= terms * on["h0_bytes"], tag
            # (1) and (2) run again in backward: the planner counts them
            _, kind, num_layers, precision = r["case"]
            work = GCNWorkload(model=kind, num_nodes=graph.num_nodes, nnz=1,
                               num_features=graph.num_features, num_classes=graph.num_classes,
                               num_layers=num_layers, hidden=HIDDEN, dropout=0.5,
                               cache_first_aggregation=False, labelled_rows_only=False,
                               precision=precision, norm="none", weight_first=False)
            for mode, recompute in (("on", True), ("off", False)):
                w = GCNWorkload(**{**work.__dict__, "recompute_first": recompute})
                assert w.recomputes_first == recompute
                want = {k: v for k, v in bytes_by_axis(
                    gcn_collectives(w, r["shape"], loss=False), r["shape"]).items() if v}
                got = {k: v for k, v in r[mode]["bytes"].items() if v}
                assert got == want, f"{tag} {mode}: bytes {got} != model {want}"


@pytest.mark.cross_shape
@pytest.mark.parametrize("world, grids", [
    (1, ["1x1x1"]),
    # O > 1 (2x1x2, 4x1x1: H_0's row blocks all-reduced) and P > 1 (1x2x2: F_0 gathered
    # again); 203 nodes pad to 204
    pytest.param(4, ["1x2x2", "2x1x2", "4x1x1"], marks=pytest.mark.slow),
])
def test_recomputed_first_aggregation_equals_keeping_it(world, grids):
    _assert_recompute_equals_keep(run_ranks(_runs, world, grids))


def test_the_planner_drops_h0_and_adds_the_recompute_phase():
    from common.perf.gcn import GCNWorkload, gcn_memory_parts, gcn_memory_phases

    # (weight_first off: the narrowing layer 0 would multiply first and remake F' instead)
    base = dict(num_nodes=100_000, nnz=1_000_000, num_features=128, num_classes=10,
                hidden=64, dropout=0.5, cache_first_aggregation=False, weight_first=False)
    shape = {"x": 1, "y": 1, "z": 1}
    on, off = GCNWorkload(**base), GCNWorkload(**base, recompute_first=False)
    assert on.recomputes_first and not off.recomputes_first
    assert not GCNWorkload(**{**base, "dropout": 0.0}).recomputes_first  # H_0 is cached
    assert not GCNWorkload(**base, learn_features=True).recomputes_first
    h0 = 100_000 * 128 * 4
    assert gcn_memory_parts(off, shape)["kept_h"] - gcn_memory_parts(on, shape)["kept_h"] == h0
    assert "backward 0 recompute" in gcn_memory_phases(on, shape)
    assert "backward 0 recompute" not in gcn_memory_phases(off, shape)
    assert max(gcn_memory_phases(on, shape).values()) < max(gcn_memory_phases(off,
                                                                              shape).values())


@pytest.mark.cross_shape
@pytest.mark.parametrize("op", ["recomputed", "remade"])
def test_layer_zeros_input_is_handed_back_when_its_forward_ends(monkeypatch, pooling, op):
    """F' (layer 0's input) is made again in backward by RecomputedMatmul's blocks and
    RemadeInputMatmul's make, so their forward hands it back from the pool of tall buffers
    instead of keeping it idle through the rest of the step, where it would raise the step's
    peak above that of a run without the pool (docs/benchmarks.md, "Allocator": with the
    hand-back the pool adds no memory). The product is unchanged and backward makes F'
    again."""
    from common.grid import AxisGroup

    pooled_at_hand_back = []
    real = dense.hand_back_pooled

    def hand_back():
        pooled_at_hand_back.append(pooling.pooled)
        real()

    monkeypatch.setattr(dense, "hand_back_pooled", hand_back)
    rows, d0, d1 = 4096, 32, 16  # F' of rows * d0 >= PAIR_MIN elements: a pooled buffer
    assert rows * d0 >= dense.PAIR_MIN
    group = AxisGroup("z", None, 1, 0)
    x = torch.randn(rows, d0, generator=torch.Generator().manual_seed(0))
    w = torch.randn(d0 * d1, generator=torch.Generator().manual_seed(1), requires_grad=True)
    made = []

    def make():
        made.append(1)
        return dense.empty(rows, d0).copy_(x)

    def blocks():
        f = make()
        for lo, hi in ((0, 1000), (1000, rows)):
            yield 0, lo, hi, f[lo:hi].clone()

    if op == "recomputed":
        q = ops.RecomputedMatmul.apply(blocks, rows, group, (d0, d1), None, (None, None), w)
    else:
        q = ops.RemadeInputMatmul.apply(make, group, (d0, d1), None, (None, None), w)[0]
    assert pooled_at_hand_back == [4 * rows * d0]  # F', freed, then handed back
    assert pooling.pooled == 0 and pooling.free == []
    # the product of row blocks (a vendor GEMM of other heights) and dW summed over them:
    # each within gamma(k) |a| |b| of the float64 product (tests/rounding.py)
    assert_product_orders_agree(q, x, w.detach().view(d0, d1), "H W")
    q.sum().backward()
    assert len(made) == 2  # made again for dW
    assert_product_orders_agree(w.grad.view(d0, d1), x.t(), torch.ones(rows, d1), "dW")
