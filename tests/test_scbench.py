"""SCBench: rows in SCBench's format become conversations of turns with SCBench's prompts, from local files and the
hub; SCBench's metrics on hand-made predictions; refusals in one line.

Fixtures: tests/fixtures/scbench/{task}.jsonl are rows in the columns of the hub dataset microsoft/SCBench (id, the
context, multi_turns of {input, answer}, choice_eng's options, summary_with_needles's turn task), two short
conversations per scored task; scbench_vt's rows hold their context in ``input``, as the hub's do.
"""

import json
import socket
import time
import urllib.request
from pathlib import Path

import datasets
import pytest
from hydra.utils import instantiate

from evaluate.benchmarks.scbench import TASKS, SCBench, score_predictions
from evaluate.benchmarks.sources import no_connection
from evaluate.errors import ConfigError
from evaluate.score.rescore import main as score_main
from tests.support import compose_config

ROWS = Path(__file__).resolve().parent / "fixtures" / "scbench"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def by_id(samples) -> dict:
    return {sample.id: sample for sample in samples}


# ---------------------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------------------


def test_each_row_is_a_conversation_of_its_turns_in_order(tiny_tokenizer):
    samples = SCBench(path=str(ROWS), max_turns=None).load(tiny_tokenizer)
    rows = {task: read_jsonl(ROWS / f"{task}.jsonl") for task in TASKS}
    assert len(samples) == sum(len(row["multi_turns"]) for task_rows in rows.values() for row in task_rows) == 44
    assert [sample.task for sample in samples] == sorted((s.task for s in samples), key=TASKS.index)
    conversations: dict[str, list] = {}
    for sample in samples:
        conversations.setdefault(sample.conversation, []).append(sample)
    assert list(conversations) == [f"{task}-{row['id']}" for task in TASKS for row in rows[task]]
    for name, turns in conversations.items():
        assert [sample.turn for sample in turns] == list(range(len(turns)))
        assert [sample.id for sample in turns] == [f"{name}-{turn}" for turn in range(len(turns))]
        assert len({sample.context for sample in turns}) == 1, name  # one context, shared exactly
        assert all(sample.chat_template for sample in turns)


def test_prompts_answers_and_lengths_are_scbench_s(tiny_tokenizer):
    samples = by_id(SCBench(path=str(ROWS)).load(tiny_tokenizer))

    kv = [samples[f"scbench_kv-0-{turn}"] for turn in range(3)]
    assert kv[0].context == (
        "Extract the value corresponding to the specified key in the JSON object below.\n\nJSON data:\n"
        '{"4b2c-91aa": "77e1-0d3f", "a0f3-5521": "c9d8-e712", "19be-7c04": "3f6a-b2e9"}'
    )
    # The first turn continues the first user message; a follow-up is a user message of its own.
    assert kv[0].question == '\n\nKey: "a0f3-5521"\nThe value associated with the specified key is: '
    assert kv[1].question == 'Key: "19be-7c04"\nThe value associated with the specified key is: '
    assert [(s.answers, s.max_new_tokens, s.answer_prefix) for s in kv] == [
        (["c9d8-e712"], 150, ""),
        (["3f6a-b2e9"], 150, ""),
        (["77e1-0d3f"], 150, ""),
    ]

    first, second = samples["scbench_choice_eng-7-0"], samples["scbench_choice_eng-7-1"]
    assert (
        first.context
        == "Read the book and answer the question.\n\n" + read_jsonl(ROWS / "scbench_choice_eng.jsonl")[0]["context"]
    )
    assert first.question == (
        "\n\nQuestion: What fruit grew in the orchard?\nA. Apples\nB. Pears\nC. Plums\nD. Cherries\n\n"
        "The the correct answer is"
    )
    assert second.question == (
        "Question: Where were the pears sold?\nA. Hamburg\nB. Lubeck\nC. Kiel\nD. Bremen\n\nThe the correct answer is"
    )
    assert (first.answers, second.answers, first.max_new_tokens) == (["Pears", "B"], ["Bremen", "D"], 40)
    assert first.extra == {"label": ["Pears", "B"]}

    qa = samples["scbench_qa_eng-12-1"]
    assert qa.context.startswith("Read the book and answer the question. Be very concise in your answer.\n\nMara ")
    assert (qa.question, qa.answers, qa.extra) == (
        "Question: Where did the ferry sail to?\nAnswer:",
        ["Port Ellery"],
        {"label": ["Port Ellery"]},
    )
    chinese = [samples["scbench_qa_chn-5-0"], samples["scbench_qa_chn-5-1"]]
    assert chinese[0].context.startswith("阅读以下书籍然后回答问题。\n\n李白")
    assert [s.question for s in chinese] == [
        "\n\n问题：李白出生在哪里？\n答案：",
        "问题：《静夜思》的作者是谁？\n答案：",
    ]

    # scbench_mf: the numbers as Python writes the list, after the first turn's "What is ...?".
    mf = [samples[f"scbench_mf-9-{turn}"] for turn in range(2)]
    assert mf[0].context == "What is the largest number of the list?\n\n[12, 7, 93, 41, 5]"
    assert mf[0].question == "\n\nThe largest number of the list is: "
    assert mf[1].question == "What is the smallest number of the list?\n\nThe smallest number of the list is: "
    assert [(s.answers, s.extra, s.max_new_tokens) for s in mf] == [
        (["93"], {"label": 93}, 5),
        (["5"], {"label": 5}, 5),
    ]

    vt = samples["scbench_vt-0-0"]
    assert vt.context == read_jsonl(ROWS / "scbench_vt.jsonl")[0]["input"]  # its rows hold the context in input
    assert (vt.answers, vt.max_new_tokens) == (["QPKLM", "RTSZA", "HUYEB"], 30)

    summary = [samples["scbench_summary-4-0"], samples["scbench_summary-4-1"]]
    assert [(s.question, s.answer_prefix, s.max_new_tokens) for s in summary] == [
        ("\n\nSummarize the paper above in a few sentences.", "", 200),
        ("Now summarize its experiments.", "This paper", 200),
    ]
    assert samples["scbench_many_shot-2-1"].max_new_tokens == 10
    assert samples["scbench_prefix_suffix-3-0"].max_new_tokens == 150
    needles = [samples[f"scbench_summary_with_needles-1-{turn}"] for turn in range(3)]
    assert [(s.max_new_tokens, s.extra["subtask"]) for s in needles] == [
        (800, "scbench_summary"),
        (15, "scbench_passkey"),
        (800, "scbench_summary"),
    ]


