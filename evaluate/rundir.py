"""Files of a run directory, written so that a crash at any moment loses at most the context in flight.

- ``predictions.jsonl`` is appended one object per line, flushed and fsynced after each context; a torn
  last line left by a crash is detected and cut off when the file is read back.
- ``config.yaml``, ``metrics.json`` and ``run.json`` are replaced whole (write beside, then rename).
"""

import fcntl
import json
import logging
import os
import socket
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import yaml

from evaluate.config import ConfigError

PREDICTIONS = "predictions.jsonl"
METRICS = "metrics.json"
RUN = "run.json"
CONFIG = "config.yaml"
LOCK = ".lock"

logger = logging.getLogger(__name__)


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(staging, path)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise


def write_json(path: Path, data: dict) -> None:
    write_atomic(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def write_yaml(path: Path, data: dict) -> None:
    write_atomic(path, yaml.safe_dump(data, sort_keys=False, allow_unicode=True))


def read_json(path: Path) -> dict | None:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


def read_yaml(path: Path) -> dict | None:
    return yaml.safe_load(path.read_text(encoding="utf-8")) if path.exists() else None


def read_predictions(path: Path, repair: bool = False) -> list[dict]:
    """Rows of a predictions file. A torn last line (a crash mid-write) is dropped, and cut from the file
    when ``repair`` is set so that appending can resume after the last complete row."""
    if not path.exists():
        return []
    data = path.read_bytes()
    complete_end = data.rfind(b"\n") + 1
    rows = [json.loads(line) for line in data[:complete_end].decode("utf-8").splitlines() if line.strip()]
    if complete_end < len(data) and repair:
        with path.open("r+b") as handle:
            handle.truncate(complete_end)
    return rows


def _jsonl(rows: Iterable[dict]) -> str:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def append_predictions(path: Path, rows: Iterable[dict]) -> None:
    with path.open("a", encoding="utf-8") as handle:
        handle.write(_jsonl(rows))
        handle.flush()
        os.fsync(handle.fileno())


def rewrite_predictions(path: Path, rows: Iterable[dict]) -> None:
    write_atomic(path, _jsonl(rows))


class RunLocked(ConfigError):
    """Another live process is writing this run directory."""

    def __init__(self, run_directory: Path, holder: str):
        super().__init__(f"{run_directory} is being written by {holder}; wait for it to finish or stop it first")
        self.holder = holder


@contextmanager
def locked(run_directory: Path, wait: bool = False) -> Iterator[None]:
    """Hold the run directory for this process; ``wait`` blocks until its holder lets go instead of refusing.

    The lock is an flock on ``.lock``: the kernel releases it when its holder dies, however it dies, so a
    lock left by a killed process is taken over without any staleness heuristics. The file names the holder
    so that a refused second process can say who has the run.
    """
    run_directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_directory / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode("utf-8", errors="replace").strip() or "another process"
            if not wait:
                raise RunLocked(run_directory, holder) from None
            logger.warning("%s is being written by %s; waiting for it (wait_for_locks=true)", run_directory, holder)
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        started = datetime.now(timezone.utc).isoformat(timespec="seconds")
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} (since {started})".encode(), 0)
        yield
    finally:
        os.close(fd)
