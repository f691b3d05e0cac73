"""SCBench (Li et al., ICLR 2025, "SCBench: A KV Cache-Centric Analysis of Long-Context Methods") in its multi-turn
mode: one long context is prefilled (and compressed) once, then a conversation's turns are asked about it in order.

Data. The hub dataset ``microsoft/SCBench`` declares one config per task (``load_dataset("microsoft/SCBench",
"scbench_kv", split="test")``, as SCBench's ``run_scbench.py`` loads it). A row is a conversation: ``id``, the
``context`` (``scbench_vt`` holds it in ``input``, read in its place as SCBench does; ``scbench_mf``'s is a list of
integers, written as Python writes the list) and ``multi_turns``, a list of ``{input, answer}`` turns
(``scbench_choice_eng``'s turns add their ``options``, ``scbench_summary_with_needles``'s their ``task``,
scbench_summary or scbench_passkey). A local ``path`` holds the same rows: a hub snapshot directory (one
``{task}/`` folder of parquet files per task) or its ``data/`` folder (one ``{task}.jsonl`` per task).

Samples. Each row becomes one conversation, ``{task}-{id}``, and each of its first ``max_turns`` turns (SCBench's
``--max_turns``, 5 by default) one sample with ``turn`` k from 0, the id ``{task}-{id}-{k}``; ``limit`` counts
conversations, so it never cuts one. SCBench cuts an over-long first prompt in its middle; here the run's
``truncation`` applies (``truncation=middle`` for SCBench's).

Prompts: SCBench's ``eval_utils.py`` with ``--use_chat_template``, as its ``scripts/run_all_tasks.sh`` runs every
task:

- ``context``: the first turn's text up to and including the context (e.g. kv's instruction, two newlines, the
  JSON), the same string in every turn of the conversation;
- turn 0's ``question``: the rest of SCBench's first-turn text, so that context + question is its first user message
  (e.g. ``"\\n\\nQuestion: {input}\\nAnswer:"`` for qa_eng);
- a later turn's ``question``: SCBench's follow-up user message in the chat template
  (``multiturn_follow_up_templates_in_chat_tempate``), which follows the earlier turns' answers; with
  ``history=reference`` those are the reference answers, as SCBench writes them (``str()`` of the hub's answer,
  :meth:`SCBench.reference_answer`); scbench_summary's follow-ups open the answer with ``"This paper"`` (the
  ``answer_prefix``);
- ``max_new_tokens``: SCBench's ``DATA_NAME_TO_MAX_NEW_TOKENS``, per turn task for scbench_summary_with_needles
  (summary 800, passkey 15).

SCBench's own typos are data and are kept: choice_eng asks "The the correct answer is". scbench_mf's instruction,
"What is {the quantity}?", precedes the context and is taken from the first turn's "The ... is" phrase (each
follow-up's from its own).

Metrics (SCBench's ``compute_scores.py``, per turn on ``extra['label']``, the ground truth exactly as its
``get_ground_truth`` builds it: ``[answer, letter]`` for choice_eng, ``[answer]`` for qa_eng, the hub's answer
otherwise):

- kv, prefix_suffix: 1 when the answer is a substring of the prediction;
- vt: the share of the label's items found in the lower-cased prediction (RULER's string_match_all), rounded to 2;
- qa_eng, many_shot: 1 when an item of the label, upper-cased, is in the stripped upper-cased prediction;
- qa_chn: the best character F1 over the label's items (InfiniteBench's Chinese QA F1);
- choice_eng: InfiniteBench's En.MC cascade without its first step (:func:`infinitebench.choice_cascade`);
- mf: the first number of the prediction, cut to an integer, equals the answer (InfiniteBench's Math.Find as SCBench
  has it: ``int(float(...))``, so 94.7 matches 94);
- summary: ROUGE-Lsum F1 of the ``rouge-score`` package, the answer as the reference (``evaluate``'s rouge, which
  SCBench calls, is that package with its defaults);
- summary_with_needles: each turn by its own task, summary as above and passkey as InfiniteBench's passkey (the
  first run of digits equals the answer).

SCBench iterates over the label where its metric takes several references, so a string label is iterated character
by character: many_shot's and qa_chn's hub answers are strings, so SCBench credits a prediction that holds any one
character of the answer (many_shot) or scores it against single characters (qa_chn). That is what SCBench's
published numbers measure, and it is reproduced here; each such task's ``note`` says so.

A task's ``score`` is the mean over its samples x 100 (rounded to 2), and ``turns`` the mean at each turn, the
figures SCBench prints; summary_with_needles also scores its two turn tasks apart (``subtasks``: scbench_summary,
scbench_passkey), as SCBench prints them, and takes their mean as its score. The headline is the mean of the task
scores present.

Refused: scbench_repoqa and scbench_repoqa_and_kv. SCBench scores a RepoQA answer by parsing it with tree-sitter
and matching it by BLEU against every function of the repository (``repo_qa_utils.py``), a code-similarity judge not
reproduced here.
"""

