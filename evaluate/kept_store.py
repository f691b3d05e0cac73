"""A run's stored kept sets (``save_kept=true``): one file per row under ``kept/`` in its run directory, which the
recorder writes and the report reads (``--agreement``, the kept map) without torch.

A file holds the row's sample id, its kept set as one bitmask per layer and KV head over the context's positions
(bit-packed, then compressed: ``numpy.savez_compressed``), and the answer's positions in the context (empty where the
answer is not in it). Written whole or not at all, as every file of a run directory is.
"""

import hashlib
import io
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

KEPT = "kept"


def kept_path(run_directory: Path, sample_id: str) -> Path:
    """A row's file: named by a hash of its sample id, which may hold any character."""
    return run_directory / KEPT / f"{hashlib.sha1(str(sample_id).encode()).hexdigest()[:20]}.npz"


@dataclass
class StoredKept:
    """One row's kept set as stored: ``mask`` [layers, KV heads, context positions] bool, the answer's positions."""

    sample_id: str
    mask: np.ndarray
    answer_positions: np.ndarray

    @property
    def context_length(self) -> int:
        return self.mask.shape[-1]


def write_kept(run_directory: Path, sample_id: str, mask: np.ndarray, answer_positions: np.ndarray | None) -> Path:
    """Store a row's kept set (``mask`` bool [layers, KV heads, positions]) and its answer's positions."""
    buffer = io.BytesIO()
    np.savez_compressed(
        buffer,
        sample_id=np.array(str(sample_id)),
        shape=np.array(mask.shape, dtype=np.int64),
        bits=np.packbits(mask.astype(bool), axis=-1),
        answer_positions=np.asarray([] if answer_positions is None else answer_positions, dtype=np.int64),
    )
    path = kept_path(run_directory, sample_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}-{os.getpid()}")
    staging.write_bytes(buffer.getvalue())
    os.replace(staging, path)
    return path


def read_kept(path: Path) -> StoredKept:
    with np.load(path) as stored:
        shape = tuple(int(size) for size in stored["shape"])
        mask = np.unpackbits(stored["bits"], axis=-1, count=shape[-1]).astype(bool).reshape(shape)
        return StoredKept(str(stored["sample_id"]), mask, stored["answer_positions"])


def read_run_kept(run_directory: Path) -> dict[str, StoredKept]:
    """Every stored kept set of a run, by sample id (empty where it stored none)."""
    stored = (read_kept(path) for path in sorted((run_directory / KEPT).glob("*.npz")))
    return {kept.sample_id: kept for kept in stored}
