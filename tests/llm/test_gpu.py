"""GPU tests of llm (``pytest -m gpu``; skipped without CUDA; ``make gpu-check`` runs them).

On ONE GPU, each against the CPU:

* training: the tiny trainer on one CUDA rank follows the CPU run and its checkpoint continues
  on the CPU; bf16, activation checkpointing and NEFTune follow their CPU runs; bf16 attention
  runs SDPA's flash kernels; compiled blocks follow the eager run; the CLI picks NCCL; with
  two GPUs a 2-rank NCCL run (row = 2) follows one CPU rank.
* the tensor-parallel layers with 4 ranks sharing cuda:0 over gloo (which carries CUDA
  tensors for the three collectives they use: all_reduce, all_gather_into_tensor,
  reduce_scatter_tensor; NCCL refuses two ranks on one GPU): loss and every gradient equal
  the serial CPU model's on four grids, and greedy generation its tokens.
* decoding on a CUDA model: sampling with a CPU generator (the seed draws the CPU's tokens),
  every decode-time method (full, topk, loki, sift) against its CPU run, Loki calibrated on
  CPU tokens, QuantSpec equal to plain greedy, ``load_model(device="cuda")``.
* the CLIs ``llm.sample``, ``llm.evaluate`` and ``llm.memorization`` with ``--device cuda``
  print what ``--device cpu`` prints.

CPU and CUDA kernels round differently, so numbers are compared with a tolerance and tokens
exactly (two logits within rounding of each other would be needed to flip one; the decode
methods' selections can flip at such near-ties, so their logits are compared step by step and
most steps must agree).
"""

import dataclasses
import json

import pytest
import torch

from common.collectives import all_reduce
from common.comm_stats import CommStats
from common.grid import AXONN_AXES, ProcessGrid
from llm import checkpoint
from llm.config import DataConfig, GoldfishConfig, OptimConfig, Overlap, PrecisionConfig, RunConfig
from llm.decode.kv_cache import KVCache
from llm.decode.loki import calibrate_loki
from llm.decode.quantspec import quantspec_generate
from llm.decode.sparse_attention import METHODS, make_method
from llm.loss import goldfish_sums
from llm.model import GPT, tiny
from llm.parallel.gpt import ParallelGPT, batch_shard, make_groups
from llm.trainer import Trainer, run
from tests.distributed import launch, run_ranks
from tests.llm.helpers import (
    GQA64,
    SMALL,
    assert_greedy_agrees,
    make_trainer,
    one_rank,
    random_tokens,
)

pytestmark = [pytest.mark.gpu, pytest.mark.cross_shape,  # every test: CUDA against the CPU
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
KEYS = ("loss", "loss_all", "loss_dropped", "grad_norm")
STEPS = 4
CUDA = torch.device("cuda", 0)


def close(a, b, rel):
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-8)


# ------------------------------------------------------------------------------ training
def test_one_cuda_rank_follows_the_cpu_run(tmp_path):
    cpu = run(make_trainer(one_rank(), steps=STEPS))
    trainer = make_trainer(one_rank("cuda"), steps=STEPS)
    assert all(p.is_cuda for p in trainer.model.shards().values())
    gpu = run(trainer)
    assert [r["step"] for r in gpu] == list(range(1, STEPS + 1))
    for a, b in zip(cpu, gpu, strict=True):
        # the kernels differ (cuBLAS, fused attention), so equal up to rounding, growing a
        # little with every AdamW step
        for key in KEYS:
            assert close(a[key], b[key], 1e-3), (a["step"], key, a[key], b[key])
        assert (a["num_kept"], a["num_dropped"]) == (b["num_kept"], b["num_dropped"])
    assert close(cpu[-1]["val_loss"], gpu[-1]["val_loss"], 1e-3)
    # a GPU checkpoint (raw bytes per shard) continues on the CPU
    trainer.save(str(tmp_path), keep=1, is_main=True)
    resumed = make_trainer(one_rank(), steps=STEPS + 1)
    assert resumed.resume(str(tmp_path)) == STEPS
    assert run(resumed)[-1]["step"] == STEPS + 1


