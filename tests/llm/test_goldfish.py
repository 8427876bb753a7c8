"""Goldfish mask against a plain-Python reading of the spec, and the masked loss."""

import functools

import pytest
import torch
from torch.nn.functional import cross_entropy

from llm.goldfish import goldfish_loss, goldfish_mask
from tests.rounding import order_bound

TABLE_SIZE = 1_000_003


@functools.lru_cache(maxsize=1)
def spec_table() -> list[float]:
    """The spec's table, as Python floats."""
    generator = torch.Generator("cpu").manual_seed(2971215073)
    return torch.rand(TABLE_SIZE, generator=generator).tolist()


def wrap_int64(x: int) -> int:
    """Two's-complement 64-bit wrap-around of a Python int."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


def spec_mask(rows: list[list[int]], k: int, h: int) -> list[list[bool]]:
    """Section 4 of the spec, one position at a time, in Python ints."""
    table = spec_table()
    out = []
    for row in rows:
        dropped = [False] * len(row)
        for p in range(h - 1, len(row)):
            key = 1
            for label in row[p - h + 1 : p + 1]:
                key = wrap_int64(key * label)
            dropped[p] = table[key % TABLE_SIZE] < 1 / k  # Python % is non-negative here
        out.append(dropped)
    return out


def random_targets(batch, seq, vocab, seed, zeros=0.0, ignore=0.0):
    g = torch.Generator().manual_seed(seed)
    targets = torch.randint(vocab, (batch, seq), generator=g)
    targets[torch.rand(batch, seq, generator=g) < zeros] = 0
    targets[torch.rand(batch, seq, generator=g) < ignore] = -100
    return targets


@pytest.mark.parametrize(
    "vocab, h, k, seq",
    [
        (50_257, 13, 4, 160),  # GPT-2 vocab: products overflow int64
        (65_536, 32, 3, 96),  # long window
        (128_256, 13, 128, 120),  # Llama-3 vocab, rare drops
        (256, 13, 8, 64),  # bytes
        (2, 13, 2, 48),  # only 0 and 1: most keys are 0
        (32_000, 1, 4, 40),  # h = 1: the key is the label itself
        (1_000, 13, 4, 7),  # T < h: nothing can be dropped
        (50_257, 13, 32, 13),  # T == h: only the last position
    ],
)
def test_hash_mask_matches_spec(vocab, h, k, seq):
    targets = random_targets(4, seq, vocab, seed=vocab + h + k, zeros=0.02, ignore=0.02)
    mask = goldfish_mask(targets, k=k, h=h)
    assert mask.dtype == torch.bool and mask.shape == targets.shape
    assert mask.tolist() == spec_mask(targets.tolist(), k, h)
    assert not mask[:, : h - 1].any()


def test_products_really_overflow():
    """Guard that the reference test exercises wrap-around (and that it differs from no wrap)."""
    targets = random_targets(1, 13, 50_257, seed=0)[0].tolist()
    exact = 1
    for label in targets:
        exact *= label
    assert exact >= 1 << 63
    assert (exact % TABLE_SIZE) != (wrap_int64(exact) % TABLE_SIZE)


def test_int32_targets_give_the_same_mask():
    targets = random_targets(2, 64, 50_257, seed=1)
    assert torch.equal(goldfish_mask(targets.int(), k=4), goldfish_mask(targets, k=4))


def test_table_is_pinned():
    """The first values of the paper's table (torch's CPU Mersenne Twister is stable)."""
    from llm.goldfish import hash_table

    table = hash_table()
    assert table.shape == (TABLE_SIZE,) and table.dtype == torch.float32
    expected = [0.23368388414382935, 0.4412640333175659, 0.7411476969718933]
    assert table[:3].tolist() == expected


@pytest.mark.parametrize("strategy", ["hash", "hash-ordered"])
@pytest.mark.parametrize("k", [4, 8])
def test_drop_rate_is_about_one_over_k(strategy, k):
    targets = random_targets(32, 2048, 50_257, seed=k)
    mask = goldfish_mask(targets, k=k, strategy=strategy)
    rate = mask[:, 12:].float().mean().item()
    assert abs(rate - 1 / k) < 0.02


def test_k1_drops_every_hashed_position():
    mask = goldfish_mask(random_targets(2, 40, 1000, seed=3), k=1)
    assert not mask[:, :12].any() and mask[:, 12:].all()


@pytest.mark.parametrize("k, start, seq", [(4, 0, 17), (3, 2, 10), (5, 7, 30), (4, 50, 20)])
def test_static_positions(k, start, seq):
    targets = random_targets(3, seq, 100, seed=0)
    mask = goldfish_mask(targets, k=k, strategy="static", start=start)
    expected = [p >= start and (p - start) % k == 0 for p in range(seq)]
    assert mask.tolist() == [expected] * 3


def test_reference_hash_ignores_order_and_collapses_zero():
    """The known flaws of the paper's hash (kept for compatibility), absent in hash-ordered."""
    window = random_targets(1, 13, 50_257, seed=4)
    flipped = window.flip(1)
    assert torch.equal(goldfish_mask(window, 2)[:, -1], goldfish_mask(flipped, 2)[:, -1])
    row = random_targets(1, 400, 50_257, seed=5)
    row[0, 200] = 0  # the 13 windows containing it all hash to key 0
    zero_windows = goldfish_mask(row, 2)[0, 200:213]
    assert zero_windows.all() or not zero_windows.any()
    ordered = goldfish_mask(row, 2, strategy="hash-ordered")[0, 200:213]
    assert ordered.any() and not ordered.all()
    diffs = [
        goldfish_mask(w, 2, strategy="hash-ordered")[0, -1] !=
        goldfish_mask(w.flip(1), 2, strategy="hash-ordered")[0, -1]
        for w in random_targets(64, 13, 50_257, seed=6).split(1)
    ]
    assert any(diffs)


