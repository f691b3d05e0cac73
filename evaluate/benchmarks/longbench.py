"""LongBench (v1): the 16 English and code tasks, run as the kvpress leaderboard runs them or as LongBench's pred.py.

Prompts and generation lengths are LongBench's ``config/dataset2prompt.json`` and ``config/dataset2maxlen.json``
(byte-exact copies in ``longbench_data/``); the rules below are those of ``shared/reference/longbench/README.md``.

Protocols (``protocol``)
------------------------
``kvpress`` (default; the EG-ChunkKV PR's numbers were produced this way): the prompt is split as kvpress's
``create_huggingface_dataset.py`` splits it (context = instructions and document up to the question; question; the
task's answer cue as answer prefix), the chat template is applied to every task, generation lengths are
dataset2maxlen + 20, and over-long contexts keep their head (the runner's ``max_context_length``).

``official`` (LongBench's pred.py): the whole prompt (instructions, document and question) longer than
``max_length`` tokens keeps its first and last ``max_length // 2`` tokens; trec, triviaqa, samsum, lcc and
repobench-p are fed without the chat template; generation lengths are dataset2maxlen. For a chat task the question
and its cue stay inside the user turn (answer prefix empty), as pred.py wraps the whole prompt; for a raw task the
text after the prompt's last newline becomes the answer prefix, because kvpress's pipeline joins question and
answer prefix with a newline when no chat template is used, so the model sees exactly LongBench's prompt.

Sources: the kvpress hub dataset ``Xnhyacinth/LongBench`` (one data_dir per task; columns context, question,
answer_prefix, answers, all_classes, length, _id, task, max_new_tokens), or ``path`` with the same columns, or
LongBench's original jsonl rows (input, context, answers, all_classes, length, _id), which are turned into prompts
with the official templates.

Metrics (LongBench's ``metrics.py``, as kvpress's ``evaluation/benchmarks/longbench/calculate_metrics.py`` runs them):
qa_f1 (SQuAD normalisation), ROUGE-L F from the ``rouge`` package, classification over ``all_classes``, retrieval,
count, and code_sim (fuzzywuzzy's ``fuzz.ratio`` on its pure-Python path). Each sample takes the max over its
answers; a task scores 100 x the mean, rounded to 2. Before scoring, ``kvpress`` left-strips every prediction and
keeps the first line of trec / triviaqa / samsum after stripping all leading whitespace; ``official`` (LongBench's
eval.py) keeps that first line after stripping leading newlines only, and strips nothing else.
"""

import importlib.resources
import json
import re
import string
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from difflib import SequenceMatcher
from functools import cache
from typing import ClassVar

from evaluate.benchmarks import Sample, Source, TaskedHubBenchmark
from evaluate.benchmarks.sources import Schema, first_rows, rows_by_task
from evaluate.errors import ConfigError

CATEGORIES: dict[str, tuple[str, ...]] = {
    "Single-Document QA": ("narrativeqa", "qasper", "multifieldqa_en"),
    "Multi-Document QA": ("hotpotqa", "2wikimqa", "musique"),
    "Summarization": ("gov_report", "qmsum", "multi_news"),
    "Few-shot Learning": ("trec", "triviaqa", "samsum"),
    "Synthetic Tasks": ("passage_count", "passage_retrieval_en"),
    "Code Completion": ("lcc", "repobench-p"),
}
TASKS: tuple[str, ...] = tuple(task for tasks in CATEGORIES.values() for task in tasks)
PROTOCOLS = ("kvpress", "official")
HUB = Source(dataset="Xnhyacinth/LongBench")

FIRST_LINE_TASKS = ("trec", "triviaqa", "samsum")
# pred.py: "chat models are better off without build prompts on these tasks".
RAW_PROMPT_TASKS = ("trec", "triviaqa", "samsum", "lcc", "repobench-p")

# kvpress's answer prefix per task: the cue that ends LongBench's prompt (for trec, triviaqa and samsum, the row's
# input ends with it).
ANSWER_PREFIXES = {
    **dict.fromkeys(("narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique"), "Answer:"),
    "qmsum": "Answer:",
    "triviaqa": "Answer:",
    "gov_report": "Summary:",
    "multi_news": "Summary:",
    "samsum": "Summary:",
    "trec": "Type:",
    "passage_count": "The final answer is: ",
    "passage_retrieval_en": "The answer is: ",
    "lcc": "Next line of code:\n",
    "repobench-p": "Next line of code:\n",
}

