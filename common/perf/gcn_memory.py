"""Peak memory per rank of a Plexus 3D GCN/GraphSAGE training step (docs/design/perf-model.md
section "Memory"): what lives for the whole run, and the largest set of tensors alive at any
one moment of the step, found by walking the step phase by phase as plexus.model runs it.

Persistent bytes: the adjacency blocks of ``min(6, L)`` layer layouts (CSR; layouts of one
parity cut alike share a block, as on one rank; GraphSAGE's root blocks; the last layer's
labelled rows; no transposes: the backward reads each block as its own transpose,
plexus.transpose) and the cache-blocked SpMM's column-slice plans kept with them (at most a
cut per row and slice, and one more slice than the mean row length), the feature
shard (with its gradient and AdamW moments when trained), and every weight with ``dW`` and the
AdamW moments.

Kept for backward, per layer ``l`` with roles (O, I, P): ``H_l`` (and GraphSAGE's ``R_l``)
``[N/P, D_l/I]`` for ``dW``, in the stored precision; the ReLU's mask (one bit an entry,
plexus.ops.BitMask) and the batch or layer norm's centred block ``[N/P, D_l+1/O]``; the
logits of the last layer; the dropout keep-mask of ``F_l`` in bits (of fixed input features
only when ``H_0`` is recomputed: otherwise no gradient flows back through it). With fixed
features the cached ``H_0`` *is* the ``H_0`` kept for ``dW`` (the same storage), so it is
counted once; a recomputed ``H_0`` (``work.recomputes_first``) is not kept at all.

The step's phases, in order, each adding its short-lived tensors (float32) to what is kept
by then:

* forward, layer ``l``: the input ``F_l [N/O, D_l/I]`` (layer 0: the all-gathered ``F_0`` of
  the first epoch) while ``H``/``R`` are written and all-reduced over O; then ``Q = H W``
  (GraphSAGE: ``H W + R W_r``, the second product accumulated into the first) all-reduced
  over I; then the norm (its input, which its output is written over, and the centred block
  it keeps; as torch operations also the squares, in bf16 a row chunk at a time);
* the loss on the logits, and their gradient;
* backward, layer ``l`` from the last: the ReLU's and the norm's backward: with
  ``fused_norm`` (plexus.norms' kernels, a batch norm on the CPU) ``dq`` written over ``dy``;
  as torch operations ``dy``, the ReLU's output, a product and ``dq`` (in bf16 a batch
  norm's product and widened centred block a row chunk at a time, ``dq`` over ``dy``);
  ``dQ`` with one of ``dH``/``dR`` while ``H_l`` is still kept; then ``dH`` (and ``dR``)
  all-reduced over O; the transposed SpMM's output ``dF [N/O, D_l/I]`` beside them
  (GraphSAGE: one block, each term's product added into it); ``dF`` all-reduced over P.
  Layer 0 with fixed features has no ``dH``.

A layer that multiplies first (``work.weight_first_layer``, ``Q = A (F' W)``) keeps ``F'
[N/O, D_l/I]`` for ``dW`` instead of ``H`` (in bf16 one copy per term, in float32 one for both);
its forward holds ``F'`` and ``G = F' W [N/O, D_l+1/O]`` (per term), then ``G`` and ``Q``; its
backward ``dQ`` and ``dG = A^T dQ``, then ``dG`` with ``dF' = dG W^T`` and ``dW``, then ``dF``
all-reduced over P.

Where layer 0 recomputes ``H_0`` (``work.recomputes_first``) its forward and backward are one
phase each: ``Q`` (or ``dQ``), ``dropout(F_0)`` and one of :data:`RECOMPUTE_BLOCKS` row blocks
of ``H_0`` at a time (on a GPU the whole ``H_0``: this under-counts there).

An in-place all-reduce of ``B`` bytes over more than one rank needs a ``B/2`` receive buffer
(MPICH's reduce-scatter halving; measured with mpich 4 on 2, 4 and 8 ranks; NCCL needs none,
so on GPUs this over-counts by at most half a block). Gathered weights and their gradients
(``2 D_l/I D_l+1/O`` floats) are the smallest transients and count where they are larger.
Pure Python.
"""