def test_the_reference_answer_is_the_one_scbench_writes_into_the_conversation(tiny_tokenizer):
    benchmark = SCBench(path=str(ROWS))
    samples = by_id(benchmark.load(tiny_tokenizer))
    assert benchmark.reference_answer(samples["scbench_choice_eng-7-0"]) == "Pears"
    assert benchmark.reference_answer(samples["scbench_qa_eng-12-0"]) == "Mara"
    assert benchmark.reference_answer(samples["scbench_vt-0-0"]) == "['QPKLM', 'RTSZA', 'HUYEB']"
    assert benchmark.reference_answer(samples["scbench_mf-9-0"]) == "93"


def test_max_turns_and_limit_never_cut_a_conversation_short_of_its_first_turns(tiny_tokenizer):
    default = SCBench(path=str(ROWS)).load(tiny_tokenizer)  # max_turns=5: every fixture turn
    assert len(default) == len(SCBench(path=str(ROWS), max_turns=None).load(tiny_tokenizer))
    two = SCBench(path=str(ROWS), max_turns=2).load(tiny_tokenizer)
    assert len(two) == 44 - 4  # kv 0, qa_eng 12, mf 10 and summary_with_needles 1 lose their third turn
    assert max(sample.turn for sample in two) == 1
    first = SCBench(path=str(ROWS), tasks=["scbench_mf", "scbench_kv"]).load(tiny_tokenizer, limit=1)
    assert [sample.id for sample in first] == [
        "scbench_mf-9-0",
        "scbench_mf-9-1",
        "scbench_kv-0-0",
        "scbench_kv-0-1",
        "scbench_kv-0-2",
    ]


def test_the_hub_and_a_hub_snapshot_give_the_same_samples(monkeypatch, tmp_path, tiny_tokenizer):
    expected = SCBench(path=str(ROWS)).load(tiny_tokenizer)
    rows = {task: read_jsonl(ROWS / f"{task}.jsonl") for task in TASKS}
    for task, task_rows in rows.items():
        datasets.Dataset.from_list(task_rows).to_parquet(str(tmp_path / task / "test-00000-of-00001.parquet"))
    assert SCBench(path=str(tmp_path)).load(tiny_tokenizer) == expected

    calls = []

    def hub(path, name=None, data_dir=None, split=None):
        calls.append((path, name, data_dir, split))
        return datasets.Dataset.from_list(rows[name])

    monkeypatch.setattr(datasets, "load_dataset", hub)
    assert SCBench().load(tiny_tokenizer) == expected
    # By config name, as SCBench's run_scbench.py loads each task.
    assert calls == [("microsoft/SCBench", task, None, "test") for task in TASKS]


