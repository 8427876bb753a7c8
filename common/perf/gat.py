"""Performance model of one Plexus 3D GAT epoch (``GCNWorkload(model="gat")``;
docs/design/plexus-3d.md section 14, docs/design/perf-model.md): its collectives, compute and
peak memory per rank, as plexus.gat_model runs a layer. :func:`common.perf.gcn.predict_gcn`
calls these for a GAT workload, so ``--grid auto`` and ``python -m common.perf gcn --model gat``
rank its grids.

Layer ``l`` with roles (O, I, P), ``K`` heads of width ``c`` (the classes in the last layer),
``K' = K / I`` of them on a rank, ``N`` and widths padded as plexus.layout pads them, ``a =
D_l / I``, the rank's ``n_c = ceil(N/O / P)`` rows of ``F'`` and its block's ``e = nnz / (P O)``
edges. Collectives (``M``: full bytes, float32):

* forward: (1) at layer 0; ``W``'s flat shard all-gathered over P; G1 ``F' W`` [n_c, K c]
  reduce-scattered over I; G2 ``G`` [n_c, K' c] all-gathered over P; ``t`` [N/P, K'] gathered
  by owner over O (plexus.root_rows); G4 the softmax's row max and sum [N/P, K'] all-reduced
  over O; G5 ``Q`` [N/P, K' c] all-reduced over O; G7 ``Q``'s heads all-gathered over I (the
  last layer: G6, their mean [N/P, c] all-reduced over I);
* backward: ``dQ``'s column chunks all-gathered over O [N/P, D_l+1]; G4' ``r`` [N/P, K']
  all-reduced over O; ``dt`` reduce-scattered over O by owner; G2' ``dG`` reduce-scattered
  over P; G1' all-gathered over I; ``dF'``'s row chunks all-gathered over P (layers >= 1);
  ``dW`` reduce-scattered over P (flat) and all-reduced over O; the attention vectors'
  gradients [K', c] all-reduced over P and over O (two each);
* the norm's, as a GCN layer's; the loss's, as the GCN's.

Compute per rank: three GEMMs ``[n_c, a] @ [a, K c]`` (two at layer 0, whose input has no
gradient); the passes over the block's edges, memory-bound like an SpMM: the aggregation
forward and its transpose backward (a row of ``G`` or ``dQ`` gathered per edge, ``K' c``
wide), the scores' SDDMM backward, and about eight passes over ``[e, K']`` float32 each way
(scores, exponentials, division, the keep-mask's product; their gradients); the attention
keep-mask's hash, about fifteen 4-byte passes over ``[e, K']``; the ReLU, norm, loss and Adam
as the GCN's.

Memory per rank (:func:`gat_memory_parts`): the adjacency blocks (their CSR, read as the
pattern only) with each block's edge lists (rows and columns, and the column order: two more
arrays; int32 where a block fits, int64 pointers), the root blocks that move ``t`` (owners
int16, columns int32), the feature shard, ``W``, ``a_src``, ``a_dst`` with their gradients
and Adam moments; kept per layer:
``F'`` [N/O, a] for ``dW``, its dropout bits, ``G`` [N/O, K' c], ``alpha`` [e, K'] float32,
the sign of the scores (one byte) and the attention keep-mask (float32), the ReLU's bits and
the norm's centred block; the largest transient set of the step's phases on top (forward:
``F' W`` before G1, the gathered ``G``, the keep-mask's hash, ``Q`` and its all-reduce
buffer; backward: ``dQ``, ``dG`` and ``dalpha``, then ``dG`` over I, ``dF'`` and its gathered
rows). Pure Python.
"""

from __future__ import annotations

from collections.abc import Mapping

from common.grid import ceil_div, round_up
from common.perf.gcn_memory import _node_vectors, _reduce_buffer
from common.perf.gcn_workload import F32, GCNWorkload, roles
from common.perf.machine import MachineProfile
from common.perf.model import Collective
from common.perf.roofline import gemm_seconds, spmm_bytes

__all__ = ["gat_collectives", "gat_compute", "gat_memory", "gat_memory_parts"]

EDGE_PASSES = 8  # float32 passes over [e, K'] each way (scores, softmax, keep; gradients)
HASH_PASSES = 15  # 4-byte passes of the attention keep-mask's hash over [e, K']


