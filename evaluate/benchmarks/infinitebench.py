"""InfiniteBench as kvpress runs it: the hub dataset ``MaxJeblick/InfiniteBench``, one data_dir per task.

Rows hold kvpress's columns (context, question, answer_prefix, answer, task, max_new_tokens), made by kvpress's
``evaluation/benchmarks/infinite_bench/create_huggingface_dataset.py`` from ``xinrongzhang2022/InfiniteBench``:
InfiniteBench's yarn-mistral prompt templates around the context, the options appended to the question of the
multiple-choice tasks, an answer prefix per task, and InfiniteBench's generation length + 20 as max_new_tokens.
``answer`` is a list of strings (the loader casts every label to a string; the multiple-choice tasks keep only the
letter of the right option). A local ``path`` holds the same columns. The chat template is applied to every task,
as in kvpress.

Tasks: the 11 that kvpress's ``calculate_metrics.py`` (adapted from InfiniteBench's ``compute_scores.py``) has a
scorer for. The hub's twelfth data_dir, ``longbook_sum_eng``, is refused there ("not supported due to a conflict
with rouge library"), and here. kvpress scores one data_dir per run (``calculate_metrics`` reads the task of the
first row), so each task is scored on its own rows; with the labels read as InfiniteBench's data types
(``scoring=infinitebench``; ``kvpress`` differs as told below), a sample scores:

- passkey, number_string: 1 when the first run of ASCII digits in the prediction equals the answer.
- kv_retrieval: 1 when the answer is one of the prediction's words, after ``\\n : " ' . , ? ! { }`` become spaces.
- code_run: 1 when the last word, after ``\\n . ` ' " :`` become spaces, parses as ``int`` and equals the answer
  read as an int.
- code_debug: 1 when the option letter is the prediction's first standalone A-J that no other follows on its line,
  or (``\\n ` ' " - * Option option`` made spaces, space runs collapsed) the prediction starts with the letter or
  the function name, or the text one character after the first of ``answer is:``, ``is:``, ``answer:``,
  ``correct option is:`` (in this order) that occurs does. A one-element label is the letter alone (the hub's rows
  hold no function name); a two-element one is InfiniteBench's ``[function name, letter]``.
- math_find: the first number (``\\d+\\.\\d+|\\d+``) of the prediction equals the answer, compared as an int when
  the answer is an integer, else as a float. **Deviation:** a decimal first number for an integer answer (``94.0``
  for 94) scores 0 here, where InfiniteBench's ``compute_scores.py`` raises ValueError (``int("94.0")``) and scores
  nothing; the task's ``note`` counts such rows.
- math_calc: the number of leading ASCII-digit runs of the prediction, as ints, equal to the answer's values read
  as ints, in order (up to the first mismatch), divided by the number of values.
- longdialogue_qa_eng: 1 when an answer, upper-cased, is a substring of the upper-cased stripped prediction.
- longbook_qa_eng: the best F1 over the answers of the SQuAD-normalised word multisets (LongBench's qa_f1).
- longbook_qa_chn: the best F1 over the answers of the character multisets after lower-casing and dropping ASCII
  and CJK punctuation and all whitespace.
- longbook_choice_eng: InfiniteBench's cascade on the stripped prediction: its first standalone A-D that no other
  follows on its line, if that is the answer; else empty -> 0; else a first character in ABCD decides; else the
  whole prediction equal to an answer; else (``\\n " ' . , ? ! { }`` made spaces, space runs collapsed) the first
  of ``answer is:``, ``answer:``, ``answer is``, ``option is`` (in this order) that occurs decides on the text one
  character after it; else the first word that is a substring of "ABCD" decides.

Task ``score``: the mean over its samples x 100, rounded to 2 (kvpress reports the unrounded fraction), or null
when kvpress's scorer raises on the task (``kvpress`` only; ``note`` names the exception). Headline ``score``: the
unweighted mean of the task scores that are numbers, rounded to 2; ``score_label`` says how many of the 11 tasks
it covers and names the tasks present that it leaves out. metrics.json records the ``scoring``.

Scoring (``scoring``)
---------------------
kvpress's ``evaluate.py`` hands its scorer each label as the numpy array of strings that ``to_pandas`` makes of the
hub's list, where the scorer's code (InfiniteBench's) expects InfiniteBench's data types.

``kvpress`` (default): kvpress 0.5.5's outcome on those arrays under numpy 2.3. The comparison of an array label
with a value is an array, which kvpress turns into a number (``float``) or a truth value (``in``): one element
gives that element, any other length raises (TypeError, or ValueError for kv_retrieval's ``in`` on a prediction
with a word). So passkey, number_string and kv_retrieval score as above on one-element labels, and the four text
tasks score as above whatever the labels; code_run compares the string label with the parsed int, which is never
equal (0); code_debug reads ``label[1]`` as the letter and ``label[0]`` as the function name, and raises IndexError
on the hub's one-element labels; math_find raises TypeError (the label is neither an int nor a float) and math_calc
AssertionError (the label is not a list), whatever the labels. A task on which the scorer raises for any of its
rows has no number in kvpress (it scores a data_dir in one call): here its score is null and it stays out of the
headline. Under numpy >= 2.4 ``float`` of a one-element array raises too, so kvpress 0.5.5 there also fails on
passkey, number_string and on code_run rows whose last word is an integer; this mode keeps numpy 2.3's values.

``infinitebench``: the labels read as InfiniteBench's data types (the original ``compute_scores.py`` semantics),
as listed above: code_run and math_calc compare ints, math_find reads the label as a number, and code_debug
decides on the letter (and the function name when the label holds one). All 11 tasks score.
"""