# Where the question starts in each template: kvpress's context is everything before it.
QUESTION_STARTS = {
    **dict.fromkeys(
        ("narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique"), "Question: {input}"
    ),
    "gov_report": "Now, write a one-page summary of the report.",
    "qmsum": "Query: {input}",
    "multi_news": "Now, write a one-page summary of all the news.",
    **dict.fromkeys(("trec", "triviaqa", "samsum", "passage_retrieval_en", "repobench-p"), "{input}"),
    "passage_count": "Please enter the final count",
    "lcc": "Next line of code:",
}

# kvpress generates this many tokens beyond LongBench's lengths "to avoid any cut-offs".
KVPRESS_EXTRA_NEW_TOKENS = 20

# pred.py's budget for 32k-context models in LongBench's model2maxlen.json (e.g. longchat-v1.5-7b-32k).
DEFAULT_MAX_LENGTH = 31500

KVPRESS_COLUMNS = ("context", "question", "answer_prefix", "answers")
ORIGINAL_COLUMNS = ("context", "input", "answers")
# A row has kvpress's columns, or else LongBench's original ones.
SCHEMA = Schema(KVPRESS_COLUMNS, alternative=ORIGINAL_COLUMNS)


# ---------------------------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------------------------


@cache
def _reference(name: str) -> dict:
    data = importlib.resources.files(__package__).joinpath("longbench_data").joinpath(name)
    return json.loads(data.read_text(encoding="utf-8"))


def prompt_template(task: str) -> str:
    return _reference("dataset2prompt.json")[task]


def max_new_tokens(task: str, protocol: str) -> int:
    extra = KVPRESS_EXTRA_NEW_TOKENS if protocol == "kvpress" else 0
    return _reference("dataset2maxlen.json")[task] + extra


def split_original(task: str, row: dict) -> tuple[str, str]:
    """LongBench's prompt for an original row, as (everything before the question, the rest)."""
    template = prompt_template(task)
    start = template.index(QUESTION_STARTS[task])
    return template[:start].format(context=row["context"]), template[start:].format(input=row["input"])


def truncate_middle(tokenizer, head: str, tail: str, max_length: int) -> tuple[str, str]:
    """pred.py's truncation of the prompt ``head + tail``, returned as the kept parts of head and tail.

    A prompt of more than ``max_length`` tokens (counted with special tokens, as pred.py counts them) keeps its first
    and last ``max_length // 2`` tokens. pred.py decodes each half back to text; here the prompt is cut at the token
    offsets instead, which keeps the same tokens without decode's clean-up of spaces and tells exactly which kept
    text belonged to the question.
    """
    prompt = head + tail
    try:
        offsets = tokenizer(prompt, return_offsets_mapping=True)["offset_mapping"]
    except NotImplementedError as error:
        raise ConfigError("protocol=official truncates with token offsets, which needs a fast tokenizer") from error
    if len(offsets) <= max_length:
        return head, tail
    half = max_length // 2
    keep_until = max(end for _, end in offsets[:half])
    resume_at = offsets[len(offsets) - half][0]

    def kept(start: int, end: int) -> str:
        return prompt[start : min(end, keep_until)] + prompt[max(start, resume_at) : end]

    return kept(0, len(head)), kept(len(head), len(prompt))


