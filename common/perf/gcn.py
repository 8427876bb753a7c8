"""Performance model of one Plexus 3D GCN epoch (docs/design/plexus-3d.md sections 2-4,
docs/design/perf-model.md).

Grid ``X x Y x Z``; layer ``l`` gives the axes the roles (O, I, P) = (x, y, z), (z, x, y),
(y, z, x) for ``l % 3 = 0, 1, 2``. With ``N`` nodes and widths ``D_l`` padded exactly as
:mod:`plexus.layout` pads them, a rank of layer ``l`` holds
``A_l [N/P, N/O]`` (``nnz / (P O)`` nonzeros), ``F_l [N/O, D_l/I]``, ``W_l [D_l/I, D_l+1/O]``
(flattened, ``1/P`` of it), ``H_l [N/P, D_l/I]`` and ``Q_l [N/P, D_l+1/O]``.

Collectives per layer (``M`` = full bytes, float32; a flat shard is padded to a multiple of
``P`` elements): (1) all-gather F over P (layer 0), (2) all-reduce H over O, (3) all-gather W
over P, (4) all-reduce Q over I, (5) all-gather W over P, (6) reduce-scatter dW over P,
(7) all-reduce dH over O, (8) all-reduce dF over P (layers >= 1) or reduce-scatter (layer 0,
trainable features). GraphSAGE (``model="sage"``) also aggregates the root term ``R = S F``
with the permuted identity ``S`` (about ``N / (P O)`` nonzeros per block) and multiplies it by
a second weight: (3), (5) and (6) run twice; (1), (4) and (8) once. Where the layer aggregates
its own input (:meth:`GCNWorkload.exchanges_root`) the root term moves ``R``'s rows by owner
(plexus.root_rows): an all-gather over O forward and a reduce-scatter backward, each of ``R``'s
bytes (half an all-reduce's; the padding of uneven owners is not counted), beside (2) and (7) of
``H``; elsewhere (2) and (7) run twice.

With fixed features ``H_0`` is cached after the first epoch, so a steady
epoch skips (1), (2) and the layer-0 SpMM, and nothing flows back into layer 0's aggregation:
(5), (7), (8) and the SpMM with ``A_0^T`` are skipped too. The trainer adds the sharded loss
(plexus/loss.py): three all-reduces of ``[R]`` over O and one scalar over P. An epoch is the
training step the trainer times (``epoch_s``), of the paper's bare model (no bias, dropout or
norm); the evaluation forward after it (``eval_s``) is not modelled.

The last layer computes only the ``R`` output rows of labelled nodes when at most half the
nodes are labelled (:func:`labelled_rows_pay`, as plexus.model does): its SpMM reads those
rows of ``A`` (about ``R / (N/P)`` of the block's nonzeros), its ``H``, ``Q`` and the loss
are ``R`` rows, and the gathered rows and their transpose are kept beside the full block.
``R = round(labelled_fraction * num_nodes / P)``, the mean over the ranks; otherwise
``R = N/P``.

Compute per rank:

* SpMM is memory-bound (docs/design/perf-model.md): ``bytes = nnz (b_idx + 4) + (rows + 1) b_idx
  + nnz * ceil(4 D / line) line + rows * 4 D``, time = bytes / spmm_bandwidth. The gathered
  row is rounded up to the cache line or sector, the shape penalty that makes narrow (tall and
  skinny) dense operands slow per flop.
* GEMM ``[m, k] @ [k, n]``: roofline ``max(2 m k n / flops, 4 (m k + k n + m n) / mem_bw)``.
* A layer that multiplies first (:func:`weight_first_pays`, ``Q = A (F' W)``): its SpMMs, both
  passes, gather ``D_l+1/O``-wide float32 rows, and its GEMMs run over the ``N/O`` rows of
  ``F'`` (the same as ``N/P`` on one rank). Layer 0 of fixed features with dropout that
  multiplies first runs its SpMM once forward and ``A^T dQ`` backward (for ``dW``; no ``dF``),
  and aggregates nothing again (``F'`` is remade, an elementwise pass).
* Elementwise: ReLU forward/backward, the out-of-place copy of each all-reduce, the loss and
  AdamW, as bytes / memory bandwidth.

Memory per rank: :mod:`common.perf.gcn_memory` (persistent shards, what each layer keeps for
backward, and the largest set of short-lived tensors of the step, phase by phase).

``precision="bf16"`` (plexus.train --precision bf16, docs/design/plexus-3d.md section 11): the
feature shard, its all-gather (1), the layer-0 SpMM's gathered rows (on a GPU every forward
SpMM's: a later layer's float32 ``F'`` rounded for it in one pass), the kept ``H_l``, the
norm's kept input and the cached ``H_0`` take 2 bytes an element, and so does every message
of (2)-(8) (sums add in float32: common.collectives); the weights, gradients and AdamW state,
the logits, the norm's and the loss's collectives and the other SpMM operands stay float32.
Pure Python.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from common.grid import ProcessGrid, ceil_div, round_up
from common.perf.gat import gat_collectives, gat_compute, gat_memory
from common.perf.gcn_memory import RECOMPUTE_BLOCKS as RECOMPUTE_BLOCKS  # re-exported
from common.perf.gcn_memory import gcn_memory
from common.perf.gcn_memory import gcn_memory_parts as gcn_memory_parts  # re-exported
from common.perf.gcn_memory import gcn_memory_phases as gcn_memory_phases  # re-exported

# the workload and its rules (common.perf.gcn_workload), re-exported
from common.perf.gcn_workload import AGGREGATION_BLOCKS as AGGREGATION_BLOCKS
from common.perf.gcn_workload import AXES, F32, roles
from common.perf.gcn_workload import GCNWorkload as GCNWorkload
from common.perf.gcn_workload import comm_offloaded as comm_offloaded
from common.perf.gcn_workload import labelled_rows_pay as labelled_rows_pay
from common.perf.gcn_workload import ogbn_papers100m as ogbn_papers100m
from common.perf.gcn_workload import ogbn_products as ogbn_products
from common.perf.gcn_workload import overlap_pays as overlap_pays
from common.perf.gcn_workload import weight_first_pays as weight_first_pays
from common.perf.machine import MachineProfile
from common.perf.model import (
    Collective,
    Plan,
    Prediction,
    bytes_by_axis,
    comm_seconds,
    factorizations,
    group_stride,
    rank_predictions,
)
from common.perf.roofline import gemm_seconds as gemm_seconds  # re-exported
from common.perf.roofline import spmm_bytes as spmm_bytes  # re-exported
from common.precision import PRECISIONS as PRECISIONS


def gcn_collectives(work: GCNWorkload, shape: Mapping[str, int], *, first_epoch: bool = False,
                    loss: bool = True) -> list[Collective]:
    """Every collective one rank issues in one epoch (see the module docstring).

    Args:
        work: the workload.
        shape: ``{"x": X, "y": Y, "z": Z}``.
        first_epoch: epoch 1 (computes ``H_0`` even when it is cached afterwards).
        loss: include the trainer's loss collectives.
    """
    n, w = work.padded(shape)
    out: list[Collective] = []
    k = work.terms

    def flat(numel: int, g: int, width: int = F32) -> int:
        return round_up(numel, g) * width

    last_rows = work.output_rows(shape)
    wire = work.stored_bytes  # (2)-(8) travel in the precision (common.collectives' wire)
    for layer in range(work.num_layers):
        o, i, p = roles(layer)
        O, I, P = shape[o], shape[i], shape[p]  # noqa: N806 - the paper's names
        f_block = (n // O) * (w[layer] // I)
        w_flat = flat((w[layer] // I) * (w[layer + 1] // O), P, wire)
        rows = last_rows if layer == work.num_layers - 1 else n // P
        h_bytes = rows * (w[layer] // I) * wire
        q_bytes = rows * (w[layer + 1] // O) * wire
        forward, backward = work._runs(layer, first_epoch)
        again = 2 if layer == 0 and work.recomputes_first else 1  # H_0 recomputed backward
        if layer == 0 and forward:
            out.append(Collective(p, "all_gather", flat(f_block, P, work.stored_bytes),
                                  count=again))  # (1)
        root = work.exchanges_root(layer, shape)  # R's rows by owner
        if forward:
            out.append(Collective(o, "all_reduce", h_bytes, count=(1 if root else k) * again))
            if root:  # (2), and R = S F' gathered from the ranks that own its rows
                out.append(Collective(o, "all_gather", h_bytes, count=again))
        out.append(Collective(p, "all_gather", w_flat, count=k))  # (3)
        out.append(Collective(i, "all_reduce", q_bytes))  # (4)
        if backward:
            out.append(Collective(p, "all_gather", w_flat, count=k))  # (5)
        out.append(Collective(p, "reduce_scatter", w_flat, count=k))  # (6)
        if work.norm != "none" and layer < work.num_layers - 1:
            # mean and variance, both passes; the affine weight and bias are replicated over
            # P and their gradients all-reduced there (plexus.norms)
            affine_bytes = w[layer + 1] // O * F32
            if work.norm == "batch":  # statistics per column, over the rows' axis P: the sum
                # and the sum of squares forward, both gradient sums in one call backward (in
                # bf16 with the kept centred block's column sum, to recentre it)
                out.append(Collective(p, "all_reduce", affine_bytes, count=2))
                out.append(Collective(p, "all_reduce", (
                    3 if work.stored_bytes < F32 else 2) * affine_bytes))
            else:  # layer norm: statistics per row, over the columns' axis O
                out.append(Collective(o, "all_reduce", rows * F32, count=4))
                out.append(Collective(p, "all_reduce", affine_bytes, count=2))
        if backward:
            out.append(Collective(o, "all_reduce", h_bytes, count=1 if root else k))  # (7)
            if root:  # dR summed onto the ranks that own its rows
                out.append(Collective(o, "reduce_scatter", h_bytes))
            if layer == 0:
                out.append(Collective(p, "reduce_scatter", flat(f_block, P, wire)))  # (8)
            else:
                out.append(Collective(p, "all_reduce", f_block * wire))  # (8)
    if loss:
        o, _, p = roles(work.num_layers - 1)
        out.append(Collective(o, "all_reduce", last_rows * F32, count=3))  # max, sum-exp, target
        out.append(Collective(p, "all_reduce", F32))  # the loss sum
    return out


def spmm_t_bytes(rows: int, cols: int, nnz: float, width: int, *, index_bytes: int,
                 cache_line: int, x_bytes: int = F32) -> float:
    """Bytes ``A^T @ Y`` moves for a CSR ``A [rows, cols]`` read as its own transpose
    (plexus.transpose, the CPU's backward), Y ``[rows, width]``: A once, the row cursors
    (written and read once a slice, counted three times), Y's rows once, and per nonzero one
    float32 output row read and written back (the output rows are random); the output
    ``[cols, width]`` is zeroed once."""
    row = ceil_div(width * F32, cache_line) * cache_line
    return (nnz * (index_bytes + F32) + 3 * (rows + 1) * index_bytes + rows * width * x_bytes
            + 2 * nnz * row + cols * width * F32)


def backward_spmm_bytes(machine: MachineProfile, rows: int, cols: int, nnz: float, width: int,
                        *, index_bytes: int, cache_line: int, x_bytes: int = F32) -> float:
    """Bytes of a layer's ``A^T @ Y`` (A ``[rows, cols]``): on a CPU the view of A's own CSR
    (:func:`spmm_t_bytes`), on a GPU the stored transpose (:func:`spmm_bytes`, ``cols``
    output rows)."""
    if machine.device_memory is not None:
        return spmm_bytes(cols, nnz, width, index_bytes=index_bytes, cache_line=cache_line,
                          x_bytes=x_bytes)
    return spmm_t_bytes(rows, cols, nnz, width, index_bytes=index_bytes,
                        cache_line=cache_line, x_bytes=x_bytes)


# what an all-reduce with bf16 messages (common.collectives, common.wire) costs in memory
# traffic per float32 element, against 8 (a copy) in float32: three passes that each take
# about as long as a copy on one core (round to bf16; add the g received chunks in float32;
# widen the gathered bf16 into the float32 result), so about three copies
WIRE_SUM_BYTES = 3 * 2 * F32
# the same for an H that stays bf16 (plexus.ops.BlockedAggregation's narrow): the rounding of
# the SpMM's float32 block into H (backward: autograd's of dH), and the sums; no widening
NARROW_SUM_BYTES = 2 * 2 * F32


def root_exchange_bytes(rows: int, width: int, owners: int, x_bytes: int, wire: int, *,
                        forward: bool, backward: bool, again: int = 1) -> float:
    """Memory traffic of GraphSAGE's root term ``R = S F'`` exchanged by owner
    (plexus.root_rows) on ``rows`` output rows of ``width`` columns over ``owners`` ranks:
    forward, this rank's ``rows / owners`` rows of ``F'`` packed into a message and the
    gathered messages put in row order (``R`` kept in the wire's dtype); backward, ``dR``
    packed by owner into messages, the received ones summed in float32, and this rank's sum
    added into ``dF``."""
    own = rows / owners * width
    out = 0.0
    if forward:
        out += again * (own * (x_bytes + wire) + rows * width * 2 * wire)
    if backward:
        grad = wire if wire < F32 else F32
        out += rows * width * (grad + wire) + rows * width * wire * (owners > 1) + own * 3 * F32
    return out


def gcn_compute(work: GCNWorkload, shape: Mapping[str, int], machine: MachineProfile, *,
                node_ranks: int, first_epoch: bool = False) -> dict[str, float]:
    """Seconds of SpMM, GEMM and elementwise work of one rank in one epoch."""
    rate = machine.compute_at(node_ranks)
    n, w = work.padded(shape)
    idx, line = work.index_width(shape), machine.cache_line
    spmm = gemm = moved = 0.0
    red = WIRE_SUM_BYTES if work.stored_bytes < F32 else 2 * F32  # per element all-reduced
    params = 0
    last_rows = work.output_rows(shape)
    gpu = machine.device_memory is not None
    for layer in range(work.num_layers):
        o, i, p = roles(layer)
        O, I, P = shape[o], shape[i], shape[p]  # noqa: N806
        a, b, rows = w[layer] // I, w[layer + 1] // O, n // P
        kept = 1.0  # share of the block's rows (and so nonzeros) the layer computes
        if layer == work.num_layers - 1:
            kept, rows = last_rows / rows, last_rows
        nnz = kept * work.imbalance * work.nnz / (P * O)
        root = kept * work.num_nodes / (P * O)  # GraphSAGE's S block
        k = work.terms
        forward, backward = work._runs(layer, first_epoch)
        first = work.weight_first_layer(layer, shape)  # A (F' W): the SpMMs b wide, O = I = 1
        # F_0 is stored in the precision; on a GPU every later F' (or any F' W) is rounded
        # to it as the SpMM reads it (one pass, float32 in, bf16 out), on the CPU not
        rounds_x = gpu and work.stored_bytes < F32 and (layer > 0 or first)
        x_bytes = work.stored_bytes if (layer == 0 and not first) or rounds_x else F32
        # H_0 recomputed in backward; where layer 0 multiplies first, F' is remade instead
        again = 2 if layer == 0 and work.recomputes_first and not first else 1
        # dG = A^T dQ for dW: a layer that multiplies first needs it without dF too
        back_spmm = backward or (first and forward)
        spmm_width = b if first else a
        narrow = work.narrows(layer, shape)  # H (R) and dH (dR) stay bf16 through (2), (7)
        h_red = NARROW_SUM_BYTES if narrow else red
        for term, blk in enumerate([nnz, root][:k]):
            if term == 1 and work.exchanges_root(layer, shape):  # R by owner (plexus.root_rows)
                moved += root_exchange_bytes(rows, a, O, x_bytes, work.stored_bytes,
                                             forward=forward, backward=backward, again=again)
                continue
            if forward:
                spmm += again * spmm_bytes(rows, blk, spmm_width, index_bytes=idx,
                                           cache_line=line, x_bytes=x_bytes)
                if rounds_x:
                    moved += again * (n // O) * spmm_width * (F32 + work.stored_bytes)
                moved += again * rows * a * h_red * (O > 1)  # copy of H (R), all-reduce
                if work.stored_bytes < F32 and not narrow:  # keep a bf16 copy of H (F')
                    # for dW; round it in place first, unless it is the sum of a bf16
                    # all-reduce (bf16 values)
                    passes = 1 if O > 1 and not first else 3
                    moved += (n // O if first else rows) * a * passes * (F32 + work.stored_bytes)
            if back_spmm:  # (A^T reads a narrowed dH in bf16)
                spmm += backward_spmm_bytes(machine, rows, n // O, blk, spmm_width,
                                            index_bytes=idx, cache_line=line,
                                            x_bytes=work.stored_bytes if narrow else F32)
            if backward:  # dH (dR) all-reduced over O
                moved += rows * a * h_red * (O > 1)
        if backward:  # dF (one for both terms) all-reduced over P
            moved += (n // O) * a * red * (P > 1)
        n_gemm = 3 if backward else 2  # Q = H W, dW = H^T dQ, and dH = dQ W^T
        gemm += k * n_gemm * gemm_seconds(n // O if first else rows, a, b, rate.gemm_flops,
                                          rate.memory_bandwidth)
        q = rows * b * F32
        moved += q // F32 * red * (I > 1)  # copy of Q for its all-reduce
        if layer < work.num_layers - 1:
            if work.norm == "batch" and machine.device_memory is None:
                # plexus.norms' kernels, the ReLU in them: forward reads Q thrice, writes the
                # output and the kept centred block; backward reads the gradient and the
                # centred block twice and writes dQ; the ReLU's bits (1/32 of Q) both ways
                kept_q = rows * b * work.stored_bytes
                moved += 7 * q + 3 * kept_q + q / 16
            else:
                moved += 2 * q + 3 * q  # ReLU forward (read, write), backward (read 2, write)
            if work.norm == "batch" and machine.device_memory is not None:
                moved += 22 * q  # plexus.norms._RowSplitBatchNorm: 8 passes forward, 14 back
            elif work.norm == "layer":  # tensor operations under autograd: 16 passes
                moved += 45 * q  # forward, about twice that backward
        params += k * round_up(a * b, P) // P
    o, _, p = roles(work.num_layers - 1)
    moved += 12 * last_rows * (w[-1] // shape[o]) * F32  # loss, softmax, argmax passes
    params += round_up((n // shape["x"]) * (w[0] // shape["y"]), shape["z"]) // shape["z"] * (
        work.learn_features)
    moved += 7 * params * F32  # AdamW: read param, grad, 2 moments; write param, 2 moments
    return {"spmm": spmm / rate.spmm_bandwidth, "gemm": gemm,
            "elementwise": moved / rate.memory_bandwidth}


def overlap_hidden_seconds(work: GCNWorkload, shape: Mapping[str, int],
                           machine: MachineProfile, *, node_ranks: int,
                           first_epoch: bool = False,
                           blocks: int = AGGREGATION_BLOCKS) -> float:
    """Seconds of one epoch's communication that the overlapped aggregation hides
    (plexus.ops.BlockedAggregation, docs/design/plexus-3d.md section 10).

    Per layer and term, with the SpMM times ``s_f`` (forward) and ``s_b`` (backward), the
    all-reduce times ``c2``, ``c7`` over O and the weight all-gather ``c3`` over P, and
    ``k`` row blocks (a two-stage pipeline of equal blocks hides ``(k-1)/k`` of the shorter
    stage): forward ``(k-1)/k min(s_f, c2) + min(c3, s_f / k)`` (the weight travels during
    the first block), backward ``(k-1)/k min(s_b, c7)``. Zero where the model does not
    overlap (:func:`overlap_pays`), and where the collectives need the compute's cores
    (:func:`comm_offloaded`: with one core per rank the communication thread takes the
    compute's core, so nothing is hidden; docs/benchmarks.md)."""
    offloaded = comm_offloaded(machine, node_ranks)
    if not offloaded or not overlap_pays(shape, work.overlap, comm_offloaded=offloaded):
        return 0.0  # (forced on with one core per rank, the thread's copies take the core)
    grid = ProcessGrid.plexus(shape["x"], shape["y"], shape["z"])
    rate = machine.compute_at(node_ranks)
    n, w = work.padded(shape)
    idx, line, k = work.index_width(shape), machine.cache_line, max(1, blocks)
    last_rows = work.output_rows(shape)

    def coll(op: str, axis: str, nbytes: int) -> float:
        g = shape[axis]
        return 0.0 if g == 1 else machine.collective_time(
            op, nbytes, g, stride=group_stride(grid, axis), node_ranks=node_ranks)

    hidden = 0.0
    for layer in range(work.num_layers):
        o, i, p = roles(layer)
        O, I, P = shape[o], shape[i], shape[p]  # noqa: N806
        a, rows = w[layer] // I, n // P
        kept = 1.0
        if layer == work.num_layers - 1:
            kept, rows = last_rows / rows, last_rows
        forward, backward = work._runs(layer, first_epoch)
        c2 = coll("all_reduce", o, rows * a * work.stored_bytes)  # the wire's bytes
        c3 = coll("all_gather", p, round_up(a * (w[layer + 1] // O), P) * work.stored_bytes)
        # GraphSAGE's root term exchanges rows by owner, synchronously (no SpMM to hide in),
        # except where it is an SpMM with S (plexus.root_rows)
        terms = 1 if work.exchanges_root(layer, shape) else work.terms
        for blk in [kept * work.imbalance * work.nnz / (P * O),
                    kept * work.num_nodes / (P * O)][:terms]:
            s_f = spmm_bytes(rows, blk, a, index_bytes=idx, cache_line=line) / rate.spmm_bandwidth
            s_b = backward_spmm_bytes(machine, rows, n // O, blk, a, index_bytes=idx,
                                      cache_line=line) / rate.spmm_bandwidth
            if forward:  # (a cached H_0 has no aggregation for the weight to hide in)
                hidden += (k - 1) / k * min(s_f, c2) + min(c3, s_f / k)
            if backward:
                hidden += (k - 1) / k * min(s_b, c2)  # (7) moves what (2) moved
    return hidden


def predict_gcn(work: GCNWorkload, shape: Mapping[str, int] | Sequence[int],
                machine: MachineProfile, *, ranks_per_node: int | None = None,
                first_epoch: bool = False) -> Prediction:
    """Predicted epoch of ``work`` on one grid ``{"x": X, "y": Y, "z": Z}``."""
    shape = dict(shape) if isinstance(shape, Mapping) else dict(zip(AXES, shape))
    grid = ProcessGrid.plexus(shape["x"], shape["y"], shape["z"])
    num_ranks = grid.num_ranks
    node_ranks = machine.node_ranks(num_ranks, ranks_per_node)
    limit = machine.memory_per_rank(num_ranks, ranks_per_node)
    if work.model == "gat":  # common.perf.gat: no overlap, nothing cached
        colls = gat_collectives(work, shape)
        return Prediction(shape=dict(grid.shape),
                          compute=gat_compute(work, shape, machine, node_ranks=node_ranks),
                          comm=comm_seconds(colls, grid, machine, node_ranks),
                          comm_bytes=bytes_by_axis(colls, shape),
                          memory=gat_memory(work, shape), memory_limit=limit,
                          invalid="; ".join(work.grid_problems(shape)))  # the heads
    colls = gcn_collectives(work, shape, first_epoch=first_epoch)
    return Prediction(
        shape=dict(grid.shape),
        compute=gcn_compute(work, shape, machine, node_ranks=node_ranks,
                            first_epoch=first_epoch),
        comm=comm_seconds(colls, grid, machine, node_ranks),
        comm_bytes=bytes_by_axis(colls, shape),
        memory=gcn_memory(work, shape, stored_transposes=machine.device_memory is not None,
                          fused_norm=machine.device_memory is None,
                          rounds_x=machine.device_memory is not None),
        memory_limit=limit,
        hidden=overlap_hidden_seconds(work, shape, machine, node_ranks=node_ranks,
                                      first_epoch=first_epoch),
    )


def plan_gcn(work: GCNWorkload, num_ranks: int, machine: MachineProfile, *,
             ranks_per_node: int | None = None, first_epoch: bool = False) -> Plan:
    """Every ``X x Y x Z = num_ranks`` grid, ranked by predicted epoch time."""
    preds = [predict_gcn(work, s, machine, ranks_per_node=ranks_per_node,
                         first_epoch=first_epoch) for s in factorizations(num_ranks, 3)]
    rpn = machine.node_ranks(num_ranks, ranks_per_node)
    title = (f"{work.model.upper()} {work.name}: N={work.num_nodes:,} nnz={work.nnz:,} "
             f"D0={work.num_features} hidden={work.hidden} C={work.num_classes} "
             f"L={work.num_layers} on {num_ranks} ranks ({rpn} per node) of {machine.name}; "
             "per epoch, per rank")
    return rank_predictions(preds, num_ranks, AXES, title)

