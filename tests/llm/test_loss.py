"""llm.loss: the vocabulary-sharded cross-entropy equals cross_entropy (one rank with a
padded vocabulary here; 4 row ranks in the shared launch ``four_ranks``), and the goldfish
sums equal llm.goldfish.goldfish_loss."""

import pytest
import torch
from torch.nn.functional import cross_entropy

from common.grid import AxisGroup, ProcessGrid
from llm.goldfish import goldfish_loss, goldfish_mask
from llm.loss import goldfish_sums, token_losses
from tests.rounding import assert_orders_agree

VOCAB, PADDED = 61, 64  # prime vocabulary, padded to a multiple of row = 4
ROW1 = AxisGroup("row", None, 1, 0)


def make_case(seed=0):
    """Logits [3, 7, V_pad] (padding columns hold large garbage that must be ignored),
    targets with some ignore_index, and a goldfish mask."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 7, PADDED, generator=g)
    logits[..., VOCAB:] = 50.0
    targets = torch.randint(VOCAB, (3, 7), generator=g)
    targets[torch.rand(3, 7, generator=g) < 0.2] = -100
    return logits, targets, goldfish_mask(targets, k=3, h=2)


def reference(logits, targets):
    return cross_entropy(logits[..., :VOCAB].reshape(-1, VOCAB), targets.reshape(-1),
                           ignore_index=-100, reduction="none").view_as(targets)


def check_against_cross_entropy(got, want, grad, want_grad, what=""):
    """Our log-sum-exp (max, exp, one sum, log) against ATen's log_softmax kernel: one sum of
    VOCAB terms each side, in other orders and vector widths; the gradient, softmax minus the
    target's one, moves with that sum's rounding. Normwise, by the largest loss (gradient)."""
    assert_orders_agree(got, want, terms=VOCAB, what=f"{what} losses")
    assert_orders_agree(grad, want_grad, terms=VOCAB, what=f"{what} gradient")


@pytest.mark.cross_shape
def test_padded_vocabulary_on_one_rank_is_cross_entropy():
    logits, targets, _ = make_case()
    z = logits.clone().requires_grad_()
    z_ref = logits[..., :VOCAB].clone().requires_grad_()
    got = token_losses(z, targets, vocab_size=VOCAB, row=ROW1)
    want = reference(z_ref, targets)
    assert (got[targets == -100] == 0).all()
    got.sum().backward()
    want.sum().backward()
    check_against_cross_entropy(got, want, z.grad[..., :VOCAB], z_ref.grad)
    assert (z.grad[..., VOCAB:] == 0).all()  # padded ids never receive a gradient


def test_fast_path_is_cross_entropy():
    """The fast path IS cross_entropy on the same [21, 61] input: the same kernel, bitwise."""
    logits, targets, _ = make_case(1)
    logits = logits[..., :VOCAB]
    assert torch.equal(token_losses(logits, targets, vocab_size=VOCAB, row=ROW1),
                       reference(logits, targets))


def test_goldfish_sums_equal_the_goldfish_loss():
    logits, targets, mask = make_case(2)
    logits = logits[..., :VOCAB]
    want = goldfish_loss(logits, targets, mask)
    num_kept = int(want.num_kept)
    got = goldfish_sums(logits, targets, mask, num_kept=num_kept, vocab_size=VOCAB, row=ROW1)
    assert got.loss.item() == pytest.approx(want.loss.item(), rel=1e-6)
    assert got.kept_sum.item() == pytest.approx(want.loss.item() * num_kept, rel=1e-6)
    assert got.dropped_sum.item() == pytest.approx(
        want.dropped_loss.item() * int(want.num_dropped), rel=1e-6)
    assert not got.kept_sum.requires_grad and not got.dropped_sum.requires_grad


def sharded_losses(ctx):
    """Per rank of the 1x1x4x1 grid: the per-token losses and this rank's logits gradient
    for vocabulary chunk ``row.rank`` of :func:`make_case`."""
    from llm.parallel.gpt import make_groups

    row = make_groups(ProcessGrid.axonn(1, 1, 4, 1), ctx.rank, ctx.transport)["row"]
    logits, targets, _ = make_case()
    width = PADDED // 4
    z = logits[..., row.rank * width : (row.rank + 1) * width].clone().requires_grad_()
    per_token = token_losses(z, targets, vocab_size=VOCAB, row=row)
    per_token.sum().backward()
    return {"losses": per_token.detach(), "grad": z.grad}


@pytest.mark.slow
@pytest.mark.cross_shape
def test_vocabulary_split_over_4_row_ranks(four_ranks):
    logits, targets, _ = make_case()
    z_ref = logits[..., :VOCAB].clone().requires_grad_()
    want = reference(z_ref, targets)
    want.sum().backward()
    grad = torch.cat([r["loss"]["grad"] for r in four_ranks], dim=-1)  # [3, 7, V_pad]
    for rank, r in enumerate(four_ranks):  # the sum over 4 chunks of 16: another order
        check_against_cross_entropy(r["loss"]["losses"], want, grad[..., :VOCAB], z_ref.grad,
                                    f"rank {rank}")
    assert (grad[..., VOCAB:] == 0).all()