from __future__ import annotations

from collections.abc import Mapping

from common.comm_stats import WIRE_PIECE_BYTES
from common.grid import round_up
from common.perf.gcn_workload import AGGREGATION_BLOCKS, F32, GCNWorkload

__all__ = ["gcn_memory", "gcn_memory_parts", "gcn_memory_phases"]

RECOMPUTE_BLOCKS = 8  # row blocks of a recomputed H_0 on the CPU (plexus.ops.RecomputedMatmul)
NORM_CHUNKS = 8  # row chunks of a bf16 batch norm's torch temporaries (plexus.norms)
# the X rows one column slice of the cache-blocked SpMM may take (plexus.slicing: 1/2 of a
# 32 MiB last-level cache; the planner does not read the machine's cache)
SLICE_BUDGET_BYTES = (32 << 20) // 2
# a plan's cut: a uint16 offset from its row's start (plexus.slicing.cut_dtype; a block with a
# row of 65,536 nonzeros or more keeps its index width, which the planner does not foresee)
CUT_BYTES = 2
EXCHANGE_BYTES = 4  # an entry of plexus.root_rows.RootExchange's maps (int32)
# the float32 copy of a bf16 H that dW = H^T dQ reads: whole up to this size, else a row block
# of it at a time (common.dense.WIDEN_BYTES)
WIDEN_BYTES = 64 << 20
PARTS = ("adjacency", "features", "nodes", "weights", "kept_h", "kept_other", "transient")


def gcn_memory(work: GCNWorkload, shape: Mapping[str, int], *,
               stored_transposes: bool = False, fused_norm: bool = True,
               cut_bytes: int | None = CUT_BYTES, compact_root: bool = True,
               widen_bytes: int | None = WIDEN_BYTES, rounds_x: bool = False) -> float:
    """Peak bytes per rank of a training step on grid ``{"x": X, "y": Y, "z": Z}``: the sum of
    :func:`gcn_memory_parts`."""
    return sum(gcn_memory_parts(work, shape, stored_transposes=stored_transposes,
                                cut_bytes=cut_bytes, fused_norm=fused_norm,
                                compact_root=compact_root, widen_bytes=widen_bytes,
                                rounds_x=rounds_x).values())


