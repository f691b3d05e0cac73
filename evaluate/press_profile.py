"""Every fact the harness reads of a press, in one place: the one module that tests a press's classes.

kvpress's classes declare none of what the harness must know of them (whether ``compress`` writes into its inputs,
whether scores can be shared, which attention it needs, what it downloads), so :data:`TRAITS` declares it, one row
per class; adding a press or a scorer that needs one means one row. Around the table, each question the harness asks
of a press object is answered here and nowhere else: its prefill and decoding parts, the knobs kvpress's runner sets
on it, whether and how it keeps a token budget, its tensor stand-in, Finch's extra steps, and each reason it cannot
take a path ("why not" pooled, budgeted, teacher-forced, multi-turn). :func:`profile` gathers them for one press
into a :class:`PressProfile`, which a point's plan carries (evaluate/points/plan.py) and the engine, the loader and
the checks read. It imports kvpress and the presses alone, so every stage, and the registry, may import it.
"""

from dataclasses import dataclass
from functools import cache

import torch
from kvpress import (
    AdaKVPress,
    BasePress,
    CAMPress,
    ChunkKVPress,
    ComposedPress,
    DecodingPress,
    DMSPress,
    DuoAttentionPress,
    ExpectedAttentionPress,
    FastKVzipPress,
    FinchPress,
    KeyDiffPress,
    KeyRerotationPress,
    KnormPress,
    KVzapPress,
    LUKVPress,
    ObservedAttentionPress,
    PrefillDecodingPress,
    QFilterPress,
    RandomPress,
    RestoreKVPress,
    ScorerPress,
    SnapKVPress,
    StreamingLLMPress,
    ThinKPress,
    TOVAPress,
)
from kvpress import EntropyGatedChunkKVPress as UpstreamEntropyGatedChunkKVPress

from presses.chunkkv_exact import ExactChunkKVPress
from presses.eg_chunkkv import EntropyGatedChunkKVPress
from presses.exact_budget import ExactBudgetSelection
from scorers.dropkv import DropKVPress


@dataclass(frozen=True)
class Traits:
    """What the harness must know of a press class that the class does not say itself.

    The two *verified* traits hold for the class named and never for its subclasses, which may override what was
    read (PyramidKV is a SnapKV with another ``compress``); the *required* ones hold for its subclasses too.

    - ``read_only`` (verified): its ``compress`` writes into none of the tensors it is given (it selects with
      gather or index_select, which copy, or leaves keys and values as they are), so the shared prefill lends it the
      captured tensors themselves (evaluate/engine/prefill.py); any other class gets copies.
    - ``shares_scores`` (verified): a scorer whose ``score`` is a function of the layer's inputs and of its fields
      other than the compression ratio only (no random numbers, no state, no writes), so one context's points share
      one computation (evaluate/engine/score_memo.py).
    - ``needs_non_eager``: refuses eager attention (AdaKV masks keys through the attention functions kvpress patches;
      ChunkKV and EG-ChunkKV refuse the weights eager attention hands their hook).
    - ``needs_eager``: reads the attention weights, which kvpress's runner loads eager attention for.
    - ``needs_query_aware``: finds the question behind a delimiter, so kvpress's runner requires query-aware runs.
    - ``decodes``: compresses while the answer is decoded, so each row is asked on its own and has no fixed cache.
    - ``changes_model``: changes the model and tokenizer it runs on (Finch's delimiter token), so it loads its own.
    - ``downloads``: what it downloads when it first meets a model, which does not ship with kvpress.
    """

    read_only: bool = False
    shares_scores: bool = False
    needs_non_eager: bool = False
    needs_eager: bool = False
    needs_query_aware: bool = False
    decodes: bool = False
    changes_model: bool = False
    downloads: str | None = None


