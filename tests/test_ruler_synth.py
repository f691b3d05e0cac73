"""Tests for the locally generated RULER tasks (evaluate/benchmarks/ruler_synth.py).

Two tokenizers are used. ``tiny_tokenizer`` (conftest) is byte-level: one token per byte, about 4x more
tokens than a real BPE tokenizer. That makes two RULER rules infeasible with it, exactly as they would be in
RULER itself: vt's in-context example has a fixed 500-token budget that its template alone nearly fills, and
cwe's 40-word few-shot example plus 10 words x 30 repetitions exceed 4096 tokens. For vt and for cwe at 4096
the tests use ``word_tokenizer``, one token per word or punctuation run, which is closer to real token counts.
"""

import math
import random
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from evaluate.benchmarks import Sample
from evaluate.benchmarks.ruler_synth import (
    TASKS,
    RulerSynth,
    _CommonWords,
    _riemann_zeta,
    _SortedAdjectiveNounPairs,
    _task_configs,
    generate_task,
    split_prompt,
)

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NIAH_WORD_KEY = r"[^\n]+-[^\n]+"  # adjective-noun; some words contain spaces ("ad hoc", "contact lens")
UUID4 = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
FAMILY_MAX_NEW_TOKENS = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50}


@pytest.fixture(scope="module")
def word_tokenizer() -> PreTrainedTokenizerFast:
    """One token per word or punctuation run: realistic token counts without a download."""
    backend = Tokenizer(models.WordLevel(vocab={"[UNK]": 0}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


def tokenizer_for(task: str, max_seq_length: int, request) -> PreTrainedTokenizerFast:
    if task == "vt" or (task == "cwe" and max_seq_length >= 4096):
        return request.getfixturevalue("word_tokenizer")
    return request.getfixturevalue("tiny_tokenizer")


def full_prompt(sample: Sample) -> str:
    # The question keeps its trailing space, so plain concatenation restores RULER's prompt.
    return sample.context + sample.question + sample.answer_prefix


def num_tokens(tokenizer, text: str) -> int:
    return len(tokenizer.tokenize(text))


def numbered_words(text: str) -> list[str]:
    """'1. a 2. b c 3. d' -> ['a', 'b c', 'd'], checking the numbering runs 1, 2, 3, ..."""
    parts = re.split(r"(?:^| )(\d+)\. ", text)
    assert parts[0] == ""
    numbers, words = parts[1::2], parts[2::2]
    assert [int(n) for n in numbers] == list(range(1, len(numbers) + 1))
    return words


# ---------------------------------------------------------------------------------------------------------------
# Determinism
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", TASKS)
def test_deterministic_per_seed_and_prefix_stable(task, request):
    tokenizer = tokenizer_for(task, 2048, request)
    # Disturbing the global generators must not matter: the module only uses its own instances.
    saved = random.getstate(), np.random.get_state()
    try:
        random.seed(0)
        np.random.seed(0)
        first = generate_task(task, tokenizer, 5, max_seq_length=2048, seed=42)
        random.random()
        np.random.rand()
        again = generate_task(task, tokenizer, 5, max_seq_length=2048, seed=42)
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
    fewer = generate_task(task, tokenizer, 2, max_seq_length=2048, seed=42)
    other_seed = generate_task(task, tokenizer, 5, max_seq_length=2048, seed=7)

    assert first == again
    assert fewer == first[:2]
    assert [s.id for s in first] == [f"{task}-{i}" for i in range(5)]
    assert all(s.task == task for s in first)
    assert [full_prompt(s) for s in other_seed] != [full_prompt(s) for s in first]
    # Samples within a run differ too: each is drawn afresh.
    assert len({full_prompt(s) for s in first}) == 5


# ---------------------------------------------------------------------------------------------------------------
# Fitting to max_seq_length
# ---------------------------------------------------------------------------------------------------------------


def fitting_unit_and_step(task: str, sample: Sample, tokenizer, max_seq_length: int) -> tuple[int, int, int]:
    """(tokens of one haystack unit, RULER's step in units, extra slack in tokens) for the closeness bound.

    RULER binary-searches the largest size (in units) whose drawn prompt fits, which is exact to one unit, then
    shrinks a sample by one step when its own random content is longer. So a sample falls short of
    max_seq_length by less than (step + 1) units. cwe's content also swings with its 10 common words, each
    repeated 30 (or 6) times, so its slack adds that swing: repeats x 10 x (longest - shortest list item).
    fwe grows its word count in steps from below, so it is exact to one step.
    """
    small = max_seq_length < 4096
    if task == "niah_single_1":
        return num_tokens(tokenizer, NOISE + "\n"), 5 if small else 25, 0
    if task.startswith("niah"):
        lines = sample.context.split("\n")[1:-1]
        return max(num_tokens(tokenizer, line + "\n") for line in lines), 5 if small else 25, 0
    if task == "vt":
        return num_tokens(tokenizer, NOISE + "\n"), 5 if small else 10, 0
    if task == "cwe":
        items = [f"{i + 1}. {w} " for i, w in enumerate(numbered_words(sample.context.split("\n")[-2]))]
        item_tokens = [num_tokens(tokenizer, item) for item in items]
        uncommon_repeats, common_repeats = (1, 6) if small else (3, 30)
        swing = common_repeats * 10 * (max(item_tokens) - min(item_tokens))
        return uncommon_repeats * max(item_tokens), 10, swing
    if task == "fwe":
        words = sample.context.split("coded words. ", 1)[1].split()
        return max(num_tokens(tokenizer, w + " ") for w in words), (max_seq_length - 50) // 32, 0
    raise AssertionError(task)


def haystack_size(task: str, sample: Sample) -> int | None:
    """The size RULER searched over, read back from the text (fwe's word count is not recoverable)."""
    if task in ("niah_single_1", "vt"):
        # vt's in-context example has noise lines too; only count the task's own text after it.
        own = sample.context.split("\n\nMemorize and track")[-1]
        return own.split("\n").count(NOISE)
    if task.startswith("niah"):
        return len(sample.context.split("\n")[1:-1]) - 1
    if task == "cwe":
        return len(set(numbered_words(sample.context.split("\n")[-2])))
    return None


@pytest.mark.parametrize(
    "task, max_seq_length",
    [(task, 2048) for task in TASKS] + [(task, 4096) for task in TASKS],
)
def test_fits_max_seq_length_and_is_close_to_it(task, max_seq_length, request):
    tokenizer = tokenizer_for(task, max_seq_length, request)
    samples = generate_task(task, tokenizer, 8, max_seq_length=max_seq_length)
    closest = max_seq_length
    sizes = [haystack_size(task, sample) for sample in samples]
    for sample in samples:
        total = num_tokens(tokenizer, full_prompt(sample)) + sample.max_new_tokens
        assert total <= max_seq_length
        unit, step, slack = fitting_unit_and_step(task, sample, tokenizer, max_seq_length)
        assert max_seq_length - total < (step + 1) * unit + slack, (task, total, unit, step, slack)
        # The size search is exact to one unit (to one step for fwe), so some sample lands that close.
        precision = (step + 1) * unit if task == "fwe" else 2 * unit
        closest = min(closest, (max_seq_length - total) / precision)
    assert closest < 1
    # A sample is drawn at the searched size or shrunk by whole steps (25 noise lines at 4096 for niah, ...).
    step = fitting_unit_and_step(task, samples[0], tokenizer, max_seq_length)[1]
    if sizes[0] is not None:
        assert all((size - sizes[0]) % step == 0 for size in sizes), sizes
    if (task, max_seq_length) == ("niah_single_1", 4096):
        assert len(set(sizes)) > 1, "seed 42 draws a sample that has to shrink by one step"


def test_infeasible_budget_raises_instead_of_looping(tiny_tokenizer):
    # RULER would redraw forever; with one token per byte, vt's 500-token example cannot fit.
    with pytest.raises(ValueError, match="500-token"):
        generate_task("vt", tiny_tokenizer, 1)
    with pytest.raises(ValueError, match="smallest haystack"):
        generate_task("niah_multikey_3", tiny_tokenizer, 1, max_seq_length=512)


# ---------------------------------------------------------------------------------------------------------------
# Formats
# ---------------------------------------------------------------------------------------------------------------


def test_niah_single_1_format(tiny_tokenizer):
    for sample in generate_task("niah_single_1", tiny_tokenizer, 3, max_seq_length=2048):
        assert sample.max_new_tokens == 128
        (value,) = sample.answers
        assert re.fullmatch(r"[1-9]\d{6}", value)
        key = re.fullmatch(
            r"What is the special magic number for (.+) mentioned in the provided text\? ", sample.question
        ).group(1)
        assert re.fullmatch(NIAH_WORD_KEY, key)
        assert sample.answer_prefix == f"The special magic number for {key} mentioned in the provided text is"
        # The singular rewrite applies to the instruction too.
        head = (
            "A special magic number is hidden within the following text. Make sure to memorize it. "
            "I will quiz you about the number afterwards.\n"
        )
        assert sample.context.startswith(head)
        assert sample.context.endswith("\n")
        lines = sample.context[len(head) : -1].split("\n")
        # The needle keeps the plural type word; everything else is the noise sentence.
        needle = f"One of the special magic numbers for {key} is: {value}."
        assert [line for line in lines if line != NOISE] == [needle]
        assert lines.count(NOISE) == len(lines) - 1 >= 5


@pytest.mark.parametrize("task", ["niah_multikey_2", "niah_multikey_3"])
def test_niah_multikey_format(task, tiny_tokenizer):
    kind = "number" if task == "niah_multikey_2" else "uuid"
    key_pattern, value_pattern = (NIAH_WORD_KEY, r"[1-9]\d{6}") if kind == "number" else (UUID4, UUID4)
    for sample in generate_task(task, tiny_tokenizer, 3, max_seq_length=2048):
        assert sample.max_new_tokens == 128
        (value,) = sample.answers
        key = re.fullmatch(
            rf"What is the special magic {kind} for (.+) mentioned in the provided text\? ", sample.question
        ).group(1)
        assert sample.answer_prefix == f"The special magic {kind} for {key} mentioned in the provided text is"
        head = (
            f"A special magic {kind} is hidden within the following text. Make sure to memorize it. "
            f"I will quiz you about the {kind} afterwards.\n"
        )
        assert sample.context.startswith(head)
        lines = sample.context[len(head) : -1].split("\n")
        # The haystack is distractor needles: every line is a needle with a key and value of the task's types.
        parsed = [re.fullmatch(rf"One of the special magic {kind}s for (.+) is: (.+)\.", line) for line in lines]
        assert all(parsed) and len(parsed) > 5
        for match in parsed:
            assert re.fullmatch(key_pattern, match.group(1)) and re.fullmatch(value_pattern, match.group(2))
        assert (key, value) in [m.groups() for m in parsed]


def test_vt_format(word_tokenizer):
    for sample in generate_task("vt", word_tokenizer, 3, max_seq_length=2048):
        assert sample.max_new_tokens == 30
        names = sample.answers
        assert len(names) == 5 and len(set(names)) == 5
        assert all(re.fullmatch(r"[A-Z]{5}", name) for name in names)
        value = re.fullmatch(
            r"Question: Find all variables that are assigned the value (\d{5}) in the text above\. ", sample.question
        ).group(1)
        assert sample.answer_prefix == (
            "Answer: According to the chain(s) of variable assignment in the text above, "
            f"5 variables are assigned the value {value}, they are: "
        )
        # The context is the solved in-context example, a blank line, then the task's own instruction and text.
        instruction = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
        assert sample.context.startswith(instruction)
        example, own = sample.context.split("\n\n" + instruction)
        assert sample.context.count(instruction) == 2

        # The task's chain is in order, first line carrying the value, each hop pointing at the previous name.
        own_lines = own.split("\n")
        assert own_lines[-1] == ""
        chain = [line for line in own_lines[:-1] if line != NOISE]
        assert chain == [f"VAR {names[0]} = {value}"] + [f"VAR {names[i + 1]} = VAR {names[i]} " for i in range(4)]

        # The example: 3-letter names, a re-randomised value (not RULER's placeholder 12345), its own answer.
        icl_value = re.search(r"assigned the value (\d{5}) in the text above", example).group(1)
        assert icl_value != "12345" and "12345" not in example
        icl_names = re.search(r"they are:  ([A-Z]{3}(?: [A-Z]{3}){4})$", example).group(1).split()
        icl_chain = [line for line in example.split("\n") if line.startswith("VAR ")]
        assert icl_chain == [f"VAR {icl_names[0]} = {icl_value}"] + [
            f"VAR {icl_names[i + 1]} = VAR {icl_names[i]} " for i in range(4)
        ]


@pytest.mark.parametrize(
    "max_seq_length, example_shape, list_repeats",
    [(2048, (20, 3, 1), (6, 1)), (4096, (40, 10, 3), (30, 3))],  # RULER's few-shot rule switches at 4096
)
def test_cwe_format(max_seq_length, example_shape, list_repeats, word_tokenizer):
    instruction = (
        "Below is a numbered list of words. In these words, some appear more often than others. "
        "Memorize the ones that appear most often."
    )
    question = "Question: What are the 10 most common words in the above list? "
    prefix = "Answer: The top 10 words that appear most often in the list are:"
    example_positions = []
    for sample in generate_task("cwe", word_tokenizer, 3, max_seq_length=max_seq_length):
        assert sample.max_new_tokens == 120
        assert sample.question == question and sample.answer_prefix == prefix
        example_instruction, example_list, example_qa, own_instruction, own_list, end = sample.context.split("\n")
        assert end == ""

        # One solved example: its words, the 10 common ones repeated more, then the question answered in order.
        example_size, example_common, example_uncommon = example_shape
        assert example_instruction == instruction
        assert example_qa.startswith(question + prefix + " ")
        counts = Counter(numbered_words(example_list))
        top = numbered_words(example_qa[len(question + prefix + " ") :])
        assert len(counts) == example_size and len(top) == 10
        assert all(counts[w] == example_common for w in top)
        assert sorted(counts.values()) == [example_uncommon] * (example_size - 10) + [example_common] * 10

        # RULER shuffles each list with a fresh generator seeded with the run seed, so every same-sized list gets
        # the same permutation: the common words of the example sit at the same positions in every sample.
        example_positions.append([i for i, w in enumerate(numbered_words(example_list)) if w in top])

        # The task: the answers are exactly the 10 words repeated most, all others far fewer times.
        common, uncommon = list_repeats
        assert own_instruction == instruction
        counts = Counter(numbered_words(own_list))
        assert len(sample.answers) == 10 and len(set(sample.answers)) == 10
        assert {w: counts[w] for w in sample.answers} == dict.fromkeys(sample.answers, common)
        assert all(n == uncommon for w, n in counts.items() if w not in sample.answers)
        assert len(counts) > 10
    assert example_positions[0] == example_positions[1] == example_positions[2]


def test_fwe_format(tiny_tokenizer):
    head = (
        "Read the following coded text and track the frequency of each coded word. "
        "Find the three most frequently appeared coded words. "
    )
    rank_sequences = []
    for sample in generate_task("fwe", tiny_tokenizer, 3, max_seq_length=2048):
        assert sample.max_new_tokens == 50
        assert sample.question == (
            "Question: Do not provide any explanation. Please ignore the dots '....'. "
            "What are the three most frequently appeared words in the above coded text? "
        )
        assert sample.answer_prefix == (
            "Answer: According to the coded text above, the three most frequently appeared words are:"
        )
        assert sample.context.startswith(head) and sample.context.endswith("\n")
        words = sample.context[len(head) : -1].split(" ")
        ranked = Counter(words).most_common()
        # Rank 1 is the "..." noise; the answers are ranks 2-4, with strictly decreasing counts (zeta, alpha 2).
        assert ranked[0][0] == "..."
        assert sample.answers == [word for word, _ in ranked[1:4]]
        assert ranked[0][1] > ranked[1][1] > ranked[2][1] > ranked[3][1] > ranked[4][1]
        assert all(re.fullmatch(r"[a-z]{6}", w) for w in set(words) - {"..."})
        # Counts follow int(num_words * k^-2 / zeta(2)) for some num_words at least the number of words shown
        # (truncation and the ranks beyond the vocabulary lose a few).
        counts = [count for _, count in ranked]
        zeta2 = math.pi**2 / 6
        word_counts = [
            n
            for n in range(len(words), 2 * len(words))
            if counts == [c for c in (int(n * k**-2.0 / zeta2) for k in range(1, len(words))) if c > 0]
        ]
        assert word_counts
        # That word count comes from growing budget // 6 in steps of budget // 32 (budget = 2048 - 50).
        budget = 2048 - 50
        assert any((n - budget // 6) % (budget // 32) == 0 for n in word_counts), word_counts
        # Each sample draws a new vocabulary, but the words are shuffled with a fresh generator seeded with the
        # run seed, so the sequence of ranks is the same whenever the word count is.
        rank_of = {word: rank for rank, (word, _) in enumerate(ranked)}
        rank_sequences.append([rank_of[w] for w in words])
    assert rank_sequences[0] == rank_sequences[1] == rank_sequences[2]


@pytest.mark.parametrize("task", TASKS)
def test_split_follows_kvpress_rule(task, request):
    tokenizer = tokenizer_for(task, 2048, request)
    (sample,) = generate_task(task, tokenizer, 1, max_seq_length=2048)
    family = task.split("_")[0]
    assert sample.max_new_tokens == FAMILY_MAX_NEW_TOKENS[family]
    assert sample.question.endswith(" ") and not sample.answer_prefix.startswith(" ")
    assert sample.answer_prefix.startswith("The special magic" if family == "niah" else "Answer:")
    # Re-splitting the full prompt gives the same fields, and the answer prefix is RULER's for the family.
    assert split_prompt(task, full_prompt(sample)) == (sample.context, sample.question, sample.answer_prefix)
    assert "\n" not in sample.question + sample.answer_prefix


# ---------------------------------------------------------------------------------------------------------------
# Benchmark object
# ---------------------------------------------------------------------------------------------------------------


def test_ruler_synth_load_and_score(tiny_tokenizer):
    bench = RulerSynth(tasks=["niah_single_1", "fwe"], max_seq_length=2048, num_samples=3)
    assert [s.id for s in bench.load(tiny_tokenizer, limit=2)] == [
        "niah_single_1-0",
        "niah_single_1-1",
        "fwe-0",
        "fwe-1",
    ]
    samples = bench.load(tiny_tokenizer, limit=10)  # capped by num_samples
    assert len(samples) == 6
    assert samples[:2] == bench.load(tiny_tokenizer, limit=2)[:2]

    rows = [{"task": s.task, "answers": s.answers, "prediction": " ".join(s.answers)} for s in samples]
    rows[0]["prediction"] = "no idea"
    metrics = bench.score(rows)
    assert metrics["benchmark"] == "ruler_synth"
    assert metrics["tasks"]["fwe"]["score"] == 100.0
    assert metrics["tasks"]["niah_single_1"]["score"] == pytest.approx(66.67)


def test_ruler_synth_defaults_and_unknown_tasks(tiny_tokenizer):
    bench = RulerSynth()
    assert TASKS == ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "vt", "cwe", "fwe")
    assert (bench.tasks, bench.max_seq_length, bench.seed, bench.num_samples, bench.name) == (
        list(TASKS),
        4096,
        42,
        500,
        "ruler_synth",
    )
    with pytest.raises(ValueError, match="niah_single_1, niah_multikey_2, niah_multikey_3, vt, cwe, fwe"):
        RulerSynth(tasks=["niah_single_1", "qa_1"]).load(tiny_tokenizer, limit=1)
    with pytest.raises(ValueError, match="valid tasks"):
        generate_task("niah_single_2", tiny_tokenizer, 1)
    assert generate_task("fwe", tiny_tokenizer, 0) == []


# ---------------------------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------------------------


def test_sorted_pairs_match_brute_force():
    # Hyphenated and spaced adjectives whose runs interleave with others, duplicates, odd nouns.
    adjectives = ["blue", "blue-eyed", "blue-eyed-x", "bluest", "ad hoc", "ad", "old", "old-fashioned", "blue", "a"]
    nouns = ["eyed-cat", "cat", "x-ray", "contact lens", "eyed", "ant", "jalapeño", "cat", "Zed", "'til"]
    expected = sorted({f"{a}-{n}" for a in adjectives for n in nouns})
    pairs = _SortedAdjectiveNounPairs(adjectives, nouns)
    assert len(pairs) == len(expected)
    assert list(pairs) == expected
    with pytest.raises(IndexError):
        pairs[len(expected)]
    # random.choice only needs len() and indexing, so it draws the same element as from the real list.
    assert [random.Random(3).choice(pairs) for _ in range(5)] == [random.Random(3).choice(expected) for _ in range(5)]


def test_riemann_zeta():
    assert _riemann_zeta(2.0) == 1.6449340668482264  # scipy.special.zeta(2.0), bit for bit
    assert _riemann_zeta(3.0) == pytest.approx(1.2020569031595942, rel=1e-13)
    assert _riemann_zeta(1.5) == pytest.approx(2.612375348685488, rel=1e-13)


def test_cwe_pool_too_small_raises(tiny_tokenizer):
    generator = _CommonWords(tiny_tokenizer, 4096, 42, dict(_task_configs()["cwe"]["args"]))
    with pytest.raises(ValueError, match="english_words"):
        generator._word_list(len(generator.pool) + 1, 3, 1)


def test_bundled_reference_data_is_a_byte_exact_copy():
    bundled = Path(__file__).resolve().parents[1] / "evaluate" / "benchmarks" / "ruler_data"
    reference = Path(__file__).resolve().parents[2] / "shared" / "reference" / "ruler"
    if not reference.is_dir():
        pytest.skip("shared/reference/ruler is not available")
    for name in ("templates.json", "synthetic.yaml"):
        assert (bundled / name).read_bytes() == (reference / name).read_bytes()
