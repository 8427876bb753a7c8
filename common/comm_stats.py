"""Byte and time accounting for collectives, owned by the caller (no global counters).

Bytes are the bytes *sent per rank* by a ring implementation (the volumes of the performance
model, docs/design/plexus-3d.md section 4), where ``M`` is the byte size of the full tensor being
reduced or collected and ``g`` the group size:

* all-reduce:      ``2 (g-1)/g * M``
* all-gather:      ``(g-1)/g * M``   (``M`` = gathered output)
* reduce-scatter:  ``(g-1)/g * M``   (``M`` = unscattered input)

A group of one rank sends nothing and is not recorded.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

# an all-reduce whose messages travel in a narrower dtype (common.collectives' wire) runs in
# pieces of this many bytes of message, so its buffers stay this small whatever its size
WIRE_PIECE_BYTES = 4 << 20


def ring_bytes(op: str, full_bytes: int, group_size: int) -> int:
    """Bytes sent per rank by a ring ``op`` on a tensor of ``full_bytes`` over ``group_size``.

    Integer arithmetic: the result is exact when ``full_bytes`` is divisible by
    ``group_size`` (always true for our padded shards).
    """
    g = group_size
    if g <= 1:
        return 0
    if op == "all_reduce":
        return 2 * (g - 1) * full_bytes // g
    if op in ("all_gather", "reduce_scatter"):
        return (g - 1) * full_bytes // g
    raise ValueError(f"unknown collective {op!r}")


@dataclass
class CommRecord:
    """Totals for one (axis, op) pair."""

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0
    # the part of ``seconds`` the caller spent blocked (a synchronous call: all of it; an
    # async one: the time inside ``wait()``); what overlap could not hide
    exposed: float = 0.0
    # the part of ``bytes`` that pads messages of uneven content to one size (GraphSAGE's
    # root rows by owner, plexus.root_rows): what a count of the content alone leaves out
    padding: int = 0


class CommStats:
    """Accumulates (axis, op) -> calls, bytes sent per rank, seconds.

    Pass one instance down to the collectives of a step; read it at the end of the step with
    :meth:`by_axis` or :meth:`table`, then :meth:`reset`. Seconds are wall time, or for
    collectives on a GPU the time between CUDA events on its stream: those are recorded as a
    function and resolved (waiting for the events) the first time the stats are read.
    """

    def __init__(self) -> None:
        self._records: dict[tuple[str, str], CommRecord] = defaultdict(CommRecord)
        self._pending: list[tuple[CommRecord, Callable[[], float]]] = []

    @property
    def records(self) -> dict[tuple[str, str], CommRecord]:
        """(axis, op) -> totals, with every pending time resolved."""
        if self._pending:
            pending, self._pending = self._pending, []
            for rec, seconds in pending:  # GPU times: exposure unknown, counted whole
                value = float(seconds())
                rec.seconds += value
                rec.exposed += value
        return self._records

    def record(self, axis: str, op: str, nbytes: int,
               seconds: float | Callable[[], float], exposed: float | None = None, *,
               padding: int = 0) -> None:
        """Count one call of ``op`` along ``axis``: ``nbytes`` sent, ``seconds`` taken (or a
        function that returns them once the collective is done, called when read), of which
        ``exposed`` the caller waited (None: all of them, as for a synchronous call);
        ``padding``: how many of ``nbytes`` are padding (:class:`CommRecord`)."""
        rec = self._records[(axis, op)]
        rec.calls += 1
        rec.bytes += int(nbytes)
        rec.padding += int(padding)
        if callable(seconds):
            self._pending.append((rec, seconds))
            if exposed is not None:
                rec.exposed += float(exposed)
        else:
            rec.seconds += float(seconds)
            rec.exposed += float(seconds if exposed is None else exposed)

    def reset(self) -> None:
        """Forget everything (pending times unread: nothing waits)."""
        self._records.clear()
        self._pending.clear()

    @property
    def total_bytes(self) -> int:
        return sum(r.bytes for r in self._records.values())  # known at once: nothing waits

    @property
    def total_seconds(self) -> float:
        return sum(r.seconds for r in self.records.values())

    @property
    def exposed_seconds(self) -> float:
        """Seconds the caller was blocked in collectives (the communication not overlapped)."""
        return sum(r.exposed for r in self.records.values())

    def by_axis(self) -> dict[str, CommRecord]:
        """Totals per axis over all ops."""
        out: dict[str, CommRecord] = defaultdict(CommRecord)
        for (axis, _), r in self.records.items():
            o = out[axis]
            o.calls += r.calls
            o.bytes += r.bytes
            o.padding += r.padding
            o.seconds += r.seconds
            o.exposed += r.exposed
        return dict(out)

    def as_dict(self) -> dict[str, dict[str, float]]:
        """JSON-friendly ``{"axis/op": {"calls", "bytes", "seconds", "exposed", "padding"}}``."""
        return {
            f"{axis}/{op}": {"calls": r.calls, "bytes": r.bytes, "seconds": r.seconds,
                             "exposed": r.exposed, "padding": r.padding}
            for (axis, op), r in sorted(self.records.items())
        }

    def table(self) -> str:
        """A small fixed-width table, one row per (axis, op)."""
        lines = [f"{'axis':<8}{'op':<16}{'calls':>8}{'ring MiB':>12}{'seconds':>10}"]
        for (axis, op), r in sorted(self.records.items()):
            lines.append(
                f"{axis:<8}{op:<16}{r.calls:>8}{r.bytes / 2**20:>12.3f}{r.seconds:>10.4f}"
            )
        lines.append(
            f"{'total':<24}{sum(r.calls for r in self.records.values()):>8}"
            f"{self.total_bytes / 2**20:>12.3f}{self.total_seconds:>10.4f}"
        )
        return "\n".join(lines)