def gcn_memory_parts(work: GCNWorkload, shape: Mapping[str, int], *,
                     stored_transposes: bool = False, cut_bytes: int | None = CUT_BYTES,
                     fused_norm: bool = True, compact_root: bool = True,
                     widen_bytes: int | None = WIDEN_BYTES,
                     rounds_x: bool = False) -> dict[str, float]:
    """:func:`gcn_memory` by part, bytes per rank: ``adjacency`` (CSR blocks, transposes, the
    last layer's labelled rows), ``features`` (the flat shard of ``F_0``, with its gradient
    and AdamW moments when trained), ``nodes`` (the rank's per-node vectors: labels, node ids,
    split masks, :func:`_node_vectors`), ``weights`` (``W``, ``dW`` and the AdamW moments),
    ``kept_h`` (every ``H_l``, and GraphSAGE's ``R_l``, kept for ``dW``; the cached ``H_0`` is
    layer 0's), ``kept_other`` (the logits, ReLU and dropout masks, the norm's centred block)
    and ``transient`` (what the peak phase of :func:`gcn_memory_phases` holds beyond all that
    is kept). ``stored_transposes``: every block's transpose is stored too (a GPU, where
    torch multiplies it; on the CPU the backward reads the block itself). ``fused_norm``: a
    batch norm and its ReLU run as plexus.norms' kernels (the CPU), else as torch operations
    (:func:`gcn_memory_phases`). ``cut_bytes``: a column-slice plan's bytes per cut (None: the
    index width, the plans' positions before they were offsets). ``compact_root`` (what the
    planner counts before that saving when False): GraphSAGE's root blocks keep the CSR of
    ``S`` only where an SpMM reads it (plexus.data.shard.RootBlock), not for every layout.
    ``widen_bytes``: the float32 copy of a bf16 ``H`` for ``dW`` is made a row block of at
    most this size at a time (common.dense.tn), or whole (None). ``rounds_x``: in bf16 a later
    layer's SpMM reads a bf16 copy of its float32 operand (a GPU: plexus.ops.read_in), held
    beside it."""
    layers = _layers(work, shape)
    parts = dict.fromkeys(PARTS, 0.0)
    adjacency, released = _adjacency(work, shape, stored_transposes, cut_bytes, compact_root)
    parts["adjacency"] = adjacency - released
    n, w = work.padded(shape)
    f0 = (n // shape["x"]) * (w[0] // shape["y"])
    parts["features"] = round_up(f0, shape["z"]) // shape["z"] * (
        4 * F32 if work.learn_features else work.stored_bytes)
    parts["nodes"] = _node_vectors(work, shape)
    for lay in layers:
        parts["weights"] += work.terms * 4 * round_up(lay["a"] * lay["b"], lay["p_size"]) \
            // lay["p_size"] * F32  # W, dW and the two AdamW moments, flat shards
        parts["kept_h"] += lay["kept_h"]
        parts["kept_other"] += lay["kept_other"] + lay["dropout"]
    kept = parts["kept_h"] + parts["kept_other"]
    phases = gcn_memory_phases(work, shape, fused_norm=fused_norm, widen_bytes=widen_bytes,
                               rounds_x=rounds_x)
    if released:  # layer 0's blocks, alive until H_0 is cached
        phases["forward 0 aggregate"] += released
    parts["transient"] = max(0.0, max(phases.values()) - kept)
    return parts


