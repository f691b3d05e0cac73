"""Hub and local sources shared by the benchmarks, and the RULER benchmark built on them.

Fixtures (tests/fixtures/) are small files in each schema; parquet files and saved datasets are written from them
in ``tmp_path`` so that every binary format is exercised from reviewable text. The hub is never contacted: hub
tests replace ``datasets.load_dataset``, and the offline tests make it raise what it raises offline (checked by
``test_offline_hub_raises_connection_error``).
"""

import json
import shutil
from pathlib import Path

import datasets
import pyarrow
import pyarrow.parquet
import pytest

from evaluate.benchmarks import ruler, sources
from evaluate.benchmarks.ruler import Ruler
from evaluate.points.config import ConfigError

FIXTURES = Path(__file__).resolve().parent / "fixtures"
RULER_ROWS = FIXTURES / "ruler_4096.jsonl"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def write_parquet(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    return path


def offline(*args, **kwargs):
    """What ``datasets.load_dataset`` raises with HF_HUB_OFFLINE=1 for a dataset that is not cached."""
    raise ConnectionError(f"Couldn't reach '{args[0]}' on the Hub (OfflineModeIsEnabled)")


def fake_hub(rows_by_data_dir: dict[str, list[dict]], calls: list):
    def load_dataset(name, data_dir=None, split=None):
        calls.append((name, data_dir, split))
        return datasets.Dataset.from_list(rows_by_data_dir[data_dir])

    return load_dataset


# ---------------------------------------------------------------------------------------------------------------
# sources
# ---------------------------------------------------------------------------------------------------------------


def test_offline_hub_raises_connection_error():
    """The error the offline tests simulate, from the real ``load_dataset`` (HF_HUB_OFFLINE=1 in conftest)."""
    with pytest.raises(ConnectionError, match="OfflineModeIsEnabled"):
        datasets.load_dataset("pressbench-tests/never-cached", data_dir="x", split="test")


def test_unreachable_hub_is_a_config_error_naming_dataset_and_local_path(monkeypatch):
    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ConfigError) as error:
        sources.hub_rows("org/data", "task_a", "test", "one file per task", ruler.SCHEMA)
    message = str(error.value)
    assert "org/data (data_dir task_a)" in message
    assert "benchmark.path=DIR" in message and "one file per task" in message
    assert "\n" not in message  # the CLI prints it as one line


def test_every_local_format_reads_the_same_rows(tmp_path):
    rows = read_jsonl(RULER_ROWS)
    (tmp_path / "rows.json").write_text(json.dumps(rows), encoding="utf-8")
    (tmp_path / "lines.json").write_text(RULER_ROWS.read_text(encoding="utf-8"), encoding="utf-8")
    write_parquet(tmp_path / "rows.parquet", rows)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "saved_dict"))
    for source in (RULER_ROWS, tmp_path / "rows.json", tmp_path / "lines.json", tmp_path / "rows.parquet"):
        assert sources.read_rows(source, ruler.SCHEMA) == rows, source
    assert sources.read_rows(tmp_path / "saved", ruler.SCHEMA) == rows
    assert sources.read_rows(tmp_path / "saved_dict", ruler.SCHEMA, split="test") == rows
    with pytest.raises(ConfigError, match="without a 'validation' split"):
        sources.read_rows(tmp_path / "saved_dict", ruler.SCHEMA, split="validation")


def test_a_directory_of_data_files_prefers_the_split_files_in_path_order(tmp_path):
    rows = read_jsonl(RULER_ROWS)
    write_parquet(tmp_path / "snapshot" / "test-00001-of-00002.parquet", rows[3:])
    write_parquet(tmp_path / "snapshot" / "test-00000-of-00002.parquet", rows[:3])
    write_parquet(tmp_path / "snapshot" / "train-00000-of-00001.parquet", rows[:1])
    assert sources.read_rows(tmp_path / "snapshot", ruler.SCHEMA, split="test") == rows
    # Without split-named files, every data file is read.
    assert sources.read_rows(tmp_path / "snapshot", ruler.SCHEMA, split="validation") == rows[:3] + rows[3:] + rows[:1]


def test_bad_local_sources_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        sources.read_rows(tmp_path / "missing", ruler.SCHEMA)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no .jsonl"):
        sources.read_rows(tmp_path / "empty", ruler.SCHEMA)
    (tmp_path / "broken.jsonl").write_text(RULER_ROWS.read_text(encoding="utf-8").splitlines()[0] + '\n{"a": \n')
    with pytest.raises(ConfigError, match="broken.jsonl:2: not a JSON object"):
        sources.read_rows(tmp_path / "broken.jsonl", ruler.SCHEMA)


