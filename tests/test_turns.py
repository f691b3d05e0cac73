"""Conversations (``turns=multi``, evaluate/engine/turns.py): a context compressed once, its turns asked in order on
the same cache, on both of PressBench's paths.

- Both paths give identical predictions, turn by turn, for a query-agnostic press, a query-aware one, AdaKV and a
  decoding-time press, under both histories (the decoding press under ``history=model``, the one it allows).
- Without a press, each turn's answer is the greedy continuation of the whole conversation written out with the
  chat template (the earlier turns' reference answers as the assistant's messages), computed here with plain
  transformers: the conversation's format, positions and dropped answers are what a chat is.
- The first turn is kvpress's own answer to that question (the independent run's).
- A run killed mid-conversation resumes at its first unanswered turn, with an uninterrupted run's rows.
"""

from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from evaluate import rundir
from evaluate.engine.decoding_compression import NoCompression
from evaluate.engine.teacher_forcing import answer_text
from evaluate.engine.turns import Conversation, follow_up_text
from evaluate.errors import ConfigError
from evaluate.models.random_models import build_tiny_tokenizer
from evaluate.points.config import run_dir
from evaluate.report.build import build_report, write_report
from evaluate.report.runs import collect_runs
from evaluate.run.entry import run, run_sweep
from tests.kvpress_reference import LIVELY_MODEL
from tests.support import ConversationBenchmark, compose_config, with_conversations, with_shared_context

LIVELY = "+model.source.weight_scale=3.0"
# A decoding-time press that compresses every answer (8 to 10 tokens) twice: its target is below the contexts.
DECODING = ("method=decoding_knorm", "target_size=64", "compression_interval=4", "hidden_states_buffer_size=8")
POINTS = {
    "query-agnostic": ("press=topk", "cr=0.5"),
    "query-aware": ("press=topk", "cr=0.5", "query_aware=true"),
    "adakv": ("press=adakv", "cr=0.5"),
}


def rows_of(cfg) -> list[dict]:
    return rundir.read_predictions(run_dir(cfg) / rundir.PREDICTIONS)


def answered(tmp_path, *overrides: str) -> dict[str, str]:
    cfg = with_conversations(compose_config(tmp_path, "limit=null", LIVELY, *overrides))
    run(cfg)
    rows = rows_of(cfg)
    assert not [row for row in rows if row.get("error")]
    return {row["id"]: row["prediction"] for row in rows}


@pytest.mark.parametrize("history", ["reference", "model"])
@pytest.mark.parametrize("point", sorted(POINTS))
def test_both_paths_answer_a_conversation_alike(tmp_path, point, history):
    overrides = ("turns=multi", f"history={history}", *POINTS[point])
    pooled = answered(tmp_path / "pool", *overrides)
    one_by_one = answered(tmp_path / "pipeline", *overrides, "decode_batch_size=1")
    assert pooled == one_by_one
    assert len(pooled) == 6
    # The turns are asked otherwise, so they are answered otherwise: the test compares something.
    assert len(set(pooled.values())) > 1


def test_a_decoding_press_compresses_a_conversation_alike_on_both_paths(tmp_path):
    overrides = ("turns=multi", "history=model", "dtype=float64", *DECODING)
    pooled = answered(tmp_path / "pool", *overrides)
    assert pooled == answered(tmp_path / "pipeline", *overrides, "decode_batch_size=1")
    assert len(set(pooled.values())) > 1


def greedy(model, ids: list[int], max_new_tokens: int, stop_ids: set[int]) -> list[int]:
    """Plain transformers: the prompt in one pass, then one token at a time, as far as a stop token."""
    cache, tokens = DynamicCache(), []
    logits = model(input_ids=torch.tensor([ids]), past_key_values=cache).logits
    for _ in range(max_new_tokens):
        tokens.append(int(logits[0, -1].argmax()))
        if len(tokens) > 1 and tokens[-1] in stop_ids:
            break
        logits = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache).logits
    return tokens


