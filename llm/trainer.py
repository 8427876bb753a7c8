"""One rank's training state, its step and the training loop (the CLI is ``llm.train``).

The same shape as :mod:`plexus.trainer`: :class:`Trainer` sets up one rank's share of a run
(constructor: shards, optimizer, data position), continues from a checkpoint
(:meth:`Trainer.resume`), takes one optimizer step (:meth:`Trainer.train_step`) and measures
the held-out loss (:meth:`Trainer.evaluate`); :func:`run` is the loop::

    parallel = ParallelState.create(ctx, grid, AXIS_SETS)   # common.parallel, llm.parallel.gpt
    trainer = Trainer(tiny(), DataConfig(), OptimConfig(), GoldfishConfig(), RunConfig(),
                      parallel, checkpoint=CheckpointConfig(dir="runs/a", resume=True))
    trainer.resume()                                        # if the checkpoint config says so
    rows = run(trainer, on_row=print)

The configs live in :mod:`llm.config` (and :class:`common.run.CheckpointConfig`).

Every rank draws the same global batches (the iterator is deterministic), computes the
goldfish masks and the global token counts itself, and keeps its rows (split over data and
depth). The objective is the mean loss over the kept tokens of the global batch of the step
(all micro-batches of gradient accumulation together).
"""

from __future__ import annotations

import math
import random
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from common.collectives import all_reduce
from common.comm_stats import CommStats
from common.exchange import any_rank
from common.parallel import ParallelState
from common.run import CheckpointConfig
from llm import checkpoint as ckpt
from llm.config import (
    DEFAULT_STEPS,
    IGNORE,
    DataConfig,
    GoldfishConfig,
    OptimConfig,
    Overlap,
    PrecisionConfig,
    RunConfig,
)
from llm.data.batches import (
    BatchIterator,
    encode_stream,
    load_documents,
    split_documents,
    truncate_docs,
)
from llm.data.streams import open_stream, split_tokens
from llm.data.tokenizers import load_tokenizer
from llm.goldfish import drop_mask
from llm.loss import goldfish_sums, token_losses
from llm.mfu import mfu, peak_tflops
from llm.model import GPT, GPTConfig
from llm.parallel.gpt import AXIS_SETS, ParallelGPT, batch_shard
from llm.parallel.layout import is_tensor_parallel
from llm.precision import compute_dtype


