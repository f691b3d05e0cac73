"""Where benchmark rows come from: a Hugging Face hub dataset, or local files holding the same columns.

Hub datasets are read as kvpress reads them, ``datasets.load_dataset(name, data_dir=..., split=...)`` (by config name,
``load_dataset(name, config, split=...)``, where a dataset's card declares one config per task); an unreachable
hub (offline mode, no network) becomes a :class:`~evaluate.errors.ConfigError` that names the dataset and says how
to point ``benchmark.path`` at local files, raised before any model is loaded. Offline (``HF_HUB_OFFLINE`` or
``HF_DATASETS_OFFLINE``), datasets reads its cache alone, at once; otherwise a connection to the hub is tried first
(:func:`no_connection`, 3 s at most), so that no network is refused at once instead of after the hub client's
half a minute of retries.

Every row is checked where it enters, against the benchmark's :class:`Schema` (its columns and what each holds): a
row that is not a JSON object, lacks a column, or holds the wrong type (a ``max_new_tokens`` of "abc", an ``answer``
with no reference to score against) is refused in one line naming its file and line (or hub row) and the field,
before any model loads, rather than failing a sample mid-run or the scoring after it.

A local source (``benchmark.path``) is one of:

- a ``.jsonl`` file (one JSON object per line), a ``.json`` file (JSON lines or one JSON array), a ``.parquet`` file;
- a dataset written by ``Dataset.save_to_disk`` (or ``DatasetDict.save_to_disk``, whose ``split`` is taken);
- a directory of data files, e.g. one data_dir folder of a hub snapshot (``narrativeqa/test-00000-of-00001.parquet``):
  the files whose names start with the split are read if there are any, otherwise all of them, in path order.

Hub datasets stored as one data_dir or config per task (or per length, for RULER) are looked up in a local directory
as ``DIR/{name}.jsonl``, ``DIR/{name}.json``, ``DIR/{name}.parquet`` or ``DIR/{name}/``, the layout of a hub snapshot.

Rows in kvpress's hub schema (context, question, answer_prefix, max_new_tokens and the answers) become samples
through :func:`kvpress_sample`, taken at most ``limit`` per task by :func:`first_rows` (one data_dir per task) or
:func:`first_rows_per_task` (one split holding every task).
"""

import json
import socket
import urllib.request
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from evaluate.benchmarks import Sample
from evaluate.errors import ConfigError

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")

HUB_HOST = "huggingface.co"

# How a local file says which task a row belongs to: kvpress's column, then LongBench's original field.
TASK_FIELDS = ("task", "dataset")


@dataclass(frozen=True)
class Kind:
    """What one field of a row must hold, described as the refusal names it ("a positive integer")."""

    description: str
    accepts: Callable[[Any], bool]


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


TEXT = Kind("a string", lambda value: isinstance(value, str))
POSITIVE_INT = Kind("a positive integer", lambda value: is_number(value) and value > 0 and float(value).is_integer())
# A reference answer is what a row is scored against: an empty one (answer [] or "") leaves nothing to score, and
# would only fail the scoring after the whole model run (a benchmark without references, ZeroSCROLLS, reads none).
REFERENCES = Kind(
    "a non-empty list of strings (the reference answers a row is scored against)",
    lambda value: isinstance(value, list) and bool(value) and all(isinstance(item, str) for item in value),
)
REFERENCE = Kind(
    "a non-empty string (the reference answer a row is scored against)",
    lambda value: isinstance(value, str) and bool(value),
)

# What each column of kvpress's hub schema (and LongBench's original ``input``) holds, unless a schema says otherwise.
KINDS: Mapping[str, Kind] = {
    "context": TEXT,
    "question": TEXT,
    "answer_prefix": TEXT,
    "task": TEXT,
    "input": TEXT,
    "max_new_tokens": POSITIVE_INT,
    "answer": REFERENCES,
    "answers": REFERENCES,
}


@dataclass(frozen=True)
class Schema:
    """The columns a benchmark reads from each row, checked on every row as it is read (:func:`split_rows`,
    :func:`rows_by_task`), so that one bad row is refused with its place before any model loads.

    ``kinds`` overrides :data:`KINDS` where a benchmark's format differs (LooGLE's ``answer`` is one string);
    ``alternative`` is another complete set of columns a row may have instead (LongBench's original rows).
    """

    columns: tuple[str, ...]
    kinds: Mapping[str, Kind] = field(default_factory=dict)
    alternative: tuple[str, ...] = ()

    def check(self, row: Any, where: str) -> None:
        """Refuse the row at ``where`` (file:line, or the hub row) unless it has every column, each as it must be."""
        if not isinstance(row, dict):
            raise ConfigError(f"{where}: the row is {_shown(row)}, not a JSON object; fix the row or drop it")
        columns = self.columns_of(row)
        missing = [column for column in columns if column not in row]
        if missing:
            raise ConfigError(
                f"{where}: the row lacks the column(s) {', '.join(missing)} (it has {', '.join(sorted(row))}); "
                "fix the row or drop it"
            )
        for column in columns:
            kind = self.kinds.get(column, KINDS.get(column))
            if kind is not None and not kind.accepts(row[column]):
                raise ConfigError(
                    f"{where}: field {column!r} is {_shown(row[column])}, not {kind.description}; "
                    "fix the row or drop it"
                )

    def columns_of(self, row: dict) -> tuple[str, ...]:
        """The set of columns the row follows: ``columns``, unless it lacks one of them and has every one of
        ``alternative``."""
        if any(column not in row for column in self.columns) and self.alternative:
            if all(column in row for column in self.alternative):
                return self.alternative
        return self.columns