import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from evaluate.benchmarks import Sample, Source, TaskedHubBenchmark
from evaluate.benchmarks.infinitebench import (
    _NUMBER,
    choice_cascade,
    first_integer_match,
    qa_f1_chars,
    substring_match,
)
from evaluate.benchmarks.ruler import string_match_all
from evaluate.benchmarks.sources import Kind, Schema, rows_by_task
from evaluate.errors import ConfigError

TASKS: tuple[str, ...] = (
    "scbench_kv",
    "scbench_prefix_suffix",
    "scbench_vt",
    "scbench_qa_eng",
    "scbench_qa_chn",
    "scbench_choice_eng",
    "scbench_many_shot",
    "scbench_summary",
    "scbench_mf",
    "scbench_summary_with_needles",
)
UNSUPPORTED: tuple[str, ...] = ("scbench_repoqa", "scbench_repoqa_and_kv")
MIXED_TASK = "scbench_summary_with_needles"
SUMMARY, PASSKEY = "scbench_summary", "scbench_passkey"
HUB = Source(dataset="microsoft/SCBench")  # one config per task
DEFAULT_MAX_TURNS = 5  # SCBench's --max_turns
# What benchmark.path holds instead of the hub: the snapshot docs/benchmarks.md downloads, named in every refusal.
LOCAL_LAYOUT = (
    f"SCBench's hub snapshot (huggingface-cli download {HUB.dataset} --repo-type dataset --local-dir DIR): its "
    "{task}/ folders of parquet files, or its data/ folder's {task}.jsonl files"
)
HEADLINE_LABEL = "mean task score ×100 over the SCBench tasks present, each scored as SCBench does"


@dataclass(frozen=True)
class Template:
    """How SCBench words one task's turns (its chat-template path). Fields: ``{context}``, ``{input}`` (the turn's
    question), ``{A}`` to ``{D}`` (choice_eng's options), ``{prefix}`` (scbench_mf's "What is ...?")."""

    context: str
    first: str
    follow_up: str
    follow_up_answer_prefix: str = ""


_PLAIN = Template("{context}", "\n\n{input}", "{input}")
_CHOICE = "Question: {input}\nA. {A}\nB. {B}\nC. {C}\nD. {D}\n\nThe the correct answer is"
TEMPLATES: Mapping[str, Template] = {
    "scbench_kv": Template(
        "Extract the value corresponding to the specified key in the JSON object below.\n\n{context}",
        "\n\n{input}",
        "{input}",
    ),
    "scbench_prefix_suffix": _PLAIN,
    "scbench_vt": _PLAIN,
    "scbench_qa_eng": Template(
        "Read the book and answer the question. Be very concise in your answer.\n\n{context}",
        "\n\nQuestion: {input}\nAnswer:",
        "Question: {input}\nAnswer:",
    ),
    "scbench_qa_chn": Template(
        "阅读以下书籍然后回答问题。\n\n{context}", "\n\n问题：{input}\n答案：", "问题：{input}\n答案："
    ),
    "scbench_choice_eng": Template("Read the book and answer the question.\n\n{context}", "\n\n" + _CHOICE, _CHOICE),
    "scbench_many_shot": _PLAIN,
    "scbench_summary": Template("{context}", "\n\n{input}", "{input}", follow_up_answer_prefix="This paper"),
    "scbench_mf": Template("{prefix}\n\n{context}", "\n\n{input}", "{prefix}\n\n{input}"),
    MIXED_TASK: _PLAIN,
}

# SCBench's DATA_NAME_TO_MAX_NEW_TOKENS; summary_with_needles's by the task of each turn.
MAX_NEW_TOKENS: Mapping[str, int] = {
    "scbench_kv": 150,
    "scbench_prefix_suffix": 150,
    "scbench_vt": 30,
    "scbench_qa_eng": 40,
    "scbench_qa_chn": 40,
    "scbench_choice_eng": 40,
    "scbench_many_shot": 10,
    "scbench_summary": 200,
    "scbench_mf": 5,
}
MIXED_MAX_NEW_TOKENS: Mapping[str, int] = {SUMMARY: 800, PASSKEY: 15}