def trainer(device, *, precision="fp32", checkpointing=False, neftune=0.0, compile=False):
    """tests.llm.helpers.make_trainer's run (SMALL, goldfish k=4, accumulation 2) with the
    precision, checkpointing, compile and NEFTune switches."""
    return Trainer(SMALL, DataConfig(seq_len=16, batch_size=6, eval_batches=1),
                   OptimConfig(lr=1e-2, warmup_steps=3, neftune_alpha=neftune),
                   GoldfishConfig(k=4, h=3), RunConfig(steps=STEPS, grad_accum=2),
                   one_rank(device), seed=5,
                   precision=PrecisionConfig(precision=precision,
                                             activation_checkpointing=checkpointing,
                                             compile=compile))


def test_bf16_on_cuda_follows_the_cpu_bf16_run():
    cpu = run(trainer("cpu", precision="bf16"))
    gpu_trainer = trainer("cuda", precision="bf16")
    gpu = run(gpu_trainer)
    for a, b in zip(cpu, gpu, strict=True):
        # bf16 GEMMs accumulate in another order on each device: a bf16 rounding or so apart
        assert close(a["loss"], b["loss"], 2e-2), (a["step"], a["loss"], b["loss"])
    assert close(cpu[-1]["val_loss"], gpu[-1]["val_loss"], 2e-2)
    for name, p in gpu_trainer.model.shards().items():  # float32 master weights on the GPU
        assert p.is_cuda and p.dtype == p.grad.dtype == torch.float32, name
    x, _ = next(gpu_trainer.train_iter)
    assert gpu_trainer.model(x.to(CUDA)).dtype == torch.bfloat16  # the GEMMs ran in bf16


def test_bf16_attention_runs_the_flash_kernel_forward_and_backward():
    """The causal self-attention of training (no mask, bf16, head_dim 16) is what SDPA's
    flash backend takes: the default dispatch picks it, forward and backward."""
    model = GPT(tiny(), seed=0, device=CUDA, compute_dtype=torch.bfloat16)
    x = torch.randint(0, 256, (2, 64), device=CUDA)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(x).float().square().mean().backward()
    ops = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention" in ops, sorted(ops)
    assert "aten::_scaled_dot_product_flash_attention_backward" in ops, sorted(ops)


def test_compiled_blocks_on_cuda_follow_the_eager_run():
    eager = run(trainer("cuda", precision="bf16"))
    compiled_trainer = trainer("cuda", precision="bf16", compile=True)
    compiled = run(compiled_trainer)
    assert all(b._compiled_call_impl is not None for b in compiled_trainer.model.model.blocks)
    for a, b in zip(eager, compiled, strict=True):
        # fused kernels round bf16 once where eager rounds each op: a bf16 rounding or so
        assert close(a["loss"], b["loss"], 2e-2), (a["step"], a["loss"], b["loss"])


def test_activation_checkpointing_on_cuda_follows_the_plain_run():
    plain = run(trainer("cuda"))
    ckpt_trainer = trainer("cuda", checkpointing=True)
    assert ckpt_trainer.model.model.activation_checkpointing
    ckpt = run(ckpt_trainer)
    cpu = run(trainer("cpu", checkpointing=True))
    for a, b, c in zip(plain, ckpt, cpu, strict=True):
        for key in KEYS:  # the recomputed blocks run the same kernels (the attention
            # backward may sum in another order from run to run: not bitwise)
            assert close(a[key], b[key], 1e-4), (a["step"], key, a[key], b[key])
            assert close(b[key], c[key], 1e-3), (a["step"], key, b[key], c[key])


def test_neftune_on_cuda_follows_the_cpu_run():
    """The noise is keyed by (seed, step, row, position, channel) and drawn on the device of
    the embeddings: the same on both devices."""
    cpu = run(trainer("cpu", neftune=5.0))
    gpu = run(trainer("cuda", neftune=5.0))
    clean = run(trainer("cuda"))
    for a, b in zip(cpu, gpu, strict=True):
        for key in KEYS:
            assert close(a[key], b[key], 1e-3), (a["step"], key, a[key], b[key])
    assert not close(gpu[0]["loss"], clean[0]["loss"], 1e-4)  # the noise was on


