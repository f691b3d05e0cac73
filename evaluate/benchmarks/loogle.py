"""LooGLE as the kvpress leaderboard runs it: the hub dataset ``simonjegou/loogle``, one data_dir per task.

Rows hold kvpress's columns (context, question, answer_prefix, answer, task, max_new_tokens), made by kvpress's
``create_huggingface_dataset.py`` from LooGLE's prompts and generation lengths; a local ``path`` holds the same
columns. The chat template is applied to every task, and over-long contexts keep their head (the runner's
``max_context_length``), as in kvpress.

Metrics reproduce kvpress's ``evaluation/benchmarks/loogle/calculate_metrics.py`` (kvpress 0.5.5), on a x100 scale
rounded to 2 decimals (kvpress reports 0-1 fractions):

- shortdep_qa, longdep_qa, longdep_summarization: per row, then averaged over the task's rows,
  ``bleu1`` and ``bleu4`` (NLTK ``sentence_bleu`` without smoothing on whitespace tokens, newlines counted as
  spaces; weights (1,0,0,0) and (0,0,0,1), so bleu4 is the 4-gram precision alone times the brevity penalty) and
  ``rouge-1`` / ``rouge-2`` / ``rouge-l`` *recall* from the ``rouge`` package (``get_scores(hyps=[prediction],
  refs=[answer])``). A metric that raises on a row (``rouge`` does on an empty prediction) scores 0 on that row.
  ``meteor`` (NLTK ``single_meteor_score`` on the de-duplicated token sets) is added only when NLTK's WordNet data is
  already on disk; nothing is downloaded. kvpress passes Python sets, whose order (and so METEOR's fragmentation
  penalty) changes from process to process; here the sets are sorted, so a rescore gives the same number.
  ``bertscore`` (the R output of ``bert_score.score(answers, predictions, lang="en")``, kvpress's argument order) is
  added only when ``bertscore=true``; it needs the ``bert-score`` package and its model.
- shortdep_cloze: gold and prediction are mask -> entity dicts, parsed with ``ast.literal_eval`` (never ``eval``).
  ``exact_match`` pools over masks: a parsed dict adds one match per gold mask whose predicted value is equal and
  counts every gold mask; a prediction that does not parse to a dict adds 0 matched and 1 counted, whatever the
  number of masks. ``partial_match``: a gold mask matches when the prediction has the key and the two values share a
  whitespace token; an unparseable prediction adds 0 matched and every gold mask counted.

Task ``score``: rouge-l for the three text tasks, exact_match for the cloze task. Headline ``score``: the mean
ROUGE-L recall x 100 over the text tasks present.
"""

import ast
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache
from typing import ClassVar

from evaluate.benchmarks import Sample, Source, TaskedHubBenchmark
from evaluate.benchmarks.sources import REFERENCE, Schema, first_rows, kvpress_sample, rows_by_task
from evaluate.errors import ConfigError

TEXT_TASKS: tuple[str, ...] = ("shortdep_qa", "longdep_qa", "longdep_summarization")
CLOZE_TASK = "shortdep_cloze"
TASKS: tuple[str, ...] = (*TEXT_TASKS, CLOZE_TASK)

# ``answer`` is one gold string (a cloze task's is a mask -> entity dict written as text).
SCHEMA = Schema(("context", "question", "answer_prefix", "answer", "max_new_tokens"), {"answer": REFERENCE})
HEADLINE_LABEL = "ROUGE-L recall ×100, mean over the text tasks"
HUB = Source(dataset="simonjegou/loogle")


def _tokens(text: str) -> list[str]:
    return text.replace("\n", " ").split()


def bleu_scores(reference: str, prediction: str) -> dict[str, float]:
    from nltk.translate.bleu_score import sentence_bleu

    reference_tokens, predicted_tokens = _tokens(reference), _tokens(prediction)
    with warnings.catch_warnings():
        # NLTK warns on every missing n-gram order; the score (0, or bleu4's near-0) is what the reference reports.
        warnings.simplefilter("ignore")
        return {
            "bleu1": sentence_bleu([reference_tokens], predicted_tokens, weights=(1, 0, 0, 0)),
            "bleu4": sentence_bleu([reference_tokens], predicted_tokens, weights=(0, 0, 0, 1)),
        }


def rouge_recalls(reference: str, prediction: str) -> dict[str, float]:
    from rouge import Rouge

    scores = Rouge().get_scores(hyps=[prediction], refs=[reference])[0]
    return {key: scores[key]["r"] for key in ("rouge-1", "rouge-2", "rouge-l")}


def meteor_score(reference: str, prediction: str) -> dict[str, float]:
    from nltk.translate.meteor_score import single_meteor_score

    return {"meteor": float(single_meteor_score(sorted(set(_tokens(reference))), sorted(set(_tokens(prediction)))))}


@cache
def wordnet_on_disk() -> bool:
    """Whether NLTK finds its WordNet corpus locally (METEOR needs it); never downloads."""
    import nltk

    for resource in ("corpora/wordnet", "corpora/wordnet.zip"):
        try:
            nltk.data.find(resource)
            return True
        except LookupError:
            continue
    return False


def text_metric_functions() -> list[tuple[Callable[[str, str], dict[str, float]], tuple[str, ...]]]:
    """The per-row metrics with the keys each returns (all 0 on a row where the metric raises)."""
    functions = [(bleu_scores, ("bleu1", "bleu4")), (rouge_recalls, ("rouge-1", "rouge-2", "rouge-l"))]
    if wordnet_on_disk():
        functions.append((meteor_score, ("meteor",)))
    return functions


def text_row_scores(reference: str, prediction: str) -> dict[str, float]:
    scores: dict[str, float] = {}
    for function, keys in text_metric_functions():
        try:
            scores.update(function(reference, prediction))
        except Exception:
            scores.update(dict.fromkeys(keys, 0.0))
    return scores


