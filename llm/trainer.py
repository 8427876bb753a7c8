"""One rank's training state, its step and the training loop.

Configs (one per component, keyword-only, validated on construction): the model's
:class:`~llm.model.GPTConfig`, :class:`DataConfig`, :class:`OptimConfig` (AdamW with warmup +
cosine), :class:`GoldfishConfig`, :class:`RunConfig` (length, cadence, overlap),
:class:`PrecisionConfig` (bf16, activation checkpointing) and
:class:`common.run.CheckpointConfig`. :class:`Trainer` holds one rank's shards, optimizer and
data position; :func:`run` is the loop. The CLI on top is ``python -m llm.train``.

Every rank draws the same global batches (the iterator is deterministic), computes the
goldfish masks and the global token counts itself, and keeps its rows (split over data and
depth). The objective is the mean loss over the kept tokens of the global batch of the step
(all micro-batches of gradient accumulation together).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from common.collectives import all_reduce
from common.comm_stats import CommStats
from common.dist import any_rank
from common.grid import AxisGroup
from common.mpi import MPITransport
from common.run import CheckpointConfig
from llm import checkpoint as ckpt
from llm.data import BatchIterator, encode_stream, load_documents, split_documents, truncate_docs
from llm.goldfish import STRATEGIES, goldfish_mask
from llm.loss import goldfish_sums, token_losses
from llm.model import GPT, GPTConfig
from llm.parallel import ParallelGPT, batch_shard
from llm.precision import PRECISIONS, compute_dtype
from llm.streams import open_stream, split_tokens
from llm.tokenizer import load_tokenizer
from llm.tp import Overlap

IGNORE = -100
DEFAULT_STEPS = 200  # when neither steps nor epochs is given


@dataclass(kw_only=True)
class DataConfig:
    """Text and batches.

    Attributes:
        source: ``pydoc`` (built in), ``files`` (one document per file; ``.jsonl`` files:
            one per line's ``text``), ``paragraphs``, or ``tokens`` (one pre-tokenised
            ``.bin``/``.npy`` file, memory-mapped: ``python -m llm.tokenize`` writes one).
        paths: text files for ``files`` / ``paragraphs``; the token file for ``tokens``.
        tokenizer: ``bytes`` or a Hugging Face ``tokenizer.json`` (a path or a model
            directory holding one; :func:`llm.tokenizer.load_tokenizer`).
        token_cache: stream mode: tokenize the text once into this directory and
            memory-map it (:func:`llm.streams.open_stream`) instead of holding it in memory.
        docs: memorization setting: train on the first ``docs`` documents only, each cut to
            ``seq_len + 1`` tokens, one sample per document; held-out text is the rest.
            None: a stream of all training documents (a seeded 10% is held out).
        seq_len: targets per sample (T).
        batch_size: global samples per micro-batch (split over data x depth).
        val_fraction: share of documents held out in stream mode.
        eval_batches: held-out batches per evaluation.
        seed: seeds the batch order, the split and the held-out windows.
    """

    source: str = "pydoc"
    paths: tuple[str, ...] = ()
    tokenizer: str = "bytes"
    token_cache: str | None = None
    docs: int | None = None
    seq_len: int = 128
    batch_size: int = 16
    val_fraction: float = 0.1
    eval_batches: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        self.paths = tuple(str(p) for p in self.paths)
        if self.seq_len < 1 or self.batch_size < 1 or self.eval_batches < 0:
            raise ValueError(f"need seq_len >= 1, batch_size >= 1, eval_batches >= 0; got "
                             f"{self.seq_len}, {self.batch_size}, {self.eval_batches}")
        if self.docs is not None and self.docs < 1:
            raise ValueError(f"--docs must be >= 1, got {self.docs}")
        if self.source == "tokens" and (len(self.paths) != 1 or self.docs is not None):
            raise ValueError("a token file is one stream: give exactly one file, and no --docs "
                             "(it has no documents)")


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW with linear warmup and cosine decay to ``min_lr_ratio * lr``; global-norm clip.

    Weight decay applies to matrices (Linears, embedding), not to RMSNorm weights.
    ``neftune_alpha > 0``: NEFTune (Jain et al. 2023), uniform noise scaled by
    ``alpha / sqrt(T d)`` on the token embeddings in training, the same on every grid.
    """

    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    neftune_alpha: float = 0.0

    def __post_init__(self) -> None:
        if not self.lr > 0 or not 0 <= self.min_lr_ratio <= 1 or self.warmup_steps < 0:
            raise ValueError(f"need lr > 0, 0 <= min_lr_ratio <= 1, warmup_steps >= 0; got "
                             f"{self.lr}, {self.min_lr_ratio}, {self.warmup_steps}")
        if self.neftune_alpha < 0:
            raise ValueError(f"--neftune-alpha must be >= 0, got {self.neftune_alpha}")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError(f"weight_decay and grad_clip must be >= 0, got "
                             f"{self.weight_decay}, {self.grad_clip}")


