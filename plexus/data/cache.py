"""Prepare big datasets once, on first use: ``--dataset ogbn-papers100M`` maps blocks per rank.

    path = prepared_cache("ogbn-papers100M", "data", blocks=8, permutation="double", seed=0,
                          symmetrize=False, is_writer=rank == 0)   # every rank calls it
    source = PreparedGraph(path)

The cache of a dataset is ``ROOT/prepared/<name>-k<blocks>-<permutation>-s<seed>[-sym]``:
``<name>`` is the OGB name or the edge file's stem (``ROOT/prepared/edges-k8-double-s0`` for
``edges.npy``; two edge files with one stem share it, and the manifest, which records each
input's path, size and modification time, tells them apart), ``-sym`` marks a directed graph
made undirected by ``--symmetrize``. It is a directory written by ``python -m
plexus.prepare`` (plexus.data.writer), which writes under ``OUT.partial`` and renames at the
end, so a half-written cache is never used and the next writer starts over. A cache whose
inputs changed since (another edge file of that stem, rewritten raw files) stops the run with
the cache's name to delete, never silently reused or rewritten.

The rule (:func:`wants_cache`): ``ogbn-papers100M`` and ``ogbn-products`` always go through
the cache, ``.npy`` edge files too (they have no in-memory reader); another OGB dataset does
when its estimated in-memory size ``nodes * features * 4 + edges * 16`` bytes, read from the
raw files' headers and count files only, exceeds :data:`IN_MEMORY_LIMIT_BYTES` (1 GiB).

One rank (``is_writer``) prepares; the others poll the filesystem, which must be shared by
every node, for the finished directory, never through a collective, so a preparation of
hours hits no collective timeout. Across jobs (a sweep sharing ``--root``), the writers take
turns on the ``flock`` of ``OUT.lock`` (:mod:`plexus.data.lock`): one prepares, the others
print that they wait and for whom, then reuse its cache; the ``OUT.partial`` of a job that
was killed is found by the next holder of the lock and written anew. A writer that fails
leaves ``OUT.failed`` (the error text and the job's token) so the waiters stop with its
message; the next attempt removes it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import warnings
import zipfile
from pathlib import Path

from common.alloc import retain_freed_memory
from plexus.data.errors import DatasetCorruptError, DatasetNotFoundError
from plexus.data.lock import preparing_lock
from plexus.data.ogb import OGB_DATASETS, missing_files, not_found_message
from plexus.data.schema import StaleFormatError, is_prepared, read_manifest

IN_MEMORY_LIMIT_BYTES = 1 << 30  # estimated in-memory size above which "auto" prepares
ALWAYS_CACHED = ("ogbn-papers100M", "ogbn-products")
PREPARE_MODES = ("auto", "always", "never")
POLL_S = 2.0  # how often a waiting rank looks for the finished cache
REPORT_EVERY_S = 30.0  # how often a verbose waiting rank says it is still waiting


class PrepareFailedError(RuntimeError):
    """The writer rank failed to prepare the cache (its error text is in the message)."""


def is_edge_file(name: str) -> bool:
    return name.endswith(".npy")


def cacheable(name: str) -> bool:
    """Whether ``name`` has a streaming reader the cache can prepare from."""
    return name in OGB_DATASETS or is_edge_file(name)


def estimated_bytes(name: str, root: str | os.PathLike) -> int | None:
    """``nodes * features * 4 + edges * 16``: the in-memory size of an OGB dataset, from the
    npz headers or the CSV count files (edges as stored); None if the files are not there."""
    from plexus.data.sources import ogb_sizes

    if name not in OGB_DATASETS:
        return None
    try:
        nodes, edges, features = ogb_sizes(Path(root) / OGB_DATASETS[name].dir_name / "raw")
    except (OSError, ValueError, KeyError, IndexError, zipfile.BadZipFile):
        return None
    return nodes * features * 4 + edges * 16


def wants_cache(name: str, root: str | os.PathLike, limit_bytes: int | None = None) -> bool:
    """The ``--prepare auto`` rule (module docstring); ``limit_bytes`` default:
    :data:`IN_MEMORY_LIMIT_BYTES`."""
    if name in ALWAYS_CACHED or is_edge_file(name):
        return True
    size = estimated_bytes(name, root)
    limit = IN_MEMORY_LIMIT_BYTES if limit_bytes is None else limit_bytes
    return size is not None and size > limit


def cache_dir(name: str, root: str | os.PathLike, *, blocks: int, permutation: str, seed: int,
              symmetrize: bool) -> Path:
    """``ROOT/prepared/<name>-k<blocks>-<permutation>-s<seed>[-sym]`` (module docstring)."""
    stem = Path(name).stem if is_edge_file(name) else name
    sym = "-sym" if symmetrize and name != "ogbn-products" else ""  # products: undirected
    return Path(root) / "prepared" / f"{stem}-k{blocks}-{permutation}-s{seed}{sym}"


def prepared_cache(name: str, root: str | os.PathLike, *, blocks: int, permutation: str,
                   seed: int, symmetrize: bool, is_writer: bool, token: str | None = None,
                   timeout_s: float | None = None, poll_s: float = POLL_S,
                   report_every_s: float = REPORT_EVERY_S, verbose: bool = False,
                   quiet: bool = True) -> Path:
    """The cache directory of ``name``, prepared by the writer if needed; every rank calls it.

    A finished cache is reused after a cheap check: its manifest must be of this format
    version and match (source, blocks, permutation, seed, symmetry), its inputs must be
    those it was prepared from, and every file it lists must exist with the recorded size.
    The inputs: an edge file's resolved path, size and modification time (the file must
    exist, even for a cache that holds it); an OGB dataset's raw files' sizes and
    modification times, those still present (a job may delete the raw files once prepared).
    Checksums are not read; ``python -m plexus.prepare
    --verify DIR`` checks them all. A cache of another format version (an older plexus's: one
    without the mean aggregation's blocks, say) stops every rank with the ``python -m
    plexus.prepare ... --force`` command that rebuilds it in place; like a cache that does not
    match, it is never deleted or rewritten unasked (a rebuild of ogbn-papers100M takes hours
    and twice its disk until the old one is replaced).

    Args:
        name: an OGB name (raw files under ``root``) or a ``.npy`` edge file (a path, or a
            name under ``root``; nodes: the largest id + 1, the synthetic R-MAT task).
        root: the ``--root`` folder; the cache goes to ``root/prepared``.
        blocks, permutation, seed: as ``python -m plexus.prepare`` takes them.
        symmetrize: make a directed graph undirected (reverse edges added, duplicates merged).
        is_writer: this rank prepares (exactly one rank of the job, e.g. global rank 0).
        token: the same on every rank of this job, new per job; a failure marker with another
            token is an earlier job's and waiters ignore it. None: every marker counts.
        timeout_s: waiters give up after this long (None: never; a writer that dies is
            caught by the launcher or the trainer's watchdog).
        poll_s, report_every_s: waiters look every ``poll_s`` seconds, and with ``verbose``
            print a line every ``report_every_s``.
        verbose: print what happens (one rank per node, e.g. local rank 0).
        quiet: no progress bars while preparing.

    Raises:
        ValueError: the cache holds another dataset or other settings, or its inputs have
            changed since it was prepared (delete it).
        DatasetCorruptError: a file of the cache is missing or has the wrong size;
            ``StaleFormatError``: the cache is of another format version (rebuild it).
        DatasetNotFoundError: the raw files are missing and there is no cache, or the
            edge file is missing.
        PrepareFailedError: (waiters) the writer failed; TimeoutError: waited ``timeout_s``.
    """
    out = cache_dir(name, root, blocks=blocks, permutation=permutation, seed=seed,
                    symmetrize=symmetrize)
    want = {"blocks": blocks, "permutation": permutation, "seed": seed,
            "symmetric": symmetrize or name == "ogbn-products"}
    # the edge file first: a cache of another file of the same stem, or of one that is gone,
    # must not be taken for it
    edge_file = _edge_file(name, root) if is_edge_file(name) else None
    inputs = _Inputs(name, root, edge_file)
    if is_prepared(out):
        return _checked(out, inputs, want, verbose and is_writer)
    if edge_file is None:
        _check_ogb_files(name, root)
    failed = Path(f"{out}.failed")
    if not is_writer:
        return _wait(out, failed, inputs, want, token, timeout_s, poll_s, report_every_s,
                     verbose)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with preparing_lock(out, token=token, verbose=verbose, poll_s=poll_s,
                            report_every_s=report_every_s, timeout_s=timeout_s) as previous:
            if is_prepared(out):  # another job prepared it while this one waited
                return _checked(out, inputs, want, verbose)
            failed.unlink(missing_ok=True)  # an earlier attempt's
            if out.exists():
                raise ValueError(f"{out} exists but is not a prepared dataset (no "
                                 "manifest.json); delete or move it, and run again to prepare "
                                 "the cache there")
            partial = Path(f"{out}.partial")
            if verbose and partial.exists():  # its writer is gone: it held the lock
                print(f"{partial} was left by a job that stopped ({previous}); preparing "
                      "anew", flush=True)
            if verbose:
                print(f"preparing {name} into {out} (once; later runs reuse it)", flush=True)
            source = _source(name, root, edge_file, seed, symmetrize, tmp_dir=out.parent)
            from plexus.data.writer import prepare

            # preparing's buffers go back to the OS as they are freed: glibc's thresholds
            # left alone rise to each freed buffer's size (up to 32 MiB), and its heap then
            # keeps hundreds of MiB, which training touches again (common.alloc). On the CPU
            # the trainer sets its own policy after; elsewhere (a GPU job's host) this rank
            # keeps these fixed thresholds, glibc's defaults less their growth
            retain_freed_memory(False)
            prepare(source, out, blocks=blocks, permutation=permutation, seed=seed,
                    quiet=quiet)
    except BaseException as e:
        _write_marker(failed, {"token": token, "error": f"{type(e).__name__}: {e}"})
        raise
    return _checked(out, inputs, want, verbose=False)


def _write_marker(failed: Path, record: dict) -> None:
    """Best effort: where it cannot be written, the waiters learn of the failure from the
    launcher or the watchdog when the writer exits."""
    tmp = Path(f"{failed}.tmp")
    try:
        tmp.write_text(json.dumps(record))
        os.replace(tmp, failed)  # whole or absent: a waiter never reads half a marker
    except OSError:
        pass


def _check_ogb_files(name: str, root: str | os.PathLike) -> None:
    """Every rank stops with the same message when the raw files are missing."""
    spec = OGB_DATASETS[name]
    if missing := missing_files(spec, Path(root) / spec.dir_name):
        raise DatasetNotFoundError(not_found_message(spec, Path(root), missing))


def _edge_file(name: str, root: str | os.PathLike) -> Path:
    for path in (Path(name), Path(root) / name):
        if path.is_file():
            return path
    raise DatasetNotFoundError(f"edge file {name} not found (looked at {Path(name)} and "
                               f"{Path(root) / name}); pass an existing .npy file")


def _source(name, root, edge_file: Path | None, seed: int, symmetrize: bool, tmp_dir: Path):
    """The streamed EdgeSource of ``name`` (what ``python -m plexus.prepare`` would read)."""
    from plexus.data.sources import edge_file_source, ogb_source

    if edge_file is None:
        source = ogb_source(name, root, tmp_dir=tmp_dir)
        if symmetrize and not source.symmetric:  # as Graph.to_undirected: no duplicates
            source = dataclasses.replace(source, symmetrize=True, dedupe=True)
        return source
    source = edge_file_source(edge_file, num_nodes=2**62, symmetrize=symmetrize, seed=seed,
                              tmp_dir=tmp_dir)
    num_nodes = max((int(c.max()) for c in source.chunks() if c.size), default=-1) + 1
    if num_nodes < source.num_classes:
        raise ValueError(f"edge file {edge_file} has {num_nodes} nodes (largest id + 1), fewer "
                         f"than {source.num_classes} classes of the synthetic task")
    return dataclasses.replace(source, num_nodes=num_nodes)


@dataclasses.dataclass(frozen=True)
class _Inputs:
    """What a cache must have been prepared from: ``name`` and, for an edge file, the file
    itself (resolved path, size and modification time); for an OGB dataset, the size and
    time of each raw file read (plexus.data.sources.ogb_input_stamps)."""

    name: str
    root: str | os.PathLike
    edge_file: Path | None

    def problems(self, src: dict, out: Path, verbose: bool) -> list[str]:
        """How the manifest's ``source`` record differs from these inputs ([] if it does not).

        Raw OGB files that are gone are not compared: the cache is what is left of them (a
        job may delete the 57 GB of ogbn-papers100M once it is prepared). An edge file must
        exist (:func:`_edge_file`): its path is the dataset's name. A cache prepared before
        the inputs' sizes and times were recorded is reused with a warning (``verbose``: this
        rank prints it), not refused: rebuilding ogbn-papers100M's takes hours.
        """
        from plexus.data.sources import file_stamp, ogb_input_stamps

        unrecorded = (f"the prepared cache {out} records no sizes and times of its inputs (an "
                      "older plexus prepared it), so whether they changed since cannot be "
                      "told; delete it to prepare it anew if they did")
        if self.edge_file is not None:
            if src.get("kind") != "edge-file":
                return [f"source {src} (wanted the edge file {self.edge_file})"]
            path = str(self.edge_file.resolve())
            if "bytes" not in src:  # (an older manifest: its file name only)
                if Path(src.get("path", "")).name != self.edge_file.name:
                    return [f"edge file {src.get('path')} (wanted {path})"]
                if verbose:
                    warnings.warn(unrecorded, stacklevel=2)
                return []
            if src.get("path") != path:
                return [f"edge file {src.get('path')} (wanted {path})"]
            now = file_stamp(self.edge_file)
            recorded = {k: src.get(k) for k in now}
            if recorded != now:
                return [f"edge file {path} {_stamp_text(recorded)} when prepared, "
                        f"{_stamp_text(now)} now"]
            return []
        if src.get("kind") != "ogb" or src.get("name") != self.name:
            return [f"source {src} (wanted {self.name})"]
        recorded = src.get("inputs")
        if recorded is None:
            if verbose:
                warnings.warn(unrecorded, stacklevel=2)
            return []
        return [f"raw file {rel} {_stamp_text(recorded.get(rel))} when prepared, "
                f"{_stamp_text(now)} now" for rel, now in
                ogb_input_stamps(self.name, self.root).items() if recorded.get(rel) != now]


def _stamp_text(stamp: dict | None) -> str:
    if not stamp:
        return "not recorded"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp["mtime_ns"] / 1e9))
    return f"{stamp['bytes']} bytes modified {when}"


def _checked(out: Path, inputs: _Inputs, want: dict, verbose: bool) -> Path:
    """``out`` if its manifest matches ``want`` and ``inputs`` and its files have their
    sizes."""
    delete = f"delete {out} and run again to prepare it anew"
    try:
        m = read_manifest(out)
    except StaleFormatError as e:  # an older plexus wrote it: never replaced behind one's back
        raise StaleFormatError(f"the prepared cache {out} cannot be used: {e} (or {delete})"
                               ) from e
    except DatasetCorruptError as e:
        raise DatasetCorruptError(f"the prepared cache {out} is unusable: {e}; {delete}") from e
    bad = [f"{k} {m.get(k)!r} (wanted {v!r})" for k, v in want.items() if m.get(k) != v]
    bad += inputs.problems(m.get("source") or {}, out, verbose)
    if bad:
        raise ValueError(f"the prepared cache {out} does not match this run: {', '.join(bad)}; "
                         f"{delete} (or move it away to keep it; --dataset {out} trains on it "
                         "as it is)")
    for rel, meta in m["files"].items():
        p = out / rel
        size = p.stat().st_size if p.is_file() else None
        if size != meta["bytes"]:
            found = "is missing" if size is None else f"has {size} bytes"
            raise DatasetCorruptError(
                f"the prepared cache {out} is damaged: {p} {found}, the manifest says "
                f"{meta['bytes']} bytes; {delete} (python -m plexus.prepare --verify {out} "
                "checks every file's SHA-256)")
    if verbose:
        print(f"using the prepared cache {out}", flush=True)
    return out


def _wait(out: Path, failed: Path, inputs: _Inputs, want: dict, token: str | None,
          timeout_s: float | None, poll_s: float, report_every_s: float,
          verbose: bool) -> Path:
    """Poll until the writer's cache or its failure marker appears."""
    start = last = time.monotonic()
    while True:
        if is_prepared(out):
            return _checked(out, inputs, want, verbose=False)
        if failed.is_file():
            try:
                marker = json.loads(failed.read_text())
            except (OSError, ValueError):
                marker = None  # vanished or replaced while read: look again
            if marker is not None and (token is None or marker.get("token") == token):
                raise PrepareFailedError(f"rank 0 failed to prepare {out}: {marker['error']}")
        now = time.monotonic()
        if timeout_s is not None and now - start > timeout_s:
            raise TimeoutError(f"waited {now - start:.0f} s for rank 0 to prepare {out}; is "
                               "--root on a filesystem every node shares?")
        if verbose and now - last >= report_every_s:
            last = now
            print(f"waiting for rank 0 to prepare {out} (elapsed {now - start:.0f} s)",
                  flush=True)
        time.sleep(poll_s)