# ---------------------------------------------------------------------------------------------------------------
# Metrics (LongBench's metrics.py)
# ---------------------------------------------------------------------------------------------------------------


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, drop ASCII punctuation, then the articles a/an/the, collapse whitespace."""
    text = "".join(character for character in text.lower() if character not in string.punctuation)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def qa_f1_score(prediction: str, ground_truth: str, **_) -> float:
    """F1 of the two normalised token multisets."""
    predicted, gold = normalize_answer(prediction).split(), normalize_answer(ground_truth).split()
    same = sum((Counter(predicted) & Counter(gold)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(predicted), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def rouge_score(prediction: str, ground_truth: str, **_) -> float:
    """ROUGE-L F of the ``rouge`` package (summary-level LCS over '.'-separated sentences); 0 when it raises.

    The package raises on a prediction with no sentence (e.g. empty or only dots) and can exceed Python's recursion
    limit on very long sentences; LongBench scores both 0.
    """
    from rouge import Rouge

    try:
        return Rouge().get_scores([prediction], [ground_truth], avg=True)["rouge-l"]["f"]
    except Exception:
        return 0.0


def classification_score(prediction: str, ground_truth: str, all_classes: list[str] | None = None, **_) -> float:
    """1 / (labels found) when the gold label is among the labels of ``all_classes`` found in the prediction.

    Found labels that are strict substrings of the gold label are dropped, but LongBench drops them while iterating
    over the same list, so the label right after a dropped one is never checked; that is kept for parity.
    """
    if all_classes is None:
        raise ValueError("classification needs the row's all_classes")
    found = [label for label in all_classes if label in prediction]
    index = 0
    while index < len(found):
        label = found[index]
        if label in ground_truth and label != ground_truth:
            found.remove(label)
        index += 1
    return 1.0 / len(found) if ground_truth in found else 0.0


def _share_equal(prediction: str, target: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    return sum(number == target for number in numbers) / len(numbers) if numbers else 0.0


def retrieval_score(prediction: str, ground_truth: str, **_) -> float:
    """Share of the integers in the prediction equal to the gold paragraph number ("Paragraph N")."""
    match = re.search(r"Paragraph (\d+)", ground_truth)
    return _share_equal(prediction, match.group(1)) if match else 0.0


def count_score(prediction: str, ground_truth: str, **_) -> float:
    """Share of the integers in the prediction equal to the gold count."""
    return _share_equal(prediction, str(ground_truth))


def fuzz_ratio(first: str, second: str) -> int:
    """fuzzywuzzy's ``fuzz.ratio`` without python-Levenshtein: difflib's ratio x 100, rounded half to even.

    Identical strings score 100 before the empty-string check, so two empty strings score 100, as in fuzzywuzzy.
    """
    if first == second:
        return 100
    if not first or not second:
        return 0
    return int(round(100 * SequenceMatcher(None, first, second).ratio()))


def code_sim_score(prediction: str, ground_truth: str, **_) -> float:
    """Fuzzy ratio / 100 between the gold line and the first predicted line that is not a comment or a fence.

    Leading newlines are dropped first; a line containing '`', '#' or '//' is skipped; none left scores ''.
    """
    lines = prediction.lstrip("\n").split("\n")
    line = next((line for line in lines if "`" not in line and "#" not in line and "//" not in line), "")
    return fuzz_ratio(line, ground_truth) / 100


METRICS: dict[str, Callable[..., float]] = {
    **dict.fromkeys(
        ("narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique", "triviaqa"), qa_f1_score
    ),
    **dict.fromkeys(("gov_report", "qmsum", "multi_news", "samsum"), rouge_score),
    "trec": classification_score,
    "passage_retrieval_en": retrieval_score,
    "passage_count": count_score,
    "lcc": code_sim_score,
    "repobench-p": code_sim_score,
}


def clean_prediction(task: str, prediction: str, protocol: str) -> str:
    """The protocol's clean-up of a prediction before scoring (see the module docstring)."""
    if protocol == "kvpress":
        if task in FIRST_LINE_TASKS:
            prediction = prediction.lstrip().split("\n")[0]
        return prediction.lstrip()
    if task in FIRST_LINE_TASKS:
        return prediction.lstrip("\n").split("\n")[0]
    return prediction


def best_score(task: str, prediction: str, answers: Iterable[str], all_classes: list[str] | None = None) -> float:
    """The task's metric of an already cleaned prediction, the max over the answers (0 without answers)."""
    metric = METRICS[task]
    return max((metric(prediction, answer, all_classes=all_classes) for answer in answers), default=0.0)


def sample_score(
    task: str, prediction: str, answers: Iterable[str], all_classes: list[str] | None = None, protocol: str = "kvpress"
) -> float:
    """One sample's score in [0, 1]: the max over its answers, after the protocol's clean-up of the prediction.

    A prediction that is empty or only whitespace scores 0. Under ``kvpress`` that is what the metrics give anyway;
    LongBench's eval.py would give code_sim a few points for blanks matching the gold line's indentation.
    """
    if not prediction.strip():
        return 0.0
    return best_score(task, clean_prediction(task, prediction, protocol), answers, all_classes)


def score_predictions(rows: Iterable[dict], protocol: str = "kvpress", benchmark: str = "longbench") -> dict:
    """metrics.json content from rows with ``task``, ``answers``, ``prediction`` and, for trec, ``all_classes``."""
    per_task: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        task = row["task"]
        if task not in METRICS:
            raise ValueError(f"unknown LongBench task {task!r}; the tasks are {', '.join(TASKS)}")
        prediction = row.get("prediction") or ""
        per_task[task].append(sample_score(task, prediction, row["answers"], row.get("all_classes"), protocol))
    tasks = {
        task: {"score": round(100 * sum(per_task[task]) / len(per_task[task]), 2), "n": len(per_task[task])}
        for task in TASKS
        if task in per_task
    }
    for task, values in tasks.items():
        values["metric"] = METRICS[task].__name__.removesuffix("_score")
    headline = round(sum(t["score"] for t in tasks.values()) / len(tasks), 2) if tasks else None
    categories = {
        category: round(sum(tasks[task]["score"] for task in members) / len(members), 2)
        for category, members in ((c, [t for t in ts if t in tasks]) for c, ts in CATEGORIES.items())
        if members
    }
    category_average = round(sum(categories.values()) / len(categories), 2) if categories else None
    return {
        "benchmark": benchmark,
        "protocol": protocol,
        "score": headline,
        "score_label": f"mean over the {len(tasks)} task scores",
        "category_average": category_average,
        "category_average_label": f"macro average over {len(categories)} LongBench categories",
        "categories": categories,
        "tasks": tasks,
    }