def test_without_a_press_each_turn_continues_the_whole_chat_with_the_reference_answers(tmp_path):
    predictions = answered(tmp_path, "turns=multi", "press=none")
    tokenizer = build_tiny_tokenizer()
    model = LIVELY_MODEL.load_model("cpu", "float32", "sdpa")
    stop_ids = {tokenizer.eos_token_id}
    turns = [sample for sample in ConversationBenchmark().load(tokenizer) if sample.conversation == "doc-1"]
    messages = []
    for sample in turns:
        question = sample.context + sample.question if sample.turn == 0 else sample.question
        messages.append({"role": "user", "content": question})
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(prompt + sample.answer_prefix, add_special_tokens=False)
        with torch.no_grad():
            tokens = greedy(model, ids, sample.max_new_tokens, stop_ids)
        assert predictions[sample.id] == tokenizer.decode(tokens, skip_special_tokens=True), sample.id
        answer = answer_text(sample.answers[0], sample.answer_prefix)
        messages.append({"role": "assistant", "content": sample.answer_prefix + answer})


def test_the_first_turn_is_kvpress_s_answer_to_its_question(tmp_path):
    multi = answered(tmp_path / "multi", "turns=multi", *POINTS["query-agnostic"])
    independent = answered(tmp_path / "independent", *POINTS["query-agnostic"])
    firsts = [sample_id for sample_id in multi if sample_id.endswith("turn-0")]
    assert [multi[sample_id] for sample_id in firsts] == [independent[sample_id] for sample_id in firsts]
    # Later turns see the earlier ones: the conversation changes what they answer.
    assert any(multi[sample_id] != independent[sample_id] for sample_id in multi if sample_id not in firsts)


@pytest.mark.parametrize("path", ["pool", "pipeline"])
@pytest.mark.parametrize("history", ["reference", "model"])
def test_a_run_killed_mid_conversation_resumes_at_its_first_unanswered_turn(tmp_path, monkeypatch, path, history):
    overrides = ("limit=null", LIVELY, "turns=multi", f"history={history}", *POINTS["query-agnostic"])
    overrides += ("decode_batch_size=1",) if path == "pipeline" else ()
    reference = with_conversations(compose_config(tmp_path / "reference", *overrides))
    run(reference)
    cfg = with_conversations(compose_config(tmp_path / "resumed", *overrides))
    original_append = rundir.append_predictions
    written = []

    def killed_after_four_turns(file, rows):
        if len(written) == 4:
            raise KeyboardInterrupt
        rows = list(rows)
        written.extend(rows)
        original_append(file, rows)

    monkeypatch.setattr(rundir, "append_predictions", killed_after_four_turns)
    with pytest.raises(KeyboardInterrupt):
        run(cfg)
    kept = rows_of(cfg)
    assert len(kept) == 4
    # Killed mid-conversation: a conversation has answered turns and unanswered ones.
    assert {row["turn"] for row in kept if row["conversation"] == "doc-1"} < {0, 1, 2}

    monkeypatch.setattr(rundir, "append_predictions", original_append)
    run(cfg)
    by_id = lambda rows: {row["id"]: row for row in rows}  # noqa: E731
    assert by_id(rows_of(cfg)) == by_id(rows_of(reference))
    assert (run_dir(cfg) / rundir.METRICS).read_text() == (run_dir(reference) / rundir.METRICS).read_text()


def test_conversations_of_every_point_share_the_pool_and_one_prefill(tmp_path, caplog):
    cfg = with_conversations(compose_config(tmp_path, "limit=null", LIVELY, "turns=multi", *POINTS["adakv"]))
    with caplog.at_level("INFO"):
        run(cfg)
    record = rundir.read_json(run_dir(cfg) / rundir.RUN)
    assert record["samples"] == 6
    # Each conversation's turns are answered from its one prefill.
    assert "2 contexts prefilled, once each" in caplog.text


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (("turns=multi", "press=none"), "samples have no turns"),
        (("turns=sometimes",), "choose one of independent, multi"),
        (("history=model",), "read only by turns=multi"),
        (("turns=multi", "generate=false"), "answers none"),
        (("turns=multi", *DECODING), "use history=model"),
        (("turns=multi", "method=finch", "query_aware=true"), "compressed cache's length"),
    ],
)
def test_conversation_settings_that_cannot_run_are_refused_in_one_line(tmp_path, overrides, words):
    cfg = compose_config(tmp_path, *overrides)
    cfg = with_shared_context(cfg) if "samples have no turns" in words else with_conversations(cfg)
    with pytest.raises(ConfigError, match=words):
        run(cfg)


