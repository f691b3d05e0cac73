"""Files of a run directory, written so that a crash at any moment loses at most the context in flight.

- ``predictions.jsonl`` is appended one object per line, flushed and fsynced after each context; a torn
  last line left by a crash is detected and cut off when the file is read back. Any other unreadable line is
  refused with its file and line number, until ``python -m evaluate.run.repair`` moves it aside.
- ``config.yaml``, ``metrics.json`` and ``run.json`` are replaced whole (write beside, then rename).
- A shard of a point (evaluate/points/shard.py) appends to ``shards/<shard>.jsonl`` and records its session in
  ``shards/<shard>.json``; the shard that answers a point's last sample merges them into ``predictions.jsonl``, in
  the order one process would have written, and removes them. A shard's lock, ``shards/<shard>.lock``, is removed by
  its holder as it lets go, and by the merge where no live process holds it (a killed shard's).
"""

import fcntl
import json
import logging
import os
import secrets
import shutil
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import TypeVar

import yaml

from evaluate.errors import ConfigError

PREDICTIONS = "predictions.jsonl"
METRICS = "metrics.json"
RUN = "run.json"
# run.json statuses of a run whose every sample is answered (failed ones included).
FINISHED = ("complete", "complete_with_errors")
CONFIG = "config.yaml"
LOCK = ".lock"
SHARDS = "shards"
# Held while a shard reads or rewrites what every shard of the point shares (run.json, the merge).
MERGE_LOCK = ".merge-lock"

logger = logging.getLogger(__name__)
_Made = TypeVar("_Made")
_warned: set[str] = set()  # the duplicate samples' warnings this process gave (read_predictions)


def cr_text(cr: float) -> str:
    """A compression ratio as run names, summaries and tables print it: two decimals, or as many as it has where two
    would round it (0.999 and 0.998 are not both 1.00; 0.9375 is 16:1)."""
    text = f"{cr:.10g}"
    return text if "." in text and len(text.split(".")[1]) > 2 else f"{cr:.2f}"


def _fresh(parent: Path, prefix: str, make: Callable[[Path], _Made]) -> _Made:
    """``make`` a new name in ``parent`` that starts with ``prefix``, another name as long as one exists.

    Files and folders written beside their target are created with modes 0o666 and 0o777 so that the kernel applies
    the umask (and a folder's default ACL), as for any file a program creates: tempfile.mkstemp and mkdtemp fix
    0o600 and 0o700, which left every result owner-only. The umask itself is never read: only os.umask reads it
    portably, by setting it, and a thread creating a file between its two calls would get the wrong mode.
    """
    while True:
        try:
            return make(parent / f"{prefix}{secrets.token_hex(4)}")
        except FileExistsError:
            continue


def _new_file(path: Path) -> tuple[int, Path]:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666), path


def _new_folder(path: Path) -> Path:
    path.mkdir(0o777)
    return path


def staging_folder(parent: Path, prefix: str) -> Path:
    """A new empty folder in ``parent`` (mode 0o777 less the umask) to fill, then rename into place."""
    parent.mkdir(parents=True, exist_ok=True)
    return _fresh(parent, prefix, _new_folder)


def first_missing(path: Path) -> Path | None:
    """The topmost folder on ``path`` (``path`` included) that does not exist yet, which creating ``path`` creates
    and a refused command removes again; None when ``path`` exists."""
    if path.exists():
        return None
    while not path.parent.exists():
        path = path.parent
    return path