def test_rows_by_task_from_a_per_task_directory_and_from_one_file(tmp_path):
    rows = read_jsonl(RULER_ROWS)
    shutil.copy(RULER_ROWS, tmp_path / "niah_single_1.jsonl")  # a per-task entry as a file...
    write_parquet(tmp_path / "qa_1" / "test-00000-of-00001.parquet", rows[3:])  # ...and as a folder
    grouped = sources.rows_by_task("org/data", ["qa_1", "niah_single_1"], "test", str(tmp_path), "layout", ruler.SCHEMA)
    assert grouped == {"qa_1": rows[3:], "niah_single_1": rows}
    with pytest.raises(ConfigError, match="no data for vt; DIR needs layout"):
        sources.rows_by_task("org/data", ["qa_1", "vt"], "test", str(tmp_path), "layout", ruler.SCHEMA)

    grouped = sources.rows_by_task("org/data", ["vt", "qa_1"], "test", str(RULER_ROWS), "layout", ruler.SCHEMA)
    assert grouped == {"vt": rows[2:3], "qa_1": rows[3:]}
    with pytest.raises(ConfigError, match="no rows for cwe"):
        sources.rows_by_task("org/data", ["vt", "cwe"], "test", str(RULER_ROWS), "layout", ruler.SCHEMA)


def test_rows_by_task_reads_each_task_from_its_own_hub_data_dir(monkeypatch):
    rows = read_jsonl(RULER_ROWS)
    calls = []
    monkeypatch.setattr(datasets, "load_dataset", fake_hub({"vt": rows[2:3], "qa_1": rows[3:]}, calls))
    assert sources.rows_by_task("org/data", ["vt", "qa_1"], "test", None, "layout", ruler.SCHEMA) == {
        "vt": rows[2:3],
        "qa_1": rows[3:],
    }
    assert calls == [("org/data", "vt", "test"), ("org/data", "qa_1", "test")]


# ---------------------------------------------------------------------------------------------------------------
# RULER on the hub and locally
# ---------------------------------------------------------------------------------------------------------------


def test_ruler_loads_data_dir_4096_from_the_hub(monkeypatch, tiny_tokenizer):
    calls = []
    monkeypatch.setattr(datasets, "load_dataset", fake_hub({"4096": read_jsonl(RULER_ROWS)}, calls))
    samples = Ruler().load(tiny_tokenizer, limit=1)
    assert calls == [("simonjegou/ruler", "4096", "test")]
    assert [sample.id for sample in samples] == ["niah_single_1-0", "vt-0", "qa_1-0"]
    first = read_jsonl(RULER_ROWS)[0]
    assert (samples[0].context, samples[0].question, samples[0].answer_prefix) == (
        first["context"],
        first["question"],
        first["answer_prefix"],
    )
    assert samples[0].answers == ["4827391"] and samples[0].max_new_tokens == 128


def test_ruler_offline_is_a_config_error(monkeypatch, tiny_tokenizer):
    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ConfigError, match=r"simonjegou/ruler \(data_dir 4096\).*benchmark\.path=DIR"):
        Ruler().load(tiny_tokenizer)


def test_ruler_local_file_snapshot_and_saved_dataset_give_the_hub_samples(monkeypatch, tmp_path, tiny_tokenizer):
    rows = read_jsonl(RULER_ROWS)
    monkeypatch.setattr(datasets, "load_dataset", fake_hub({"4096": rows}, []))
    expected = Ruler(tasks=["qa_1", "vt"]).load(tiny_tokenizer)
    assert [sample.id for sample in expected] == ["vt-0", "qa_1-0", "qa_1-1"]
    write_parquet(tmp_path / "snapshot" / "4096" / "test-00000-of-00001.parquet", rows)
    write_parquet(tmp_path / "snapshot" / "8192" / "test-00000-of-00001.parquet", rows[:1])
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    for path in (RULER_ROWS, tmp_path / "snapshot", tmp_path / "saved"):
        assert Ruler(tasks=["qa_1", "vt"], path=str(path)).load(tiny_tokenizer) == expected, path


def test_ruler_local_source_must_have_the_requested_tasks_and_columns(tmp_path, tiny_tokenizer):
    with pytest.raises(ConfigError, match="no rows for cwe"):
        Ruler(tasks=["cwe"], path=str(RULER_ROWS)).load(tiny_tokenizer)
    rows = read_jsonl(RULER_ROWS)
    for row in rows:
        del row["answer_prefix"]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    with pytest.raises(ConfigError, match="rows.jsonl:1: the row lacks the column.s. answer_prefix"):
        Ruler(path=str(tmp_path / "rows.jsonl")).load(tiny_tokenizer)


def test_ruler_metric_matches_kvpress_calculate_metrics():
    """Expected values: kvpress 0.5.5's ``evaluation/benchmarks/ruler/calculate_metrics.py`` on
    tests/fixtures/ruler_predictions.jsonl, printed by tests/fixtures/reference_values.py (see its docstring)."""
    reference = {"cwe": 100.0, "niah_multivalue": 75.0, "niah_single_1": 50.0, "qa_1": 100.0, "qa_2": 0.0, "vt": 100.0}
    metrics = ruler.score_predictions(read_jsonl(FIXTURES / "ruler_predictions.jsonl"))
    assert {task: values["score"] for task, values in metrics["tasks"].items()} == reference
    assert metrics["score"] == round(sum(reference.values()) / len(reference), 2) == 70.83


