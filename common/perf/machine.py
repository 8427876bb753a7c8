"""Machine profiles for the performance model: links, compute rates and measured collectives.

A :class:`MachineProfile` is data (a JSON file under ``common/perf/profiles/``): the presets for
published machines are written from published figures, and ``python -m common.perf.calibrate``
writes one measured on the machine at hand. Pure Python: no torch.

Collective time (alpha-beta model, ``g`` = group size, ``M`` = bytes of the full tensor, ``c`` =
``collective_call_s``, the fixed cost of one collective call). The ring (NCCL's default)::

    all-reduce:                  c + 2 (g-1) alpha + 2 (g-1)/g * M / beta
    all-gather, reduce-scatter:  c +   (g-1) alpha +   (g-1)/g * M / beta

Two-level (PCCL: Singh et al., "The Big Send-off", arXiv 2504.18658): a group of ``g = k n``
ranks, ``k`` on each of ``n`` nodes, runs one collective inside every node (``k`` ranks, intra
link) and one across nodes (``n`` ranks, one per node, the ``k`` rails of the group in parallel
over the NICs)::

    all-gather:      inter all-gather of M/k over n, then intra all-gather of M over k
    reduce-scatter:  intra reduce-scatter of M over k, then inter reduce-scatter of M/k over n
    all-reduce:      the two-level reduce-scatter, then the two-level all-gather

Each level is one call (``c``) and costs the cheaper of the ring and the latency-optimal
algorithm (:func:`level_seconds`: Bruck all-gather, recursive-halving reduce-scatter; ``ceil(log2
g)`` steps of alpha and the ring's bytes). ``collective_algorithm`` picks ``ring``, ``two-level``
or ``auto`` (the cheaper of the two for each call).

``alpha`` and ``beta`` come, in this order, from

1. a measured fit for (op, ranks on the node, group size) when the profile has one (the CPU
   calibration measures every group size with the same number of ranks the job will launch,
   so oversubscribed cores and loopback contention are inside the numbers), else
2. the placement of the group (docs/design/perf-model.md): a group whose ranks share a node rings
   over the intra-node link; otherwise it uses the node's NICs, ``nics_per_node * inter.bandwidth``,
   divided among the groups of the node that talk at once (every rank is in one group of the axis,
   and all groups of an axis run together). A ring whose group has ``k`` ranks on each node leaves
   the node once per ring (NCCL spreads its channels over the node's NICs and GPUs), so the node's
   ``ranks_per_node / k`` groups share the NICs: ``beta = min(nics_per_node * inter.bandwidth * k /
   ranks_per_node, intra ring of k)``. Ranks are numbered consecutively on nodes, so the groups of
   an axis with stride ``s`` and size ``g`` all lie inside nodes exactly when ``s * g`` divides
   ``ranks_per_node``.

Inside a node, ``intra.bandwidth`` is what one rank pushes into a ring over the whole node; with
``intra_peer_bandwidth`` (fully connected nodes: dedicated links to every peer), a ring of ``k``
ranks uses only the links among them: ``min(intra.bandwidth, (k-1) * intra_peer_bandwidth)``.

Units: seconds, bytes, bytes/s, flop/s.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

OPS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter")
ALGORITHMS: tuple[str, ...] = ("ring", "two-level", "auto")
PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
ENV_PROFILE = "HPC_MACHINE_PROFILE"


def ring_steps(op: str, group_size: int) -> int:
    """Latency terms of a ring ``op``: ``2(g-1)`` for all-reduce, ``g-1`` otherwise."""
    check_op(op)
    return (2 if op == "all_reduce" else 1) * max(group_size - 1, 0)


def ring_factor(op: str, group_size: int) -> float:
    """Bytes sent per rank divided by the full tensor's bytes ``M``: ``2(g-1)/g`` or ``(g-1)/g``."""
    g = group_size
    return ring_steps(op, g) / g if g > 1 else 0.0