# Read in kvpress 0.5.5 and PressBench's own presses and scorers. StreamingLLM's scores depend on the ratio and
# RandomPress draws from the point's own stream: read-only, but never shared. ThinK zeroes pruned key channels in
# place: not read-only.
TRAITS: dict[type[BasePress], Traits] = {
    AdaKVPress: Traits(read_only=True, needs_non_eager=True),
    ChunkKVPress: Traits(read_only=True, needs_non_eager=True),
    UpstreamEntropyGatedChunkKVPress: Traits(read_only=True, needs_non_eager=True),
    ExactChunkKVPress: Traits(read_only=True),
    EntropyGatedChunkKVPress: Traits(read_only=True),
    SnapKVPress: Traits(read_only=True, shares_scores=True),
    TOVAPress: Traits(read_only=True, shares_scores=True),
    ExpectedAttentionPress: Traits(read_only=True, shares_scores=True),
    KnormPress: Traits(read_only=True, shares_scores=True),
    KeyDiffPress: Traits(read_only=True, shares_scores=True),
    DropKVPress: Traits(read_only=True, shares_scores=True),
    RandomPress: Traits(read_only=True),
    StreamingLLMPress: Traits(read_only=True),
    ObservedAttentionPress: Traits(needs_eager=True),
    FinchPress: Traits(needs_query_aware=True, changes_model=True),
    DecodingPress: Traits(decodes=True),
    PrefillDecodingPress: Traits(decodes=True),
    DuoAttentionPress: Traits(
        downloads="DuoAttention's attention patterns (from its GitHub repository, for a few checkpoints)"
    ),
    KVzapPress: Traits(downloads="KVzap's scorer weights (nvidia/KVzap-<type>-<model>)"),
    QFilterPress: Traits(downloads="the model's Q-filters (nthngdy/<model>_qfilt)"),
    FastKVzipPress: Traits(downloads="Fast-KVzip's gates (Jang-Hyun/Fast-KVzip)"),
    RestoreKVPress: Traits(downloads="RestoreKV's embeddings (higokri/RestoreKV-<model>)"),
    LUKVPress: Traits(downloads="a budget curve, published for meta-llama/Llama-3.1-8B-Instruct only"),
}
_VERIFIED = ("read_only", "shares_scores")


@cache
def traits(cls: type[BasePress]) -> Traits:
    """The traits of a press class: its own row's, and the required traits its base classes' rows declare."""
    own = TRAITS.get(cls, Traits())
    required = {
        name: getattr(TRAITS[base], name)
        for base in reversed(cls.__mro__[1:])
        if base in TRAITS
        for name in Traits.__dataclass_fields__
        if name not in _VERIFIED and getattr(TRAITS[base], name)
    }
    return Traits(**{**required, **{name: value for name, value in own.__dict__.items() if value}})


def any_member(press: BasePress | None, trait: str) -> bool:
    """Whether ``press`` or a press it holds has ``trait``."""
    return any(getattr(traits(type(member)), trait) for member in members(press))


def needs_non_eager(press: BasePress | None) -> bool:
    return any_member(press, "needs_non_eager")


def why_not_shared_prefill(press: BasePress | None, attention: str) -> str | None:
    """Why ``press`` cannot be applied to a prefill shared with other sweep points; None when it can.

    A press shares the prefill when its whole effect is the ``compress`` call kvpress's forward hook makes after
    each layer's attention: its class keeps ``BasePress``'s hook and context manager. kvpress's ``DecodingPress`` and
    ``PrefillDecodingPress`` (exactly these classes) share it too: the prefill part (none, or the prefilling press)
    on the shared prefill, the decoding part in the pool (:func:`why_not_pooled_decoding`). Presses that hook
    elsewhere (other decoding-time presses, extra forward passes, delimiter tokens) answer through kvpress's pipeline.
    """
    if press is None:
        return None
    if attention == "eager":
        return "under eager attention a press may read the attention weights, which a shared prefill does not keep"
    if type(press) in (DecodingPress, PrefillDecodingPress):
        decoding, prefill = decoding_part(press), prefill_part(press)
        if decoding is not None and any(isinstance(member, AdaKVPress) for member in members(prefill)):
            return (
                "kvpress keeps the prefill's AdaKV masks on the modules after a decoding compression has moved the "
                "keys they index, which the pool's masks do not reproduce"
            )
        return why_not_pooled_decoding(decoding) or why_not_shared_prefill(prefill, attention)
    for method in ("forward_hook", "__call__"):
        if getattr(type(press), method) is not getattr(BasePress, method):
            return f"{type(press).__name__} overrides BasePress.{method}: it acts beyond each layer's compress call"
    return None


def prefill_part(press: BasePress | None) -> BasePress | None:
    """What of ``press`` compresses at the prefill: a ``PrefillDecodingPress``'s prefilling press, nothing of a
    ``DecodingPress`` (kvpress's pipeline runs the prefill without its hooks), any other press whole."""
    if isinstance(press, DecodingPress):
        return None
    if isinstance(press, PrefillDecodingPress):
        return press.prefilling_press
    return press


