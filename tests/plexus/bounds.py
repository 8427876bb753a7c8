"""The rounding bounds of a plexus model's outputs computed two ways (the last layer on the
labelled rows or on every row, layer 0 recomputed or kept): where the two runs' sums first
differ and how far that may move the logits, the loss and the gradients (tests/rounding.py)."""

import math

from tests.rounding import assert_orders_agree, order_bound

# the sums a layer's backward adds in turn to a gradient's path once the two runs differ:
# dH = dQ W^T (or dW = H^T dQ), the transposed SpMM A^T dH, the all-reduces of dH and dF
# over the grid's axes and the norm's sums over rows
BACKWARD_SUMS = 4


def last_layer_sums(exact: bool) -> int:
    """The sums in turn from where the labelled-row model first differs from the all-row one
    to its logits: the last layer's ``H W`` (a vendor GEMM of another height) where its O and
    I groups have at most 2 ranks (a sum of two floats has one value in any order, and the
    SpMM over the labelled rows is our kernel, the rows' sums in their order); else also the
    ring all-reduces of H over O and of Q over I, whose order follows the buffer's length."""
    return 1 if exact else 3


def assert_loss_agrees(got, want, *, terms, sums, logit_max, train, classes, what,
                       stored=None):
    """Two losses of logits that agree within order_bound(terms, sums, stored=stored) of
    ``logit_max``, the largest |logit| of every rank (:func:`last_layer_sums`). The loss, the
    mean over the ``train`` rows of ``logsumexp(z) - z_label``, moves by at most twice the
    largest logit's change (its slope in a row's logits sums to at most 2 in absolute value),
    plus its own rounding, twice: the row sum and each row's ``classes``-term log-sum-exp, within
    order_bound(train + classes) of their terms (the loss, two logits and log C)."""
    got, want = float(got), float(want)
    moved = 2 * order_bound(terms, products=sums, stored=stored) * logit_max
    own = order_bound(train + classes) * (abs(want) + 2 * logit_max + math.log(classes))
    assert abs(got - want) <= moved + own, (what, got, want, moved + own)


def assert_gradients_agree(got, want, *, terms, sums, what, stored=None):
    """Every gradient within order_bound(terms, sums, stored=stored) of the largest |gradient|
    of the model
    (normwise over the whole gradient: a bias before batch norm has a gradient of zero up to
    rounding, whose rounding is that of its terms, not of itself). ``terms``: the longest sum
    on backward's path, the rows a ``dW`` or a batch norm sums over (at most the padded node
    count); ``sums``: :func:`last_layer_sums`, the loss's gradient and :data:`BACKWARD_SUMS`
    per layer; ``stored``: the dtype the activations are kept in (tests/rounding.py)."""
    assert sorted(got) == sorted(want), what
    scale = max((t.abs().max().item() for t in want.values() if t.numel()), default=0.0)
    for name, t in want.items():
        assert_orders_agree(got[name], t, terms=terms, products=sums, scale=scale,
                            stored=stored, what=f"{what}: grad of {name}")