@dataclass(kw_only=True)
class GoldfishConfig:
    """Goldfish loss (llm-4d-goldfish.md section 4); ``k = 0`` is the standard loss."""

    k: int = 0
    h: int = 13
    strategy: str = "hash"
    start: int = 0

    def __post_init__(self) -> None:
        if self.k < 0 or self.h < 1 or self.strategy not in STRATEGIES:
            raise ValueError(f"goldfish needs k >= 0 (0 = off), h >= 1 and a strategy in "
                             f"{STRATEGIES}; got k={self.k}, h={self.h}, {self.strategy!r}")

    def mask(self, targets: Tensor) -> Tensor:
        """bool [B, T], True = dropped (all False when k = 0)."""
        if self.k == 0:
            return torch.zeros_like(targets, dtype=torch.bool)
        return goldfish_mask(targets, self.k, self.h, self.strategy, self.start)


@dataclass(kw_only=True)
class RunConfig:
    """Length and cadence of a run (checkpoint cadence: :class:`common.run.CheckpointConfig`).

    Attributes:
        steps: optimizer steps; or ``epochs`` passes over the training samples (not both;
            neither: ``DEFAULT_STEPS``).
        grad_accum: micro-batches per optimizer step.
        eval_every, log_every: in steps (eval 0: only at the end; log 0: never).
        overlap: communication overlap, ``all``, ``none`` or a list of ``oar,ors,oag``.
    """

    steps: int | None = None
    epochs: float | None = None
    grad_accum: int = 1
    eval_every: int = 0
    log_every: int = 10
    overlap: str = "all"

    def __post_init__(self) -> None:
        if self.steps is not None and self.epochs is not None:
            raise ValueError("give --steps or --epochs, not both")
        if (self.steps is not None and self.steps < 0) or (
                self.epochs is not None and self.epochs <= 0) or self.grad_accum < 1:
            raise ValueError(f"need steps >= 0, epochs > 0, grad_accum >= 1; got "
                             f"{self.steps}, {self.epochs}, {self.grad_accum}")
        if self.eval_every < 0 or self.log_every < 0:
            raise ValueError(f"need eval_every >= 0 and log_every >= 0; got "
                             f"{self.eval_every}, {self.log_every}")
        Overlap.parse(self.overlap)


@dataclass(kw_only=True)
class PrecisionConfig:
    """Numerics and memory of the forward and backward (:mod:`llm.precision`).

    Attributes:
        precision: ``fp32``, or ``bf16``: bf16 compute and communication, float32 master
            weights, optimizer state, gradients and loss.
        activation_checkpointing: keep only each transformer block's input and recompute the
            block in backward (its collectives included); fp32 results are bit for bit those
            without it.
    """

    precision: str = "fp32"
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision {self.precision!r}: choose one of "
                             f"{', '.join(PRECISIONS)}")

    def __str__(self) -> str:
        return self.precision + (", activation checkpointing" if self.activation_checkpointing
                                 else "")


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