def decoding_part(press: BasePress | None) -> DecodingPress | None:
    """What of ``press`` compresses while decoding: a ``DecodingPress`` itself, a ``PrefillDecodingPress``'s
    decoding press, else nothing."""
    if isinstance(press, DecodingPress):
        return press
    if isinstance(press, PrefillDecodingPress):
        return press.decoding_press
    return None


def why_not_pooled_decoding(press: DecodingPress | None) -> str | None:
    """Why the decoding pool cannot compress each row as kvpress's ``DecodingPress`` compresses it alone (None when
    it can: evaluate/engine/decoding_compression.py).

    - A subclass may hook or compress otherwise (CAM).
    - A base press drawing random numbers would draw them in the pool's order of rows, not its run's.
    """
    if press is None:
        return None
    if type(press) is not DecodingPress:
        return f"{type(press).__name__} overrides DecodingPress: only kvpress's own schedule is reproduced in the pool"
    if any(isinstance(member, RandomPress) for member in members(press)):
        return "its base press draws random numbers while decoding, in an order the pool's interleaved rows change"
    return None


def selects_by_position(press: BasePress | None) -> bool:
    """Whether ``press`` keeps pairs by their positions alone (StreamingLLM's sink and window), so that no rounding
    of the model's activations can change what it keeps."""
    return isinstance(press, StreamingLLMPress)


def why_not_decoding_window(press: BasePress | None) -> str | None:
    """Why ``press``'s decoding part cannot compress past its first compression, if it cannot: after the first, a
    compression holds the hidden states of its last ``min(compression_interval, hidden_states_buffer_size + 1)``
    decoding steps (kvpress's ``DecodingPress.forward_hook`` clears its buffer at each compression and trims it to
    ``hidden_states_buffer_size`` after each step), and SnapKV asserts that it holds more than its window."""
    decoding = decoding_part(press)
    if decoding is None:
        return None
    held = min(decoding.compression_interval, decoding.hidden_states_buffer_size + 1)
    for member in members(decoding.base_press):
        if isinstance(member, SnapKVPress) and held <= member.window_size:
            return (
                f"its SnapKV scores the last {member.window_size} queries of a compression, and with "
                f"compression_interval={decoding.compression_interval} and hidden_states_buffer_size="
                f"{decoding.hidden_states_buffer_size} a compression after the first holds {held} (kvpress asserts "
                f"'Query length {held} should be greater than the window size {member.window_size}'); give "
                f"compression_interval > {member.window_size} and hidden_states_buffer_size >= {member.window_size}"
            )
    return None


def members(press: BasePress | None) -> list[BasePress]:
    """``press`` and every press it holds (wrapped, base or composed), outermost first."""
    if press is None:
        return []
    found = [press]
    for name in ("press", "base_press", "prefilling_press", "decoding_press"):
        inner = getattr(press, name, None)
        if isinstance(inner, BasePress):
            found += members(inner)
    for inner in getattr(press, "presses", None) or []:
        found += members(inner)
    return found


def downloads(press: BasePress | None) -> str | None:
    """What ``press`` must download before it can compress anything, if anything."""
    for member in members(press):
        if isinstance(member, DuoAttentionPress) and member.on_the_fly_scoring:
            return "the kmfoda/booksum dataset, to score DuoAttention's heads on the fly"
        if traits(type(member)).downloads:
            return traits(type(member)).downloads
    return None


def kvpress_defect(press: BasePress | None) -> str | None:
    """Why kvpress 0.5.5 itself fails with ``press`` whatever the model, if it does."""
    if isinstance(press, CAMPress) and isinstance(press.base_press, AdaKVPress):
        return "kvpress 0.5.5's CAMPress calls score() on its base press, which AdaKVPress does not have"
    return None


def needs_eager(press: BasePress | None) -> bool:
    """kvpress's runner loads the model with eager attention for ObservedAttentionPress, which reads its weights."""
    return press is not None and traits(type(press)).needs_eager


def needs_query_aware(press: BasePress | None) -> bool:
    """FinchPress finds the question behind a delimiter token appended to the context: kvpress's runner requires
    query-aware runs for it."""
    return press is not None and traits(type(press)).needs_query_aware