def test_an_unreachable_hub_names_the_config_and_the_local_alternative(monkeypatch, tiny_tokenizer):
    def offline(path, name=None, data_dir=None, split=None):
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ConfigError, match=r"microsoft/SCBench \(config scbench_qa_eng\).*benchmark\.path=DIR"):
        SCBench(tasks=["scbench_qa_eng"]).load(tiny_tokenizer)


SNAPSHOT = (
    "benchmark.path=DIR, with SCBench's hub snapshot (huggingface-cli download microsoft/SCBench --repo-type dataset "
    "--local-dir DIR): its {task}/ folders of parquet files, or its data/ folder's {task}.jsonl files"
)


@pytest.fixture
def no_network(monkeypatch):
    """Every connection fails as a machine without network fails it; returns the hosts tried."""
    tried = []

    def refused(address, *args, **kwargs):
        tried.append(address)
        raise OSError(-2, "Name or service not known")

    monkeypatch.setattr(socket, "create_connection", refused)
    monkeypatch.setattr(socket.socket, "connect", lambda self, address: refused(address))
    monkeypatch.setattr(urllib.request, "getproxies", dict)
    no_connection.cache_clear()
    yield tried
    no_connection.cache_clear()


def test_offline_the_refusal_tries_no_connection_and_names_the_snapshot(no_network, tiny_tokenizer):
    # The real datasets under HF_HUB_OFFLINE/HF_DATASETS_OFFLINE (tests/conftest.py): its cache alone, no retry.
    started = time.monotonic()
    with pytest.raises(ConfigError) as refused:
        SCBench(tasks=["scbench_kv"]).load(tiny_tokenizer)
    assert time.monotonic() - started < 10 and no_network == []
    message = str(refused.value)
    assert message.startswith("cannot load microsoft/SCBench (config scbench_kv) from the Hugging Face hub (")
    assert message.endswith(f"; download it where the hub is reachable and pass {SNAPSHOT}")


def test_without_network_the_hub_is_not_retried(no_network, monkeypatch, tiny_tokenizer):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)  # online mode, on a machine with no network

    def retried(*args, **kwargs):
        raise AssertionError("the hub client was asked, and would retry for half a minute")

    monkeypatch.setattr(datasets, "load_dataset", retried)
    with pytest.raises(ConfigError) as refused:
        SCBench(tasks=["scbench_kv"]).load(tiny_tokenizer)
    assert no_network == [("huggingface.co", 443)]  # one connection tried, and no hub request
    assert str(refused.value) == (
        "cannot reach the Hugging Face hub for microsoft/SCBench (config scbench_kv) (huggingface.co: [Errno -2] "
        "Name or service not known); set HF_DATASETS_OFFLINE=1 to read it from the datasets cache, or download it "
        f"where the hub is reachable and pass {SNAPSHOT}"
    )


def test_the_config_composes_and_instantiates(tmp_path):
    benchmark = instantiate(compose_config(tmp_path, "benchmark=scbench").benchmark)
    assert isinstance(benchmark, SCBench)
    assert (benchmark.name, benchmark.dataset, benchmark.split, benchmark.max_turns, benchmark.tasks) == (
        "scbench",
        "microsoft/SCBench",
        "test",
        5,
        None,
    )


# ---------------------------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------------------------


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("task", ["scbench_repoqa", "scbench_repoqa_and_kv"])
def test_repoqa_tasks_are_refused_naming_the_supported_ones(task, tiny_tokenizer):
    with pytest.raises(ConfigError) as refused:
        SCBench(path=str(ROWS), tasks=["scbench_kv", task]).load(tiny_tokenizer)
    message = one_line(refused)
    assert message.startswith(f"SCBench's {task} metric needs a code-similarity judge")
    assert message.endswith(f"choose from {', '.join(TASKS)}")