# The tasks whose label SCBench wraps (get_ground_truth): the reference answer is its first item.
WRAPPED_LABELS = ("scbench_choice_eng", "scbench_qa_eng")
# The tasks whose hub answers are strings that SCBench's metric iterates over, character by character.
CHARACTER_LABELS = ("scbench_many_shot", "scbench_qa_chn")
CHARACTER_NOTE = (
    "SCBench iterates over this task's answer string, so each character counts as a reference (reproduced as is)"
)
_MF_QUANTITY = re.compile(r"The .+ is")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_text(value: Any) -> bool:
    return isinstance(value, str) and bool(value)


def _choice_ok(turn: dict) -> bool:
    options = turn.get("options")
    if not (isinstance(options, list) and all(isinstance(option, str) for option in options)):
        return False
    # SCBench writes the first four options as A to D and the answer's place among them as its letter.
    return len(options) >= 4 and turn.get("answer") in options[:4]


# What each task's turns hold besides a string ``input``: (how the refusal says it, the check).
TURN_KINDS: Mapping[str, tuple[str, Callable[[dict], bool]]] = {
    **dict.fromkeys(
        ("scbench_kv", "scbench_prefix_suffix", "scbench_qa_eng", "scbench_qa_chn", "scbench_many_shot", SUMMARY),
        ("a non-empty string 'answer'", lambda turn: _is_text(turn.get("answer"))),
    ),
    "scbench_vt": (
        "an 'answer' that is a non-empty string or a non-empty list of strings",
        lambda turn: (
            _is_text(turn.get("answer"))
            or (isinstance(turn.get("answer"), list) and bool(turn["answer"]) and all(map(_is_text, turn["answer"])))
        ),
    ),
    "scbench_choice_eng": ("four or more string 'options' and an 'answer' among the first four", _choice_ok),
    "scbench_mf": (
        "an integer 'answer' (or a non-empty list of integers) and an 'input' that says 'The ... is'",
        lambda turn: (
            (
                _is_int(turn.get("answer"))
                or (isinstance(turn.get("answer"), list) and bool(turn["answer"]) and all(map(_is_int, turn["answer"])))
            )
            and _MF_QUANTITY.search(turn["input"]) is not None
        ),
    ),
    MIXED_TASK: (
        f"a non-empty string 'answer' and a 'task' of {SUMMARY} or {PASSKEY}",
        lambda turn: _is_text(turn.get("answer")) and turn.get("task") in MIXED_MAX_NEW_TOKENS,
    ),
}

CONTEXT = Kind(
    "a string (or, for scbench_mf, a list of integers)",
    lambda value: isinstance(value, str) or (isinstance(value, list) and all(map(_is_int, value))),
)
ROW_ID = Kind("an integer or a string", lambda value: _is_int(value) or isinstance(value, str))


def schema(task: str) -> Schema:
    """The columns of one task's rows: ``id``, the context (``context``, or ``input`` as scbench_vt's rows hold it)
    and ``multi_turns``, each turn checked as the task needs it."""
    description, turn_ok = TURN_KINDS[task]
    turns = Kind(
        f"a non-empty list of turns, each an object with a string 'input' and {description}",
        lambda value: (
            isinstance(value, list)
            and bool(value)
            and all(isinstance(turn, dict) and isinstance(turn.get("input"), str) and turn_ok(turn) for turn in value)
        ),
    )
    kinds = {"id": ROW_ID, "context": CONTEXT, "input": CONTEXT, "multi_turns": turns}
    return Schema(("id", "context", "multi_turns"), kinds, alternative=("id", "input", "multi_turns"))


def mf_prefix(question: str) -> str:
    """scbench_mf's instruction: "What is <the quantity>?", from the turn's first "The ... is" phrase, lower-cased."""
    quantity = _MF_QUANTITY.search(question)
    return f"What is {quantity.group().lower()[: -len(' is')]}?"


def label(task: str, turn: Mapping[str, Any]) -> Any:
    """The turn's ground truth as SCBench's get_ground_truth builds it, which its metrics read."""
    if task == "scbench_choice_eng":
        return [turn["answer"], "ABCD"[turn["options"].index(turn["answer"])]]
    if task == "scbench_qa_eng":
        return [turn["answer"]]
    return turn["answer"]


def _fields(task: str, turn: Mapping[str, Any]) -> dict[str, Any]:
    """The template fields of one turn."""
    fields: dict[str, Any] = {"input": turn["input"]}
    if task == "scbench_choice_eng":
        fields.update(zip("ABCD", turn["options"], strict=False))
    if task == "scbench_mf":
        fields["prefix"] = mf_prefix(turn["input"])
    return fields


