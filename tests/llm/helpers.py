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
    from tests.llm import test_loss, test_parallel, test_plan, test_trainer

    return {"parallel": test_parallel.parallel_cases(ctx, test_parallel.CASES[4]),
            "overlap": test_trainer.overlap_runs(ctx),
            "loss": test_loss.sharded_losses(ctx),
            "generate": test_parallel.generate_case(ctx),
            "saved": test_plan.saved_activation_bytes(ctx)}


def eight_rank_checks(ctx, tmp: str) -> dict[str, Any]:
    """Everything the 8-rank tests compare, computed on one rank of one launch (``tmp``: a
    directory shared by the ranks, for a checkpoint)."""
    from tests.llm import test_parallel, test_tp, test_trainer

    return {"parallel": test_parallel.parallel_cases(ctx, test_parallel.CASES[8]),
            "volumes": [test_tp.linear_volumes(ctx, g, o) for g, o in test_tp.VOLUME_CASES],
            **test_trainer.train_on_grids(ctx, tmp)}