def test_unknown_tasks_and_bad_max_turns_are_refused(tiny_tokenizer):
    with pytest.raises(ConfigError) as refused:
        SCBench(path=str(ROWS), tasks=["scbench_passkey"]).load(tiny_tokenizer)
    assert one_line(refused).startswith("unknown SCBench task(s) scbench_passkey; choose from scbench_kv, ")
    for bad in (0, -1, "5"):
        with pytest.raises(ConfigError) as refused:
            SCBench(path=str(ROWS), max_turns=bad).load(tiny_tokenizer)
        assert one_line(refused) == f"benchmark.max_turns={bad!r}; give a positive integer, or null for all"


@pytest.mark.parametrize(
    ("task", "change", "field"),
    [
        ("scbench_choice_eng", lambda row: row["multi_turns"][1].update(answer="Paris"), "multi_turns"),
        ("scbench_mf", lambda row: row["multi_turns"][0].update(input="Find the maximum."), "multi_turns"),
        ("scbench_mf", lambda row: row["multi_turns"][0].update(answer="93"), "multi_turns"),
        ("scbench_summary_with_needles", lambda row: row["multi_turns"][0].update(task="passkey"), "multi_turns"),
        ("scbench_kv", lambda row: row["multi_turns"][0].update(answer=""), "multi_turns"),
        ("scbench_kv", lambda row: row.update(multi_turns=[]), "multi_turns"),
        ("scbench_qa_eng", lambda row: row.update(context=None), "context"),
    ],
)
def test_a_bad_row_is_refused_with_its_place_and_field(task, change, field, tmp_path, tiny_tokenizer):
    rows = read_jsonl(ROWS / f"{task}.jsonl")
    change(rows[0])
    (tmp_path / f"{task}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    with pytest.raises(ConfigError) as refused:
        SCBench(path=str(tmp_path), tasks=[task]).load(tiny_tokenizer)
    assert one_line(refused).startswith(f"{tmp_path / task}.jsonl:1: field {field!r} is ")


def test_a_row_without_its_context_is_refused(tmp_path, tiny_tokenizer):
    row = read_jsonl(ROWS / "scbench_kv.jsonl")[0]
    del row["context"]
    (tmp_path / "scbench_kv.jsonl").write_text(json.dumps(row) + "\n", encoding="utf-8")
    with pytest.raises(ConfigError) as refused:
        SCBench(path=str(tmp_path), tasks=["scbench_kv"]).load(tiny_tokenizer)
    assert "scbench_kv.jsonl:1: the row lacks the column(s) context" in one_line(refused)


# ---------------------------------------------------------------------------------------------------------------
# Metrics, hand-computed
# ---------------------------------------------------------------------------------------------------------------


def scored(task: str, turn: int, label, prediction: str, **extra) -> dict:
    return {"task": task, "turn": turn, "label": label, "answers": ["-"], "prediction": prediction, **extra}


PREDICTIONS = [
    # kv: the value anywhere in the prediction, case included.
    scored("scbench_kv", 0, "c9d8-e712", "The value is c9d8-e712."),
    scored("scbench_kv", 1, "3f6a-b2e9", "3F6A-B2E9"),
    # vt: 2 of 3 variables, case ignored, rounded to 0.67.
    scored("scbench_vt", 0, ["QPKLM", "RTSZA", "HUYEB"], "qpklm and RTSZA"),
    # qa_eng: the answer, upper-cased, inside the prediction.
    scored("scbench_qa_eng", 0, ["Port Ellery"], " port ellery, by ferry"),
    scored("scbench_qa_eng", 1, ["Port Ellery"], "Ellery"),
    # many_shot: SCBench iterates the string "(A)": the "(" of a wrong "(B)" scores.
    scored("scbench_many_shot", 0, "(A)", "(B)"),
    scored("scbench_many_shot", 1, "(A)", "B"),
    # qa_chn: each character of the answer is a reference: the exact answer scores F1 2*(1/3)/(4/3) = 0.5, one
    # of its characters alone 1.
    scored("scbench_qa_chn", 0, "碎叶城", "碎叶城"),
    scored("scbench_qa_chn", 1, "碎叶城", "城"),
    # choice_eng: a leading letter; the text after "answer is:"; else the first word that is a letter.
    scored("scbench_choice_eng", 0, ["Pears", "B"], "B. Pears"),
    scored("scbench_choice_eng", 0, ["Pears", "B"], "The answer is: Pears"),
    scored("scbench_choice_eng", 1, ["Bremen", "D"], "I think C"),
    # mf: the first number cut to an int (93.8 counts for 93); a one-item list label reads its item.
    scored("scbench_mf", 0, 93, "93.8 is the largest"),
    scored("scbench_mf", 1, 5, "It is 39"),
    scored("scbench_mf", 1, [5], "5"),
    # summary: ROUGE-Lsum F1. LCS 2 of 3 reference and 2 of 2 predicted tokens: F = 0.8. Lines are matched as a
    # summary: the two lines in the other order still score 1 (plain ROUGE-L would give 0.5).
    scored("scbench_summary", 0, "the cat sat", "The cat!"),
    scored("scbench_summary", 1, "a b\nc d", "c d\na b"),
    # summary_with_needles: summary turns as summary, passkey turns by the first run of digits.
    scored("scbench_summary_with_needles", 0, "the cat sat", "the cat", subtask="scbench_summary"),
    scored("scbench_summary_with_needles", 1, "48213", "The pass key is 48213.", subtask="scbench_passkey"),
    scored("scbench_summary_with_needles", 1, "48213", "", subtask="scbench_passkey"),
]


def test_scbench_s_metrics_on_hand_made_predictions():
    metrics = score_predictions(PREDICTIONS)
    tasks = metrics["tasks"]
    assert {task: (values["score"], values["turns"]) for task, values in tasks.items()} == {
        "scbench_kv": (50.0, {"0": 100.0, "1": 0.0}),
        "scbench_vt": (67.0, {"0": 67.0}),
        "scbench_qa_eng": (50.0, {"0": 100.0, "1": 0.0}),
        "scbench_qa_chn": (75.0, {"0": 50.0, "1": 100.0}),
        "scbench_choice_eng": (66.67, {"0": 100.0, "1": 0.0}),
        "scbench_many_shot": (50.0, {"0": 100.0, "1": 0.0}),
        "scbench_summary": (90.0, {"0": 80.0, "1": 100.0}),
        "scbench_mf": (66.67, {"0": 100.0, "1": 50.0}),
        "scbench_summary_with_needles": (65.0, {"0": 80.0, "1": 50.0}),
    }
    assert tasks["scbench_summary_with_needles"]["subtasks"] == {"scbench_passkey": 50.0, "scbench_summary": 80.0}
    assert [tasks[task]["metric"] for task in ("scbench_kv", "scbench_vt", "scbench_summary", "scbench_mf")] == [
        "substring",
        "string_match_all",
        "rougeLsum",
        "first_number_match",
    ]
    assert {task for task, values in tasks.items() if "note" in values} == {"scbench_many_shot", "scbench_qa_chn"}
    assert tasks["scbench_choice_eng"]["n"] == 3
    # The mean of the 9 task scores present.
    assert metrics["score"] == round((50 + 67 + 50 + 75 + 66.67 + 50 + 90 + 66.67 + 65) / 9, 2) == 64.48
    assert metrics["score_label"].endswith("(9 of 10)")


def test_scores_from_a_file_on_the_command_line(tmp_path, capsys):
    path = tmp_path / "predictions.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in PREDICTIONS), encoding="utf-8")
    score_main(["--benchmark", "scbench", str(path)])
    printed = json.loads(capsys.readouterr().out)
    assert (printed["benchmark"], printed["score"]) == ("scbench", 64.48)


def test_loaded_samples_carry_what_their_rows_are_scored_on(tiny_tokenizer):
    # A prediction row is the sample's identity and extra fields plus the prediction: answering each turn with its
    # references (choice_eng's letter first) scores every exact-match task in full.
    samples = SCBench(path=str(ROWS), tasks=["scbench_kv", "scbench_choice_eng", "scbench_mf", "scbench_vt"]).load(
        tiny_tokenizer
    )
    rows = [
        {"task": s.task, "turn": s.turn, "answers": s.answers, "prediction": " ".join(s.answers[::-1]), **s.extra}
        for s in samples
    ]
    metrics = score_predictions(rows)
    assert {task: values["score"] for task, values in metrics["tasks"].items()} == {
        "scbench_kv": 100.0,
        "scbench_vt": 100.0,
        "scbench_choice_eng": 100.0,
        "scbench_mf": 100.0,
    }


def test_an_unknown_task_is_refused_when_scoring():
    with pytest.raises(ValueError, match="unknown SCBench task 'scbench_repoqa'"):
        score_predictions([scored("scbench_repoqa", 0, "def f(): pass", "def f(): pass")])