# ---------------------------------------------------------------------------------------------------------------
# Benchmark
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class LongBench(TaskedHubBenchmark):
    """LongBench v1's 16 English and code tasks, from the kvpress hub dataset or local files.

    Parameters
    ----------
    protocol : str
        ``kvpress`` (chat template everywhere, head truncation by the runner, dataset2maxlen + 20 new tokens,
        kvpress's scoring) or ``official`` (LongBench's pred.py and eval.py).
    max_length : int, optional
        ``official`` only: pred.py's token budget of the whole prompt, cut in the middle. The default, 31500, is
        LongBench's budget for 32k-context models; null keeps every prompt whole.
    tasks : list[str], optional
        Tasks to run, named as in THUDM/LongBench; all 16 when null.
    path : str, optional
        Local source instead of the hub: a directory with ``{task}.jsonl|.json|.parquet`` or ``{task}/`` per task, or
        one file / saved dataset whose rows carry ``task`` (or LongBench's ``dataset``). Rows have kvpress's columns
        or LongBench's original ones.
    dataset, split : str
        Hub dataset (one data_dir per task) and split.
    name : str
        Benchmark name in run directories and metrics.json.
    """

    name: str = "longbench"
    # kvpress loads one data_dir per task, so ``fraction`` draws within each task's rows.
    fraction_by_task: ClassVar[bool] = True
    protocol: str = "kvpress"
    max_length: int | None = DEFAULT_MAX_LENGTH
    all_tasks: ClassVar[tuple[str, ...]] = TASKS
    source: ClassVar[Source] = HUB

    def _check(self) -> list[str]:
        if self.protocol not in PROTOCOLS:
            raise ConfigError(f"benchmark.protocol={self.protocol!r}; choose one of {', '.join(PROTOCOLS)}")
        if self.max_length is not None and self.max_length < 2:
            raise ConfigError(f"benchmark.max_length={self.max_length} must be at least 2 tokens, or null")
        return self.selected_tasks("LongBench")

    def load(self, tokenizer, limit: int | None = None) -> list[Sample]:
        """At most ``limit`` samples per task, in source order, task after task."""
        tasks = self._check()
        layout = "one {task}.jsonl or {task}.parquet file, or {task}/ folder, per LongBench task"
        sources = rows_by_task(self.dataset, tasks, self.split, self.path, layout, SCHEMA)
        return [self._sample(task, index, row, tokenizer) for task, index, row in first_rows(sources, limit)]

    def _sample(self, task: str, index: int, row: dict, tokenizer) -> Sample:
        original = SCHEMA.columns_of(row) == ORIGINAL_COLUMNS
        extra = {"all_classes": row.get("all_classes")}
        if self.protocol == "kvpress":
            if original:
                context, tail = split_original(task, row)
                answer_prefix = ANSWER_PREFIXES[task]
                # kvpress appends lcc's input although LongBench's lcc template has no slot for it.
                question = row["input"] if task == "lcc" else tail.removesuffix(answer_prefix)
                new_tokens = max_new_tokens(task, "kvpress")
            else:
                context, question, answer_prefix = row["context"], row["question"], row["answer_prefix"]
                new_tokens = int(row.get("max_new_tokens") or max_new_tokens(task, "kvpress"))
            answers = list(row["answers"])
            return Sample(f"{task}-{index}", task, context, question, answer_prefix, answers, new_tokens, extra=extra)
        if original:
            head, tail = split_original(task, row)
        else:
            # Joined, kvpress's three parts give back LongBench's prompt, except that kvpress put lcc's input in.
            head = row["context"]
            tail = ("" if task == "lcc" else row["question"]) + row["answer_prefix"]
        if self.max_length is not None:
            head, tail = truncate_middle(tokenizer, head, tail, self.max_length)
        raw = task in RAW_PROMPT_TASKS
        if raw and "\n" in tail:
            question, answer_prefix = tail.rsplit("\n", 1)
        else:
            question, answer_prefix = tail, ""
        return Sample(
            f"{task}-{index}",
            task,
            head,
            question,
            answer_prefix,
            list(row["answers"]),
            max_new_tokens(task, "official"),
            chat_template=not raw,
            extra=extra,
        )

    def score(self, rows: list[dict]) -> dict:
        return score_predictions(rows, protocol=self.protocol, benchmark=self.name)
