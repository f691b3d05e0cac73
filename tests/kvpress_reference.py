"""kvpress's ``evaluation/evaluate.py`` inference, written out for the tests: the reference PressBench must equal.

It follows kvpress 0.5.5's ``EvaluationRunner``: torch seeded first; a pandas frame of a local RULER-format file;
the press's knobs set as ``_setup_press`` sets them; eager attention for ObservedAttentionPress; for FinchPress the
delimiter token added to tokenizer and model and appended to every context; in query-aware runs the question appended
to the context and emptied; DecodingPress rows asked one by one with ``question=``, every other press's rows grouped
by context (``groupby("context")``) and asked with ``questions=``, the group's answer prefix and ``max_new_tokens``;
the model as ``from_pretrained`` gives it, with no PressBench hook unless ``fit_layers`` asks for one (see
``UNEVEN_LAYERS``).
"""

from collections.abc import Callable
from pathlib import Path

import pandas as pd
import torch
from kvpress import (
    BasePress,
    ComposedPress,
    DecodingPress,
    DMSPress,
    DuoAttentionPress,
    FinchPress,
    KVPressTextGenerationPipeline,
    ObservedAttentionPress,
    ThinKPress,
)

from evaluate.models.layer_masks import fit_masks_to_layers
from evaluate.models.random_models import TinyRandomModel
from tests.support import FILLER

# A random model whose answers depend on what the press kept.
LIVELY_MODEL = TinyRandomModel(weight_scale=3.0)

# Entries whose layers keep different numbers of pairs: kvpress's pipeline decodes them only under flash attention
# (bottom-right causal alignment); under sdpa the question's mask fits no layer but the longest. PressBench fits the
# mask to each layer (evaluate/models/layer_masks.py, proven equal to token-by-token decoding in
# tests/test_layer_masks.py), so their reference is kvpress's pipeline with that hook.
UNEVEN_LAYERS = frozenset({"pyramidkv", "kvcompose"})


def set_runner_knobs(press: BasePress | None, cr: float, **knobs) -> BasePress | None:
    """``EvaluationRunner._setup_press``: which knob each kind of press takes."""
    if isinstance(press, DuoAttentionPress):
        press.head_compression_ratio = knobs["head_compression_ratio"]
    elif isinstance(press, DMSPress):
        press.threshold = knobs["threshold"]
    elif isinstance(press, ComposedPress):
        for member in press.presses:
            if isinstance(member, ThinKPress):
                member.key_channel_compression_ratio = knobs["key_channel_compression_ratio"]
            elif hasattr(member, "compression_ratio"):
                member.compression_ratio = cr
    elif isinstance(press, ThinKPress):
        press.key_channel_compression_ratio = knobs["key_channel_compression_ratio"]
    elif isinstance(press, DecodingPress):
        for knob in ("compression_interval", "target_size", "hidden_states_buffer_size"):
            setattr(press, knob, knobs.get(knob) or getattr(press, knob))
    elif press is not None and hasattr(press, "compression_ratio"):
        press.compression_ratio = cr
    return press


def ruler_rows(ask: str = "", shared_questions: int = 4, single_contexts: int = 3) -> list[dict]:
    """RULER-format rows: one context asked ``shared_questions`` questions and its first question once more (a
    context asked the same question twice: kvpress answers both rows, query-aware or not), and ``single_contexts``
    contexts asked one each; every question starts with ``ask``."""
    rows = []
    shared = "Report.\n" + FILLER * 5 + "The special magic number for apples is 7341.\n" + FILLER * 2
    for number, fruit in enumerate(("apples", "pears", "plums", "kiwis")[:shared_questions]):
        rows.append(
            {
                "context": shared,
                "question": f"{ask}What is the number for {fruit}?",
                "answer_prefix": " Answer:",
                "answer": [str(7341 + number)],
                "task": "niah_multiquery",
                "max_new_tokens": 12,
            }
        )
    rows.append({**rows[0], "task": "niah_single_1"})
    for index in range(single_contexts):
        rows.append(
            {
                "context": f"Notes {index}.\n" + FILLER * (4 + index) + f"Remember the word {'xyz'[index] * 3}.\n",
                "question": f"{ask}Which word?",
                "answer_prefix": " Word:",
                "answer": ["xyz"[index] * 3],
                "task": "fwe" if index else "vt",
                "max_new_tokens": 9 + index,
            }
        )
    return rows


def sample_ids(frame: pd.DataFrame) -> list[str]:
    """PressBench's RULER ids, ``{task}-{index within the task}`` in file order."""
    return [f"{task}-{index}" for task, index in zip(frame["task"], frame.groupby("task").cumcount(), strict=True)]


def kvpress_predictions(
    path: Path,
    press: BasePress | None,
    query_aware: bool,
    source=LIVELY_MODEL,
    fit_layers: bool = False,
    seed=42,
    cache: Callable | None = None,
) -> dict[str, str]:
    """kvpress's evaluate.py inference on ``path`` with ``press`` (knobs set), keyed by PressBench's sample ids;
    with ``cache``, the rows are asked one by one, each pipeline call given ``cache=cache(model)`` (kvpress's README's
    way to a QuantizedCache, whose pipeline cannot ask several questions on one: evaluate/kv_cache.py), else the
    pipeline makes its own."""
    torch.manual_seed(seed)  # EvaluationRunner._setup_deterministic_seeds, before anything else
    attention = "eager" if isinstance(press, ObservedAttentionPress) else "sdpa"
    model = source.load_model("cpu", "auto", attention)  # from_pretrained as kvpress calls it: dtype auto, no hooks
    tokenizer = source.load_tokenizer()
    if fit_layers:
        fit_masks_to_layers(model)
    df = pd.read_json(path, lines=True)
    df["id"] = sample_ids(df)
    if isinstance(press, FinchPress):
        torch.manual_seed(seed)  # PressBench seeds the embedding row the resize draws
        press.update_model_and_tokenizer(model, tokenizer)
        df["context"] = df["context"] + press.delimiter_token
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer, device=torch.device("cpu"))
    if query_aware:
        df["context"] = df["context"] + df["question"]
        df["question"] = ""
    df["predicted_answer"] = None
    if cache is not None:
        # One question per cache, which nothing reads after its answer: kvpress's cleanup, which can fail on a
        # QuantizedCache after the answer is generated (evaluate/kv_cache.py), has nothing to do.
        pipe._remove_answer_from_cache = lambda cache, lengths: None
    with torch.inference_mode():
        if isinstance(press, DecodingPress) or cache is not None:
            for index, row in df.iterrows():
                output = pipe(
                    row["context"],
                    question=row["question"],
                    answer_prefix=row["answer_prefix"],
                    press=press,
                    max_new_tokens=row["max_new_tokens"],
                    max_context_length=None,
                    **({"cache": cache(model)} if cache else {}),
                )
                df.loc[index, "predicted_answer"] = output["answer"]
        else:
            for context, group in df.groupby("context"):
                output = pipe(
                    context,
                    questions=group["question"].to_list(),
                    answer_prefix=group["answer_prefix"].iloc[0],
                    press=press,
                    max_new_tokens=group["max_new_tokens"].iloc[0],
                    max_context_length=None,
                )
                df.loc[group.index, "predicted_answer"] = output["answers"]
    return dict(zip(df["id"], df["predicted_answer"], strict=True))
