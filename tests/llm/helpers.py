"""Plain helpers of the llm tests (test modules and rank processes import them; the fixtures
are in conftest.py): a small GPT and trainer, and the per-rank functions of the two shared
multi-rank launches.

Starting ranks costs seconds each on 2 cores, so all 4-rank checks (test_parallel,
test_trainer, test_loss) run in ONE launch and all 8-rank checks (test_parallel, test_tp,
test_trainer) in another; each check's per-rank function lives in its test module.
"""

from __future__ import annotations

from typing import Any

from common.grid import ProcessGrid
from llm.model import GPTConfig, tiny

# A 2-layer GPT on bytes with grouped-query attention (4 / 2 heads), 16-token windows.
SMALL = GPTConfig(vocab_size=256, num_layers=2, num_heads=4, num_kv_heads=2, d_model=32,
                  d_ff=48, max_seq_len=16)
TRAIN_STEPS = 20
# The same shape with a 64-token window: the decoding tests (KV cache methods, QuantSpec).
GQA64 = GPTConfig(vocab_size=256, num_layers=2, num_heads=4, num_kv_heads=2, d_model=32,
                  d_ff=48, max_seq_len=64)
# the two shapes every decode-time method is checked on: MHA (tiny) and GQA
DECODE_CONFIGS = {"tiny": tiny(), "gqa": GQA64}


def logits_sums(config: GPTConfig, seq_len: int | None = None) -> tuple[int, int]:
    """``(terms, products)`` of a GPT forward from tokens to logits, for tests/rounding.py's
    bounds where two computations of the logits differ in shapes or kernels (a KV-cache decode
    step against the full forward, a grid's shards against one rank, another library).

    terms: the longest sum, ``max(d_model, d_ff, seq_len)`` (seq_len: the keys one query sums
    over, ``max_seq_len`` by default). products: the sums in turn on the path, 9 a block (the
    attention norm's mean square, the q/k/v projections, the scores, the softmax's denominator,
    probabilities times values, o_proj, the MLP norm, gate/up, down) and 2 after the blocks
    (the final norm, the LM head); the residual additions and elementwise maps add a few
    roundings that each step's ``gamma(terms)`` covers.
    """
    seq = config.max_seq_len if seq_len is None else seq_len
    return max(config.d_model, config.d_ff, seq), 9 * config.num_layers + 2


def logits_bound(config: GPTConfig, compute_dtype: Any = None,
                 seq_len: int | None = None) -> float:
    """How far two orders of summation may move a logit, relative to the largest |logit|:
    ``order_bound`` of :func:`logits_sums` (float32 accumulation), and where the activations
    are stored in a narrower ``compute_dtype`` (bf16), each of the products' stored results may
    round to the neighbouring value: ``2 u`` more per product."""
    from tests.rounding import order_bound

    terms, products = logits_sums(config, seq_len)
    return order_bound(terms, products=products, stored=compute_dtype)


def assert_logits_agree(got: Any, want: Any, config: GPTConfig, seq_len: int | None = None,
                        what: str = "", per_block: int = 0) -> None:
    """float32 logits of two computations of the same GPT forward (other shapes or kernels)
    within :func:`logits_sums`'s bound, normwise (tests/rounding.py); ``per_block``: sums a
    block adds on one side (Loki's projections of q and k into its basis: 2)."""
    from tests.rounding import assert_orders_agree

    terms, products = logits_sums(config, seq_len)
    assert_orders_agree(got, want, terms=terms, products=products + per_block * config.num_layers,
                        what=what)


def perplexity_rel(model: Any, num_targets: int, per_block: int = 0) -> float:
    """How far, relatively, two orders of summation may move a perplexity ``exp(mean NLL)``:
    ``expm1`` of the mean NLL's move, which is at most twice a logit's (the log-sum-exp's slope
    is at most 1, plus the target's logit; :func:`logits_bound`, ``per_block`` sums a block
    more on one side) plus 2 gamma of the log-sum-exp's sum over V and of the mean's over the
    targets, each of the largest NLL, ``2 L + log V``. ``L`` bounds every |logit| from the
    weights: the final RMSNorm's output has norm at most ``max|w| sqrt(D)``, times the LM
    head's largest row norm."""
    import math

    from tests.rounding import gamma, order_bound

    c = model.config
    with_weights = model.norm.weight.detach().abs().max() * math.sqrt(c.d_model)
    big = float(with_weights * model.lm_head.weight.detach().norm(dim=1).max())  # L
    rel = logits_bound(c, model.compute_dtype)
    if per_block:
        rel += order_bound(logits_sums(c)[0], products=per_block * c.num_layers)
    nll = 2 * big + math.log(c.vocab_size)
    move = 2 * rel * big + 2 * (gamma(c.vocab_size) + gamma(num_targets)) * nll
    return math.expm1(move)