def remove_created(top: Path | None) -> None:
    """Remove the folders a refused command created under ``top`` (its :func:`first_missing` from before it began),
    with what they hold: the refusal comes before anything runs, so they hold only what the command itself wrote
    (a sweep's multirun.yaml)."""
    if top is not None and top.is_dir():
        shutil.rmtree(top)


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` whole: written beside it (mode 0o666 less the umask), then renamed onto it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = _fresh(path.parent, f".{path.name}-", _new_file)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(staging, path)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise


def write_json(path: Path, data: dict) -> None:
    write_atomic(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def write_yaml(path: Path, data: dict) -> None:
    write_atomic(path, yaml.safe_dump(data, sort_keys=False, allow_unicode=True))


def read_json(path: Path) -> dict | None:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


def read_yaml(path: Path) -> dict | None:
    return yaml.safe_load(path.read_text(encoding="utf-8")) if path.exists() else None


class Unreadable(ConfigError):
    """A run file that cannot be read as the mapping it should hold; the message names the file and why, in one
    line, so that a reader of a results tree can skip it and go on with the rest."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"{path}: {' '.join(reason.split())}")
        self.path = path


def read_record(path: Path) -> dict | None:
    """The mapping a run file holds (config.yaml as YAML, the others as JSON), None when it is missing; raises
    :class:`Unreadable` for a file that is unreadable, a folder, truncated, not JSON or YAML, or not a mapping."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as error:
        raise Unreadable(path, f"unreadable ({error.strerror})") from None
    try:
        data = yaml.safe_load(text) if path.suffix == ".yaml" else json.loads(text)
    except (ValueError, yaml.YAMLError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise Unreadable(path, f"not {'YAML' if path.suffix == '.yaml' else 'JSON'} ({error})") from None
    if not isinstance(data, dict):
        raise Unreadable(path, f"holds a {type(data).__name__}, not a mapping")
    return data


class DamagedPredictions(ConfigError):
    """A predictions file with an unreadable line that is not a torn last line; nothing reads past it."""

    def __init__(self, path: Path, line: int, reason: str):
        super().__init__(
            f"{path}:{line} is not a prediction row ({reason}); the file is left as it is. Move the damaged lines "
            f"aside with python -m evaluate.run.repair {path.parent}, then rerun to answer their samples again"
        )
        self.path, self.line = path, line


def _parse_row(raw: bytes) -> dict:
    """One line of a predictions file as its row; ValueError (JSONDecodeError, UnicodeDecodeError) when damaged."""
    row = json.loads(raw.decode("utf-8"))
    if not isinstance(row, dict):
        raise ValueError(f"a JSON {type(row).__name__}, not an object")
    return row


def _numbered_lines(data: bytes) -> tuple[list[tuple[int, bytes]], int]:
    """The non-blank complete lines of a predictions file with their line numbers, and where the complete lines
    end: what follows is a torn last line, a crash mid-write."""
    complete_end = data.rfind(b"\n") + 1
    lines = enumerate(data[:complete_end].split(b"\n")[:-1], start=1)
    return [(number, raw) for number, raw in lines if raw.strip()], complete_end


def read_predictions(path: Path, repair: bool = False) -> list[dict]:
    """Rows of a predictions file, each sample once. A torn last line (a crash mid-write) is dropped, and cut from
    the file when ``repair`` is set so that appending can resume after the last complete row. Any other unreadable
    line is refused with :class:`DamagedPredictions`, naming the file and line, and the file is left untouched.

    A sample with several rows (a line copied by hand, two files joined) counts once, as its first row, the one a
    resume keeps: one warning line names each such sample, its lines, and whether the copies differ."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as error:
        raise Unreadable(path, f"unreadable ({error.strerror})") from None
    lines, complete_end = _numbered_lines(data)
    rows, first, repeats = [], {}, {}
    for number, raw in lines:
        try:
            row = _parse_row(raw)
        except ValueError as error:
            raise DamagedPredictions(path, number, getattr(error, "msg", None) or str(error)) from None
        key = row.get("id")
        if not isinstance(key, str | int):  # a bare scoring file's rows need no id: each one counts
            rows.append(row)
        elif key in first:
            repeats.setdefault(key, []).append((number, row))
        else:
            first[key] = (number, row)
            rows.append(row)
    if repeats and (warning := _repeated_samples(path, first, repeats)) not in _warned:
        # Once per process: the plan, the recorder and the summary of one run each read the same file.
        _warned.add(warning)
        logger.warning(warning)
    if complete_end < len(data) and repair:
        with path.open("r+b") as handle:
            handle.truncate(complete_end)
    return rows


def _differing_fields(row: dict, other: dict) -> set[str]:
    return {field for field in {*row, *other} if row.get(field) != other.get(field)}


def _repeated_samples(path: Path, first: dict, repeats: dict[str | int, list[tuple[int, dict]]]) -> str:
    """The one line that names a predictions file's samples with several rows (their lines), says that the first row
    of each counts, and names the copies that differ from it: a reader cannot tell which answer is right, the user
    can."""
    named = [f"{key} (lines {', '.join(map(str, [first[key][0], *(n for n, _ in repeats[key])]))})" for key in repeats]
    shown = "; ".join(named[:5]) + (f" and {len(named) - 5} more" if len(named) > 5 else "")
    differing = {
        key: fields
        for key, copies in repeats.items()
        if (fields := set().union(*(_differing_fields(row, first[key][1]) for _, row in copies)))
    }
    if differing:
        key, fields = next(iter(differing.items()))
        tail = (
            f"; the copies of {len(differing)} of them differ (of {key}, in {', '.join(sorted(fields))}): delete the "
            "line that is wrong to count the other"
        )
    else:
        tail = "; the copies are identical"
    return (
        f"{path}: {len(repeats)} {'sample has' if len(repeats) == 1 else 'samples have'} several rows, each counted "
        f"once, as its first row: {shown}{tail}"
    )


def move_damaged_lines(path: Path) -> tuple[int, int, Path]:
    """Move every unreadable line of a predictions file, a torn last line too, to ``<file>.damaged``: appended there
    as it was and fsynced before the file is rewritten with its readable rows, so a crash between the two loses
    nothing. Returns (rows kept, lines moved, the file they went to)."""
    aside = path.with_name(path.name + ".damaged")
    data = path.read_bytes()
    lines, complete_end = _numbered_lines(data)
    rows, damaged = [], []
    for _, raw in lines:
        try:
            rows.append(_parse_row(raw))
        except ValueError:
            damaged.append(raw + b"\n")
    if data[complete_end:].strip():
        damaged.append(data[complete_end:] + b"\n")
    if damaged:
        with aside.open("ab") as handle:
            handle.write(b"".join(damaged))
            handle.flush()
            os.fsync(handle.fileno())
        rewrite_predictions(path, rows)
    return len(rows), len(damaged), aside


def _jsonl(rows: Iterable[dict]) -> str:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def append_predictions(path: Path, rows: Iterable[dict]) -> None:
    with path.open("a", encoding="utf-8") as handle:
        handle.write(_jsonl(rows))
        handle.flush()
        os.fsync(handle.fileno())


def rewrite_predictions(path: Path, rows: Iterable[dict]) -> None:
    write_atomic(path, _jsonl(rows))


def shard_path(run_directory: Path, shard: str, suffix: str) -> Path:
    """A shard's file in its point's run directory: ``.jsonl`` (its predictions), ``.json`` (its sessions),
    ``.lock``."""
    return run_directory / SHARDS / f"{shard}{suffix}"


def shard_paths(run_directory: Path, suffix: str) -> list[Path]:
    """Every shard's file of that kind in the run directory, whatever the shard count that wrote it."""
    return sorted((run_directory / SHARDS).glob(f"*-of-*{suffix}"))


def read_all_predictions(run_directory: Path) -> list[dict]:
    """The rows of ``predictions.jsonl`` and of every shard's file, each sample once (its first row): what the run
    directory holds, whether one process or several shards answered it."""
    rows, seen = [], set()
    for path in [run_directory / PREDICTIONS, *shard_paths(run_directory, ".jsonl")]:
        for row in read_predictions(path):
            if row["id"] not in seen:
                seen.add(row["id"])
                rows.append(row)
    return rows


def remove_shard_files(run_directory: Path) -> None:
    """Drop the shards' predictions and session records once ``predictions.jsonl`` and run.json hold them, the locks
    no live process holds (a killed shard's; a live one removes its own as it lets go), and the shards folder when
    that empties."""
    for path in [*shard_paths(run_directory, ".jsonl"), *shard_paths(run_directory, ".json")]:
        path.unlink(missing_ok=True)
    for path in shard_paths(run_directory, ".lock"):
        _remove_if_free(path)
    _remove_if_empty(run_directory / SHARDS)


def _remove_if_free(lock: Path) -> None:
    """Remove a shard's lock file that no process holds, holding it while it goes: a process that opened it
    meanwhile finds, once it takes the lock, that the file is gone, and takes a fresh one (:func:`_take_shard_lock`)."""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.unlink(missing_ok=True)
    except BlockingIOError:
        pass  # a live shard holds it, and removes it as it lets go
    finally:
        os.close(fd)


def _remove_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:  # missing, or not empty: another shard's files are in it
        pass


class RunLocked(ConfigError):
    """Another live process is writing this run directory."""

    def __init__(self, run_directory: Path, holder: str):
        super().__init__(f"{run_directory} is being written by {holder}; wait for it to finish or stop it first")
        self.holder = holder


def held(run_directory: Path) -> bool:
    """Whether a live process (a whole run, or any shard) holds the run directory's lock now (a reader's question:
    it takes the lock for an instant when it is free)."""
    try:
        fd = os.open(run_directory / LOCK, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _holder(fd: int) -> str:
    return os.pread(fd, 4096, 0).decode("utf-8", errors="replace").strip()


def _flock(fd: int, mode: int, wait: bool) -> bool:
    """Take an flock; without ``wait``, retry a few times over a tenth of a second first, since a reader's
    :func:`held` takes a free lock for an instant."""
    if wait:
        fcntl.flock(fd, mode)
        return True
    for attempt in range(5):
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            time.sleep(0.02 * attempt)
    return False


def live_shards(run_directory: Path) -> dict[str, str]:
    """The shards whose process holds their lock now, by name (``1-of-4``), with who holds it."""
    live = {}
    for path in shard_paths(run_directory, ".lock"):
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:  # its shard let go and removed it since the folder was listed
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            live[path.stem] = _holder(fd)
        finally:
            os.close(fd)
    return live


def _named(shards: dict[str, str]) -> str:
    return ", ".join(f"shard {name} ({holder})" for name, holder in shards.items())


def _claim(fd: int) -> None:
    os.ftruncate(fd, 0)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} (since {started})".encode(), 0)


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _take_shard_lock(path: Path, shard: str, wait: bool) -> int:
    """Open and take a shard's own lock file; RunLocked when a live process holds it (and ``wait`` is off).

    Lock files are removed by whoever holds them (:func:`_let_go`, :func:`_remove_if_free`), so a lock taken on a
    file that is no longer at ``path`` guards nothing: it is dropped and the file now there (or a new one) is taken.
    """
    while True:
        path.parent.mkdir(exist_ok=True)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # another shard removed the emptied shards folder in between
            continue
        if not _flock(fd, fcntl.LOCK_EX, wait):
            holder = _holder(fd)
            os.close(fd)
            raise RunLocked(path.parent.parent, f"shard {shard} ({holder})")
        if _same_file(fd, path):
            return fd
        os.close(fd)


def _let_go(fd: int, path: Path) -> None:
    """Remove a shard's lock file while still holding it (no other process can hold it then), then release it: a
    finished or stopped shard leaves no lock behind, nor an emptied shards folder."""
    try:
        path.unlink(missing_ok=True)
        _remove_if_empty(path.parent)
    finally:
        os.close(fd)


@contextmanager
def locked(run_directory: Path, wait: bool = False, shard: str | None = None) -> Iterator[None]:
    """Hold the run directory for this process; ``wait`` blocks until its holder lets go instead of refusing.

    The lock is an flock on ``.lock``: the kernel releases it when its holder dies, however it dies, so a
    lock left by a killed process is taken over without any staleness heuristics. The file names the holder
    so that a refused second process can say who has the run.

    A ``shard`` (its name, ``1-of-4``) shares ``.lock`` with the point's other shards and holds its own
    ``shards/<shard>.lock`` alone, and removes it as it lets go: shards run side by side, a shard never twice, and a
    whole run never beside a shard. Shards of another count, whose contexts overlap this one's, are refused too.
    """
    run_directory.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        fd = os.open(run_directory / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        stack.callback(os.close, fd)
        if not _flock(fd, fcntl.LOCK_SH if shard else fcntl.LOCK_EX, wait=False):
            holder = _named(live_shards(run_directory)) or _holder(fd) or "another process"
            if not wait:
                raise RunLocked(run_directory, holder)
            logger.warning("%s is being written by %s; waiting for it (wait_for_locks=true)", run_directory, holder)
            _flock(fd, fcntl.LOCK_SH if shard else fcntl.LOCK_EX, wait=True)
        if shard is None:
            _claim(fd)
            yield
            return
        count = shard.split("-of-")[1]
        others = {name: holder for name, holder in live_shards(run_directory).items() if name.split("-of-")[1] != count}
        if others:
            raise RunLocked(run_directory, f"{_named(others)}, of another shard count")
        path = shard_path(run_directory, shard, ".lock")
        own = _take_shard_lock(path, shard, wait)
        stack.callback(_let_go, own, path)
        _claim(own)
        yield


def _lock_files(run_directory: Path) -> list[Path]:
    return [run_directory / LOCK, run_directory / MERGE_LOCK, *shard_paths(run_directory, ".lock")]


def holds_only_locks(run_directory: Path) -> bool:
    """Whether the run directory holds nothing but the locks a run (or a shard) took."""
    shards = run_directory / SHARDS
    files = [path for path in run_directory.rglob("*") if path != shards]
    return set(files) <= set(_lock_files(run_directory))


def remove_locks(run_directory: Path) -> None:
    """Remove a refused run's locks, and its shards folder when that empties."""
    for path in _lock_files(run_directory):
        path.unlink(missing_ok=True)
    _remove_if_empty(run_directory / SHARDS)


@contextmanager
def merging(run_directory: Path) -> Iterator[None]:
    """Hold what a point's shards share (run.json, the merge) while one shard reads and rewrites it."""
    fd = os.open(run_directory / MERGE_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
