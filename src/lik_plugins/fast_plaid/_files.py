"""fast-plaid's index folder: which layout its files are in, and each document token's
code and residual read from it, whatever release wrote them.

The layout is read from the files on disk, never assumed from the installed release: an
index written by one release may be searched by another, and 1.7 stages files of its own
older layout while it updates.  Every release keeps the same small files -- ``metadata.json``
(``num_chunks``, ``nbits``), ``centroids.npy`` (fp16 ``[C, d]``), ``bucket_weights.npy``,
``ivf.npy`` with ``ivf_lengths.npy``, and per chunk ``i`` ``doclens.<i>.json`` (the lengths
of its documents) -- and differs in where the codes (int64, one per token) and residuals
(uint8 ``[tokens, d * nbits / 8]``) of chunk ``i`` lie:

==============  ==============================================================================
``"shards"``    1.4 and older: ``<i>.codes.npy`` / ``<i>.residuals.npy`` per chunk.  A
                ``merged_*.npy`` beside them is a cache rebuilt from them at load time.
``"merged"``    1.7 (one copy on disk): ``merged_codes.npy`` / ``merged_residuals.npy`` hold
                every chunk back to back, at the rows ``merged_<kind>.manifest.json`` lists
                per chunk (``{"<i>.<kind>.npy": {"rows": n, "merged": true}}``, in chunk
                order), followed by padding rows; ``metadata.json`` says ``"frozen": true,
                "mutable": true``.  An index frozen by an older release has a merged file
                without manifest: its chunks lie in ``doclens`` order.
``"mixed"``     1.7 between an ``update`` / ``delete`` and its next load: chunks whose
                ``<i>.<kind>.npy`` is on disk (staged, newer than the merged copy) read
                from there, the others from the merged file at the manifest's rows.
==============  ==============================================================================

Anything else -- a chunk found in neither place, a manifest whose rows disagree with
``doclens``, codes that are not integers, residuals of another width -- is
:class:`UnknownIndexLayout`: the caller lets fast-plaid serve, with that reason.
"""
from __future__ import annotations

import json
import os
from typing import Iterator, NamedTuple

import numpy as np

KINDS = ("codes", "residuals")


class UnknownIndexLayout(ValueError):
    """The folder's files are in no layout this module reads (the message says what is off)."""


class ChunkSource(NamedTuple):
    """Where chunk ``chunk``'s ``rows`` tokens of one kind lie: ``file`` at row ``start``."""

    chunk: int
    rows: int
    file: str
    start: int