def _shown(value: Any, width: int = 40) -> str:
    """The value as JSON, cut to ``width`` characters, for a one-line refusal."""
    text = json.dumps(value, ensure_ascii=False, default=repr)
    return text if len(text) <= width else text[: width - 3] + "..."


@cache
def no_connection() -> str | None:
    """Why the Hugging Face hub cannot be reached, if a connection to it fails within 3 s; None when it connects, or
    when a proxy carries https (a direct connection would say nothing of the proxy's)."""
    if urllib.request.getproxies().get("https"):
        return None
    try:
        socket.create_connection((HUB_HOST, 443), timeout=3).close()
    except OSError as error:
        return f"{HUB_HOST}: {error}"
    return None


def hub_rows(
    dataset: str, data_dir: str | None, split: str, local_layout: str, schema: Schema, config: str | None = None
) -> list[dict]:
    """All rows of one hub data_dir, or of one ``config`` (a dataset whose card declares one config per task, e.g.
    SCBench), checked; ``local_layout`` tells the user what ``benchmark.path`` must hold instead."""
    from datasets import config as datasets_config
    from datasets import load_dataset

    if config is not None:
        where, selection = f"{dataset} (config {config})", {"name": config}
    else:
        where = dataset if data_dir is None else f"{dataset} (data_dir {data_dir})"
        selection = {"data_dir": data_dir}
    local = f"download it where the hub is reachable and pass benchmark.path=DIR, with {local_layout}"
    # Offline, datasets reads its cache alone and answers at once; online, it would retry an unreachable hub for
    # half a minute before its cache, which HF_DATASETS_OFFLINE=1 reads at once.
    unreachable = None if datasets_config.HF_HUB_OFFLINE else no_connection()
    if unreachable is not None:
        raise ConfigError(
            f"cannot reach the Hugging Face hub for {where} ({unreachable}); set HF_DATASETS_OFFLINE=1 to read it "
            f"from the datasets cache, or {local}"
        )
    try:
        rows = load_dataset(dataset, **selection, split=split).to_list()
    except ConnectionError as error:
        raise ConfigError(f"cannot load {where} from the Hugging Face hub ({error}); {local}") from error
    return _checked(rows, schema, f"{where} {split} row")


def split_rows(
    dataset: str, data_dir: str | None, split: str, path: str | None, local_layout: str, schema: Schema
) -> list[dict]:
    """All rows of one split: from the hub (:func:`hub_rows`), or from the local source ``path``.

    With a ``data_dir``, a local directory that is not a saved dataset may be a hub snapshot: its ``data_dir`` entry
    (see :func:`locate`) is read when it has one, the whole directory otherwise.
    """
    if path is None:
        return hub_rows(dataset, data_dir, split, local_layout, schema)
    root = Path(path).expanduser()
    snapshot = data_dir is not None and root.is_dir() and not is_saved_dataset(root)
    nested = locate(root, data_dir) if snapshot else None
    return read_rows(nested or root, schema, split)


def data_dir_layout(data_dir: str) -> str:
    """What ``benchmark.path`` must hold instead of one hub data_dir (for :func:`split_rows`)."""
    return f"the rows of data_dir {data_dir} (a .jsonl/.parquet file, a saved dataset, or {data_dir}/)"


def is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def locate(root: Path, name: str) -> Path | None:
    """``root/{name}.jsonl|.json|.parquet`` or ``root/{name}/``, whichever exists first."""
    for candidate in (*(root / f"{name}{suffix}" for suffix in DATA_SUFFIXES), root / name):
        if candidate.exists():
            return candidate
    return None


def read_rows(path: Path, schema: Schema, split: str = "test") -> list[dict]:
    """Every row of a local file, saved dataset or directory of data files, each checked against ``schema``."""
    if path.is_file():
        return _read_file(path, schema)
    if not path.is_dir():
        raise ConfigError(f"benchmark.path: {path} does not exist")
    if is_saved_dataset(path):
        return _read_saved_dataset(path, split, schema)
    files = sorted(file for file in path.rglob("*") if file.is_file() and file.suffix in DATA_SUFFIXES)
    files = [file for file in files if file.name.startswith(split)] or files
    if not files:
        raise ConfigError(f"benchmark.path: {path} holds no .jsonl, .json or .parquet file and is not a saved dataset")
    return [row for file in files for row in _read_file(file, schema)]