def assert_greedy_agrees(model: Any, got: Any, want: Any, what: str = "") -> None:
    """``got`` and ``want``: greedy continuations of the same prompts by ``model`` computed two
    ways (a KV cache, a grid, drafts) whose logits differ by other orders of summation. Each row
    is equal, or it first differs at a near-tie: there, ``model``'s plain forward of the shared
    prefix (cropped to the window) has both rows' tokens within ``2 * bound`` of its top logit
    (every computation is within ``bound / 2`` of the exact logits, so each pick is at most one
    bound below the other computations' top, and the reference is off by another half bound on
    either side; bound: :func:`logits_bound` times the largest |logit|). After a row's first
    difference the two continue from other prefixes and are not compared."""
    import torch

    assert got.shape == want.shape, what
    window = model.config.max_seq_len
    bound = logits_bound(model.config, model.compute_dtype)
    for row in range(want.shape[0]):
        differ = (got[row] != want[row]).nonzero()
        if not len(differ):
            continue
        t = int(differ[0])
        with torch.no_grad():
            ref = model(want[row : row + 1, :t][:, -window:])[0, -1].float()  # [V]
        room = 2 * bound * ref.abs().max()
        top = ref.max()
        assert ref[want[row, t]] >= top - room and ref[got[row, t]] >= top - room, \
            (f"{what}: row {row} leaves the reference at position {t} ({int(got[row, t])} for "
             f"{int(want[row, t])}) where no near-tie explains it (top-2 logits "
             f"{ref.topk(2).values.tolist()}, rounding room {float(room):.3g})")


def random_tokens(batch: int, length: int, seed: int = 1) -> Any:
    """Seeded random byte ids, int64 [batch, length]."""
    import torch

    return torch.randint(256, (batch, length), generator=torch.Generator().manual_seed(seed))


def one_rank(device: str = "cpu") -> Any:
    """The parallel state of the 1x1x1x1 grid on one process: no process group needed."""
    from common.parallel import ParallelState
    from llm.parallel.gpt import AXIS_SETS

    return ParallelState.single(ProcessGrid.axonn(1, 1, 1, 1), AXIS_SETS, device=device)


def on_grid(ctx, grid_text: str) -> Any:
    """The parallel state of ``grid_text`` (data x depth x row x col) on the ranks of ``ctx``;
    collective."""
    from common.grid import AXONN_AXES
    from common.parallel import ParallelState
    from llm.parallel.gpt import AXIS_SETS

    return ParallelState.create(ctx, ProcessGrid.parse(grid_text, AXONN_AXES), AXIS_SETS)


def one_rank_groups() -> dict[str, Any]:
    """Axis groups of the 1x1x1x1 grid: no process group needed."""
    return dict(one_rank().groups)


def make_trainer(parallel, steps=TRAIN_STEPS, overlap="all"):
    """:data:`SMALL` on 16-byte windows, goldfish on (k=4, h=3), gradient accumulation 2, on
    ``parallel`` (:func:`one_rank`, :func:`on_grid`)."""
    from llm.config import DataConfig, GoldfishConfig, OptimConfig, RunConfig
    from llm.trainer import Trainer

    return Trainer(SMALL, DataConfig(seq_len=16, batch_size=6, eval_batches=1),
                   OptimConfig(lr=1e-2, warmup_steps=3), GoldfishConfig(k=4, h=3),
                   RunConfig(steps=steps, grad_accum=2, overlap=overlap), parallel, seed=5)


def four_rank_checks(ctx) -> dict[str, Any]:
    """Everything the 4-rank tests compare, computed on one rank of one launch."""
    from tests.llm import test_loss, test_plan, test_trainer
    from tests.llm.parallel import test_gpt as test_parallel

    return {"parallel": test_parallel.parallel_cases(ctx, test_parallel.CASES[4]),
            "overlap": test_trainer.overlap_runs(ctx),
            "loss": test_loss.sharded_losses(ctx),
            "generate": test_parallel.generate_case(ctx),
            "saved": test_plan.saved_activation_bytes(ctx)}


def eight_rank_checks(ctx, tmp: str) -> dict[str, Any]:
    """Everything the 8-rank tests compare, computed on one rank of one launch (``tmp``: a
    directory shared by the ranks, for a checkpoint)."""
    from tests.llm import test_trainer
    from tests.llm.parallel import test_gpt as test_parallel
    from tests.llm.parallel import test_layers as test_tp

    return {"parallel": test_parallel.parallel_cases(ctx, test_parallel.CASES[8]),
            "volumes": [test_tp.linear_volumes(ctx, g, o) for g, o in test_tp.VOLUME_CASES],
            **test_trainer.train_on_grids(ctx, tmp)}