# ---------------------------------------------------------------------------------------------------------------
# rows checked where they enter
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, refusal",
    [
        ({"max_new_tokens": "abc"}, "field 'max_new_tokens' is \"abc\", not a positive integer"),
        ({"max_new_tokens": 0}, "field 'max_new_tokens' is 0, not a positive integer"),
        ({"context": 12}, "field 'context' is 12, not a string"),
        ({"task": None}, "field 'task' is null, not a string"),
        (
            {"answer": "a string"},
            "field 'answer' is \"a string\", not a non-empty list of strings (the reference answers a row is scored "
            "against)",
        ),
        (
            {"answer": []},
            "field 'answer' is [], not a non-empty list of strings (the reference answers a row is scored against)",
        ),
        (
            {"answer": ["x", 3]},
            "field 'answer' is [\"x\", 3], not a non-empty list of strings (the reference answers "
            "a row is scored against)",
        ),
    ],
    ids=[
        "max-new-tokens-text",
        "max-new-tokens-zero",
        "context-number",
        "task-null",
        "answer-string",
        "answer-empty",
        "answer-number",
    ],
)
def test_a_bad_field_is_refused_in_one_line_naming_file_line_and_field(tmp_path, tiny_tokenizer, change, refusal):
    rows = read_jsonl(RULER_ROWS)
    rows[3] |= change  # line 4 of the file
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    with pytest.raises(ConfigError) as refused:
        Ruler(path=str(data), tasks=["niah_single_1"]).load(tiny_tokenizer, limit=1)  # every row checked, not the kept
    assert str(refused.value) == f"{data}:4: {refusal}; fix the row or drop it"


def test_a_row_that_is_not_an_object_or_lacks_a_column_is_refused_naming_its_line(tmp_path, tiny_tokenizer):
    lines = RULER_ROWS.read_text(encoding="utf-8").splitlines()
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join([lines[0], "", '["a", "list"]', *lines[1:]]) + "\n", encoding="utf-8")
    with pytest.raises(ConfigError) as refused:
        Ruler(path=str(data)).load(tiny_tokenizer)
    assert str(refused.value) == f'{data}:3: the row is ["a", "list"], not a JSON object; fix the row or drop it'
    row = read_jsonl(RULER_ROWS)[0]
    del row["max_new_tokens"]
    data.write_text("\n".join([*lines[:2], json.dumps(row)]) + "\n", encoding="utf-8")
    with pytest.raises(ConfigError) as refused:
        Ruler(path=str(data)).load(tiny_tokenizer)
    assert str(refused.value) == (
        f"{data}:3: the row lacks the column(s) max_new_tokens (it has answer, answer_prefix, context, question, "
        "task); fix the row or drop it"
    )


def test_rows_of_every_local_format_and_of_the_hub_are_checked_naming_their_row(tmp_path, monkeypatch):
    rows = read_jsonl(RULER_ROWS)
    rows[1]["answer"] = ""
    refusal = (
        "row 2: field 'answer' is \"\", not a non-empty list of strings (the reference answers a row is scored "
        "against); fix the row or drop it"
    )
    (tmp_path / "rows.json").write_text(json.dumps(rows), encoding="utf-8")
    # Arrow columns hold one type: there the empty reference is an empty list.
    typed = [row | {"answer": []} if index == 1 else row for index, row in enumerate(rows)]
    write_parquet(tmp_path / "rows.parquet", typed)
    for source in (tmp_path / "rows.json", tmp_path / "rows.parquet"):
        with pytest.raises(ConfigError) as refused:
            sources.read_rows(source, ruler.SCHEMA)
        assert str(refused.value).startswith(f"{source} row 2: field 'answer' is "), source
    monkeypatch.setattr(datasets, "load_dataset", fake_hub({"4096": typed}, []))
    with pytest.raises(ConfigError) as refused:
        sources.hub_rows("org/data", "4096", "test", "layout", ruler.SCHEMA)
    assert str(refused.value) == "org/data (data_dir 4096) test " + refusal.replace('""', "[]")


def test_zero_scrolls_rows_have_no_references_and_are_read_all_the_same(tmp_path, tiny_tokenizer):
    from evaluate.benchmarks.zero_scrolls import ZeroScrolls

    rows = read_jsonl(FIXTURES / "zero_scrolls" / "test.jsonl")
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row | {"answer": ""}) + "\n" for row in rows), encoding="utf-8")
    samples = ZeroScrolls(path=str(data)).load(tiny_tokenizer)
    assert len(samples) == len(rows) and all(sample.answers == [] for sample in samples)
