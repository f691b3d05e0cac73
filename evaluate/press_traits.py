"""What a press needs from the harness, read off the press object: no press YAML or class list has to say it."""

from kvpress import AdaKVPress, BasePress, ChunkKVPress, EntropyGatedChunkKVPress

# kvpress declares no attention requirement on its classes, so it is declared here, once: AdaKV masks keys through
# the attention functions kvpress patches (sdpa, flash), and ChunkKV / EG-ChunkKV (ours subclass them) refuse the
# attention weights eager attention hands to their hook.
NON_EAGER_PRESSES: tuple[type[BasePress], ...] = (AdaKVPress, ChunkKVPress, EntropyGatedChunkKVPress)


def needs_non_eager(press: BasePress | None) -> bool:
    return isinstance(press, NON_EAGER_PRESSES)


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
