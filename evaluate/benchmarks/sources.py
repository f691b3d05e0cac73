"""Where benchmark rows come from: a Hugging Face hub dataset, or local files holding the same columns.

Hub datasets are read as kvpress reads them, ``datasets.load_dataset(name, data_dir=..., split=...)``; an unreachable
hub (offline mode, no network) becomes a :class:`~evaluate.spec.config.ConfigError` that names the dataset and says how
to point ``benchmark.path`` at local files, raised before any model is loaded.

A local source (``benchmark.path``) is one of:

- a ``.jsonl`` file (one JSON object per line), a ``.json`` file (JSON lines or one JSON array), a ``.parquet`` file;
- a dataset written by ``Dataset.save_to_disk`` (or ``DatasetDict.save_to_disk``, whose ``split`` is taken);
- a directory of data files, e.g. one data_dir folder of a hub snapshot (``narrativeqa/test-00000-of-00001.parquet``):
  the files whose names start with the split are read if there are any, otherwise all of them, in path order.

Hub datasets stored as one data_dir per task (or per length, for RULER) are looked up in a local directory as
``DIR/{name}.jsonl``, ``DIR/{name}.json``, ``DIR/{name}.parquet`` or ``DIR/{name}/``, the layout of a hub snapshot.

Rows in kvpress's hub schema (context, question, answer_prefix, max_new_tokens and the answers) become samples
through :func:`kvpress_sample`, taken at most ``limit`` per task by :func:`first_rows` (one data_dir per task) or
:func:`first_rows_per_task` (one split holding every task).
"""

import json
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from evaluate.benchmarks import Sample
from evaluate.spec.config import ConfigError

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")

# How a local file says which task a row belongs to: kvpress's column, then LongBench's original field.
TASK_FIELDS = ("task", "dataset")


def hub_rows(dataset: str, data_dir: str | None, split: str, local_layout: str) -> list[dict]:
    """All rows of one hub data_dir; ``local_layout`` tells the user what ``benchmark.path`` must hold instead."""
    from datasets import load_dataset

    try:
        return load_dataset(dataset, data_dir=data_dir, split=split).to_list()
    except ConnectionError as error:
        where = dataset if data_dir is None else f"{dataset} (data_dir {data_dir})"
        raise ConfigError(
            f"cannot load {where} from the Hugging Face hub ({error}); download it where the hub is reachable and "
            f"pass benchmark.path=DIR, with {local_layout}"
        ) from error


def split_rows(dataset: str, data_dir: str | None, split: str, path: str | None, local_layout: str) -> list[dict]:
    """All rows of one split: from the hub (:func:`hub_rows`), or from the local source ``path``.

    With a ``data_dir``, a local directory that is not a saved dataset may be a hub snapshot: its ``data_dir`` entry
    (see :func:`locate`) is read when it has one, the whole directory otherwise.
    """
    if path is None:
        return hub_rows(dataset, data_dir, split, local_layout)
    root = Path(path).expanduser()
    snapshot = data_dir is not None and root.is_dir() and not is_saved_dataset(root)
    nested = locate(root, data_dir) if snapshot else None
    return read_rows(nested or root, split)


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


def read_rows(path: Path, split: str = "test") -> list[dict]:
    """Every row of a local file, saved dataset or directory of data files."""
    if path.is_file():
        return _read_file(path)
    if not path.is_dir():
        raise ConfigError(f"benchmark.path: {path} does not exist")
    if is_saved_dataset(path):
        return _read_saved_dataset(path, split)
    files = sorted(file for file in path.rglob("*") if file.is_file() and file.suffix in DATA_SUFFIXES)
    files = [file for file in files if file.name.startswith(split)] or files
    if not files:
        raise ConfigError(f"benchmark.path: {path} holds no .jsonl, .json or .parquet file and is not a saved dataset")
    return [row for file in files for row in _read_file(file)]


def rows_by_task(
    dataset: str, tasks: Sequence[str], split: str, path: str | None, local_layout: str
) -> dict[str, list[dict]]:
    """The rows of each task, in source order, for datasets stored as one data_dir per task.

    From the hub, each task is its own data_dir. Locally, ``path`` is either a directory with one entry per task
    (see :func:`locate`), or a single file / saved dataset whose rows name their task in a ``task`` (kvpress) or
    ``dataset`` (LongBench) field. Every requested task must have rows.
    """
    if path is None:
        return {task: hub_rows(dataset, task, split, local_layout) for task in tasks}
    root = Path(path).expanduser()
    if root.is_dir() and not is_saved_dataset(root):
        found = {task: locate(root, task) for task in tasks}
        missing = [task for task, source in found.items() if source is None]
        if missing:
            raise ConfigError(
                f"benchmark.path={root} has no data for {', '.join(missing)}; DIR needs {local_layout}, "
                "or select the tasks it has with benchmark.tasks=[...]"
            )
        return {task: read_rows(source, split) for task, source in found.items()}
    grouped: dict[str, list[dict]] = {task: [] for task in tasks}
    for row in read_rows(root, split):
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


def require_columns(row: dict, columns: Sequence[str], where: str) -> None:
    missing = [column for column in columns if column not in row]
    if missing:
        raise ConfigError(f"{where}: rows lack the column(s) {', '.join(missing)}; found {', '.join(sorted(row))}")


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

    ``task_of`` reads the task of every row, kept or not, so that it may check each row (columns, task name) in
    source order, as the benchmarks always have.
    """
    counts: Counter[str] = Counter()
    for row in rows:
        task = task_of(row)
        if (tasks is not None and task not in tasks) or (limit is not None and counts[task] >= limit):
            continue
        yield task, counts[task], row
        counts[task] += 1


def _read_file(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        import pyarrow.parquet

        return pyarrow.parquet.read_table(path).to_pylist()
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        return json.loads(text)
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise ConfigError(f"{path}, line {number}: not a JSON object ({error.msg})") from error
    return rows


def _read_saved_dataset(path: Path, split: str) -> list[dict]:
    from datasets import DatasetDict, load_from_disk

    saved = load_from_disk(str(path))
    if isinstance(saved, DatasetDict):
        if split not in saved:
            raise ConfigError(f"benchmark.path={path} is a saved dataset without a {split!r} split: {list(saved)}")
        saved = saved[split]
    return saved.to_list()