def test_a_conversation_moves_on_as_its_history_says():
    stop = 9
    conversation = Conversation(
        inputs=[torch.tensor([[1, 2]]), torch.tensor([[3]]), torch.tensor([[4, 5]])],
        references=[torch.tensor([[7, 7]]), torch.tensor([[8]]), None],
        max_new_tokens=[4, 4, 4],
        keep_answers=False,
        stop_ids={stop},
        recorded=[None, None, None],
    )
    conversation.start(100)
    # Reference: the 3 answer tokens written (of 4) leave; the next input is the reference, then the follow-up.
    assert conversation.next_turn([5, 5, 5, 5]) == 3
    assert (conversation.position, conversation.input_ids.tolist()) == (102, [[7, 7, 3]])
    conversation.keep_answers = True
    # Model: nothing leaves; the stop token is not fed back (the follow-up writes the end of the message).
    assert conversation.next_turn([6, stop]) == 0
    assert (conversation.position, conversation.input_ids.tolist()) == (106, [[4, 5]])
    assert conversation.slot_length(50, NoCompression()) == 50 + (2 + 1 + 2) + 3 + (2 + 1) + 12 + 1


def test_the_follow_up_is_the_chat_template_s_next_user_message():
    tokenizer = build_tiny_tokenizer()
    assert follow_up_text(tokenizer, True) == ("<|im_end|>\n<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n")
    assert follow_up_text(tokenizer, False) == ("\n", "\n")


def test_the_cost_shows_one_prefill_per_conversation_against_one_per_turn_asked_on_its_own(tmp_path):
    costs = {}
    for turns in ("multi", "independent"):
        cfg = with_conversations(
            compose_config(tmp_path / turns, "limit=null", f"turns={turns}", *POINTS["query-agnostic"])
        )
        run(cfg)
        costs[turns] = rundir.read_json(run_dir(cfg) / rundir.RUN)
    assert (costs["multi"]["conversations"], costs["multi"]["contexts"]) == (2, 2)
    assert costs["multi"]["prefills_per_conversation"] == 1.0
    # Asked on its own, each turn has its own answer prefix, so its own prefill: three a conversation.
    assert costs["independent"]["prefills_per_conversation"] == 3.0
    assert costs["independent"]["contexts"] == 6
    runs, skipped = collect_runs(tmp_path)
    written = write_report(build_report(runs, skipped, 0, 0), tmp_path / "report", tmp_path, 0)
    cost = next(Path(path) for path in written if Path(path).name == "cost.csv").read_text(encoding="utf-8")
    assert "prefills_per_conversation" in cost.splitlines()[0]


SWEEP = [("press=none",), ("press=topk", "cr=0.5"), ("press=topk", "cr=0.8"), ("press=adakv", "cr=0.5"), DECODING]


def test_a_sweep_of_conversations_shares_each_prefill_and_equals_each_point_run_alone(tmp_path, caplog):
    def configs(output_dir):
        common = ("limit=null", LIVELY, "turns=multi", "history=model", "dtype=float64")
        return [with_conversations(compose_config(output_dir, *common, *point)) for point in SWEEP]

    swept = configs(tmp_path / "sweep")
    with caplog.at_level("INFO"):
        run_sweep(swept)
    # Two conversations, each prefilled once for every point.
    assert "2 contexts prefilled, once each, for 5 points" in caplog.text
    for cfg, alone in zip(swept, configs(tmp_path / "alone"), strict=True):
        run(alone)
        by_id = {row["id"]: row["prediction"] for row in rows_of(alone)}
        assert {row["id"]: row["prediction"] for row in rows_of(cfg)} == by_id, run_dir(cfg).name


def test_a_pool_with_room_for_one_row_answers_conversations_alike(tmp_path):
    overrides = ("turns=multi", *POINTS["adakv"])
    assert answered(tmp_path / "one", *overrides, "decode_memory=0.000001") == answered(tmp_path / "many", *overrides)