import re
import string
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import ClassVar

from evaluate.benchmarks import Sample, Source, TaskedHubBenchmark
from evaluate.benchmarks.longbench import qa_f1_score
from evaluate.benchmarks.sources import Schema, first_rows, kvpress_sample, rows_by_task
from evaluate.errors import ConfigError

TASKS: tuple[str, ...] = (
    "passkey",
    "kv_retrieval",
    "number_string",
    "longdialogue_qa_eng",
    "longbook_qa_eng",
    "longbook_choice_eng",
    "code_run",
    "code_debug",
    "math_find",
    "math_calc",
    "longbook_qa_chn",
)
UNSCORED_TASK = "longbook_sum_eng"
# ``answer`` is a list of strings (kvpress's hub schema), a one-label task's too.
SCHEMA = Schema(("context", "question", "answer_prefix", "answer", "max_new_tokens"))
HEADLINE_LABEL = "mean task score ×100 over the InfiniteBench tasks present"
HUB = Source(dataset="MaxJeblick/InfiniteBench")
SCORINGS = ("kvpress", "infinitebench")

_DIGITS = re.compile(r"[0-9]+")
_NUMBER = re.compile(r"\d+\.\d+|\d+")
# The first standalone option letter with no other standalone option letter after it on the same line.
_LAST_CHOICE = re.compile(r"\b[A-D]\b(?!.*\b[A-D]\b)")
_LAST_DEBUG_OPTION = re.compile(r"\b[A-J]\b(?!.*\b[A-J]\b)")
_CJK_PUNCTUATION = (
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣"
    "､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)
_ZH_PUNCTUATION = frozenset(string.punctuation + _CJK_PUNCTUATION)


def _spaced(text: str, separators: Iterable[str]) -> str:
    for separator in separators:
        text = text.replace(separator, " ")
    return text


def _collapse_spaces(text: str) -> str:
    return re.sub(" {2,}", " ", text)


def first_digits(prediction: str) -> str:
    """The first run of ASCII digits in the prediction ("" when there is none)."""
    found = _DIGITS.search(prediction)
    return found.group() if found else ""


def first_integer_match(prediction: str, answers: list[str]) -> float:
    return float(answers[0] == first_digits(prediction))


def word_match(prediction: str, answers: list[str]) -> float:
    return float(answers[0] in _spaced(prediction, "\n:\"'.,?!{}").split())


def last_integer_match(prediction: str, answers: list[str]) -> float:
    words = _spaced(prediction, "\n.`'\":").split()
    if not words:
        return 0.0
    try:
        return float(int(words[-1]) == int(answers[0]))
    except ValueError:
        return 0.0


def _after_first_prefix(text: str, prefixes: tuple[str, ...]) -> str | None:
    """The text one character past the first prefix (in ``prefixes`` order) found; "" when nothing follows it."""
    for prefix in prefixes:
        index = text.find(prefix)
        if index != -1:
            return text[index + len(prefix) + 1 :]
    return None


def _code_debug(prediction: str, letter: str, function: str | None) -> float:
    """InfiniteBench's Code.Debug scorer: the option letter, and the function name when the label holds one."""
    text = prediction.strip()
    found = _LAST_DEBUG_OPTION.search(text)
    if found and found.group() == letter:
        return 1.0
    targets = (letter,) if function is None else (letter, function)
    text = _collapse_spaces(_spaced(text, ("\n", "`", "'", '"', "-", "*", "Option", "option")))
    if text.startswith(targets):
        return 1.0
    after = _after_first_prefix(text, ("answer is:", "is:", "answer:", "correct option is:"))
    return float(after is not None and after.startswith(targets))


def code_debug_match(prediction: str, answers: list[str]) -> float:
    """The letter alone (the hub's one-element label), or InfiniteBench's ``[function name, letter]``."""
    if len(answers) > 1:
        return _code_debug(prediction, answers[1], answers[0])
    return _code_debug(prediction, answers[0], None)


def choice_match(prediction: str, answers: list[str]) -> float:
    """InfiniteBench's En.MC scorer (see the module docstring for the cascade)."""
    found = _LAST_CHOICE.search(prediction.strip())
    if found and found.group() in answers:
        return 1.0
    return choice_cascade(prediction, answers)


def choice_cascade(prediction: str, answers: list[str]) -> float:
    """InfiniteBench's En.MC scorer after its standalone-letter step: the whole of SCBench's (its compute_scores.py
    keeps only this part)."""
    text = prediction.strip()
    if not text:
        return 0.0
    if text[0] in "ABCD":
        return float(text[0] in answers)
    if text in answers:
        return 1.0
    text = _collapse_spaces(_spaced(text, "\n\"'.,?!{}"))
    after = _after_first_prefix(text, ("answer is:", "answer:", "answer is", "option is"))
    if after is not None:
        return float(any(after.startswith(answer) for answer in answers))
    for word in text.split():
        # A substring test, as InfiniteBench's: "AB" or "BCD" also stop the search (and score 0).
        if word in "ABCD":
            return float(word in answers)
    return 0.0


def _number(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        return float(text)


def first_number_match(prediction: str, answers: list[str]) -> float:
    found = _NUMBER.search(prediction)
    if found is None:
        return 0.0
    label = _number(answers[0])
    if isinstance(label, int):
        return float("." not in found.group() and int(found.group()) == label)
    return float(float(found.group()) == label)


def decimal_for_integer(prediction: str, answers: list[str]) -> bool:
    """Whether math_find's first number is a decimal for an integer answer, on which InfiniteBench raises."""
    found = _NUMBER.search(prediction)
    return found is not None and "." in found.group() and isinstance(_number(answers[0]), int)


def prefix_match(prediction: str, answers: list[str]) -> float:
    """The share of the expected values that the prediction's numbers reproduce, in order, before a first miss."""
    predicted = [int(digits) for digits in _DIGITS.findall(prediction)]
    matched = 0
    for expected, value in zip((int(answer) for answer in answers), predicted, strict=False):
        if expected != value:
            break
        matched += 1
    return matched / len(answers)


def substring_match(prediction: str, answers: list[str]) -> float:
    text = prediction.strip().upper()
    return float(any(answer.upper() in text for answer in answers))


def qa_f1(prediction: str, answers: list[str]) -> float:
    return max((qa_f1_score(prediction, answer) for answer in answers), default=0.0)


def _zh_characters(text: str) -> list[str]:
    return [character for character in text.lower() if character not in _ZH_PUNCTUATION and not character.isspace()]


def qa_f1_chars(prediction: str, answers: list[str]) -> float:
    """The best F1 over the answers of the normalised character multisets (one character, one token)."""
    predicted = _zh_characters(prediction)
    best = 0.0
    for answer in answers:
        gold = _zh_characters(answer)
        same = sum((Counter(predicted) & Counter(gold)).values())
        if same:
            precision, recall = same / len(predicted), same / len(gold)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


METRICS: dict[str, tuple[str, Callable[[str, list[str]], float]]] = {
    "passkey": ("first_integer_match", first_integer_match),
    "kv_retrieval": ("word_match", word_match),
    "number_string": ("first_integer_match", first_integer_match),
    "longdialogue_qa_eng": ("substring_match", substring_match),
    "longbook_qa_eng": ("qa_f1", qa_f1),
    "longbook_choice_eng": ("choice_match", choice_match),
    "code_run": ("last_integer_match", last_integer_match),
    "code_debug": ("code_debug_match", code_debug_match),
    "math_find": ("first_number_match", first_number_match),
    "math_calc": ("prefix_match", prefix_match),
    "longbook_qa_chn": ("qa_f1_chars", qa_f1_chars),
}


# ---------------------------------------------------------------------------------------------------------------
# scoring=kvpress: kvpress 0.5.5's scorer on the label as its evaluate.py hands it over, a numpy array of strings
# ---------------------------------------------------------------------------------------------------------------


class KvpressRaises(Exception):
    """kvpress 0.5.5's scorer raises on this label; ``error`` is the name of the exception it raises."""

    def __init__(self, error: str):
        super().__init__(error)
        self.error = error


def _array_value(elementwise: list[bool], error: str) -> bool:
    """numpy 2.3's ``float()`` / ``bool()`` of the comparison array of an array label: its element when it has one."""
    if len(elementwise) != 1:
        raise KvpressRaises(error)
    return elementwise[0]


def kvpress_first_integer_match(prediction: str, answers: list[str]) -> float:
    digits = first_digits(prediction)
    return float(_array_value([answer == digits for answer in answers], "TypeError"))


def kvpress_word_match(prediction: str, answers: list[str]) -> float:
    # ``label in words``: each word compared with the array, each comparison's truth value taken, up to a match.
    words = _spaced(prediction, "\n:\"'.,?!{}").split()
    return float(any(_array_value([answer == word for answer in answers], "ValueError") for word in words))


def kvpress_last_integer_match(prediction: str, answers: list[str]) -> float:
    words = _spaced(prediction, "\n.`'\":").split()
    if not words:
        return 0.0
    try:
        value = int(words[-1])
    except ValueError:
        return 0.0
    # The label's elements are strings and ``value`` an int.
    return float(_array_value([answer == value for answer in answers], "TypeError"))


def kvpress_code_debug_match(prediction: str, answers: list[str]) -> float:
    if len(answers) < 2:  # ``label[1]``
        raise KvpressRaises("IndexError")
    return _code_debug(prediction, answers[1], answers[0])


def kvpress_first_number_match(prediction: str, answers: list[str]) -> float:
    raise KvpressRaises("TypeError")  # the label is an array: neither an int nor a float


def kvpress_prefix_match(prediction: str, answers: list[str]) -> float:
    raise KvpressRaises("AssertionError")  # ``assert isinstance(label, list)``: the label is an array


KVPRESS_METRICS: dict[str, tuple[str, Callable[[str, list[str]], float]]] = METRICS | {
    "passkey": ("first_integer_match", kvpress_first_integer_match),
    "kv_retrieval": ("word_match", kvpress_word_match),
    "number_string": ("first_integer_match", kvpress_first_integer_match),
    "code_run": ("last_integer_match", kvpress_last_integer_match),
    "code_debug": ("code_debug_match", kvpress_code_debug_match),
    "math_find": ("first_number_match", kvpress_first_number_match),
    "math_calc": ("prefix_match", kvpress_prefix_match),
}
METRICS_BY_SCORING = {"kvpress": KVPRESS_METRICS, "infinitebench": METRICS}


def kvpress_fails(error: str) -> str:
    return f"kvpress 0.5.5's scorer fails on these labels ({error}); benchmark.scoring=infinitebench scores them"


def sample_score(task: str, prediction: str | None, answers: list[str], scoring: str = "kvpress") -> float:
    """One sample's score in [0, 1]; under ``kvpress``, raises KvpressRaises where kvpress's scorer raises."""
    return METRICS_BY_SCORING[scoring][task][1](prediction or "", list(answers))


def _task_metrics(task: str, rows: list[dict], scoring: str) -> dict:
    metric = METRICS_BY_SCORING[scoring][task][0]
    try:
        values = [sample_score(task, row.get("prediction"), row["answers"], scoring) for row in rows]
    except KvpressRaises as raised:
        return {"score": None, "n": len(rows), "metric": metric, "note": kvpress_fails(raised.error)}
    metrics = {"score": round(100 * sum(values) / len(values), 2), "n": len(rows), "metric": metric}
    if scoring == "infinitebench" and task == "math_find":
        decimals = sum(decimal_for_integer(row.get("prediction") or "", row["answers"]) for row in rows)
        if decimals:
            metrics["note"] = (
                f"{decimals} of {len(rows)} predictions give a decimal for an integer answer (e.g. 94.0 for 94): "
                "InfiniteBench's compute_scores raises ValueError on them, here they score 0"
            )
    return metrics


def score_predictions(rows: Iterable[dict], benchmark: str = "infinitebench", scoring: str = "kvpress") -> dict:
    """metrics.json content from rows with ``task``, ``answers`` and ``prediction``."""
    if scoring not in SCORINGS:
        raise ValueError(f"unknown InfiniteBench scoring {scoring!r}; choose one of {', '.join(SCORINGS)}")
    per_task: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        if row["task"] not in METRICS:
            raise ValueError(f"unknown InfiniteBench task {row['task']!r}; the tasks are {', '.join(TASKS)}")
        per_task[row["task"]].append(row)
    tasks = {task: _task_metrics(task, per_task[task], scoring) for task in TASKS if per_task.get(task)}
    scores = [values["score"] for values in tasks.values() if values["score"] is not None]
    label = f"{HEADLINE_LABEL} ({len(scores)} of {len(TASKS)})"
    unscored = [task for task, values in tasks.items() if values["score"] is None]
    if unscored:
        label = f"{label[:-1]}; {', '.join(unscored)} unscored by kvpress 0.5.5)"
    return {
        "benchmark": benchmark,
        "scoring": scoring,
        "score": round(sum(scores) / len(scores), 2) if scores else None,
        "score_label": label,
        "tasks": tasks,
    }


@dataclass
class InfiniteBench(TaskedHubBenchmark):
    """InfiniteBench's 11 tasks that kvpress scores, from kvpress's hub dataset (one data_dir per task).

    Parameters
    ----------
    scoring : str
        ``kvpress`` (kvpress 0.5.5's scorer on the hub's labels: code_run scores 0, and code_debug, math_find and
        math_calc have no score) or ``infinitebench`` (the labels read as InfiniteBench's data types; every task
        scores). See the module docstring.
    tasks : list[str], optional
        Tasks to run; all 11 when null.
    path : str, optional
        Local source instead of the hub: a directory with ``{task}.jsonl|.json|.parquet`` or ``{task}/`` per task, or
        one file / saved dataset whose rows carry ``task``; kvpress's columns either way.
    dataset, split : str
        Hub dataset (one data_dir per task) and split.
    name : str
        Benchmark name in run directories and metrics.json.
    """

    name: str = "infinitebench"
    # kvpress loads one data_dir per task, so ``fraction`` draws within each task's rows.
    fraction_by_task: ClassVar[bool] = True
    scoring: str = "kvpress"
    all_tasks: ClassVar[tuple[str, ...]] = TASKS
    source: ClassVar[Source] = HUB

    def _check_scoring(self) -> None:
        if self.scoring not in SCORINGS:
            raise ConfigError(f"benchmark.scoring={self.scoring!r}; choose one of {', '.join(SCORINGS)}")

    def load(self, tokenizer, limit: int | None = None) -> list[Sample]:
        """At most ``limit`` samples per task, in source order, task after task."""
        self._check_scoring()
        if UNSCORED_TASK in (self.tasks or ()):
            raise ConfigError(
                f"kvpress does not score {UNSCORED_TASK} (its calculate_metrics refuses it); drop it from "
                "benchmark.tasks"
            )
        layout = "one {task}.jsonl or {task}.parquet file, or {task}/ folder, per InfiniteBench task"
        tasks = self.selected_tasks("InfiniteBench")
        sources = rows_by_task(self.dataset, tasks, self.split, self.path, layout, SCHEMA)
        return [
            kvpress_sample(task, index, row, list(row["answer"])) for task, index, row in first_rows(sources, limit)
        ]

    def score(self, rows: list[dict]) -> dict:
        self._check_scoring()
        return score_predictions(rows, benchmark=self.name, scoring=self.scoring)