def decodes_per_sample(press: BasePress | None) -> bool:
    """Decoding-time presses compress while one question's answer is generated, so kvpress's runner asks each row
    on its own (``question=``) instead of a context's questions together."""
    return press is not None and traits(type(press)).decodes


def changes_the_model(press: BasePress | None) -> bool:
    """FinchPress adds its delimiter token to the tokenizer and resizes the model's embeddings to it."""
    return press is not None and traits(type(press)).changes_model


def compressed_suffix(press: BasePress | None) -> str:
    """Text kvpress's runner appends to every context for this press (before the question, in query-aware runs)."""
    return FINCH_DELIMITER if isinstance(press, FinchPress) else ""


# FinchPress.update_model_and_tokenizer's default, which kvpress's runner uses.
FINCH_DELIMITER = "<|finch_sep|>"


def why_not_teacher_forced(press: BasePress | None) -> str | None:
    """Why the likelihood fields cannot be computed under ``press`` (evaluate/engine/teacher_forcing.py); None when
    they can."""
    if decodes_per_sample(press):
        return "it compresses while decoding, so there is no fixed cache to teacher-force the answer on"
    return None


def why_not_multi_turn(press: BasePress | None, history: str) -> str | None:
    """Why a conversation's turns cannot be asked on one cache under ``press`` with ``history`` (``turns=multi``,
    evaluate/engine/turns.py); None when they can."""
    for member in members(press):
        if isinstance(member, (KeyRerotationPress, RestoreKVPress)) or getattr(member, "rerotate_keys", False):
            return (
                "kvpress asks its question at the compressed cache's length instead of the context's, a rule for one "
                "question that a conversation's later turns have no counterpart of"
            )
        if isinstance(member, DMSPress):
            return "kvpress's pipeline switches its compression while decoding by a flag of its own, not followed here"
    if decoding_part(press) is not None and history == "reference":
        return (
            "it compresses each answer into the cache while decoding, so no reference answer can take the answer's "
            "place; use history=model"
        )
    return None


def budget_scorer(press: BasePress | None) -> ScorerPress | None:
    """The ScorerPress whose ``compression_ratio`` decides how many pairs ``press`` keeps, where it keeps
    ``int(L * (1 - ratio))`` of an L-token context (evaluate/points/budget.py sets that ratio for a token budget);
    None for a press that keeps another count."""
    if isinstance(press, ScorerPress) and type(press).compress is ScorerPress.compress:
        return press  # per head (the topk presses, kvpress's registry entries of one scorer)
    exact = isinstance(press, ExactBudgetSelection) or type(press) is UpstreamEntropyGatedChunkKVPress
    if (exact or type(press) is AdaKVPress) and isinstance(press.press, ScorerPress):
        return press.press  # per layer (exact budgets), or in total over the heads (AdaKV)
    return None


def why_not_budget(press: BasePress | None) -> str | None:
    """Why ``press`` cannot keep a token budget, in words that name the fix; None when it can."""
    if decoding_part(press) is not None:
        return (
            "it compresses while decoding, not the context; its own token budget is target_size: give "
            "target_size=N instead of budget=N"
        )
    if isinstance(press, ChunkKVPress) and budget_scorer(press) is None:
        return (
            "kvpress's ChunkKVPress keeps whole chunks, int(n_chunks * (1 - cr)), so no ratio keeps exactly N "
            "tokens; use press=chunkkv_exact, its exact budget"
        )
    if budget_scorer(press) is None:
        names = "/".join(type(member).__name__ for member in members(press))
        return (
            f"{names} does not keep int(L * (1 - cr)) pairs of an L-token context (its budget is split otherwise), "
            "so no ratio keeps exactly N; use cr=, or a topk, adakv, chunkkv_exact or eg_chunkkv press"
        )
    return None


def kvpress_chunk_lengths(press: BasePress | None) -> list[int]:
    """The chunk length of each member of ``press`` that keeps whole chunks by kvpress's own ``ChunkKVPress.compress``
    (press=chunkkv, method=chunkkv), whose budget rounds to ``int(n_chunks * (1 - cr))`` chunks; presses/
    chunkkv_exact.py's exact budget is not one."""
    return [
        member.chunk_length
        for member in members(press)
        if isinstance(member, ChunkKVPress) and type(member).compress is ChunkKVPress.compress
    ]