ARGS = ["-m", "llm.train", "--preset", "tiny", "--steps", "3", "--seq-len", "32",
        "--batch-size", "4", "--eval-batches", "1", "--log-every", "1"]


def _losses(path):
    return [json.loads(line) for line in path.read_text().splitlines()
            if '"step"' in line]


def test_cli_on_one_gpu_uses_nccl(tmp_path):
    r = launch([*ARGS, "--device", "cuda", "--metrics", str(tmp_path / "gpu.jsonl")],
               launcher="single", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "(1 ranks, single, cpu:gloo,cuda:nccl)" in r.stdout
    cpu = launch([*ARGS, "--device", "cpu", "--metrics", str(tmp_path / "cpu.jsonl")],
                 launcher="single", timeout=300)
    assert cpu.returncode == 0, cpu.stdout + cpu.stderr
    for a, b in zip(_losses(tmp_path / "cpu.jsonl"), _losses(tmp_path / "gpu.jsonl"),
                    strict=True):
        assert close(a["loss"], b["loss"], 1e-3), (a, b)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank")
def test_two_nccl_ranks_follow_one_cpu_rank(tmp_path):
    gpu = launch([*ARGS, "--device", "cuda", "--grid", "data=1,depth=1,row=2,col=1",
                  "--metrics", str(tmp_path / "gpu.jsonl")], ranks=2, launcher="torchrun",
                 timeout=300)
    assert gpu.returncode == 0, gpu.stdout + gpu.stderr
    assert "(2 ranks, torchrun, cpu:gloo,cuda:nccl)" in gpu.stdout
    cpu = launch([*ARGS, "--device", "cpu", "--metrics", str(tmp_path / "cpu.jsonl")],
                 launcher="single", timeout=300)
    assert cpu.returncode == 0, cpu.stdout + cpu.stderr
    for a, b in zip(_losses(tmp_path / "cpu.jsonl"), _losses(tmp_path / "gpu.jsonl"),
                    strict=True):
        assert close(a["loss"], b["loss"], 1e-3), (a, b)
        assert b["comm_bytes"] > 0


# ------------------------------------------- tensor-parallel layers: 4 ranks share cuda:0
# (grid data x depth x row x col, changes to test_parallel.BASE, overlap, micro-batches):
# row and col all-reduces; depth all-gathers and reduce-scatters; data; d_model padded on col
TP_CASES = [("1x1x2x2", {}, "all", 1), ("1x2x2x1", {}, "all", 1), ("2x1x1x2", {}, "all", 2),
            ("1x1x1x4", {"d_model": 30, "num_heads": 3, "num_kv_heads": 1}, "all", 1)]


def tensor_parallel_on_cuda0(ctx):
    """Per rank (4 ranks over gloo, all on cuda:0): loss, full gradients, devices and bytes
    per axis of each TP_CASES case (as test_parallel.parallel_cases, on the GPU), and greedy
    tokens on test_parallel.GENERATE_GRID."""
    from tests.llm.parallel import test_gpt as tp

    torch.cuda.set_device(CUDA)
    results = []
    for grid_text, changes, overlap, micro in TP_CASES:
        config = dataclasses.replace(tp.BASE, **changes)
        groups = make_groups(ProcessGrid.parse(grid_text, AXONN_AXES), ctx.rank, ctx.transport)
        stats = CommStats()
        model = ParallelGPT(GPT(config, device="meta"), groups, seed=tp.SEED,
                            overlap=Overlap.parse(overlap), stats=stats, device=CUDA)
        batches = tp.make_batch(micro=micro)
        total = sum(int(((y != -100) & ~m).sum()) for _, y, m in batches)
        kept_sum = torch.zeros((), device=CUDA)
        for x, y, m in batches:
            logits = model(batch_shard(x, groups, 0).to(CUDA))
            out = goldfish_sums(logits, batch_shard(y, groups, -100).to(CUDA),
                                batch_shard(m, groups, True).to(CUDA), num_kept=total,
                                vocab_size=config.vocab_size, row=groups["row"], stats=stats)
            out.loss.backward()
            model.finish_backward()
            kept_sum += out.kept_sum
        model.sync_gradients()
        loss = all_reduce(kept_sum, groups["data+depth"]) / total
        grads = model.full_state_dict(grads=True)
        results.append({"case": (grid_text, tuple(changes.items()), micro),
                        "loss": loss.item(),
                        "devices": sorted({str(g.device) for g in grads.values()} |
                                          {str(p.device) for p in model.parameters()}),
                        "grads": {name: g.cpu() for name, g in grads.items()},
                        "axes": {k: v.bytes for k, v in stats.by_axis().items()}})
    groups = make_groups(ProcessGrid.parse(tp.GENERATE_GRID, AXONN_AXES), ctx.rank,
                         ctx.transport)
    model = ParallelGPT(GPT(tp.BASE, device="meta"), groups, seed=tp.SEED, device=CUDA)
    prompt = torch.randint(tp.BASE.vocab_size, (3, 5), generator=torch.Generator().manual_seed(1))
    return {"cases": results, "generate": model.generate_greedy(prompt, 6)}


def test_tensor_parallel_layers_on_one_gpu_over_gloo():
    from tests.llm.parallel import test_gpt as tp

    per_rank = run_ranks(tensor_parallel_on_cuda0, 4, timeout=600)
    for cases in zip(*(r["cases"] for r in per_rank)):  # one case on every rank
        grid_text, changes, micro = cases[0]["case"]
        loss, grads = tp.serial(dataclasses.replace(tp.BASE, **dict(changes)), micro)
        grid = ProcessGrid.parse(grid_text, AXONN_AXES)
        for rank, r in enumerate(cases):
            tag = f"grid {grid_text} {dict(changes)} rank {rank}"
            assert r["devices"] == ["cuda:0"], tag
            assert close(r["loss"], loss, 1e-5), (tag, r["loss"], loss)
            assert set(r["grads"]) == set(grads), tag
            for name, want in grads.items():
                assert tp.rel(r["grads"][name], want) < 1e-4, (tag, name)
            for axis in ("data", "depth", "row", "col"):  # the collectives really ran
                assert (r["axes"].get(axis, 0) > 0) == (grid.size(axis) > 1), (tag, axis)
    prompt = torch.randint(tp.BASE.vocab_size, (3, 5), generator=torch.Generator().manual_seed(1))
    serial = GPT(tp.BASE, seed=tp.SEED)
    want = serial.generate(prompt, 6)
    for rank, r in enumerate(per_rank):  # cuBLAS against MKL: equal but at a near-tie
        assert_greedy_agrees(serial, r["generate"].cpu(), want, f"rank {rank}")


# ------------------------------------------------------------------------------ decoding
@pytest.fixture(scope="module")
def decode_models():
    """The same weights on the CPU and on the GPU (keyed initialisation), and a Loki basis
    calibrated on the CPU model."""
    cpu = GPT(GQA64, seed=0).eval()
    gpu = GPT(GQA64, seed=0, device=CUDA).eval()
    text = random_tokens(4, 48, seed=2)
    return cpu, gpu, text, calibrate_loki(cpu, text)


def test_sampling_with_a_cpu_generator_on_a_cuda_model_draws_the_cpu_tokens(decode_models):
    cpu, gpu, _, _ = decode_models
    assert gpu.device == CUDA
    idx = random_tokens(2, 4)
    for use_cache in (True, False):
        want = cpu.generate(idx, 20, temperature=1.0, use_cache=use_cache,
                            generator=torch.Generator().manual_seed(7))
        got = gpu.generate(idx.to(CUDA), 20, temperature=1.0, use_cache=use_cache,
                           generator=torch.Generator().manual_seed(7))
        assert got.is_cuda and torch.equal(got.cpu(), want), use_cache
    # a generator on the GPU draws there
    out = gpu.generate(idx.to(CUDA), 5, temperature=1.0,
                       generator=torch.Generator(device=CUDA).manual_seed(7))
    assert out.is_cuda and out.shape == (2, 9)
    assert_greedy_agrees(cpu, gpu.generate(idx.to(CUDA), 20).cpu(), cpu.generate(idx, 20),
                         "greedy on CUDA")  # equal but at a near-tie


def decode(model, idx, prefill, method):
    """Teacher-forced logits of positions prefill-1 .. T-1 through a cache carrying
    ``method``: [B, T - prefill + 1, V] (as test_sparse_attention.decode)."""
    cache = KVCache(model.config.num_layers, model.config.max_seq_len, method=method)
    with torch.no_grad():
        rows = [model(idx[:, :prefill], cache)[:, -1]]
        rows += [model(idx[:, t : t + 1], cache)[:, -1] for t in range(prefill, idx.shape[1])]
    return torch.stack(rows, 1).float()


@pytest.mark.parametrize("name", METHODS)
def test_every_decoding_method_on_cuda_follows_the_cpu_run(decode_models, name):
    """Sift past its warm-up and refits (it once fitted on a CPU tensor), Loki with the CPU's
    basis: teacher-forced logits step by step, and greedy generation's kept fraction."""
    cpu, gpu, _, basis = decode_models

    def make():
        return make_method(name, budget=0.25, rank_fraction=0.5, basis=basis, warmup=4,
                           refit_every=5)

    idx = random_tokens(2, 48, seed=5)
    want = decode(cpu, idx, 8, make())
    got = decode(gpu, idx.to(CUDA), 8, make())
    assert got.is_cuda
    near = (got.cpu() - want).abs().amax(-1) <= 1e-3 * want.abs().amax()  # [B, steps]
    assert near.float().mean() >= (1.0 if name == "full" else 0.9), near
    on_cpu, on_gpu = make(), make()
    a = cpu.generate(idx[:, :8], 32, method=on_cpu)
    b = gpu.generate(idx[:, :8].to(CUDA), 32, method=on_gpu)
    assert b.is_cuda and b.shape == a.shape
    assert on_gpu.bytes_read > 0 and abs(on_gpu.kept_fraction - on_cpu.kept_fraction) <= 0.1
    if name != "full":
        assert on_gpu.kept_fraction < 1.0


def test_loki_calibrates_a_cuda_model_on_cpu_tokens(decode_models):
    cpu, gpu, text, basis = decode_models
    for post_rope in (True, False):
        want = basis if post_rope else calibrate_loki(cpu, text, post_rope=False)
        got = calibrate_loki(gpu, text, post_rope=post_rope)  # CPU tokens, CUDA model
        assert got.bases.device.type == "cpu" and got.post_rope == post_rope
        torch.testing.assert_close(got.explained, want.explained, rtol=0, atol=1e-4)
    on_gpu = calibrate_loki(gpu, text.to(CUDA))  # tokens already there
    torch.testing.assert_close(on_gpu.explained, basis.explained, rtol=0, atol=1e-4)


@pytest.mark.parametrize("gamma", [1, 4])
@pytest.mark.parametrize(("config", "length", "new", "seed"), [
    ("tiny", 7, 24, 1), ("gqa", 12, 20, 4)])  # as tests/llm/decode/test_quantspec.py
def test_quantspec_on_cuda_equals_plain_greedy(config, length, new, seed, gamma):
    model = GPT({"tiny": tiny(), "gqa": GQA64}[config], seed=0, device=CUDA).eval()
    idx = random_tokens(1, length, seed=seed).to(CUDA)
    got, stats = quantspec_generate(model, idx, new, gamma=gamma, fp_buffer=4, group_size=16)
    assert got.is_cuda  # verification passes of gamma + 1 rows: equal but at a near-tie
    assert_greedy_agrees(model, got, model.generate(idx, new), f"gamma {gamma}")
    assert stats.generated == new == stats.accepted + stats.target_passes
    assert 0 <= stats.accepted <= stats.drafted


def test_quantspec_on_cuda_accepts_a_draft_that_must_agree():
    from tests.llm.decode.test_quantspec import successor_model

    model = successor_model().to(CUDA)
    idx = random_tokens(1, 5).to(CUDA)
    got, stats = quantspec_generate(model, idx, 20, gamma=4, fp_buffer=4, group_size=16)
    assert torch.equal(got, model.generate(idx, 20))
    assert stats.drafted > 0 and stats.accepted == stats.drafted


# ------------------------------------------------------------------ load_model and the CLIs
@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    """A one-step tests.llm.helpers.make_trainer checkpoint (SMALL on pydoc, written on the
    CPU)."""
    trainer = make_trainer(one_rank(), steps=1)
    trainer.train_step()
    root = tmp_path_factory.mktemp("gpu_ckpt")
    trainer.save(str(root), keep=1, is_main=True)
    return root


def test_load_model_on_cuda(ckpt_dir):
    cpu, meta = checkpoint.load_model(ckpt_dir)
    gpu, meta_gpu = checkpoint.load_model(ckpt_dir, device="cuda")
    assert meta_gpu == meta and all(p.is_cuda for p in gpu.parameters())
    for (name, p), q in zip(cpu.named_parameters(), gpu.parameters(), strict=True):
        assert torch.equal(p, q.cpu()), name
    idx = random_tokens(2, 6)
    assert_greedy_agrees(cpu, gpu.generate(idx.to(gpu.device), 8).cpu(), cpu.generate(idx, 8),
                         "load_model on CUDA")  # cuBLAS against MKL: equal but at a near-tie


def test_sample_cli_on_cuda_prints_the_cpu_text(ckpt_dir, capsys):
    from llm.sample import main

    for temperature in ("0", "1.0"):
        args = ["--checkpoint", str(ckpt_dir), "--prompt", "The ", "--tokens", "12",
                "--temperature", temperature, "--seed", "3"]
        assert main([*args, "--device", "cpu"]) == 0
        want = capsys.readouterr().out
        assert main([*args, "--device", "cuda"]) == 0
        assert capsys.readouterr().out == want, temperature


@pytest.mark.parametrize("name", ["sift", "loki"])
def test_evaluate_cli_on_cuda_follows_the_cpu_run(ckpt_dir, capsys, name):
    """CUDA first: Loki calibrates on the GPU (CPU calibration text) and stores the basis the
    CPU run then reads; QuantSpec equals plain greedy on the GPU."""
    from llm.evaluate import main

    args = ["--checkpoint", str(ckpt_dir), "--attention", name, "--budget", "0.25",
            "--tokens", "96", "--prompts", "2", "--new-tokens", "10", "--sift-warmup", "2",
            "--calibration-tokens", "512", "--speculative", "quantspec", "--gamma", "3",
            "--fp-buffer", "4", "--json"]
    assert main([*args, "--device", "cuda"]) == 0
    gpu = json.loads(capsys.readouterr().out)
    assert main([*args, "--device", "cpu"]) == 0
    cpu = json.loads(capsys.readouterr().out)
    assert (gpu["device"], cpu["device"]) == ("cuda:0", "cpu")
    if name == "loki":
        assert gpu["loki_basis"]["calibrated"] and not cpu["loki_basis"]["calibrated"]
    (g_full, g_method), (c_full, c_method) = gpu["rows"], cpu["rows"]
    assert close(g_full["perplexity"], c_full["perplexity"], 1e-4)
    assert g_full["token_agreement"] == 1.0 and g_full["bytes_ratio"] == 1.0
    assert close(g_method["perplexity"], c_method["perplexity"], 1e-2)
    assert abs(g_method["kept_fraction"] - c_method["kept_fraction"]) <= 0.1
    assert g_method["kept_fraction"] < 1.0 and 0 < g_method["bytes_ratio"] < 1
    assert gpu["quantspec"]["equal_to_greedy"] == gpu["quantspec"]["num_prompts"] == 2


def test_memorization_cli_on_cuda_equals_the_cpu_result(ckpt_dir, capsys):
    from llm.memorization import main

    args = ["--checkpoint", str(ckpt_dir), "--docs", "4", "--seq-len", "16", "--suffix-len",
            "4", "--json"]
    assert main([*args, "--device", "cuda"]) == 0
    gpu = json.loads(capsys.readouterr().out)
    assert main([*args, "--device", "cpu"]) == 0
    cpu = json.loads(capsys.readouterr().out)
    assert gpu["num_docs"] == 4
    assert (gpu["exact"], gpu["rouge"]) == (cpu["exact"], cpu["rouge"])