def rows_by_task(
    dataset: str,
    tasks: Sequence[str],
    split: str,
    path: str | None,
    local_layout: str,
    schema: Schema,
    configs: bool = False,
) -> dict[str, list[dict]]:
    """The rows of each task, in source order, for datasets stored as one data_dir (or one config) per task.

    From the hub, each task is its own data_dir, or its own config with ``configs``. Locally, ``path`` is either a
    directory with one entry per task (see :func:`locate`), or a single file / saved dataset whose rows name their
    task in a ``task`` (kvpress) or ``dataset`` (LongBench) field. Every requested task must have rows.
    """
    if path is None:
        return {
            task: hub_rows(dataset, None if configs else task, split, local_layout, schema, task if configs else None)
            for task in tasks
        }
    root = Path(path).expanduser()
    if root.is_dir() and not is_saved_dataset(root):
        found = {task: locate(root, task) for task in tasks}
        missing = [task for task, source in found.items() if source is None]
        if missing:
            raise ConfigError(
                f"benchmark.path={root} has no data for {', '.join(missing)}; DIR needs {local_layout}, "
                "or select the tasks it has with benchmark.tasks=[...]"
            )
        return {task: read_rows(source, schema, split) for task, source in found.items()}
    grouped: dict[str, list[dict]] = {task: [] for task in tasks}
    for row in read_rows(root, schema, split):
        task = next((row[field] for field in TASK_FIELDS if row.get(field) is not None), None)
        if task in grouped:
            grouped[task].append(row)
    missing = [task for task, rows in grouped.items() if not rows]
    if missing:
        raise ConfigError(
            f"benchmark.path={root} has no rows for {', '.join(missing)} (rows name their task in a 'task' or "
            "'dataset' field); select the tasks it has with benchmark.tasks=[...]"
        )
    return grouped


def kvpress_sample(
    task: str, index: int, row: Mapping[str, Any], answers: list[str], extra: dict[str, Any] | None = None
) -> Sample:
    """The sample of a row in kvpress's hub schema, ``index`` being its place within its task (the id's number)."""
    return Sample(
        id=f"{task}-{index}",
        task=task,
        context=row["context"],
        question=row["question"],
        answer_prefix=row["answer_prefix"],
        answers=answers,
        max_new_tokens=int(row["max_new_tokens"]),
        extra=extra or {},
    )


def first_rows(rows_of_task: Mapping[str, Sequence[dict]], limit: int | None) -> Iterator[tuple[str, int, dict]]:
    """(task, index within the task, row) of the first ``limit`` rows of each task, task after task."""
    for task, rows in rows_of_task.items():
        for index, row in enumerate(rows[:limit]):
            yield task, index, row


def first_rows_per_task(
    rows: Iterable[dict], task_of: Callable[[dict], str], tasks: Collection[str] | None, limit: int | None
) -> Iterator[tuple[str, int, dict]]:
    """(task, index within the task, row) of the first ``limit`` rows of each task in ``tasks`` (None: every task),
    in source order, from one split that holds every task.

    ``task_of`` reads the task of every row, kept or not, so that it may check each row's task name in source order.
    """
    counts: Counter[str] = Counter()
    for row in rows:
        task = task_of(row)
        if (tasks is not None and task not in tasks) or (limit is not None and counts[task] >= limit):
            continue
        yield task, counts[task], row
        counts[task] += 1


def _read_file(path: Path, schema: Schema) -> list[dict]:
    """The rows of one data file, each checked where it stands: ``FILE:LINE`` in JSON lines, ``FILE row N`` in a
    JSON array or parquet file."""
    if path.suffix == ".parquet":
        import pyarrow
        import pyarrow.parquet

        try:
            table = pyarrow.parquet.read_table(path)
        except pyarrow.ArrowException as error:
            raise ConfigError(f"{path} is not a parquet file ({error}); point benchmark.path at the data") from None
        return _checked(table.to_pylist(), schema, f"{path} row")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{path} is not UTF-8 text (byte {error.start}: {error.reason}): benchmark.path takes .jsonl, .json or "
            ".parquet rows, a saved dataset or a folder of them; point it at the data"
        ) from None
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigError(f"{path}:{error.lineno}: not a JSON array of rows ({error.msg}); fix the file") from error
        return _checked(rows, schema, f"{path} row")
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ConfigError(
                    f"{path}:{number}: not a JSON object ({error.msg}); fix the row or drop it"
                ) from error
            schema.check(row, f"{path}:{number}")
            rows.append(row)
    return rows


def _checked(rows: list, schema: Schema, where: str) -> list[dict]:
    """``rows``, each checked as ``{where} N`` (N counting from 1)."""
    for number, row in enumerate(rows, start=1):
        schema.check(row, f"{where} {number}")
    return rows


def _read_saved_dataset(path: Path, split: str, schema: Schema) -> list[dict]:
    from datasets import DatasetDict, load_from_disk

    saved = load_from_disk(str(path))
    if isinstance(saved, DatasetDict):
        if split not in saved:
            raise ConfigError(f"benchmark.path={path} is a saved dataset without a {split!r} split: {list(saved)}")
        saved = saved[split]
    return _checked(saved.to_list(), schema, f"{path} ({split}) row")