def lr_at(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Learning rate of optimizer step ``step`` (1-based): linear warmup, then cosine."""
    if step <= cfg.warmup_steps:
        return cfg.lr * step / max(cfg.warmup_steps, 1)
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress))


def make_data(cfg: DataConfig, vocab_size: int | None = None
              ) -> tuple[BatchIterator, list[tuple[Tensor, Tensor]]]:
    """The training iterator and the fixed held-out batches (see :class:`DataConfig`);
    ``vocab_size``: the model's, which the tokenizer and a token file must fit."""
    tok = load_tokenizer(cfg.tokenizer, vocab_size=vocab_size)
    held: Any
    if cfg.source == "tokens" or (cfg.token_cache and cfg.docs is None):
        stream = open_stream(cfg.paths or (), tok, cache_dir=cfg.token_cache,
                             split="files" if cfg.source == "tokens" else cfg.source,
                             vocab_size=vocab_size) if cfg.paths else None
        if stream is None:
            raise ValueError("--token-cache needs text files (--text)")
        train_tokens, held = split_tokens(stream, cfg.val_fraction)
        train = BatchIterator(train_tokens, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                              seed=cfg.seed)
    else:
        docs = load_documents(cfg.source, cfg.paths or None)
        if cfg.docs is not None:
            train = BatchIterator(truncate_docs(docs, cfg.docs, cfg.seq_len, tok),
                                  mode="documents", batch_size=cfg.batch_size,
                                  seq_len=cfg.seq_len, seed=cfg.seed, ignore_index=IGNORE)
            held_out = docs[cfg.docs :]
        else:
            train_docs, held_out = split_documents(docs, cfg.val_fraction, cfg.seed)
            train = BatchIterator(encode_stream(train_docs, tok), batch_size=cfg.batch_size,
                                  seq_len=cfg.seq_len, seed=cfg.seed)
        held = encode_stream(held_out, tok)
    if not cfg.eval_batches or len(held) <= cfg.seq_len:
        return train, []
    val = BatchIterator(held, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                        seed=cfg.seed + 1)
    return train, [next(val) for _ in range(cfg.eval_batches)]


# the settings a resumed run must share with its checkpoint, (config, its fields; None: all):
# its numbers would otherwise silently be another run's (a goldfish loss dropped, other
# batches, another rounding); the data's paths and caches may move, and how many batches are
# evaluated may change
SAME_ON_RESUME = (("goldfish", None), ("seed", None), ("precision", ("precision",)),
                  ("data", ("source", "tokenizer", "docs", "seq_len", "batch_size",
                            "val_fraction", "seed")))


class Trainer:
    """This rank's share of a run: model shards, AdamW, data and the step counter.

    Args:
        model_config: the GPT's sizes; each rank draws only its shards of the initial
            weights, keyed by ``seed`` (the same model on every grid: ``GPT(config, seed=seed)``).
        data, optim, goldfish, run: the configs (:mod:`llm.config`).
        parallel: the grid, its :data:`~llm.parallel.gpt.AXIS_SETS` groups, the device and
            the transport (``ParallelState.create(ctx, grid, AXIS_SETS)``, or
            ``ParallelState.single(grid, AXIS_SETS)`` on one process).
        precision: bf16 and activation checkpointing (default: fp32, none).
        checkpoint: where to save, how often, and whether :meth:`resume` continues.

    Raises:
        ValueError: the sequences do not fit the model, or ``parallel`` lacks a group.
    """

    def __init__(self, model_config: GPTConfig, data: DataConfig, optim: OptimConfig,
                 goldfish: GoldfishConfig, run: RunConfig, parallel: ParallelState, *,
                 seed: int = 0, precision: PrecisionConfig | None = None,
                 checkpoint: CheckpointConfig | None = None) -> None:
        if data.seq_len > model_config.max_seq_len:
            raise ValueError(f"--seq-len {data.seq_len} exceeds the model's max_seq_len="
                             f"{model_config.max_seq_len}")
        if goldfish.k and goldfish.strategy != "static" and goldfish.h > data.seq_len:
            raise ValueError(f"--goldfish-h {goldfish.h} exceeds --seq-len {data.seq_len}: no "
                             "window of h tokens fits in a sequence, so the goldfish loss "
                             "would drop nothing; lower --goldfish-h or raise --seq-len")
        if goldfish.k and goldfish.strategy == "static" and goldfish.start >= data.seq_len:
            raise ValueError(f"the static goldfish start {goldfish.start} is not below "
                             f"--seq-len {data.seq_len}: it would drop nothing")
        names = ["+".join((axes,) if isinstance(axes, str) else axes) for axes in AXIS_SETS]
        missing = [name for name in names if name not in parallel.groups]
        if missing:
            raise ValueError(f"the parallel state lacks the groups {missing}: create it with "
                             "axis_sets=llm.parallel.gpt.AXIS_SETS")
        self.model_config, self.data_cfg, self.optim_cfg = model_config, data, optim
        self.goldfish, self.run_cfg, self.seed = goldfish, run, seed
        self.parallel, self.groups = parallel, parallel.groups
        self.precision = PrecisionConfig() if precision is None else precision
        self.checkpoint = checkpoint or CheckpointConfig()
        self.transport = parallel.transport  # job-wide agreements and checkpoints go over MPI
        self.device = parallel.device
        self.stats = CommStats()
        torch.manual_seed(seed)
        # built on meta: each rank draws only its shards of the weights keyed by the seed
        gpt = GPT(model_config, device="meta",
                  compute_dtype=compute_dtype(self.precision.precision),
                  activation_checkpointing=self.precision.activation_checkpointing,
                  neftune_alpha=optim.neftune_alpha)
        self.model = ParallelGPT(gpt, self.groups, seed=seed, overlap=Overlap.parse(run.overlap),
                                 stats=self.stats, device=self.device)
        if self.precision.compile:
            compile_blocks(self.model)
        decay = [p for n, p in self.model.shards().items() if len(self.model.specs[n].shape) > 1]
        rest = [p for n, p in self.model.shards().items() if len(self.model.specs[n].shape) <= 1]
        # torch's fused AdamW on a GPU (one kernel per tensor group); the CPU keeps the
        # for-each implementation, whose numbers the CPU runs have always had
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": optim.weight_decay},
             {"params": rest, "weight_decay": 0.0}], lr=optim.lr, betas=optim.betas,
            fused=True if self.device.type == "cuda" else None)
        # MFU (llm.mfu): the model's FLOPs of a token, the device's peak (None: not logged)
        self.peak_tflops = peak_tflops(self.device, self.precision.precision, run.peak_tflops)
        self.flops_per_token = model_config.flops_per_token(data.seq_len)
        self.train_iter, self.val_batches = make_data(data, model_config.vocab_size)
        per_epoch = self.train_iter.steps_per_epoch / run.grad_accum
        self.total_steps = (run.steps if run.steps is not None else
                            math.ceil(run.epochs * per_epoch) if run.epochs else DEFAULT_STEPS)
        self.step = 0
        # the Hugging Face model the run began from (init_from), recorded in its checkpoints
        self.source: dict[str, Any] | None = None

    def _local(self, batch: Tensor, pad: int | bool) -> Tensor:
        return batch_shard(batch, self.groups, pad).to(self.device)

    def train_step(self) -> dict[str, Any]:
        """One optimizer step over ``grad_accum`` micro-batches; returns the logged row."""
        start = time.perf_counter()
        self.stats.reset()
        self.model.overlapped.reset()
        micro = [next(self.train_iter) for _ in range(self.run_cfg.grad_accum)]
        masks = [drop_mask(y, self.goldfish) for _, y in micro]
        num_kept = sum(int(((y != IGNORE) & ~m).sum()) for (_, y), m in zip(micro, masks))
        num_dropped = sum(int(((y != IGNORE) & m).sum()) for (_, y), m in zip(micro, masks))
        self.optimizer.zero_grad(set_to_none=True)
        sums = torch.zeros(2, device=self.device)  # kept, dropped loss sums on this rank
        # every micro-batch's tokens, targets and mask on the device before any compute: a
        # copy from pageable host memory waits for the device's queue to drain, so one made
        # between a forward and its loss would leave a GPU idle while the host queues the rest
        local = [(self._local(x, 0), self._local(y, IGNORE), self._local(m, True))
                 for (x, y), m in zip(micro, masks)]
        for i, (x, y, m) in enumerate(local):
            # NEFTune's noise keyed by (seed, step, global row): the same on every grid
            self.model.set_noise(step=self.step, row_offset=i * self.data_cfg.batch_size,
                                 seed=self.seed)
            out = goldfish_sums(self.model(x), y, m, num_kept=num_kept,
                                vocab_size=self.model_config.vocab_size, row=self.groups["row"],
                                ignore_index=IGNORE, stats=self.stats)
            out.loss.backward()
            self.model.finish_backward()
            sums += torch.stack((out.kept_sum, out.dropped_sum))
        self.model.sync_gradients()
        grad_norm = self.model.clip_grad_norm_(self.optim_cfg.grad_clip)  # read after step()
        lr = lr_at(self.step + 1, self.total_steps, self.optim_cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.step += 1
        kept, dropped = all_reduce(sums, self.groups["data+depth"], stats=self.stats).tolist()
        if not math.isfinite(kept):
            raise FloatingPointError(f"loss became {kept} at step {self.step}; lower --lr")
        seconds = time.perf_counter() - start
        tokens = sum(x.numel() for x, _ in micro)
        return {"step": self.step, "loss": kept / max(num_kept, 1),
                "loss_all": (kept + dropped) / max(num_kept + num_dropped, 1),
                "loss_dropped": dropped / max(num_dropped, 1), "num_kept": num_kept,
                "num_dropped": num_dropped, "lr": lr, "grad_norm": float(grad_norm),
                "epoch": self.train_iter.epoch, "tokens": tokens, "step_s": seconds,
                "tokens_per_s": tokens / seconds, "comm_s": self.stats.total_seconds,
                "comm_bytes": self.stats.total_bytes, "overlapped": asdict(self.model.overlapped),
                **({} if self.peak_tflops is None else {"mfu": mfu(
                    self.flops_per_token, tokens, seconds, self.parallel.grid.num_ranks,
                    self.peak_tflops)})}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean loss and perplexity over every token of the held-out batches ({} if none)."""
        if not self.val_batches:
            return {}
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss sum, tokens
        for x, y in self.val_batches:
            y_local = self._local(y, IGNORE)
            per_token = token_losses(self.model(self._local(x, 0)), y_local,
                                     vocab_size=self.model_config.vocab_size,
                                     row=self.groups["row"], ignore_index=IGNORE)
            sums += torch.stack((per_token.sum().double(), (y_local != IGNORE).sum().double()))
        loss_sum, count = all_reduce(sums, self.groups["data+depth"]).tolist()
        val_loss = loss_sum / max(count, 1)
        return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}

    # ----------------------------------------------------------------- checkpoints
    @torch.no_grad()
    def init_from(self, source: Any) -> None:
        """Start from pretrained weights: ``source`` has ``config`` and ``read(name, slab)``
        (an :class:`llm.hf.llama.HFCheckpoint`, a :class:`common.sharded.ShardedCheckpoint`
        adapter); each rank reads only its slices.

        Raises:
            ValueError: the weights belong to another model.
        """
        if source.config != self.model_config:
            raise ValueError(f"the initial weights are of another model: {source.config} vs "
                             f"this run's {self.model_config}")
        for name, p in self.model.shards().items():
            p.copy_(source.read(name, self.model.slab(name)).to(p.dtype))
        hf_config = getattr(source, "hf_config", None)
        if hf_config is not None:
            self.source = {"hf_dir": str(Path(source.path).resolve()), "hf_config": hf_config}

    def meta(self) -> dict[str, Any]:
        """What a checkpoint records about the run besides tensors (JSON)."""
        return {"model_config": asdict(self.model_config),
                "configs": {"data": asdict(self.data_cfg), "optim": asdict(self.optim_cfg),
                            "goldfish": asdict(self.goldfish),
                            "precision": asdict(self.precision), "seed": self.seed},
                # the Hugging Face model it began from (llm.convert export takes its token ids)
                **({"source": self.source} if self.source else {})}

    def resume(self, directory: str | None = None) -> int | None:
        """Continue from the newest intact checkpoint under ``directory`` (default: the
        checkpoint config's, when it says ``resume``), written on any grid; each rank reads
        only its slices. Its step, or None if there is none yet. Collective.

        Raises:
            ValueError: the checkpoint holds another model.
            common.checkpoint.CheckpointError: damaged, foreign or of another format.
        """
        if directory is None and self.checkpoint.resume:
            directory = self.checkpoint.dir
        if not directory or not ckpt.has_checkpoint(directory):
            return None
        saved = ckpt.open_checkpoint(directory, group=self.transport)
        changed = self._changed_settings(saved.meta.get("configs", {}))
        if changed["refused"]:
            raise ValueError(f"cannot resume from {saved.path}: it was trained with other "
                             f"settings ({'; '.join(changed['refused'])}); give the saved "
                             "settings again (its manifest.json holds them under "
                             "meta.configs), or start a new run in another --checkpoint-dir")
        if changed["optimizer"] and self.parallel.is_main:
            warnings.warn(f"resuming from {saved.path} with other optimizer settings than "
                          f"it was trained with: {'; '.join(changed['optimizer'])}",
                          stacklevel=2)
        if self.source is None:  # the pretrained model the run began from, kept on
            self.source = saved.meta.get("source")
        state = ckpt.load_into(saved, self.model, self.optimizer)
        self.train_iter.load_state_dict(state["data"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        self.step = int(state["step"])
        return self.step

    def _changed_settings(self, saved: dict[str, Any]) -> dict[str, list[str]]:
        """How this run's configs differ from a checkpoint's ``meta["configs"]``: under
        ``refused`` the settings it must share (:data:`SAME_ON_RESUME`), under ``optimizer`` the
        optimizer's (which a user may change on purpose: warned); each ``name saved -> now``.
        A checkpoint without configs (written by other tools) is not compared."""
        now = self.meta()["configs"]
        out: dict[str, list[str]] = {"refused": [], "optimizer": []}

        def compare(section: str, fields: tuple[str, ...] | None, into: str) -> None:
            if section not in saved:
                return
            old, new = saved[section], now[section]
            if not isinstance(new, dict):  # a plain value (the seed)
                if old != new:
                    out[into].append(f"{section} {old} -> {new}")
                return
            for field in fields or tuple(new):
                # (JSON keeps tuples as lists)
                before, after = old.get(field), new[field]
                if (list(after) if isinstance(after, tuple) else after) != before:
                    out[into].append(f"{section}.{field} {before} -> {after}")

        for section, fields in SAME_ON_RESUME:
            compare(section, fields, "refused")
        compare("optim", None, "optimizer")
        return out

    def save(self, directory: str, *, keep: int = 3, is_main: bool | None = None
             ) -> str | None:
        """Checkpoint under ``directory`` keeping the newest ``keep``; collective (each rank
        writes its own shards); the main rank (``is_main``, default: rank 0) gets the step
        directory's path."""
        is_main = self.parallel.is_main if is_main is None else is_main
        state = {"step": self.step, "data": self.train_iter.state_dict(),
                 "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}
        path = ckpt.save(directory, step=self.step, model=self.model, optimizer=self.optimizer,
                         meta=self.meta(), state=state, keep=keep, group=self.transport)
        return str(path) if is_main else None


def compile_blocks(model: ParallelGPT) -> None:
    """``torch.compile`` each transformer block of ``model`` in place (``--compile``,
    :meth:`llm.model.GPT.compile_blocks`), where the blocks are plain modules.

    Raises:
        ValueError: the grid is tensor parallel (its layers' collectives are custom autograd
            functions that dynamo would split the graph at).
    """
    if is_tensor_parallel(model.sizes):
        grid = "x".join(str(model.sizes[a]) for a in model.sizes)
        raise ValueError(f"--compile runs on grids without tensor parallelism (depth = row = "
                         f"col = 1), not on {grid}: drop --compile, or put the ranks on the "
                         "data axis")
    model.model.compile_blocks()


def run(trainer: Trainer, *, checkpoint: CheckpointConfig | None = None,
        on_row: Callable[[dict[str, Any]], None] | None = None,
        should_stop: Callable[[], bool] | None = None) -> list[dict[str, Any]]:
    """The training loop: step, evaluate, checkpoint, report; returns the logged rows.

    Every rank calls it, after :meth:`Trainer.resume` when resuming. ``checkpoint``: default
    the trainer's. ``should_stop`` (a preemption flag) is agreed over all ranks after every
    step; when it fires, the loop checkpoints (if ``checkpoint.dir``) and returns early, the
    last row marked ``"preempted"``. The main rank's rows name the checkpoints they wrote.
    """
    ck, eval_every = checkpoint or trainer.checkpoint, trainer.run_cfg.eval_every
    history = []
    while trainer.step < trainer.total_steps:
        row = trainer.train_step()
        stop = should_stop is not None and any_rank(should_stop(), trainer.device,
                                                    trainer.transport)
        last = stop or trainer.step == trainer.total_steps
        if last or (eval_every and trainer.step % eval_every == 0):
            row.update(trainer.evaluate())
        if ck.dir and (last or (ck.every and trainer.step % ck.every == 0)):
            path = trainer.save(ck.dir, keep=ck.keep)
            if path is not None:
                row["checkpoint"] = path
        if stop:
            row["preempted"] = True
        history.append(row)
        if on_row is not None:
            on_row(row)
        if stop:
            break
    return history