def _layer(work: GCNWorkload, shape: Mapping[str, int], layer: int) -> dict:
    """The per-rank sizes of ``layer`` (module docstring's names)."""
    n, w = work.padded(shape)
    o, i, p = roles(layer)
    last = layer == work.num_layers - 1
    c = work.num_classes if last else work.hidden // work.heads
    return {"o": o, "i": i, "p": p, "O": shape[o], "I": shape[i], "P": shape[p], "n": n,
            "a": w[layer] // shape[i], "b": w[layer + 1] // shape[o], "width": w[layer + 1],
            "c": c, "kc": work.heads * c, "kpc": work.heads // shape[i] * c,
            "kp": work.heads // shape[i], "rows_p": n // shape[p], "rows_o": n // shape[o],
            "chunk": ceil_div(n // shape[o], shape[p]),
            "edges": work.imbalance * work.nnz / (shape[p] * shape[o]), "last": last,
            # an entry of plexus.gat.EdgePattern's lists: int32 where the block fits
            "index": 4 if max(work.imbalance * work.nnz / (shape[p] * shape[o]), n) < 2**31
            else 8}


def gat_collectives(work: GCNWorkload, shape: Mapping[str, int], *,
                    loss: bool = True) -> list[Collective]:
    """Every collective one rank issues in one epoch (the module docstring)."""
    out: list[Collective] = []
    n, _ = work.padded(shape)
    for layer in range(work.num_layers):
        s = _layer(work, shape, layer)
        o, i, p, P = s["o"], s["i"], s["p"], s["P"]  # noqa: N806 - the paper's names
        rows, kp = s["rows_p"], s["kp"]
        w_flat = round_up(s["a"] * s["kc"], P) * F32
        if layer == 0:
            f_block = s["rows_o"] * s["a"]
            out.append(Collective(p, "all_gather", round_up(f_block, P) * F32))  # (1)
        g_rows = s["chunk"] * P  # N/O, padded to split over P
        out += [Collective(p, "all_gather", w_flat),                           # W
                Collective(i, "reduce_scatter", s["chunk"] * s["kc"] * F32),   # G1
                Collective(p, "all_gather", g_rows * s["kpc"] * F32),          # G2
                Collective(o, "all_gather", rows * kp * F32),                  # t by owner
                Collective(o, "all_reduce", rows * kp * F32, count=2),         # G4
                Collective(o, "all_reduce", rows * s["kpc"] * F32)]            # G5
        if s["last"]:
            out.append(Collective(i, "all_reduce", rows * s["c"] * F32))       # G6
        else:
            out.append(Collective(i, "all_gather", rows * s["kc"] * F32))      # G7
        if work.norm != "none" and not s["last"]:  # as a GCN layer's (common.perf.gcn)
            affine = s["b"] * F32
            if work.norm == "batch":
                out += [Collective(p, "all_reduce", affine, count=2),
                        Collective(p, "all_reduce", 2 * affine)]
            else:
                out += [Collective(o, "all_reduce", rows * F32, count=4),
                        Collective(p, "all_reduce", affine, count=2)]
        out += [Collective(o, "all_gather", rows * s["width"] * F32),          # dQ's chunks
                Collective(o, "all_reduce", rows * kp * F32),                  # G4' r
                Collective(o, "reduce_scatter", rows * kp * F32),              # dt by owner
                Collective(p, "reduce_scatter", g_rows * s["kpc"] * F32),      # G2'
                Collective(i, "all_gather", s["chunk"] * s["kc"] * F32),       # G1'
                Collective(p, "reduce_scatter", w_flat),                       # dW over P
                Collective(o, "all_reduce", s["a"] * s["kc"] * F32),           # dW over O
                Collective(p, "all_reduce", kp * s["c"] * F32, count=2),       # da over P
                Collective(o, "all_reduce", kp * s["c"] * F32, count=2)]       # da over O
        if layer > 0:
            out.append(Collective(p, "all_gather", g_rows * s["a"] * F32))     # dF' rows
    if loss:
        o, _, p = roles(work.num_layers - 1)
        rows = n // shape[p]
        out.append(Collective(o, "all_reduce", rows * F32, count=3))
        out.append(Collective(p, "all_reduce", F32))
    return out


def gat_compute(work: GCNWorkload, shape: Mapping[str, int], machine: MachineProfile, *,
                node_ranks: int) -> dict[str, float]:
    """Seconds of edge passes (``spmm``), GEMM and elementwise work of one rank in one
    epoch (the module docstring)."""
    rate = machine.compute_at(node_ranks)
    line = machine.cache_line
    edge = gemm = moved = 0.0
    params = 0
    for layer in range(work.num_layers):
        s = _layer(work, shape, layer)
        e, kp, kpc = s["edges"], s["kp"], s["kpc"]
        aggregate = spmm_bytes(s["rows_p"], e, kpc, index_bytes=s["index"], cache_line=line)
        transposed = spmm_bytes(s["rows_o"], e, kpc, index_bytes=2 * s["index"],
                                cache_line=line)
        # forward: the aggregation; backward: its transpose and the SDDMM of dQ with G
        edge += aggregate + transposed + aggregate + 2 * EDGE_PASSES * e * kp * F32
        if work.attention_dropout > 0:
            moved += HASH_PASSES * e * kp * 4 + 3 * e * kp * F32  # the hash, the scaled mask
        gemm += (3 if layer > 0 else 2) * gemm_seconds(s["chunk"], s["a"], s["kc"],
                                                       rate.gemm_flops, rate.memory_bandwidth)
        moved += 8 * s["rows_o"] * kpc * F32  # s and t from G, and their gradients into dG
        q = s["rows_p"] * s["b"] * F32
        if not s["last"]:
            moved += 5 * q + (22 * q if work.norm == "batch" else 45 * q
                              if work.norm == "layer" else 0)
        params += round_up(s["a"] * s["kc"], s["P"]) // s["P"] + 2 * kp * s["c"]
    n, w = work.padded(shape)
    o, _, p = roles(work.num_layers - 1)
    moved += 12 * (n // shape[p]) * (w[-1] // shape[o]) * F32  # the loss's passes
    moved += 7 * params * F32  # Adam
    return {"spmm": edge / rate.spmm_bandwidth, "gemm": gemm,
            "elementwise": moved / rate.memory_bandwidth}


def gat_memory(work: GCNWorkload, shape: Mapping[str, int]) -> float:
    """Peak bytes per rank of a GAT training step: the sum of :func:`gat_memory_parts`."""
    return sum(gat_memory_parts(work, shape).values())


def gat_memory_parts(work: GCNWorkload, shape: Mapping[str, int]) -> dict[str, float]:
    """:func:`gat_memory` by part, bytes per rank (the module docstring): ``adjacency``,
    ``features``, ``nodes``, ``weights``, ``kept`` and ``transient`` (the peak phase's
    tensors beyond what is kept by then)."""
    n, w = work.padded(shape)
    idx = work.index_width(shape)
    parts = dict.fromkeys(("adjacency", "features", "nodes", "weights", "kept", "transient"),
                          0.0)
    blocks = set()
    kept: list[float] = []
    forward: list[float] = []
    backward: list[float] = []
    for layer in range(work.num_layers):
        s = _layer(work, shape, layer)
        e, kp, kpc, P, O = s["edges"], s["kp"], s["kpc"], s["P"], s["O"]  # noqa: N806
        key = (layer % 2, s["p"] if P > 1 else "", s["o"] if O > 1 else "")
        if key not in blocks and layer < 6:  # layouts cut alike share a block
            blocks.add(key)
            parts["adjacency"] += (
                e * (idx + F32) + (s["rows_p"] + 1) * idx          # the CSR
                + 4 * e * s["index"] + (s["rows_p"] + s["rows_o"]) * 8  # edge lists
                + work.num_nodes / (P * O) * 4 + s["rows_p"] * 2   # the root block
                + s["rows_p"] * 4)                                  # the exchange's slots
        parts["weights"] += 4 * (round_up(s["a"] * s["kc"], P) // P + 2 * kp * s["c"]) * F32
        f_rows = s["chunk"] * P  # F' [N/O, a] (padded to split over P) kept for dW
        mine = (f_rows * s["a"] * F32 + s["rows_o"] * s["a"] / 8 * (work.dropout > 0)
                + s["rows_o"] * kpc * F32                          # G
                + e * kp * (F32 + 1)                               # alpha, the signs
                + e * kp * F32 * (work.attention_dropout > 0)      # the keep-mask
                + (s["rows_p"] * s["b"] / 8 if not s["last"] else s["rows_p"] * s["b"] * F32)
                + (s["rows_p"] * s["b"] * F32 if work.norm != "none" and not s["last"] else 0))
        kept.append(mine)
        q = s["rows_p"] * kpc * F32
        hashing = 3 * e * kp * 4 * (work.attention_dropout > 0)  # uint32 temporaries
        forward.append(max(s["chunk"] * s["kc"] * F32 * 1.5 + s["rows_o"] * kpc * F32,
                           hashing + e * kp * F32,
                           2 * q + _reduce_buffer(q, O, work) + s["rows_p"] * F32 * (
                               2 * s["c"] if s["last"] else s["kc"])))  # G6's mean, or G7
        # dQ's chunks gathered over O; then dQ per head (the last layer: the mean's gradient,
        # a copy per head where the rank has more than one), dG and dalpha
        gathered, mean = s["rows_p"] * s["width"] * F32, s["rows_p"] * s["c"] * F32
        heads_grad = (mean + q * (kp > 1)) if s["last"] else gathered + q
        backward.append(max(
            gathered + mean * s["last"],
            heads_grad + s["rows_o"] * kpc * F32 + e * kp * F32,
            s["chunk"] * s["kc"] * F32 * 2 + s["chunk"] * s["a"] * F32 + f_rows * s["a"] * F32
            * (layer > 0)))
    f0 = (n // shape["x"]) * (w[0] // shape["y"])
    parts["features"] = round_up(f0, shape["z"]) // shape["z"] * F32
    parts["nodes"] = _node_vectors(work, shape) + sum(
        8 * (n // shape[roles(layer)[2]] + n // shape[roles(layer)[0]])
        for layer in range(work.num_layers)) * (work.attention_dropout > 0)
    parts["kept"] = sum(kept)
    o, _, p = roles(work.num_layers - 1)
    logits = (n // shape[p]) * (w[-1] // shape[o]) * F32
    # each phase holds the kept tensors of the layers before it (forward) or up to it
    # (backward), and its own; the loss holds all of them and the logits' gradient
    peak = max([sum(kept[:layer]) + t for layer, t in enumerate(forward)]
               + [sum(kept) + 2 * logits]
               + [sum(kept[:layer + 1]) + t for layer, t in enumerate(backward)])
    parts["transient"] = max(0.0, peak - parts["kept"])
    return parts
