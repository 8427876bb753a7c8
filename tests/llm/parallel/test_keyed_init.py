"""Keyed initialisation (llm.parallel.keyed_init): any block of a parameter is the slice of
the full draw, ParallelGPT built on the meta device holds the one-process GPT with no
parameter left on meta, and a rank's build never holds the full model (peak RSS of a
~200M-parameter build in a fresh process). That every grid's shards (init_shards) are the
slices of the serial parameters: test_shards.py.

Every coordinate is built in this one process (``ParallelGPT`` communicates nothing while it
is built), so no ranks are launched.
"""

import dataclasses
import json
import sys

import pytest
import torch

import llm.parallel.keyed_init
from common.grid import AXONN_AXES, AxisGroup
from llm.model import GPT, GPTConfig, init_std
from llm.parallel.gpt import ParallelGPT
from llm.parallel.keyed_init import fill_normal_
from llm.parallel.layout import param_specs
from tests.distributed import launch
from tests.llm.parallel.test_gpt import BASE, ODD_D
from tests.llm.parallel.test_shards import CHUNKS, assemble, coords_of

SEED = 7


@pytest.mark.parametrize("chunk", CHUNKS)
def test_any_block_and_range_equals_the_slice_of_the_full_draw(chunk, monkeypatch):
    monkeypatch.setattr(llm.parallel.keyed_init, "CHUNK_NUMEL", chunk)
    shape = (13, 9)
    full = fill_normal_(torch.empty(13 * 9), seed=1, name="w", shape=shape, std=2.0).view(shape)
    padded = torch.zeros(20, 16)
    padded[:13, :9] = full
    for origin, block, start, size in [((0, 0), (13, 9), 0, 117), ((4, 3), (5, 4), 3, 12),
                                       ((10, 6), (5, 5), 7, 25), ((13, 9), (2, 2), 0, 4)]:
        want = padded[origin[0] : origin[0] + block[0], origin[1] : origin[1] + block[1]]
        want = torch.cat((want.reshape(-1), torch.zeros(40)))[start : start + size]
        got = fill_normal_(torch.full((size,), 9.0), seed=1, name="w", shape=shape, std=2.0,
                           origin=origin, block=block, start=start)
        assert torch.equal(got, want), (origin, block, start)
    other = fill_normal_(torch.empty(117), seed=1, name="v", shape=shape, std=2.0)
    assert not torch.equal(other, full.view(-1))  # the name is part of the key
    vector = fill_normal_(torch.empty(9), seed=1, name="w", shape=(9,), std=2.0)
    part = fill_normal_(torch.empty(4), seed=1, name="w", shape=(9,), std=2.0, origin=(6,),
                        block=(4,))
    assert torch.equal(part, torch.cat((vector[6:], torch.zeros(1))))


def groups_at(sizes, coords):
    """Axis groups of the rank at ``coords`` that never communicate (the build needs none)."""
    groups = {a: AxisGroup(a, None, sizes[a], coords[a]) for a in AXONN_AXES}
    for key in ("data+depth", "depth+row+col"):
        axes = key.split("+")
        rank = 0
        for a in axes:
            rank = rank * sizes[a] + coords[a]
        groups[key] = AxisGroup(key, None, int(torch.tensor([sizes[a] for a in axes]).prod()),
                                rank)
    return groups


@pytest.mark.parametrize("grid, changes", [((2, 2, 2), {}), ((1, 1, 4), ODD_D),
                                           ((1, 4, 1), {"num_kv_heads": 4})])
def test_parallel_gpt_built_on_meta_holds_the_serial_model(grid, changes):
    config = dataclasses.replace(BASE, **changes)
    sizes = dict(zip(AXONN_AXES, (1, *grid)))
    full = GPT(config, seed=SEED).state_dict()
    shards = {}
    for coords in coords_of(sizes):
        model = ParallelGPT(GPT(config, device="meta"), groups_at(sizes, coords), seed=SEED)
        assert not any(p.is_meta for p in model.parameters())
        assert not any(b.is_meta for b in model.buffers())
        for name, p in model.shards().items():
            shards.setdefault(name, {})[tuple(coords[a] for a in ("depth", "row", "col"))] = p
    specs = param_specs(config, sizes)
    for name, want in full.items():
        assert torch.equal(assemble(shards[name], specs[name], sizes), want), f"{grid}: {name}"