def _parse_masks(text: str):
    try:
        return ast.literal_eval(text)
    except Exception:
        # SyntaxError, ValueError, and RecursionError/MemoryError on adversarial nesting: all just "unparseable".
        return None


def exact_match(reference: str, prediction: str) -> tuple[int, int]:
    """(masks matched, masks counted) for one cloze row."""
    gold, predicted = _parse_masks(reference), _parse_masks(prediction)
    if not isinstance(gold, dict) or not isinstance(predicted, dict):
        return 0, 1
    return sum(predicted.get(key) == value for key, value in gold.items()), len(gold)


def partial_match(reference: str, prediction: str) -> tuple[int, int]:
    """(masks sharing a token with the gold entity, masks counted) for one cloze row."""
    gold, predicted = _parse_masks(reference), _parse_masks(prediction)
    if not isinstance(gold, dict):
        return 0, 1
    if not isinstance(predicted, dict):
        return 0, len(gold)
    try:
        matched = sum(
            key in predicted and bool(set(value.split()) & set(predicted[key].split())) for key, value in gold.items()
        )
    except AttributeError:
        # A non-string entity (e.g. a number): kvpress's try block gives the whole row 0.
        return 0, len(gold)
    return matched, len(gold)


def _percent(value: float) -> float:
    return round(100 * value, 2)


def bert_scores(references: list[str], predictions: list[str]) -> float:
    """Mean BERTScore R with kvpress's argument order (gold answers as candidates, predictions as references)."""
    try:
        from bert_score import score
    except ImportError as error:
        raise ConfigError("bertscore=true needs the bert-score package: pip install bert-score") from error
    return float(score(references, predictions, lang="en")[1].mean())


def score_predictions(rows: Iterable[dict], benchmark: str = "loogle", bertscore: bool = False) -> dict:
    """metrics.json content from rows with ``task``, ``answers`` (one gold answer) and ``prediction``."""
    per_task: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for row in rows:
        if row["task"] not in TASKS:
            raise ValueError(f"unknown LooGLE task {row['task']!r}; the tasks are {', '.join(TASKS)}")
        per_task[row["task"]].append((row["answers"][0], row.get("prediction") or ""))
    tasks: dict[str, dict] = {}
    for task in TASKS:
        pairs = per_task.get(task)
        if not pairs:
            continue
        if task == CLOZE_TASK:
            values = {}
            for key, function in (("exact_match", exact_match), ("partial_match", partial_match)):
                counts = [function(reference, prediction) for reference, prediction in pairs]
                matched, counted = sum(m for m, _ in counts), sum(c for _, c in counts)
                values[key] = _percent(matched / counted) if counted else 0.0
            tasks[task] = {"score": values["exact_match"], "n": len(pairs), "metric": "exact_match", **values}
            continue
        rows_scores = [text_row_scores(reference, prediction) for reference, prediction in pairs]
        values = {key: _percent(sum(scores[key] for scores in rows_scores) / len(pairs)) for key in rows_scores[0]}
        if bertscore:
            values["bertscore"] = _percent(bert_scores([r for r, _ in pairs], [p for _, p in pairs]))
        tasks[task] = {"score": values["rouge-l"], "n": len(pairs), "metric": "rouge-l", **values}
    text_scores = [tasks[task]["score"] for task in TEXT_TASKS if task in tasks]
    return {
        "benchmark": benchmark,
        "score": round(sum(text_scores) / len(text_scores), 2) if text_scores else None,
        "score_label": f"{HEADLINE_LABEL} ({len(text_scores)} of {len(TEXT_TASKS)})",
        "meteor": "computed" if wordnet_on_disk() else "skipped: NLTK WordNet data is not on disk",
        "tasks": tasks,
    }


@dataclass
class Loogle(TaskedHubBenchmark):
    """LooGLE's four kvpress tasks: shortdep_qa, longdep_qa, longdep_summarization and shortdep_cloze.

    Parameters
    ----------
    tasks : list[str], optional
        Tasks to run; all four when null.
    path : str, optional
        Local source instead of the hub: a directory with ``{task}.jsonl|.json|.parquet`` or ``{task}/`` per task, or
        one file / saved dataset whose rows carry ``task``; kvpress's columns either way.
    bertscore : bool
        Also compute BERTScore for the text tasks (needs ``bert-score`` and its roberta-large model).
    dataset, split : str
        Hub dataset (one data_dir per task) and split.
    name : str
        Benchmark name in run directories and metrics.json.
    """

    name: str = "loogle"
    # kvpress loads one data_dir per task, so ``fraction`` draws within each task's rows.
    fraction_by_task: ClassVar[bool] = True
    bertscore: bool = False
    all_tasks: ClassVar[tuple[str, ...]] = TASKS
    source: ClassVar[Source] = HUB

    def load(self, tokenizer, limit: int | None = None) -> list[Sample]:
        """At most ``limit`` samples per task, in source order, task after task."""
        tasks = self.selected_tasks("LooGLE")
        if self.bertscore:
            try:
                import bert_score  # noqa: F401
            except ImportError as error:
                raise ConfigError("bertscore=true needs the bert-score package: pip install bert-score") from error
        layout = "one {task}.jsonl or {task}.parquet file, or {task}/ folder, per LooGLE task"
        sources = rows_by_task(self.dataset, tasks, self.split, self.path, layout, SCHEMA)
        return [kvpress_sample(task, index, row, [row["answer"]]) for task, index, row in first_rows(sources, limit)]

    def score(self, rows: list[dict]) -> dict:
        return score_predictions(rows, benchmark=self.name, bertscore=self.bertscore)
