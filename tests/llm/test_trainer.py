"""llm.trainer: configs, the schedule, exact resume, the loop's checkpoint cadence and
preemption, overlap on == off bit for bit on a grid where OAR, ORS and OAG all run, and
training on 8 ranks tracking 1 (the multi-rank parts run in the shared launches of
conftest.py)."""

import dataclasses
import itertools
import math
import os

import pytest
import torch

from common.run import CheckpointConfig
from llm import checkpoint
from llm.config import DataConfig, GoldfishConfig, OptimConfig, RunConfig
from llm.trainer import lr_at, run
from tests.llm.helpers import TRAIN_STEPS, make_trainer, on_grid, one_rank

TRAIN_GRIDS = ("1x2x2x2",)  # depth, row and col; data > 1 is covered by the gradient cases
OVERLAP_GRID = "1x2x2x1"  # depth 2 (ORS, OAG) and row 2 (OAR) on 4 ranks
OVERLAP_STEPS = 3


def test_lr_schedule():
    cfg = OptimConfig(lr=1.0, min_lr_ratio=0.1, warmup_steps=4)
    lrs = [lr_at(s, 14, cfg) for s in range(1, 15)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[-1] == pytest.approx(0.1)
    assert lrs[8] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert all(a >= b for a, b in itertools.pairwise(lrs[3:]))  # decays monotonically


@pytest.mark.parametrize("kwargs, message", [
    (lambda: DataConfig(docs=0), "--docs"),
    (lambda: OptimConfig(lr=0), "lr > 0"),
    (lambda: GoldfishConfig(strategy="md5"), "strategy"),
    (lambda: RunConfig(steps=3, epochs=2), "not both"),
    (lambda: RunConfig(overlap="fast"), "overlap"),
    (lambda: RunConfig(eval_every=-1), "eval_every >= 0"),
])
def test_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        kwargs()


def test_resume_continues_exactly(tmp_path):
    """6 straight steps == 3 steps, checkpoint, fresh trainer resumed from it, 3 more steps."""
    straight = make_trainer(one_rank(), steps=6)
    expected = run(straight)
    first = make_trainer(one_rank(), steps=6)
    for _ in range(3):
        first.train_step()
    first.save(str(tmp_path / "ck"), keep=3, is_main=True)
    second = make_trainer(one_rank(), steps=6)
    assert second.resume(str(tmp_path / "ck")) == 3
    resumed = run(second)
    keys = ("step", "loss", "loss_all", "loss_dropped", "grad_norm", "lr", "num_kept")
    assert [{k: r[k] for k in keys} for r in resumed] == \
        [{k: r[k] for k in keys} for r in expected[3:]]
    assert resumed[-1]["val_loss"] == expected[-1]["val_loss"]
    for name, p in second.model.shards().items():
        assert torch.equal(p, straight.model.shards()[name]), name


def test_resume_from_an_empty_directory_starts_fresh(tmp_path):
    trainer = make_trainer(one_rank(), steps=2)
    assert trainer.resume(str(tmp_path / "none")) is None and trainer.step == 0


def test_resume_follows_the_checkpoint_config(tmp_path):
    """resume() with no directory: the trainer's own CheckpointConfig decides (the CLI's
    --checkpoint-dir/--resume); run() saves there by default."""
    trainer = make_trainer(one_rank(), steps=2)
    trainer.checkpoint = CheckpointConfig(dir=str(tmp_path))
    assert trainer.resume() is None  # resume=False: never reads
    assert "checkpoint" in run(trainer)[-1]
    again = make_trainer(one_rank(), steps=3)
    again.checkpoint = CheckpointConfig(dir=str(tmp_path))
    assert again.resume() is None and again.step == 0
    again.checkpoint = CheckpointConfig(dir=str(tmp_path), resume=True)
    assert again.resume() == 2 and [r["step"] for r in run(again)] == [3]


def test_a_parallel_state_without_the_llm_groups_is_refused():
    from common.grid import ProcessGrid
    from common.parallel import ParallelState

    with pytest.raises(ValueError, match="AXIS_SETS"):
        make_trainer(ParallelState.single(ProcessGrid.axonn(1, 1, 1, 1)))


def test_loop_checkpoints_every_n_steps_and_keeps_k(tmp_path):
    trainer = make_trainer(one_rank(), steps=5)
    rows = run(trainer, checkpoint=CheckpointConfig(dir=str(tmp_path), every=2, keep=2))
    assert [("checkpoint" in r) for r in rows] == [False, True, False, True, True]
    assert sorted(os.listdir(tmp_path)) == ["step-00000004", "step-00000005"]  # keep = 2
    assert "val_loss" in rows[-1] and all("val_loss" not in r for r in rows[:-1])
    assert checkpoint.open_checkpoint(tmp_path).step == 5


def test_preemption_checkpoints_and_stops(tmp_path):
    trainer = make_trainer(one_rank(), steps=5)
    rows = run(trainer, checkpoint=CheckpointConfig(dir=str(tmp_path)),
               should_stop=lambda: trainer.step >= 2)
    assert [r["step"] for r in rows] == [1, 2] and rows[-1]["preempted"]
    assert "val_loss" in rows[-1] and "checkpoint" in rows[-1]
    assert checkpoint.open_checkpoint(tmp_path).step == 2


# ----------------------------------------------------------------- overlap, 4 ranks
def overlap_runs(ctx):
    """Per rank: OVERLAP_STEPS steps on OVERLAP_GRID with every overlap on, then off: the
    rows, and the final full weights (rank 0)."""
    out = {}
    for overlap in ("all", "none"):
        trainer = make_trainer(on_grid(ctx, OVERLAP_GRID), steps=OVERLAP_STEPS,
                               overlap=overlap)
        rows = run(trainer)
        weights = trainer.model.full_state_dict()  # collective
        out[overlap] = {"rows": rows, "weights": weights if ctx.rank == 0 else None}
    return out


@pytest.mark.slow
def test_overlap_on_and_off_train_bit_for_bit_and_overlap_really_runs(four_ranks):
    for rank, result in enumerate(four_ranks):
        on, off = result["overlap"]["all"]["rows"], result["overlap"]["none"]["rows"]
        for a, b in zip(on, off, strict=True):
            tag = f"rank {rank} step {a['step']}"
            for key in ("loss", "loss_all", "loss_dropped", "grad_norm", "comm_bytes"):
                assert a[key] == b[key], f"{tag}: {key}"
            # every switch took effect on every step (OAR over row, ORS and OAG over depth) ...
            assert all(n > 0 for n in a["overlapped"].values()), f"{tag}: {a['overlapped']}"
            # ... and nothing overlapped with the switches off
            assert b["overlapped"] == {"oar": 0, "ors": 0, "oag": 0}, tag
        assert on[-1]["val_loss"] == off[-1]["val_loss"]
    weights_on = four_ranks[0]["overlap"]["all"]["weights"]
    weights_off = four_ranks[0]["overlap"]["none"]["weights"]
    assert set(weights_on) == set(weights_off)
    for name, w in weights_on.items():
        assert torch.equal(w, weights_off[name]), name


# ----------------------------------------------------------------- 8 ranks track 1
def train_on_grids(ctx, tmp):
    """Per rank: TRAIN_STEPS steps on each of TRAIN_GRIDS, and a sharded checkpoint under
    ``tmp`` after half of them on the first grid."""
    out = {"train": {}}
    for grid_text in TRAIN_GRIDS:
        trainer = make_trainer(on_grid(ctx, grid_text))
        history = []
        for _ in range(TRAIN_STEPS):
            history.append(trainer.train_step())
            if trainer.step == TRAIN_STEPS // 2 and grid_text == TRAIN_GRIDS[0]:
                out["checkpoint"] = trainer.save(f"{tmp}/ck", keep=1, is_main=True)
        history[-1].update(trainer.evaluate())
        out["train"][grid_text] = history
    return out


def run_trainer(trainer, steps):
    rows = []
    while trainer.step < steps:
        rows.append(trainer.train_step())
    rows[-1].update(trainer.evaluate())
    return rows


@pytest.mark.slow
@pytest.mark.cross_shape
def test_training_on_8_ranks_tracks_1_rank(eight_ranks):
    """The grids' products and all-reduces sum in other orders than one rank's, so the runs
    agree to rounding carried through 20 AdamW steps: 1e-4 is measured slack, not a derived
    bound (a step's update can amplify a rounding difference)."""
    serial_rows = run_trainer(make_trainer(one_rank()), TRAIN_STEPS)
    assert serial_rows[-1]["loss"] < 0.8 * serial_rows[0]["loss"]  # it learns
    assert serial_rows[0]["num_dropped"] > 0
    for grid_text in TRAIN_GRIDS:
        for rank, result in enumerate(eight_ranks):
            rows = result["train"][grid_text]
            for a, b in zip(serial_rows, rows, strict=True):
                tag = f"grid {grid_text} rank {rank} step {a['step']}"
                for key in ("loss", "loss_all", "loss_dropped", "grad_norm"):
                    assert abs(a[key] - b[key]) <= 1e-4 * abs(a[key]), f"{tag}: {key}"
                assert (a["num_kept"], a["num_dropped"]) == (b["num_kept"], b["num_dropped"])
            assert abs(rows[-1]["val_loss"] - serial_rows[-1]["val_loss"]) <= \
                1e-4 * serial_rows[-1]["val_loss"]


@pytest.mark.slow
@pytest.mark.cross_shape  # 8 ranks' steps against one rank's: to rounding, as above
def test_checkpoint_from_8_ranks_continues_on_1_rank(eight_ranks):
    from common import sharded

    path = eight_ranks[0]["checkpoint"]
    # sharded: each of the 8 ranks wrote its own file, none much above a 1/8 share
    files = sharded.load(path).manifest["files"]
    sizes = [v["bytes"] for k, v in files.items() if k.startswith("shard-")]
    assert len(sizes) == 8 and max(sizes) < 1.5 * sum(sizes) / 8, sizes
    trainer = make_trainer(one_rank())
    assert trainer.resume(str(path).rsplit("/", 1)[0]) == TRAIN_STEPS // 2
    resumed = run_trainer(trainer, TRAIN_STEPS)
    parallel = eight_ranks[0]["train"][TRAIN_GRIDS[0]][TRAIN_STEPS // 2 :]
    for a, b in zip(resumed, parallel, strict=True):
        assert a["step"] == b["step"]
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(b["loss"]), a["step"]


def test_run_config_is_keyword_only():
    with pytest.raises(TypeError):
        RunConfig(3)  # type: ignore[misc]
    assert dataclasses.fields(RunConfig)[0].kw_only