def conversation_samples(task: str, row: Mapping[str, Any], max_turns: int | None) -> list[Sample]:
    """One sample per turn of the row's conversation, its first ``max_turns`` turns (None: all)."""
    template = TEMPLATES[task]
    turns = row["multi_turns"][:max_turns]
    conversation = f"{task}-{row['id']}"
    # scbench_mf's instruction comes before the context, from the first turn: the same in every turn.
    prefix = mf_prefix(turns[0]["input"]) if task == "scbench_mf" else ""
    context = template.context.format(context=row["context"] if "context" in row else row["input"], prefix=prefix)
    samples = []
    for index, turn in enumerate(turns):
        truth = label(task, turn)
        extra = {"label": truth}
        if task == MIXED_TASK:
            extra["subtask"] = turn["task"]
        samples.append(
            Sample(
                id=f"{conversation}-{index}",
                task=task,
                context=context,
                question=(template.follow_up if index else template.first).format(**_fields(task, turn)),
                answer_prefix=template.follow_up_answer_prefix if index else "",
                answers=[str(item) for item in truth] if isinstance(truth, list) else [str(truth)],
                max_new_tokens=MIXED_MAX_NEW_TOKENS[turn["task"]] if task == MIXED_TASK else MAX_NEW_TOKENS[task],
                extra=extra,
                conversation=conversation,
                turn=index,
            )
        )
    return samples


def kv_match(prediction: str, truth: str) -> float:
    return float(truth in prediction)


def items_match_all(prediction: str, truth: Any) -> float:
    """scbench_vt: the share of the label's items in the prediction, rounded to 2 as SCBench does per turn."""
    return round(string_match_all(prediction, list(truth)), 2)


def mf_match(prediction: str, truth: int | list[int]) -> float:
    """InfiniteBench's Math.Find on an integer label, as SCBench has it: the first number, cut to an int."""
    expected = truth[0] if isinstance(truth, list) else truth
    found = _NUMBER.search(prediction)
    return float(found is not None and int(float(found.group())) == expected)


def rouge_lsum(prediction: str, truth: str) -> float:
    """ROUGE-Lsum F1 (lines split on newlines, rouge-score's default tokenizer, no stemming): what SCBench's
    ``evaluate.load("rouge")`` computes for one reference."""
    from rouge_score.rouge_scorer import RougeScorer

    return RougeScorer(["rougeLsum"]).score(truth, prediction)["rougeLsum"].fmeasure


def passkey_match(prediction: str, truth: str | list[str]) -> float:
    return first_integer_match(prediction, truth if isinstance(truth, list) else [truth])


# The metric of each task (and of summary_with_needles's turn tasks): its name and its score of one turn, on the
# prediction and the label. ``list(label)`` is SCBench's iteration over the label, a string's characters included.
METRICS: Mapping[str, tuple[str, Callable[[str, Any], float]]] = {
    "scbench_kv": ("substring", kv_match),
    "scbench_prefix_suffix": ("substring", kv_match),
    "scbench_vt": ("string_match_all", items_match_all),
    "scbench_qa_eng": ("substring_match", lambda prediction, truth: substring_match(prediction, list(truth))),
    "scbench_many_shot": ("substring_match", lambda prediction, truth: substring_match(prediction, list(truth))),
    "scbench_qa_chn": ("qa_f1_chars", lambda prediction, truth: qa_f1_chars(prediction, list(truth))),
    "scbench_choice_eng": ("choice_match", choice_cascade),
    "scbench_mf": ("first_number_match", mf_match),
    SUMMARY: ("rougeLsum", rouge_lsum),
    PASSKEY: ("first_integer_match", passkey_match),
}


def turn_score(row: Mapping[str, Any]) -> float:
    """One prediction row's score in [0, 1], by its task's metric (summary_with_needles: its turn's task's)."""
    metric = METRICS[row["subtask"] if row["task"] == MIXED_TASK else row["task"]][1]
    return metric(row.get("prediction") or "", row["label"])


def _percent(values: list[float]) -> float:
    return round(100 * sum(values) / len(values), 2)