def test_hash_ordered_prefix_and_determinism():
    targets = random_targets(4, 100, 256, seed=7)
    first = goldfish_mask(targets, k=3, h=16, strategy="hash-ordered")
    assert not first[:, :15].any()
    assert torch.equal(first, goldfish_mask(targets.clone(), k=3, h=16, strategy="hash-ordered"))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"k": 0}, "k must be"),
        ({"k": 2.0}, "k must be"),
        ({"k": True}, "k must be"),
        ({"k": 4, "h": 0}, "h must be"),
        ({"k": 4, "strategy": "sha"}, "strategy"),
        ({"k": 4, "strategy": "static", "start": -1}, "start"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        goldfish_mask(torch.zeros(2, 20, dtype=torch.int64), **kwargs)


def test_bad_targets():
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        goldfish_mask(torch.zeros(20, dtype=torch.int64), k=4)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        goldfish_mask(torch.zeros(2, 20), k=4)


def make_logits(batch=3, seq=20, vocab=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, seq, vocab, generator=g, requires_grad=True)


def test_loss_equals_manual_masked_cross_entropy():
    logits = make_logits()
    targets = random_targets(3, 20, 11, seed=1, ignore=0.1)
    mask = goldfish_mask(targets, k=3, strategy="static", start=1)
    out = goldfish_loss(logits, targets, mask)
    kept_sum, kept_n, dropped_sum, dropped_n = 0.0, 0, 0.0, 0
    for b in range(3):
        for t in range(20):
            if targets[b, t] == -100:
                continue
            ce = -torch.log_softmax(logits[b, t].double(), dim=-1)[targets[b, t]].item()
            if mask[b, t]:
                dropped_sum, dropped_n = dropped_sum + ce, dropped_n + 1
            else:
                kept_sum, kept_n = kept_sum + ce, kept_n + 1
    assert out.num_kept.item() == kept_n and out.num_dropped.item() == dropped_n
    assert out.loss.item() == pytest.approx(kept_sum / kept_n, rel=1e-5)
    assert out.kept_loss.item() == pytest.approx(kept_sum / kept_n, rel=1e-5)
    assert out.dropped_loss.item() == pytest.approx(dropped_sum / dropped_n, rel=1e-5)
    assert not out.kept_loss.requires_grad and not out.dropped_loss.requires_grad
    out.loss.backward()
    assert logits.grad[mask].abs().sum() == 0  # dropped targets are never supervised
    assert logits.grad[~mask & (targets != -100)].abs().sum() > 0


@pytest.mark.cross_shape
def test_no_mask_is_the_standard_loss():
    """cross_entropy's own mean against our sum of its per-token losses over the 60 targets:
    one sum of positive terms in another order, within 2 gamma(60) of it (the per-token
    losses are the same kernel's on the same [60, 11] input)."""
    logits = make_logits()
    targets = random_targets(3, 20, 11, seed=2, ignore=0.1)
    out = goldfish_loss(logits, targets, torch.zeros_like(targets, dtype=torch.bool))
    expected = cross_entropy(logits.reshape(-1, 11), targets.reshape(-1), ignore_index=-100)
    assert out.loss.item() == pytest.approx(expected.item(), rel=order_bound(3 * 20))
    assert out.num_dropped.item() == 0 and out.dropped_loss.item() == 0.0


def test_everything_dropped_is_finite_with_zero_gradient():
    logits = make_logits()
    targets = random_targets(3, 20, 11, seed=3)
    out = goldfish_loss(logits, targets, torch.ones_like(targets, dtype=torch.bool))
    assert out.loss.item() == 0.0 and out.num_kept.item() == 0
    assert torch.isfinite(out.dropped_loss) and out.dropped_loss.item() > 0
    out.loss.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_loss_shape_mismatch():
    logits = make_logits()
    targets = random_targets(3, 19, 11, seed=4)
    with pytest.raises(ValueError, match="logits"):
        goldfish_loss(logits, targets, torch.zeros_like(targets, dtype=torch.bool))