def latency_optimal_steps(op: str, group_size: int) -> int | None:
    """Latency terms of the latency-optimal all-gather or reduce-scatter of ``g`` ranks, or None
    where there is none better than the ring.

    All-gather: Bruck, ``ceil(log2 g)`` steps for any ``g``; reduce-scatter: recursive halving,
    ``log2 g`` steps when ``g`` is a power of two (Thakur, Rabenseifner, Gropp, "Optimization of
    collective communication operations in MPICH", IJHPCA 2005). Both send the ring's
    ``(g-1)/g * M`` bytes per rank.
    """
    if op not in ("all_gather", "reduce_scatter"):
        raise ValueError(f"latency-optimal steps are for all_gather and reduce_scatter, got {op!r}")
    g = group_size
    if g <= 1:
        return 0
    if op == "reduce_scatter" and g & (g - 1):
        return None
    return (g - 1).bit_length()


def level_seconds(op: str, full_bytes: float, group_size: int, alpha_s: float,
                  bandwidth: float) -> float:
    """Seconds of one all-gather or reduce-scatter level: the cheaper of the ring,
    ``(g-1) alpha + (g-1)/g M / beta``, and the latency-optimal algorithm,
    ``steps alpha + (g-1)/g M / beta`` (:func:`latency_optimal_steps`); no call overhead."""
    g = group_size
    if g <= 1:
        return 0.0
    steps = ring_steps(op, g)
    fast = latency_optimal_steps(op, g)
    if fast is not None:
        steps = min(steps, fast)
    return steps * alpha_s + ring_factor(op, g) * full_bytes / bandwidth