def _task_metrics(task: str, rows: list[dict]) -> dict:
    scores = [turn_score(row) for row in rows]
    by_turn: dict[int, list[float]] = defaultdict(list)
    for row, score in zip(rows, scores, strict=True):
        by_turn[row["turn"]].append(score)
    turns = {str(turn): _percent(values) for turn, values in sorted(by_turn.items())}
    if task != MIXED_TASK:
        metrics: dict[str, Any] = {"score": _percent(scores), "n": len(rows), "metric": METRICS[task][0]}
    else:
        # SCBench reports the summary and the passkey turns apart; the task's score weighs the two alike.
        by_subtask: dict[str, list[float]] = defaultdict(list)
        for row, score in zip(rows, scores, strict=True):
            by_subtask[row["subtask"]].append(score)
        subtasks = {subtask: _percent(values) for subtask, values in sorted(by_subtask.items())}
        metrics = {
            "score": round(sum(subtasks.values()) / len(subtasks), 2),
            "n": len(rows),
            "metric": f"mean of {SUMMARY}'s rougeLsum and {PASSKEY}'s first_integer_match",
            "subtasks": subtasks,
        }
    metrics["turns"] = turns
    if task in CHARACTER_LABELS:
        metrics["note"] = CHARACTER_NOTE
    return metrics


def score_predictions(rows: Iterable[dict], benchmark: str = "scbench") -> dict:
    """metrics.json content from rows with ``task``, ``turn``, ``label``, ``prediction`` (and ``subtask`` for
    summary_with_needles)."""
    per_task: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        if row["task"] not in TASKS:
            raise ValueError(f"unknown SCBench task {row['task']!r}; the scored tasks are {', '.join(TASKS)}")
        per_task[row["task"]].append(row)
    tasks = {task: _task_metrics(task, per_task[task]) for task in TASKS if per_task.get(task)}
    scores = [values["score"] for values in tasks.values()]
    return {
        "benchmark": benchmark,
        "score": round(sum(scores) / len(scores), 2) if scores else None,
        "score_label": f"{HEADLINE_LABEL} ({len(scores)} of {len(TASKS)})",
        "tasks": tasks,
    }


@dataclass
class SCBench(TaskedHubBenchmark):
    """SCBench's multi-turn conversations, one sample per turn, from the hub dataset (one config per task).

    Parameters
    ----------
    tasks : list[str], optional
        Tasks to run; all 10 scored tasks when null (scbench_repoqa and scbench_repoqa_and_kv are refused).
    max_turns : int, optional
        The first turns of each conversation asked (SCBench's ``--max_turns``, 5); null asks every turn.
    path : str, optional
        Local source instead of the hub: a directory with ``{task}.jsonl|.json|.parquet`` or ``{task}/`` per task
        (a snapshot of the hub dataset, or its ``data/`` folder), SCBench's columns.
    dataset, split : str
        Hub dataset (one config per task) and split.
    name : str
        Benchmark name in run directories and metrics.json.
    """

    name: str = "scbench"
    # SCBench loads one config per task, so ``fraction`` draws within each task's rows.
    fraction_by_task: ClassVar[bool] = True
    max_turns: int | None = DEFAULT_MAX_TURNS
    all_tasks: ClassVar[tuple[str, ...]] = TASKS
    source: ClassVar[Source] = HUB

    def _tasks(self) -> list[str]:
        refused = [task for task in self.tasks or () if task in UNSUPPORTED]
        if refused:
            raise ConfigError(
                f"SCBench's {', '.join(refused)} metric needs a code-similarity judge (tree-sitter parsing and BLEU "
                f"against every function of the repository) that PressBench does not reproduce; choose from "
                f"{', '.join(TASKS)}"
            )
        if self.max_turns is not None and (not _is_int(self.max_turns) or self.max_turns < 1):
            raise ConfigError(f"benchmark.max_turns={self.max_turns!r}; give a positive integer, or null for all")
        return self.selected_tasks("SCBench")

    def load(self, tokenizer, limit: int | None = None) -> list[Sample]:
        """Every turn of at most ``limit`` conversations per task, in source order, task after task (a limit never
        cuts a conversation)."""
        samples = []
        for task in self._tasks():
            rows = rows_by_task(self.dataset, [task], self.split, self.path, LOCAL_LAYOUT, schema(task), configs=True)
            for row in rows[task][:limit]:
                samples.extend(conversation_samples(task, row, self.max_turns))
        return samples

    def reference_answer(self, sample: Sample) -> str:
        """The turn's answer as SCBench writes it into the conversation: ``str()`` of the hub's answer (a list, e.g.
        scbench_vt's variables, as Python writes it)."""
        truth = sample.extra["label"]
        return truth[0] if sample.task in WRAPPED_LABELS else str(truth)

    def score(self, rows: list[dict]) -> dict:
        return score_predictions(rows, benchmark=self.name)
