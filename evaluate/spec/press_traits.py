"""What a press needs from the harness, read off the press object: no press YAML or class list has to say it."""

import torch
from kvpress import (
    AdaKVPress,
    BasePress,
    CAMPress,
    ChunkKVPress,
    DecodingPress,
    DuoAttentionPress,
    EntropyGatedChunkKVPress,
    FastKVzipPress,
    FinchPress,
    KVzapPress,
    LUKVPress,
    ObservedAttentionPress,
    QFilterPress,
    RestoreKVPress,
)

# kvpress declares no attention requirement on its classes, so it is declared here, once: AdaKV masks keys through
# the attention functions kvpress patches (sdpa, flash), and ChunkKV / EG-ChunkKV (ours subclass them) refuse the
# attention weights eager attention hands to their hook.
NON_EAGER_PRESSES: tuple[type[BasePress], ...] = (AdaKVPress, ChunkKVPress, EntropyGatedChunkKVPress)


def needs_non_eager(press: BasePress | None) -> bool:
    return any(isinstance(member, NON_EAGER_PRESSES) for member in members(press))


def why_not_shared_prefill(press: BasePress | None, attention: str) -> str | None:
    """Why ``press`` cannot be applied to a prefill shared with other sweep points; None when it can.

    A press shares the prefill when its whole effect is the ``compress`` call kvpress's forward hook makes after
    each layer's attention: its class keeps ``BasePress``'s hook and context manager. Presses that hook
    elsewhere (decoding-time presses, extra forward passes, delimiter tokens) answer through kvpress's pipeline.
    """
    if press is None:
        return None
    if attention == "eager":
        return "under eager attention a press may read the attention weights, which a shared prefill does not keep"
    for method in ("forward_hook", "__call__"):
        if getattr(type(press), method) is not getattr(BasePress, method):
            return f"{type(press).__name__} overrides BasePress.{method}: it acts beyond each layer's compress call"
    return None


def members(press: BasePress | None) -> list[BasePress]:
    """``press`` and every press it holds (wrapped, base or composed), outermost first."""
    if press is None:
        return []
    found = [press]
    for name in ("press", "base_press"):
        inner = getattr(press, name, None)
        if isinstance(inner, BasePress):
            found += members(inner)
    for inner in getattr(press, "presses", None) or []:
        found += members(inner)
    return found


# What each kvpress class downloads when it first meets a model (post_init_from_model or its first forward): none of
# it ships with kvpress, so offline these entries cannot run at all.
HUB_DOWNLOADS: dict[type[BasePress], str] = {
    DuoAttentionPress: "DuoAttention's attention patterns (from its GitHub repository, for a few checkpoints)",
    KVzapPress: "KVzap's scorer weights (nvidia/KVzap-<type>-<model>)",
    QFilterPress: "the model's Q-filters (nthngdy/<model>_qfilt)",
    FastKVzipPress: "Fast-KVzip's gates (Jang-Hyun/Fast-KVzip)",
    RestoreKVPress: "RestoreKV's embeddings (higokri/RestoreKV-<model>)",
    LUKVPress: "a budget curve, published for meta-llama/Llama-3.1-8B-Instruct only",
}


def downloads(press: BasePress | None) -> str | None:
    """What ``press`` must download before it can compress anything, if anything."""
    for member in members(press):
        if isinstance(member, DuoAttentionPress) and member.on_the_fly_scoring:
            return "the kmfoda/booksum dataset, to score DuoAttention's heads on the fly"
        for cls, what in HUB_DOWNLOADS.items():
            if isinstance(member, cls):
                return what
    return None


def kvpress_defect(press: BasePress | None) -> str | None:
    """Why kvpress 0.5.5 itself fails with ``press`` whatever the model, if it does."""
    if isinstance(press, CAMPress) and isinstance(press.base_press, AdaKVPress):
        return "kvpress 0.5.5's CAMPress calls score() on its base press, which AdaKVPress does not have"
    return None


def needs_eager(press: BasePress | None) -> bool:
    """kvpress's runner loads the model with eager attention for ObservedAttentionPress, which reads its weights."""
    return isinstance(press, ObservedAttentionPress)


def needs_query_aware(press: BasePress | None) -> bool:
    """FinchPress finds the question behind a delimiter token appended to the context: kvpress's runner requires
    query-aware runs for it."""
    return isinstance(press, FinchPress)


def decodes_per_sample(press: BasePress | None) -> bool:
    """Decoding-time presses compress while one question's answer is generated, so kvpress's runner asks each row
    on its own (``question=``) instead of a context's questions together."""
    return isinstance(press, DecodingPress)


def changes_the_model(press: BasePress | None) -> bool:
    """FinchPress adds its delimiter token to the tokenizer and resizes the model's embeddings to it."""
    return isinstance(press, FinchPress)


def compressed_suffix(press: BasePress | None) -> str:
    """Text kvpress's runner appends to every context for this press (before the question, in query-aware runs)."""
    return FINCH_DELIMITER if isinstance(press, FinchPress) else ""


# FinchPress.update_model_and_tokenizer's default, which kvpress's runner uses.
FINCH_DELIMITER = "<|finch_sep|>"


def prepare_model(press: BasePress | None, model, tokenizer, seed: int) -> None:
    """What kvpress's runner does to a freshly loaded model and tokenizer before a press's run (Finch's token)."""
    if isinstance(press, FinchPress):
        # Resizing the embeddings draws the new row at random: seeded, so that a run is reproducible.
        torch.manual_seed(seed)
        press.update_model_and_tokenizer(model, tokenizer, FINCH_DELIMITER)


def why_not_teacher_forced(press: BasePress | None) -> str | None:
    """Why the likelihood fields cannot be computed under ``press`` (evaluate/engine/teacher_forcing.py); None when
    they can."""
    if decodes_per_sample(press):
        return "it compresses while decoding, so there is no fixed cache to teacher-force the answer on"
    return None