def group_ranks_per_node(group_size: int, stride: int, node_ranks: int) -> int:
    """Ranks ``k`` of one group on each node it touches, when the group's ``g`` ranks, ``stride``
    apart, tile nodes of ``node_ranks`` consecutively numbered ranks evenly; 1 otherwise (the
    group crosses nodes at every step, the conservative case)."""
    g, s, r = group_size, stride, node_ranks
    if s >= r or r % s or ((s * g) % r and r % (s * g)):
        return 1
    return min(g, r // s)


@dataclass(frozen=True, kw_only=True)
class Link:
    """One kind of link.

    Attributes:
        alpha_s: latency of one ring step, seconds.
        bandwidth: bytes/s one rank can push into its ring (intra-node), or one NIC (inter).
    """

    alpha_s: float
    bandwidth: float

    def __post_init__(self) -> None:
        if self.alpha_s < 0 or not self.bandwidth > 0:
            raise ValueError(f"link needs alpha_s >= 0 and bandwidth > 0, got alpha_s="
                             f"{self.alpha_s}, bandwidth={self.bandwidth}")


@dataclass(frozen=True, kw_only=True)
class CollectiveFit:
    """A measured ``t = steps * alpha + ring_bytes / bandwidth`` for one op and group size.

    Attributes:
        op: ``all_reduce``, ``all_gather`` or ``reduce_scatter``.
        ranks_per_node: ranks that ran on the node during the measurement (all of them busy
            in groups of ``group_size``, as in training).
        group_size: ranks in each group.
        alpha_s, bandwidth: the fitted latency per step and bytes/s per rank.
    """

    op: str
    ranks_per_node: int
    group_size: int
    alpha_s: float
    bandwidth: float

    def __post_init__(self) -> None:
        check_op(self.op)
        if self.group_size < 2 or self.ranks_per_node < self.group_size:
            raise ValueError(f"collective fit needs 2 <= group_size <= ranks_per_node, got "
                             f"group_size={self.group_size}, ranks_per_node="
                             f"{self.ranks_per_node}")
        Link(alpha_s=self.alpha_s, bandwidth=self.bandwidth)  # same checks


@dataclass(frozen=True, kw_only=True)
class Compute:
    """Per-rank compute rates while ``ranks_per_node`` ranks share the node.

    Attributes:
        ranks_per_node: concurrent ranks when measured (0: independent of it, e.g. one GPU
            per rank).
        spmm_bandwidth: bytes/s of a CSR SpMM under the byte count of
            :func:`common.perf.gcn.spmm_bytes` (index + value per nonzero, one gathered row of
            ``max(4 D, cache_line)`` bytes per nonzero, the output written once).
        gemm_flops: flop/s of float32 GEMMs.
        memory_bandwidth: bytes/s (read + write) of large copies and elementwise ops.
        gemm_flops_low: flop/s of bf16/fp16 GEMMs (tensor cores); None: as float32.
    """

    ranks_per_node: int = 0
    spmm_bandwidth: float
    gemm_flops: float
    memory_bandwidth: float
    gemm_flops_low: float | None = None

    def __post_init__(self) -> None:
        if min(self.spmm_bandwidth, self.gemm_flops, self.memory_bandwidth) <= 0:
            raise ValueError(f"compute rates must be > 0, got {self}")


@dataclass(frozen=True, kw_only=True)
class MachineProfile:
    """Everything the model needs to know about a machine.

    Attributes:
        name: short name (the JSON file's stem for shipped profiles).
        description: what the machine is and how the numbers were obtained.
        sources: where each number comes from (documents, or the calibration command).
        ranks_per_node: ranks (GPUs, GCDs) per node; None for a single-node machine where
            every launched rank shares the node (a workstation).
        cores_per_node: CPU cores (informational for CPU profiles).
        device_memory: bytes per rank (GPU memory); None to split ``node_memory``.
        node_memory: bytes of host memory per node.
        cache_line: smallest chunk a gathered feature row costs (bytes): a 32-byte sector on
            NVIDIA and AMD GPUs, a 64-byte line on x86.
        intra, inter: the intra-node link (per rank, a ring over the whole node) and one NIC
            (inter-node).
        nics_per_node: NICs per node.
        compute: per-rank rates, one entry per measured ranks-per-node count.
        collectives: measured fits that override the link model.
        intra_peer_bandwidth: bytes/s of the dedicated links from one rank to each peer of a
            fully connected node (a ring of ``k`` ranks inside the node gets
            ``min(intra.bandwidth, (k-1) * intra_peer_bandwidth)``); None: every ring inside a
            node gets ``intra.bandwidth``.
        collective_call_s: fixed seconds of one collective call (kernel launch and the
            library's set-up), on top of the per-step alpha.
        collective_algorithm: ``ring``, ``two-level`` or ``auto`` (module docstring).
    """

    name: str
    description: str = ""
    sources: tuple[str, ...] = ()
    ranks_per_node: int | None = None
    cores_per_node: int | None = None
    device_memory: float | None = None
    node_memory: float
    cache_line: int = 64
    intra: Link
    inter: Link
    nics_per_node: int = 1
    compute: tuple[Compute, ...]
    collectives: tuple[CollectiveFit, ...] = field(default=())
    intra_peer_bandwidth: float | None = None
    collective_call_s: float = 0.0
    collective_algorithm: str = "ring"

    def __post_init__(self) -> None:
        if not self.compute:
            raise ValueError(f"machine profile {self.name!r} has no compute rates")
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1 or None, got {self.ranks_per_node}")
        if self.nics_per_node < 1 or self.cache_line < 1 or self.node_memory <= 0:
            raise ValueError(f"machine profile {self.name!r}: need nics_per_node >= 1, "
                             f"cache_line >= 1 and node_memory > 0")
        check_algorithm(self.collective_algorithm)
        if self.collective_call_s < 0 or (self.intra_peer_bandwidth is not None
                                          and not self.intra_peer_bandwidth > 0):
            raise ValueError(f"machine profile {self.name!r}: need collective_call_s >= 0 and "
                             f"intra_peer_bandwidth > 0 or None, got {self.collective_call_s}, "
                             f"{self.intra_peer_bandwidth}")
        keys = [(c.op, c.ranks_per_node, c.group_size) for c in self.collectives]
        if len(set(keys)) != len(keys):
            raise ValueError(f"machine profile {self.name!r} repeats a collective fit")

    # ------------------------------------------------------------------ placement
    def node_ranks(self, num_ranks: int, ranks_per_node: int | None = None) -> int:
        """Ranks sharing one node in a job of ``num_ranks``."""
        rpn = ranks_per_node or self.ranks_per_node or num_ranks
        return max(1, min(rpn, num_ranks))

    def memory_per_rank(self, num_ranks: int, ranks_per_node: int | None = None) -> float:
        if self.device_memory is not None:
            return self.device_memory
        return self.node_memory / self.node_ranks(num_ranks, ranks_per_node)

    def compute_at(self, node_ranks: int) -> Compute:
        """Rates with ``node_ranks`` ranks on a node: the exact entry, else the nearest one,
        rescaled by ``measured / node_ranks`` when more ranks than measured share the node."""
        exact = [c for c in self.compute if c.ranks_per_node in (node_ranks, 0)]
        if exact:
            return exact[0]
        near = min(self.compute, key=lambda c: (abs(math.log(c.ranks_per_node / node_ranks)),
                                                c.ranks_per_node))
        scale = min(1.0, near.ranks_per_node / node_ranks)
        low = near.gemm_flops_low * scale if near.gemm_flops_low else None
        return Compute(ranks_per_node=node_ranks, spmm_bandwidth=near.spmm_bandwidth * scale,
                       gemm_flops=near.gemm_flops * scale,
                       memory_bandwidth=near.memory_bandwidth * scale, gemm_flops_low=low)

    def intra_ring_bandwidth(self, ranks: int) -> float:
        """Bytes/s per rank of a ring of ``ranks`` ranks inside one node."""
        if self.intra_peer_bandwidth is None:
            return self.intra.bandwidth
        return min(self.intra.bandwidth, max(ranks - 1, 1) * self.intra_peer_bandwidth)

    def measured(self, op: str, group_size: int, node_ranks: int) -> CollectiveFit | None:
        """The measured fit for ``op`` on groups of ``group_size`` with ``node_ranks`` on the
        node, if the profile has one."""
        for c in self.collectives:
            if (c.op, c.ranks_per_node, c.group_size) == (op, node_ranks, group_size):
                return c
        return None

    def link_for(self, op: str, group_size: int, stride: int, node_ranks: int
                 ) -> tuple[float, float, str]:
        """(alpha_s, bandwidth, source) of a ring of ``group_size`` ranks ``stride`` apart.

        A CPU profile measured at other rank counts falls back to its intra link (the 2-rank
        fit), which is optimistic for more oversubscribed ranks: calibrate the counts you run.
        """
        fit = self.measured(op, group_size, node_ranks)
        if fit is not None:
            return fit.alpha_s, fit.bandwidth, "measured"
        if within_node(group_size, stride, node_ranks):
            return self.intra.alpha_s, self.intra_ring_bandwidth(group_size), "intra"
        k = group_ranks_per_node(group_size, stride, node_ranks)
        share = self.nics_per_node * self.inter.bandwidth * k / node_ranks
        cap = self.intra_ring_bandwidth(k) if k > 1 else self.intra.bandwidth
        return self.inter.alpha_s, min(cap, share), "inter"

    def collective_time(self, op: str, full_bytes: float, group_size: int, *, stride: int = 1,
                        node_ranks: int = 1, algorithm: str | None = None) -> float:
        """Seconds of one ``op`` on a ``full_bytes`` tensor (see the module docstring).

        Args:
            algorithm: ``ring``, ``two-level`` or ``auto``; None: the profile's
                ``collective_algorithm``. A measured fit is the library's own algorithm and
                is used as it is.
        """
        if group_size <= 1:
            return 0.0
        algo = algorithm or self.collective_algorithm
        check_algorithm(algo)
        alpha, beta, source = self.link_for(op, group_size, stride, node_ranks)
        ring = (self.collective_call_s + ring_steps(op, group_size) * alpha
                + ring_factor(op, group_size) * full_bytes / beta)
        if algo == "ring" or source == "measured":
            return ring
        two = self.two_level_time(op, full_bytes, group_size, stride=stride,
                                  node_ranks=node_ranks)
        return two if algo == "two-level" else min(ring, two)

    def two_level_time(self, op: str, full_bytes: float, group_size: int, *, stride: int = 1,
                       node_ranks: int = 1) -> float:
        """Seconds of the two-level ``op`` (module docstring): ``k`` ranks per node
        (:func:`group_ranks_per_node`; all ``g`` when the group lies inside a node) and
        ``n = g / k`` nodes; the inter level's rails share the node's NICs with the node's
        other ranks (``nics * inter.bandwidth / ranks_per_node`` each)."""
        check_op(op)
        g = group_size
        if g <= 1:
            return 0.0
        if op == "all_reduce":
            return (self.two_level_time("reduce_scatter", full_bytes, g, stride=stride,
                                        node_ranks=node_ranks)
                    + self.two_level_time("all_gather", full_bytes, g, stride=stride,
                                          node_ranks=node_ranks))
        k = g if within_node(g, stride, node_ranks) else group_ranks_per_node(g, stride,
                                                                              node_ranks)
        n = g // k
        rail = min(self.intra.bandwidth,
                   self.nics_per_node * self.inter.bandwidth / node_ranks)
        intra = level_seconds(op, full_bytes, k, self.intra.alpha_s, self.intra_ring_bandwidth(k))
        inter = level_seconds(op, full_bytes / k, n, self.inter.alpha_s, rail)
        return intra + inter + self.collective_call_s * ((k > 1) + (n > 1))

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> MachineProfile:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"machine profile: unknown fields {sorted(unknown)}")
        d = dict(data)
        d["sources"] = tuple(d.get("sources", ()))
        d["intra"], d["inter"] = Link(**d["intra"]), Link(**d["inter"])
        d["compute"] = tuple(Compute(**c) for c in d["compute"])
        d["collectives"] = tuple(CollectiveFit(**c) for c in d.get("collectives", ()))
        return cls(**d)

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")