# The knobs kvpress's runner (``EvaluationRunner._setup_press``) sets on each family of presses beside, or instead
# of, the compression ratio; the registry's build sets them (evaluate/registry.py) and refuses any other.
RUNNER_FAMILIES: tuple[tuple[type[BasePress], str, tuple[str, ...]], ...] = (
    (DuoAttentionPress, "duo_attention", ("head_compression_ratio",)),
    (DMSPress, "dms", ("threshold",)),
    (ComposedPress, "composed", ()),
    (ThinKPress, "think", ("key_channel_compression_ratio",)),
    (DecodingPress, "decoding", ("compression_interval", "target_size", "hidden_states_buffer_size")),
)


def runner_family(press: BasePress | None) -> str:
    """Which way kvpress's runner sets ``press``'s knobs: the name of its :data:`RUNNER_FAMILIES` row (the first
    that matches, in the runner's order), else ``ratio`` (the compression ratio, where it has one)."""
    return next((name for kind, name, _ in RUNNER_FAMILIES if isinstance(press, kind)), "ratio")


def knobs_read(press: BasePress | None) -> set[str]:
    """The runner knobs ``press`` (a registry entry) reads; a ComposedPress reads its members'."""
    inner = press.presses if isinstance(press, ComposedPress) else [press]
    return {knob for member in inner for kind, _, read in RUNNER_FAMILIES if isinstance(member, kind) for knob in read}


def prepare_model(press: BasePress | None, model, tokenizer, seed: int) -> None:
    """What kvpress's runner does to a freshly loaded model and tokenizer before a press's run (Finch's token)."""
    if isinstance(press, FinchPress):
        # Resizing the embeddings draws the new row at random: seeded, so that a run is reproducible.
        torch.manual_seed(seed)
        press.update_model_and_tokenizer(model, tokenizer, FINCH_DELIMITER)


def stand_in(press: BasePress) -> str | None:
    """The name of the tensor stand-in that compresses a layer exactly as ``press`` would, without the attention
    weights its own hook receives (evaluate/engine/exact_compress.py's ``STAND_INS``): kvpress's ChunkKV and
    EG-ChunkKV classes, exactly (a subclass may compress otherwise)."""
    return {ChunkKVPress: "chunkkv", UpstreamEntropyGatedChunkKVPress: "entropy_gated_chunkkv"}.get(type(press))


def keeps_every_key(press: DecodingPress) -> bool:
    """Whether a decoding-time press's compressions leave the cache whole and mask keys instead (AdaKV as the base
    press)."""
    return isinstance(press.base_press, AdaKVPress)


def prefill_hook(press: BasePress | None) -> BasePress | None:
    """The press kvpress's pipeline runs the prefill under: ``press`` whole, but none for a ``DecodingPress``,
    which compresses only while decoding."""
    return None if press is None or isinstance(press, DecodingPress) else press


@dataclass(frozen=True)
class PressProfile:
    """The facts about one point's press that the engine and the loader read once it is built (:func:`profile`
    builds it; each field's function above says what it means; the checks before the model loads ask those functions
    of the described press). ``None`` press: press=none, which has none of them."""

    press: BasePress | None
    prefill: BasePress | None
    decoding: DecodingPress | None
    decodes_per_sample: bool
    changes_model: bool
    compressed_suffix: str
    why_not_teacher_forced: str | None

    def why_not_shared_prefill(self, attention: str) -> str | None:
        """Why this press cannot be applied to a prefill shared with other points (:func:`why_not_shared_prefill`)."""
        return why_not_shared_prefill(self.press, attention)

    def prepare_model(self, model, tokenizer, seed: int) -> None:
        """kvpress's runner's steps on a fresh model for this press (:func:`prepare_model`)."""
        prepare_model(self.press, model, tokenizer, seed)


def profile(press: BasePress | None) -> PressProfile:
    """The profile of ``press``: every answer above, asked once."""
    return PressProfile(
        press=press,
        prefill=prefill_part(press),
        decoding=decoding_part(press),
        decodes_per_sample=decodes_per_sample(press),
        changes_model=changes_the_model(press),
        compressed_suffix=compressed_suffix(press),
        why_not_teacher_forced=why_not_teacher_forced(press),
    )