def gcn_memory_phases(work: GCNWorkload, shape: Mapping[str, int], *,
                      fused_norm: bool = True,
                      widen_bytes: int | None = WIDEN_BYTES,
                      rounds_x: bool = False) -> dict[str, float]:
    """Bytes per rank alive beyond the persistent ones (adjacency, features, weights) at each
    phase of a training step (module docstring), keyed ``"forward 0 aggregate"``,
    ``"backward 2 dF"`` and so on. ``fused_norm``, ``widen_bytes``, ``rounds_x``: as
    :func:`gcn_memory_parts`."""
    fused = fused_norm and work.norm == "batch"
    layers = _layers(work, shape)
    k, last = work.terms, len(layers) - 1
    phases: dict[str, float] = {}
    before = 0.0  # kept by the layers before this one
    for lay in layers:
        rows, a, b = lay["rows"], lay["a"], lay["b"]
        weights = 2 * a * b * F32  # gathered W and its product's operand
        h32 = rows * a * F32
        if lay["index"] == 0 and not work.learn_features:
            f_in = lay["in_rows"] * a * work.stored_bytes  # the first epoch's gathered F_0
        else:
            f_in = lay["in_rows"] * a * F32
        base = before + lay["dropout"]
        q32 = rows * b * F32
        # the bf16 copy of a float32 SpMM operand, rows of it a width (rounds_x)
        narrow_x = lay["in_rows"] * work.stored_bytes if rounds_x and work.stored_bytes < F32 \
            else 0
        if lay["remade"]:  # F' made (beside its mask), F' W per term, then A G; nothing kept
            g32, f0 = lay["in_rows"] * b * F32, lay["in_rows"] * a
            wide_f = f0 * F32 if work.stored_bytes != F32 else 0  # bf16 F' widened for W
            phases["forward 0 make"] = base + _remade(work, lay)
            phases["forward 0 matmul"] = base + f0 * work.stored_bytes + wide_f + k * g32 + \
                weights
            phases["forward 0 aggregate"] = base + k * g32 + (3 if k == 2 else 1) * q32 + \
                narrow_x * b
        elif lay["first"]:  # per term F' W, then A G; SAGE: Q + S G_r; O = I = 1
            g32 = lay["in_rows"] * b * F32
            # bf16: F' rounded (into a float32 copy where no dropout made a fresh F'), read
            # by both terms' products until the second is made, and one bf16 copy kept for
            # both terms' dW (lay["kept_h"]); float32 keeps F' itself
            wide = work.stored_bytes != F32
            f_held = (2 if work.dropout == 0 else 1) * f_in if wide else 0
            phases[f"forward {lay['index']} matmul"] = base + (f_held + lay["kept_h"] if wide
                                                               else f_in) + g32 + weights + (
                q32 if k == 2 else 0)  # the root term's G beside the adjacency term's Q
            # one term's G at a time (freed after its SpMM); SAGE adds the second Q into
            # the first
            phases[f"forward {lay['index']} aggregate"] = base + lay["kept_h"] + f_held + (
                2 * q32 + g32 if k == 2 else g32 + q32) + narrow_x * b
        elif lay["recomputed"]:  # Q filled row block by row block: nothing of H is kept
            phases[f"forward {lay['index']} recompute"] = base + _recompute(work, lay)
        else:  # narrowed: H (R) summed in bf16 beside one float32 row block of scratch
            held = (k * rows * a * work.stored_bytes + -(-rows // AGGREGATION_BLOCKS) * a * F32
                    if lay["narrow"] else k * h32)
            phases[f"forward {lay['index']} aggregate"] = base + f_in + held + max(
                _reduce_buffer(h32, lay["o_size"], work), weights) + (
                narrow_x * a if lay["index"] > 0 else 0)  # (F_0 is stored so)
            # bf16: the float32 H until H W (a narrowed H is widened a row block at a time)
            wide_h = h32 if work.stored_bytes != F32 and not lay["narrow"] else 0
            phases[f"forward {lay['index']} matmul"] = base + lay["kept_h"] + wide_h + (
                q32 + max(_reduce_buffer(q32, lay["i_size"], work), weights))  # SAGE: R W_r
            # added into H W by the product itself
        if lay["index"] < last and work.norm != "none":  # its input (the output written
            # over it) and the squares (a batch norm's kernels make none; in bf16 torch's
            # squares a chunk at a time)
            squares = 0 if fused else q32 / NORM_CHUNKS if _chunked_norm(work) else q32
            phases[f"forward {lay['index']} norm"] = base + lay["kept_h"] + lay["norm"] + (
                q32 + squares)
        before += lay["kept_h"] + lay["kept_other"] + lay["dropout"]
    top = layers[-1]
    phases["loss"] = before + 2 * top["rows"] * top["b"] * F32  # softmax temporaries, dlogits
    for lay in reversed(layers):
        rows, a, b = lay["rows"], lay["a"], lay["b"]
        h32, q32 = rows * a * F32, rows * b * F32
        own = lay["kept_h"] + lay["kept_other"] + lay["dropout"]
        before -= own
        base = before + lay["dropout"]
        if lay["index"] < last:  # the ReLU's backward (dy, its output), the norm's (dy, a
            # product, dq; in bf16 a batch norm's product and dq a chunk at a time, over dy;
            # its kernels write dq over dy)
            blocks = 1 if fused else 3 if work.norm != "none" and not _chunked_norm(work) else 2
            phases[f"backward {lay['index']} activation"] = before + own + blocks * q32
        grad_in = lay["index"] > 0 or work.learn_features
        if lay["remade"]:  # dQ -> dG = A^T dQ (per term); F' made again; dW = F'^T dG
            g32, f0 = lay["in_rows"] * b * F32, lay["in_rows"] * a
            wide_f = f0 * F32 if work.stored_bytes != F32 else 0
            phases["backward 0 dG"] = base + q32 + k * g32
            phases["backward 0 matmul"] = base + k * g32 + max(
                _remade(work, lay), f0 * work.stored_bytes + wide_f + 2 * a * b * F32)
            continue
        if lay["first"]:  # per term dG = A^T dQ -> dF' = dG W^T, dW; summed -> dF over P
            g32, df = lay["in_rows"] * b * F32, lay["in_rows"] * a * F32
            # one term's dG at a time; the first term's dF' waits for the second's, whose
            # dG is made after dQ's last use (autograd runs the root term's SpMM and
            # product backward first)
            phases[f"backward {lay['index']} dG"] = base + lay["kept_h"] + q32 + g32 + (
                k - 1) * df
            phases[f"backward {lay['index']} matmul"] = base + lay["kept_h"] + g32 + max(
                q32 + df, k * df) + 2 * a * b * F32
            phases[f"backward {lay['index']} dF"] = base + df + _reduce_buffer(
                df, lay["p_size"], work)
            continue
        if lay["recomputed"]:
            phases[f"backward {lay['index']} recompute"] = base + _recompute(work, lay)
        # per term (GraphSAGE: R's first, then H's): a bf16 H widened for dW a row block at
        # a time (common.dense.tn), then dH (float32, or narrowed bf16 rounded a row block at
        # a time); the first term's dH is held while the second's run, whose kept H is then
        # all that is kept
        h16 = rows * a * work.stored_bytes
        done = (h16 if lay["narrow"] else h32) if grad_in else 0
        wide = h32 if widen_bytes is None else min(h32, widen_bytes)
        step = max(wide if work.stored_bytes < F32 else 0, done)
        per = lay["kept_h"] / k
        phases[f"backward {lay['index']} matmul"] = base + q32 + 2 * a * b * F32 + step + max(
            lay["kept_h"], per + (k - 1) * done)
        if grad_in:  # dH (dR) all-reduced over O; A^T dH (+ S^T dR, added into the same
            df = lay["in_rows"] * a * F32  # block: plexus.ops.SharedGradient); then dF
            held = k * (h16 if lay["narrow"] else h32)
            phases[f"backward {lay['index']} dF"] = base + max(  # all-reduced over P
                held + _reduce_buffer(h32, lay["o_size"], work), held + df,
                df + _reduce_buffer(df, lay["p_size"], work))
    return phases


def _node_vectors(work: GCNWorkload, shape: Mapping[str, int]) -> float:
    """Bytes of the per-node vectors a rank keeps: its output rows' labels (int16 below 2^15
    classes), node ids (int32 below 2^31 nodes) and split masks (plexus.data.shard.
    node_dtypes), the node ids of each layer's input rows that its dropout masks are drawn
    from (int64, plexus.layer_dropout), and GraphSAGE's owners of the rows of each distinct
    root block and of the last layer's labelled rows (int16, plexus.data.shard.RootBlock)."""
    n, _ = work.padded(shape)
    last = work.num_layers - 1
    label = 2 if work.num_classes < 2**15 else 4
    node = 4 if n < 2**31 else 8
    rows_out = n // shape[work.axes(last)[2]]
    out = rows_out * (label + node + 3)
    roots = set()
    for layer in range(work.num_layers):
        o, _, p = work.axes(layer)
        out += 8 * (n // shape[o]) * (work.dropout > 0)
        if work.terms == 2 and layer < 6:  # layouts cut alike share a root block
            roots.add((_block_key(layer, o, p, shape), n // shape[p]))
    labelled = work.output_rows(shape) if work.output_rows(shape) < rows_out else 0
    return out + 2 * (sum(rows for _, rows in roots) + labelled * (work.terms == 2))


def _chunked_norm(work: GCNWorkload) -> bool:
    """Whether the norm makes its temporaries a row chunk at a time (a batch norm keeping its
    centred block in bf16: plexus.norms._RowSplitBatchNorm)."""
    return work.norm == "batch" and work.stored_bytes < F32


def _recompute(work: GCNWorkload, lay: dict) -> float:
    """What a recomputed layer 0 holds in either pass (plexus.ops.RecomputedMatmul): ``Q``
    (forward) or ``dQ`` (backward); ``dropout(F_0)``, made beside its bool mask where that is
    unpacked (:func:`_unpacked_mask`) and the gathered ``F_0`` over P > 1; then one row block
    of ``H_0`` with its all-reduce buffer and its product with ``W`` (``dW``'s part)."""
    a, b = lay["a"], lay["b"]
    f0 = lay["in_rows"] * a
    block = lay["rows"] * a * F32 / RECOMPUTE_BLOCKS
    return lay["rows"] * b * F32 + f0 * work.stored_bytes + max(
        _unpacked_mask(work, f0) + f0 * work.stored_bytes * (lay["p_size"] > 1),
        block + _reduce_buffer(block, lay["o_size"], work) + 2 * a * b * F32)


def _remade(work: GCNWorkload, lay: dict) -> float:
    """What making ``F' = dropout(F_0)`` holds (plexus.ops.RemadeInputMatmul, either pass):
    ``F'`` beside its bool mask where that is unpacked (:func:`_unpacked_mask`) and, over
    P > 1, the gathered ``F_0``."""
    f0 = lay["in_rows"] * lay["a"]
    return f0 * work.stored_bytes + _unpacked_mask(work, f0) + f0 * work.stored_bytes * (
        lay["p_size"] > 1)


def _unpacked_mask(work: GCNWorkload, entries: int) -> int:
    """Bytes of the bool mask a remade ``dropout(F_0)`` unpacks from its bits: none in
    float32, where plexus.ops.BitMask.clear_ reads the bits in one numba pass on the CPU (the
    planner's device), one an entry in bf16."""
    return entries if work.stored_bytes != F32 else 0


def _bits(entries: int) -> int:
    """Bytes of a mask of ``entries`` kept one bit an entry (plexus.ops.BitMask)."""
    return -(-entries // 8)


def _reduce_buffer(nbytes: float, group_size: int, work: GCNWorkload) -> float:
    """The buffers of an in-place all-reduce of ``nbytes`` (float32) over ``group_size``
    ranks: MPI's receive buffer (half), or with bf16 messages (common.collectives) one
    piece's bf16 message and what it receives (the message's buffer then takes the gathered
    sums) and the float32 sum of this rank's chunk of it."""
    if group_size == 1:
        return 0.0
    if work.stored_bytes < F32:
        piece = min(nbytes, WIRE_PIECE_BYTES * F32 / work.stored_bytes)
        return piece * (1 + 1 / group_size)
    return nbytes / 2


def _layers(work: GCNWorkload, shape: Mapping[str, int]) -> list[dict]:
    """Per layer: its index, ``rows`` (of H and Q), ``in_rows`` (of F_l), widths ``a`` (D_l/I)
    and ``b`` (D_l+1/O), the sizes of O, I and P, and the bytes it keeps for backward."""
    n, w = work.padded(shape)
    k, kept = work.terms, work.stored_bytes
    last, last_rows = work.num_layers - 1, work.output_rows(shape)
    out = []
    for layer in range(work.num_layers):
        o, i, p = work.axes(layer)
        a, b = w[layer] // shape[i], w[layer + 1] // shape[o]
        rows = last_rows if layer == last else n // shape[p]
        norm = rows * b * kept if work.norm != "none" and layer != last else 0
        # the logits, or the ReLU's mask in bits
        other = (rows * b * F32 if layer == last else _bits(rows * b)) + norm
        first = work.weight_first_layer(layer, shape)
        # layer 0 of fixed features with dropout: H_0 recomputed, or F' remade (multiplying first)
        recomputed = layer == 0 and work.recomputes_first and not first
        remade = layer == 0 and work.recomputes_first and first
        if recomputed or remade:  # kept for dW: nothing,
            kept_h = 0
        elif first:  # F' [N/O, a]: one tensor for both terms (bf16: one copy, shared)
            kept_h = (n // shape[o]) * a * kept
        else:  # or H [rows, a] per term
            kept_h = k * rows * a * kept
        out.append({"index": layer, "rows": rows, "in_rows": n // shape[o], "a": a, "b": b,
                    "narrow": work.narrows(layer, shape),
                    "o_size": shape[o], "i_size": shape[i], "p_size": shape[p],
                    "kept_h": kept_h, "kept_other": other,
                    "norm": norm, "recomputed": recomputed, "first": first, "remade": remade,
                    # the keep-mask of F_l in bits, kept where a gradient flows back through
                    # it, or for recomputing H_0 or remaking F'
                    "dropout": _bits((n // shape[o]) * a) if work.dropout > 0 and (
                        layer > 0 or work.learn_features or recomputed or remade) else 0})
    return out


def _adjacency(work: GCNWorkload, shape: Mapping[str, int],
               stored_transposes: bool, cut_bytes: int | None = CUT_BYTES,
               compact_root: bool = True) -> tuple[float, float]:
    """CSR bytes per rank: the distinct blocks of ``min(6, L)`` layouts (and GraphSAGE's root
    blocks), the last layer's labelled rows, the forward SpMM's column-slice plans, and the
    row cursors of the backward's ``A^T`` product (plexus.transpose, while it runs); with
    ``stored_transposes`` (a GPU) the transposed CSR of every block instead of the cursors.
    And of those, the bytes of layer 0's blocks that the trainer drops once ``H_0`` is cached
    (plexus.model.PlexusGCN.release_first_blocks: fixed features, no dropout, 2 to 6 layers,
    aggregating first, and no other layer's blocks cut alike)."""
    n, _ = work.padded(shape)
    idx, k = work.index_width(shape), work.terms
    last, last_rows = work.num_layers - 1, work.output_rows(shape)
    _, w = work.padded(shape)
    total, cursor, cut, planned = 0.0, 0.0, set(), set()
    by_key: dict[tuple, float] = {}
    first_key: tuple | None = None
    copies = 2 if stored_transposes else 1
    parked = None if stored_transposes else _parked_key(work, shape)
    spmm_s = _root_spmm_keys(work, shape, compact_root)
    for layer in range(work.num_layers):
        o, i, p = work.axes(layer)
        key = _block_key(layer, o, p, shape)
        full_nnz = work.imbalance * work.nnz / (shape[p] * shape[o])
        # the last layer's own full block of A where no step reads it (only its root block)
        adj_nnz = 0.0 if key == parked else full_nnz
        root_nnz = work.num_nodes / (shape[p] * shape[o]) if k == 2 else 0.0  # GraphSAGE's
        rows_a, rows_t = n // shape[p], n // shape[o]
        full = layer != last or last_rows == rows_a  # a step reads the layer's full block
        transposed = (rows_t + 1) * idx if stored_transposes else 0
        if layer < 6 and key not in cut:
            cut.add(key)
            block = copies * adj_nnz * (idx + F32) + (key != parked) * (rows_a + 1) * idx + (
                transposed)
            if k == 2:  # GraphSAGE's S, compact (plexus.data.shard.RootBlock): this rank's
                # columns, and its CSR only where an SpMM reads it
                block += EXCHANGE_BYTES * root_nnz + (key in spmm_s) * (
                    copies * root_nnz * (idx + F32) + (rows_a + 1) * idx + transposed)
            total += block
            by_key[key] = by_key.get(key, 0.0) + block
            cursor = 0.0 if stored_transposes else max(cursor, rows_a * idx)
        if layer < 6 and k == 2 and full and work.exchanges_root(layer, shape) and (
                (key, "slots") not in cut):
            cut.add((key, "slots"))  # where each row comes from (plexus.root_rows)
            total += EXCHANGE_BYTES * rows_a
            by_key[key] = by_key.get(key, 0.0) + EXCHANGE_BYTES * rows_a
        if layer == last % 6 and last_rows < rows_a:  # the labelled rows
            frac = last_rows / rows_a
            total += copies * full_nnz * frac * (idx + F32) + (last_rows + 1) * idx + (
                transposed)
            if k == 2:
                exchanged = work.exchanges_root(layer, shape)
                total += EXCHANGE_BYTES * (root_nnz * frac + last_rows * exchanged) + (
                    not exchanged or not compact_root) * (
                    copies * root_nnz * frac * (idx + F32) + (last_rows + 1) * idx + transposed)
        # the forward SpMM's column-slice plans, one per block and X width, kept with the
        # block: A_l [rows_a, rows_t] times F_l (D_l/I wide, or D_l+1/O where the layer
        # multiplies first); the backward's A_l^T reads A_l with a plan of a few cuts;
        # S's where an SpMM reads it
        width = (w[layer + 1] // shape[o] if work.weight_first_layer(layer, shape)
                 else w[layer] // shape[i])
        row_bytes = width * F32
        if (key, row_bytes) not in planned:
            planned.add((key, row_bytes))
            s_nnz = root_nnz if _reads_s(work, shape, layer, compact_root) else 0.0
            plans = sum(_plan_bytes(rows_a, rows_t, blk, row_bytes, cut_bytes or idx)
                        for blk in (adj_nnz, s_nnz) if blk)
            total += plans
            by_key[key] = by_key.get(key, 0.0) + plans
        if layer == 0:
            first_key = key
        elif layer < 6 and key == first_key:
            first_key = None  # another layer reads layer 0's blocks
    if first_key is None or not (
            work.cache_first_aggregation and not work.learn_features and work.dropout == 0
            and 1 < work.num_layers <= 6 and not work.weight_first_layer(0, shape)):
        return total + cursor, 0.0
    return total + cursor, by_key[first_key]


def _root_spmm_keys(work: GCNWorkload, shape: Mapping[str, int],
                    compact_root: bool = True) -> set:
    """The block keys of GraphSAGE's ``S`` whose CSR a training step multiplies (a layer that
    does not exchange its root rows, :meth:`GCNWorkload.exchanges_root`); the last layer's
    full block only where its step computes every row. Every layer's without
    ``compact_root``."""
    if work.terms != 2:
        return set()
    return {_block_key(layer, *work.axes(layer)[::2], shape)
            for layer in range(work.num_layers) if _reads_s(work, shape, layer, compact_root)}


def _reads_s(work: GCNWorkload, shape: Mapping[str, int], layer: int,
             compact_root: bool = True) -> bool:
    """Whether a training step multiplies by the CSR of ``layer``'s block of ``S``: a layer
    that does not exchange its root rows (the last one only where it computes every row);
    every layer without ``compact_root``."""
    n, _ = work.padded(shape)
    full = (layer != work.num_layers - 1
            or work.output_rows(shape) == n // shape[work.axes(layer)[2]])
    return not compact_root or (full and not work.exchanges_root(layer, shape))


def _block_key(layer: int, o: str, p: str, shape: Mapping[str, int]) -> tuple:
    """Which block a layer's layout reads: layouts of one parity whose rows and columns are
    cut alike on every rank (the same axis, or axes of one rank) share one block
    (plexus.data.memory._blocks)."""
    return (layer % 2, p if shape[p] > 1 else "", o if shape[o] > 1 else "")


def _parked_key(work: GCNWorkload, shape: Mapping[str, int]) -> tuple | None:
    """The block key of the last layer's full ``A`` block where a memory-mapped dataset
    (``work.mapped``) gives its pages back (plexus.data.shard.GraphShard.restrict_last_layer):
    the last layer runs on the labelled rows alone, within the first six layouts, and no
    other layer reads its block. None where it stays resident."""
    last = work.num_layers - 1
    o, _, p = work.axes(last)
    n, _ = work.padded(shape)
    if not work.mapped or last >= 6 or work.output_rows(shape) >= n // shape[p]:
        return None
    key = _block_key(last, o, p, shape)
    others = {_block_key(layer, *work.axes(layer)[::2], shape) for layer in range(last)}
    return None if key in others else key


def _plan_bytes(rows: int, cols: int, nnz: float, row_bytes: int, cut_bytes: int) -> float:
    """The most a block's column-slice plan takes (plexus.slicing.column_slicing: a cut per row
    and slice boundary, ``cut_bytes`` each; at most one more slice than the mean row
    length)."""
    budget = max(1, SLICE_BUDGET_BYTES // max(1, row_bytes))
    if min(cols, nnz) <= budget:
        return 0.0
    return rows * min(-(-cols // budget) - 1, nnz // max(1, rows)) * cut_bytes