def within_node(group_size: int, stride: int, node_ranks: int) -> bool:
    """Whether every group of an axis (``group_size`` ranks, ``stride`` apart) lies inside one
    node when ranks are numbered consecutively on nodes of ``node_ranks``."""
    return node_ranks % (stride * group_size) == 0


def available_profiles() -> list[str]:
    """Names of the shipped profiles (``common/perf/profiles/*.json``)."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def load_profile(name_or_path: str | os.PathLike | None = None) -> MachineProfile:
    """A shipped profile by name, or a JSON file by path.

    ``None`` reads ``$HPC_MACHINE_PROFILE`` and falls back to ``local-cpu`` (a shipped
    profile of a 2-core x86_64 CPU node, written by ``python -m common.perf.calibrate``).

    Raises:
        ValueError: unknown name (the message lists the shipped ones) or a malformed file.
    """
    name = name_or_path or os.environ.get(ENV_PROFILE) or "local-cpu"
    path = Path(name)
    if not path.suffix:
        path = PROFILE_DIR / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"machine profile {str(name)!r} not found; shipped profiles: "
                         f"{', '.join(available_profiles())}, or pass a path to a JSON file "
                         f"written by `python -m common.perf.calibrate`")
    try:
        return MachineProfile.from_dict(json.loads(path.read_text()))
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"machine profile {path}: malformed ({e})") from e


def check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; choose from {OPS}")


def check_algorithm(algorithm: str) -> None:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown collective algorithm {algorithm!r}; choose from {ALGORITHMS}")