class Trainer:
    """This rank's share of a run: model shards, AdamW, data and the step counter.

    Args:
        model_config: the GPT's sizes; each rank draws only its shards of the initial
            weights, keyed by ``seed`` (the same model on every grid: ``GPT(config, seed=seed)``).
        groups: from :func:`llm.parallel.make_groups` (any grid, 1x1x1x1 included).
        device: where the shards and batches live.
        precision: bf16 and activation checkpointing (default: fp32, none).
    """

    def __init__(self, model_config: GPTConfig, data: DataConfig, optim: OptimConfig,
                 goldfish: GoldfishConfig, run: RunConfig, groups: Mapping[str, AxisGroup],
                 *, seed: int = 0, device: torch.device | str = "cpu",
                 precision: PrecisionConfig | None = None,
                 transport: MPITransport | None = None) -> None:
        if data.seq_len > model_config.max_seq_len:
            raise ValueError(f"--seq-len {data.seq_len} exceeds the model's max_seq_len="
                             f"{model_config.max_seq_len}")
        self.model_config, self.data_cfg, self.optim_cfg = model_config, data, optim
        self.goldfish, self.run_cfg, self.groups, self.seed = goldfish, run, groups, seed
        self.precision = PrecisionConfig() if precision is None else precision
        self.transport = transport  # job-wide agreements and checkpoints go over MPI with it
        self.device = torch.device(device)
        self.stats = CommStats()
        torch.manual_seed(seed)
        # built on meta: each rank draws only its shards of the weights keyed by the seed
        gpt = GPT(model_config, device="meta",
                  compute_dtype=compute_dtype(self.precision.precision),
                  activation_checkpointing=self.precision.activation_checkpointing,
                  neftune_alpha=optim.neftune_alpha)
        self.model = ParallelGPT(gpt, groups, seed=seed, overlap=Overlap.parse(run.overlap),
                                 stats=self.stats, device=self.device)
        decay = [p for n, p in self.model.shards().items() if len(self.model.specs[n].shape) > 1]
        rest = [p for n, p in self.model.shards().items() if len(self.model.specs[n].shape) <= 1]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": optim.weight_decay},
             {"params": rest, "weight_decay": 0.0}], lr=optim.lr, betas=optim.betas)
        self.train_iter, self.val_batches = make_data(data, model_config.vocab_size)
        per_epoch = self.train_iter.steps_per_epoch / run.grad_accum
        self.total_steps = (run.steps if run.steps is not None else
                            math.ceil(run.epochs * per_epoch) if run.epochs else DEFAULT_STEPS)
        self.step = 0

    def _local(self, batch: Tensor, pad: int | bool) -> Tensor:
        return batch_shard(batch, self.groups, pad).to(self.device)

    def train_step(self) -> dict[str, Any]:
        """One optimizer step over ``grad_accum`` micro-batches; returns the logged row."""
        start = time.perf_counter()
        self.stats.reset()
        self.model.overlapped.reset()
        micro = [next(self.train_iter) for _ in range(self.run_cfg.grad_accum)]
        masks = [self.goldfish.mask(y) for _, y in micro]
        num_kept = sum(int(((y != IGNORE) & ~m).sum()) for (_, y), m in zip(micro, masks))
        num_dropped = sum(int(((y != IGNORE) & m).sum()) for (_, y), m in zip(micro, masks))
        self.optimizer.zero_grad(set_to_none=True)
        sums = torch.zeros(2, device=self.device)  # kept, dropped loss sums on this rank
        for i, ((x, y), m) in enumerate(zip(micro, masks)):
            # NEFTune's noise keyed by (seed, step, global row): the same on every grid
            self.model.set_noise(step=self.step, row_offset=i * self.data_cfg.batch_size,
                                 seed=self.seed)
            out = goldfish_sums(self.model(self._local(x, 0)), self._local(y, IGNORE),
                                self._local(m, True), num_kept=num_kept,
                                vocab_size=self.model_config.vocab_size, row=self.groups["row"],
                                ignore_index=IGNORE, stats=self.stats)
            out.loss.backward()
            self.model.finish_backward()
            sums += torch.stack((out.kept_sum, out.dropped_sum))
        self.model.sync_gradients()
        grad_norm = self.model.clip_grad_norm_(self.optim_cfg.grad_clip)
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
                "num_dropped": num_dropped, "lr": lr, "grad_norm": grad_norm,
                "epoch": self.train_iter.epoch, "tokens": tokens, "step_s": seconds,
                "tokens_per_s": tokens / seconds, "comm_s": self.stats.total_seconds,
                "comm_bytes": self.stats.total_bytes, "overlapped": asdict(self.model.overlapped)}

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
        (an :class:`llm.hf.HFCheckpoint`, a :class:`common.sharded.ShardedCheckpoint`
        adapter); each rank reads only its slices.

        Raises:
            ValueError: the weights belong to another model.
        """
        if source.config != self.model_config:
            raise ValueError(f"the initial weights are of another model: {source.config} vs "
                             f"this run's {self.model_config}")
        for name, p in self.model.shards().items():
            p.copy_(source.read(name, self.model.slab(name)).to(p.dtype))

    def meta(self) -> dict[str, Any]:
        """What a checkpoint records about the run besides tensors (JSON)."""
        return {"model_config": asdict(self.model_config),
                "configs": {"data": asdict(self.data_cfg), "optim": asdict(self.optim_cfg),
                            "goldfish": asdict(self.goldfish),
                            "precision": asdict(self.precision), "seed": self.seed}}

    def resume(self, directory: str) -> int | None:
        """Load the newest intact checkpoint under ``directory`` (written on any grid; each
        rank reads only its slices); its step, or None if there is none yet. Collective.

        Raises:
            ValueError: the checkpoint holds another model.
            common.checkpoint.CheckpointError: damaged, foreign or of another format.
        """
        if not ckpt.has_checkpoint(directory):
            return None
        state = ckpt.load_into(ckpt.open_checkpoint(directory, group=self.transport), self.model,
                              self.optimizer)
        self.train_iter.load_state_dict(state["data"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        self.step = int(state["step"])
        return self.step

    def save(self, directory: str, *, keep: int, is_main: bool) -> str | None:
        """Checkpoint under ``directory`` keeping the newest ``keep``; collective (each rank
        writes its own shards); the main rank gets the step directory's path."""
        state = {"step": self.step, "data": self.train_iter.state_dict(),
                 "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}
        path = ckpt.save(directory, step=self.step, model=self.model, optimizer=self.optimizer,
                         meta=self.meta(), state=state, keep=keep, group=self.transport)
        return str(path) if is_main else None


def run(trainer: Trainer, *, checkpoint: CheckpointConfig | None = None, is_main: bool = True,
        on_row: Callable[[dict[str, Any]], None] | None = None,
        should_stop: Callable[[], bool] | None = None) -> list[dict[str, Any]]:
    """The training loop: step, evaluate, checkpoint, report; returns the logged rows.

    Every rank calls it, after :meth:`Trainer.resume` when resuming. ``should_stop`` (a
    preemption flag) is agreed over all ranks after every step; when it fires, the loop
    checkpoints (if ``checkpoint.dir``) and returns early, the last row marked ``"preempted"``.
    """
    ck, eval_every = checkpoint or CheckpointConfig(), trainer.run_cfg.eval_every
    history = []
    while trainer.step < trainer.total_steps:
        row = trainer.train_step()
        stop = should_stop is not None and any_rank(should_stop(), trainer.device,
                                                    trainer.transport)
        last = stop or trainer.step == trainer.total_steps
        if last or (eval_every and trainer.step % eval_every == 0):
            row.update(trainer.evaluate())
        if ck.dir and (last or (ck.every and trainer.step % ck.every == 0)):
            path = trainer.save(ck.dir, keep=ck.keep, is_main=is_main)
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