def read_metadata(path: str) -> dict:
    try:
        with open(os.path.join(path, "metadata.json")) as fh:
            meta = json.load(fh)
        int(meta["num_chunks"]), int(meta["nbits"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UnknownIndexLayout(f"{path}: metadata.json unreadable or without num_chunks / nbits ({exc})") from exc
    return meta


def chunk_lengths(path: str, n_chunks: int) -> list[list[int]]:
    """Each chunk's document lengths (``doclens.<i>.json``)."""
    lengths = []
    for chunk in range(n_chunks):
        try:
            with open(os.path.join(path, f"doclens.{chunk}.json")) as fh:
                lengths.append([int(n) for n in json.load(fh)])
        except (OSError, ValueError, TypeError) as exc:
            raise UnknownIndexLayout(f"{path}: doclens.{chunk}.json unreadable ({exc})") from exc
    return lengths


def _manifest(path: str, kind: str) -> dict | None:
    name = os.path.join(path, f"merged_{kind}.manifest.json")
    if not os.path.exists(name):
        return None
    try:
        with open(name) as fh:
            manifest = json.load(fh)
    except (OSError, ValueError) as exc:
        raise UnknownIndexLayout(f"{path}: merged_{kind}.manifest.json unreadable ({exc})") from exc
    if not isinstance(manifest, dict):
        raise UnknownIndexLayout(f"{path}: merged_{kind}.manifest.json is not a mapping")
    return manifest


def sources(path: str, kind: str, rows: list[int], frozen: bool) -> list[ChunkSource]:
    """Where each chunk's ``kind`` (``codes`` / ``residuals``) lies; ``rows``: tokens per chunk."""
    merged = os.path.join(path, f"merged_{kind}.npy")
    manifest = _manifest(path, kind) if os.path.exists(merged) else None
    out, offset = [], 0                 # offset: the chunk's first row in the merged file
    for chunk, n in enumerate(rows):
        shard = os.path.join(path, f"{chunk}.{kind}.npy")
        entry = manifest.get(f"{chunk}.{kind}.npy") if manifest is not None else None
        if os.path.exists(shard):       # 1.4's own file, or 1.7's staged one: the newest rows
            out.append(ChunkSource(chunk, n, shard, 0))
        elif manifest is not None and isinstance(entry, dict) and entry.get("merged"):
            if entry.get("rows") != n:
                raise UnknownIndexLayout(f"{path}: merged_{kind}.manifest.json lists {entry.get('rows')} rows for "
                                         f"chunk {chunk}, doclens.{chunk}.json {n}")
            out.append(ChunkSource(chunk, n, merged, offset))
        elif manifest is None and frozen and os.path.exists(merged):
            out.append(ChunkSource(chunk, n, merged, offset))   # frozen by an older release: doclens order
        else:
            raise UnknownIndexLayout(f"{path}: chunk {chunk}'s {kind} are neither in {chunk}.{kind}.npy nor "
                                     f"listed as merged in merged_{kind}.manifest.json")
        if manifest is not None:
            # the merged file's rows follow the manifest's entries in chunk order (1.7's rule)
            offset += int(entry["rows"]) if isinstance(entry, dict) and "rows" in entry else 0
        else:
            offset += n
    return out


def layout_name(all_sources: list[list[ChunkSource]], path: str) -> str:
    shards = {s.file != os.path.join(path, f"merged_{kind}.npy")
              for kind, per_kind in zip(KINDS, all_sources) for s in per_kind}
    return "shards" if shards == {True} else "merged" if shards == {False} else "mixed"


class IndexFiles(NamedTuple):
    """What :func:`index_files` found: the metadata, every document's length, and where each
    chunk's codes and residuals lie."""

    meta: dict
    dim: int                 # the embeddings' width (centroids.npy's columns)
    lengths: list[int]
    codes: list[ChunkSource]
    residuals: list[ChunkSource]
    layout: str              # "shards", "merged" or "mixed" (module docstring)

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's residual (``d * nbits / 8``)."""
        return self.dim * int(self.meta["nbits"]) // 8


def index_files(path: str) -> IndexFiles:
    """The layout of the index in folder ``path``, or :class:`UnknownIndexLayout`.  Reads the
    small files (metadata, doclens, manifests) and the headers of the codes' and residuals'
    files (dtype, shape), not their rows."""
    meta = read_metadata(path)
    try:
        dim = int(np.load(os.path.join(path, "centroids.npy"), mmap_mode="r").shape[1])
    except (OSError, ValueError, IndexError) as exc:
        raise UnknownIndexLayout(f"{path}: centroids.npy unreadable or not [C, d] ({exc})") from exc
    per_chunk = chunk_lengths(path, int(meta["num_chunks"]))
    rows = [sum(lengths) for lengths in per_chunk]
    frozen = bool(meta.get("frozen", False))
    codes, residuals = (sources(path, kind, rows, frozen) for kind in KINDS)
    files = IndexFiles(meta, dim, [n for lengths in per_chunk for n in lengths], codes, residuals,
                       layout_name([codes, residuals], path))
    for kind, per_kind in zip(KINDS, (codes, residuals)):
        for source in per_kind:
            read_rows(source, kind, files.row_bytes)    # the headers checked now, before anything is loaded
    return files


def read_rows(source: ChunkSource, kind: str, row_bytes: int) -> np.ndarray:
    """Chunk ``source``'s rows of ``kind``, checked: integer codes ``[rows]``, uint8 residuals
    ``[rows, row_bytes]`` (a memory map sliced: only those rows are read, and only when used)."""
    try:
        array = np.load(source.file, mmap_mode="r")
    except (OSError, ValueError) as exc:
        raise UnknownIndexLayout(f"{source.file}: not a .npy array ({exc})") from exc
    end = source.start + source.rows
    if kind == "codes":
        ok = array.ndim == 1 and np.issubdtype(array.dtype, np.integer)
    else:
        ok = array.ndim == 2 and array.dtype == np.uint8 and array.shape[1] == row_bytes
    if not ok or array.shape[0] < end:
        raise UnknownIndexLayout(f"{source.file}: {array.dtype} {array.shape}, expected "
                                 + (f"integer codes with {end} rows" if kind == "codes"
                                    else f"uint8 residuals [{end}, {row_bytes}]"))
    return array[source.start:end]


def chunks(files: IndexFiles) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Each chunk's ``(codes, residuals)``, one chunk at a time (one host copy of a chunk)."""
    for code_source, residual_source in zip(files.codes, files.residuals):
        yield (read_rows(code_source, "codes", files.row_bytes),
               read_rows(residual_source, "residuals", files.row_bytes))