@pytest.mark.parametrize("tie", [False, True])
def test_fast_path_and_serial_model_use_the_same_keyed_init(tie):
    config = dataclasses.replace(BASE, tie_embeddings=tie)
    want = GPT(config, seed=SEED).state_dict()
    sizes = {"data": 2, "depth": 1, "row": 1, "col": 1}  # data parallel: the whole model
    model = ParallelGPT(GPT(config, device="meta"), groups_at(sizes, {**sizes, "data": 1}),
                        seed=SEED)
    assert not any(p.is_meta for p in model.parameters())
    got = model.model.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
    if tie:
        assert model.model.lm_head.weight is model.model.tok_emb.weight


def test_seed_rules_and_the_init_distribution():
    a, b = GPT(BASE, seed=1), GPT(BASE, seed=1)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(GPT(BASE, seed=2).tok_emb.weight, a.tok_emb.weight)
    torch.manual_seed(5)  # seed None: drawn from torch's default generator
    c = GPT(BASE)
    torch.manual_seed(5)
    assert torch.equal(GPT(BASE).lm_head.weight, c.lm_head.weight)
    meta = GPT(BASE, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    assert torch.equal(meta.materialize("cpu", seed=1).lm_head.weight, a.lm_head.weight)
    assert init_std(BASE, "blocks.1.attn.o_proj.weight") == pytest.approx(0.01)  # 0.02/sqrt(4)
    assert init_std(BASE, "blocks.0.mlp_norm.weight") is None
    with pytest.raises(ValueError, match="meta device needs seed="):
        ParallelGPT(GPT(BASE, device="meta"), groups_at(dict.fromkeys(AXONN_AXES, 1),
                                                        dict.fromkeys(AXONN_AXES, 0)))
    with pytest.raises(ValueError, match="seed= is for a GPT built on the meta device"):
        ParallelGPT(GPT(BASE), groups_at(dict.fromkeys(AXONN_AXES, 1),
                                         dict.fromkeys(AXONN_AXES, 0)), seed=1)


# ----------------------------------------------------------------- memory of one rank's build
BIG = GPTConfig(vocab_size=32000, num_layers=8, num_heads=16, d_model=1024, d_ff=4096,
                max_seq_len=128)  # 194M parameters: 777 MB in float32
MIB = 1 << 20

PEAK_SCRIPT = """
import json, resource, sys
import torch
from llm.model import GPT, GPTConfig
from llm.parallel.gpt import ParallelGPT
from tests.llm.parallel.test_keyed_init import groups_at


config, sizes, coords = GPTConfig(**json.loads(sys.argv[1])), *json.loads(sys.argv[2])
def status(key):  # kB in /proc/self/status
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
base = status("VmRSS")
try:  # reset the high-water mark to the current RSS (Linux >= 4.0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    reset = True
except OSError:  # then the lifetime peak bounds the build's from above
    reset = False
model = ParallelGPT(GPT(config, device="meta"), groups_at(sizes, coords), seed=0)
peak = status("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
shard_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
meta = sum(p.is_meta for p in model.parameters())
print(json.dumps({"base": base, "peak": peak, "reset": reset, "shard_bytes": shard_bytes,
                  "meta": meta}))
"""


def build_peak(config, sizes, coords):
    proc = launch(["-c", PEAK_SCRIPT, json.dumps(dataclasses.asdict(config)),
                   json.dumps([sizes, coords])], launcher="single", timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_one_rank_of_8_builds_without_the_full_model():
    """One rank of depth 2 x row 2 x col 2 builds its shards of a 194M-parameter
    GPT in a fresh process; its peak RSS growth stays near its shards (about 1/8 of the
    matrices and 1/4 of the embedding, which is replicated over row), far below the full
    777 MB."""
    full_bytes = BIG.num_params() * 4
    sizes = {"data": 1, "depth": 2, "row": 2, "col": 2}
    out = build_peak(BIG, sizes, {"data": 0, "depth": 1, "row": 1, "col": 0})
    growth = out["peak"] - out["base"]
    budget = full_bytes / 8 * 1.5 + 64 * MIB
    print(f"full {full_bytes / MIB:.0f} MiB, shards {out['shard_bytes'] / MIB:.0f} MiB, peak "
          f"growth {growth / MIB:.0f} MiB (budget {budget / MIB:.0f} MiB, reset {out['reset']})")
    assert out["meta"] == 0
    assert out["shard_bytes"] <= growth < budget  # the measurement sees the shards, no more
