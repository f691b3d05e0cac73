"""Helpers shared by the tests: composing the real Hydra config, running the command, and a small in-code
benchmark."""

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from hydra import compose, initialize_config_dir
from kvpress import SnapKVPress
from kvpress.utils import compute_n_kept
from omegaconf import OmegaConf
from transformers import DynamicCache

from evaluate.benchmarks import Benchmark, Sample
from evaluate.benchmarks.ruler import score_predictions
from evaluate.engine.prefill import PrefillCapture
from evaluate.models.random_models import TinyRandomModel

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
REPO = CONF_DIR.parent

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"


def kept_bounds(press: str, context_length: int, cr: float) -> tuple[int, int]:
    """Fewest and most KV pairs a layer keeps, as each press defines its budget (equal for exact budgets)."""
    if press in ("chunkkv_exact", "eg_chunkkv"):
        n_kept = max(1, int(context_length * (1 - cr)))
        return n_kept, n_kept
    if press == "chunkkv":
        # kvpress's ChunkKVPress (chunk_length 10): int(n_chunks * (1 - cr)) whole chunks, the tail chunk among them.
        n_chunks, tail = -(-context_length // 10), context_length % 10
        n_whole = max(1, int(n_chunks * (1 - cr)))
        return (10 * (n_whole - 1) + tail if tail else 10 * n_whole), 10 * n_whole
    n_kept = compute_n_kept(context_length, cr)
    return n_kept, n_kept


def assert_kept(press: str, row: dict, cr: float) -> None:
    """The row's measured kept pairs (a mean over layers and heads) lie within the press's budget."""
    low, high = kept_bounds(press, row["context_length"], cr)
    kept = row["kept_ratio"] * row["context_length"]
    assert low - 1e-6 <= kept <= high + 1e-6, (press, row["context_length"], kept, low, high)


def captured_prefill(length: int = 300) -> tuple[torch.nn.Module, torch.Tensor, list]:
    """The tiny model (its layers' rotary embedding set, as a press context sets it), ``length`` random input ids
    (seed 0), and what :class:`PrefillCapture` captured of one prefill of them."""
    model = TinyRandomModel().load_model("cpu", "float32", "sdpa")
    for layer in model.model.layers:
        layer.self_attn.rotary_emb = model.model.rotary_emb
    input_ids = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(0))
    capture = PrefillCapture(model.model.layers)
    with torch.no_grad(), capture:
        model.model(input_ids=input_ids, past_key_values=DynamicCache())
    return model, input_ids, capture.captured


def evaluate_cli(*arguments: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m evaluate ARGUMENTS`` as a user runs it, offline, from the repository."""
    return subprocess.run(
        [sys.executable, "-m", "evaluate", *arguments],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={"HF_HUB_OFFLINE": "1", "PATH": "", **(env or {})},
    )


def compose_config(output_dir: Path, *overrides: str):
    """The real config tree, on the tiny random model, writing under ``output_dir``.

    ``limit`` is pinned to 3 unless given, so that tests do not move when the default for ``make run`` does.
    """
    pinned = [] if any(override.startswith("limit=") for override in overrides) else ["limit=3"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(
            config_name="config",
            overrides=["model=tiny_random", f"output_dir={output_dir}", "device=cpu", *pinned, *overrides],
        )


@dataclass
class SharedContextBenchmark:
    """``contexts`` contexts (default 3) with three questions each: grouping and resuming cross contexts.

    Questions are short on purpose: AdaKV masks evicted keys with a fake key orthogonal to every query of the
    question, which exists only while the queries are few compared with the head dimension, and the random
    model's queries point everywhere.
    """

    name: str = "shared_context"
    fraction_by_task: ClassVar[bool] = False
    scored_on_references: ClassVar[bool] = True
    contexts: int = 3
    questions_per_context: int = 3
    max_new_tokens: int = 6

    def load(self, tokenizer, limit: int | None = None) -> list[Sample]:
        samples = []
        for c in range(self.contexts):
            context = f"Document {c}.\n" + FILLER * 4 + f"The special magic number of document {c} is {1000 + c}.\n"
            for q in range(self.questions_per_context):
                samples.append(
                    Sample(
                        id=f"doc-{c}-{q}",
                        task=f"niah_task{q % 2}",
                        context=context,
                        question=f"Q{q}? ",
                        answer_prefix="A:",
                        answers=[str(1000 + c)],
                        max_new_tokens=self.max_new_tokens,
                    )
                )
        return samples if limit is None else samples[: limit * 2]

    def score(self, rows: list[dict]) -> dict:
        return score_predictions(rows, benchmark=self.name)

    def reference_answer(self, sample: Sample) -> str:
        return sample.answers[0]


@dataclass
class UnscorableBenchmark(SharedContextBenchmark):
    """``SharedContextBenchmark`` whose metric fails, as RULER's did on rows without references: the model run
    completes, the scoring after it does not."""

    def score(self, rows: list[dict]) -> dict:
        raise ZeroDivisionError("division by zero")


def with_shared_context(cfg):
    """Swap the composed benchmark for ``SharedContextBenchmark``."""
    cfg.benchmark = OmegaConf.create({"_target_": "tests.support.SharedContextBenchmark", "name": "shared_context"})
    return cfg


class FailingScorer(SnapKVPress):
    """SnapKV that raises when it scores: every context of a run fails (``scorer.press._target_=...``)."""

    def score(self, *args, **kwargs):
        raise RuntimeError("this scorer always fails")


@dataclass
class ConversationBenchmark(Benchmark):
    """``contexts`` documents (default 2) with a conversation of ``turns`` turns each (default 3): turn k asks for
    the number of key k, which the document holds; every turn has its own question, answer prefix and reference."""

    name: str = "conversations"
    all_tasks: ClassVar[tuple[str, ...]] = ("niah_turns",)
    fraction_by_task: ClassVar[bool] = False
    scored_on_references: ClassVar[bool] = True
    contexts: int = 2
    turns: int = 3
    max_new_tokens: int = 6

    def load(self, tokenizer, limit: int | None = None) -> list[Sample]:
        samples = []
        for c in range(self.contexts if limit is None else min(limit, self.contexts)):
            numbers = [str(100 * c + 11 * k + 7) for k in range(self.turns)]
            facts = "".join(f"Key {k} of document {c} holds {number}.\n" for k, number in enumerate(numbers))
            context = f"Document {c}.\n" + FILLER * 3 + facts + FILLER
            for k, number in enumerate(numbers):
                samples.append(
                    Sample(
                        id=f"doc-{c}-turn-{k}",
                        task="niah_turns",
                        context=context,
                        question=f"Key {k}? ",
                        answer_prefix=f"K{k}:",
                        answers=[number],
                        max_new_tokens=self.max_new_tokens + k,
                        conversation=f"doc-{c}",
                        turn=k,
                    )
                )
        return samples

    def score(self, rows: list[dict]) -> dict:
        return score_predictions(rows, benchmark=self.name)

    def reference_answer(self, sample: Sample) -> str:
        return sample.answers[0]


def with_conversations(cfg, **fields):
    """Swap the composed benchmark for ``ConversationBenchmark`` (``fields`` set its sizes)."""
    cfg.benchmark = OmegaConf.create({"_target_": "tests.support.ConversationBenchmark", "name": "conversations"})
    cfg.benchmark.update(fields)
    return cfg
