"""Inner-scorer scores computed once per context and shared by every point that asks for them.

On the shared-prefill path every point of a context compresses the same captured layer inputs. The scores of a
ScorerPress (SnapKV's window attention, most of a point's compression time) depend on those inputs and on the
scorer's configuration, but for the scorers listed in :data:`SHARED_SCORERS` not on the compression ratio, nor
on which press wraps the scorer (top-k, ChunkKV, EG-ChunkKV, AdaKV...): every such point's scores are the same
tensor. :class:`ScoreMemo` computes them on the first request of a context and hands a copy to every later one.

Left out on purpose, read in kvpress 0.5.5: StreamingLLM, whose scores depend on the ratio; RandomPress, which
draws random numbers (without a seed, from the point's own stream, which must draw what it draws in a run
alone); and any other class, subclasses of the listed ones included (PyramidKV is a SnapKV with another
``compress``), until read and listed. They are computed as before, for every point.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import fields

import torch
from kvpress import BasePress, ExpectedAttentionPress, KeyDiffPress, KnormPress, SnapKVPress, TOVAPress
from kvpress.presses.scorer_press import ScorerPress

from evaluate.spec.press_traits import members
from scorers.dropkv import DropKVPress

# Scorers whose ``score`` is a function of the layer's inputs and of their fields other than the compression ratio
# only: no random numbers, no state kept between calls, and no write into the tensors they are given.
SHARED_SCORERS: frozenset[type[ScorerPress]] = frozenset(
    {SnapKVPress, TOVAPress, ExpectedAttentionPress, KnormPress, KeyDiffPress, DropKVPress}
)


def configuration(scorer: ScorerPress) -> tuple:
    """What a shared scorer's scores depend on besides the layer's inputs: its class and fields, less the ratio."""
    return type(scorer), tuple(
        (field.name, getattr(scorer, field.name)) for field in fields(scorer) if field.name != "compression_ratio"
    )


class ScoreMemo:
    """The scores of one context's layers, by (layer index, scorer configuration); made for one context only.

    A score is shared only when it is asked of the captured inputs themselves (the same tensor objects, no
    attention weights): a press that hands its scorer anything else, such as a copy it has written into, is
    scored as before. Each request gets its own copy, since some presses write into the scores they are given
    (AdaKV and CriticalKV raise each head's safeguard positions in place).
    """

    def __init__(self, captured: list[tuple]):
        self.captured = captured
        self.scores: dict[tuple, torch.Tensor] = {}

    @contextmanager
    def sharing(self, press: BasePress | None) -> Iterator[None]:
        """Within the block, the shared scorers among ``press``'s members read their scores from the memo."""
        scorers = {id(member): member for member in members(press) if type(member) in SHARED_SCORERS}.values()
        for scorer in scorers:
            # An instance attribute shadows the class's method for this object alone, as long as the block lasts.
            scorer.score = self._memoised(scorer)
        try:
            yield
        finally:
            for scorer in scorers:
                del scorer.score

    def _memoised(self, scorer: ScorerPress) -> Callable[..., torch.Tensor]:
        compute, kind = scorer.score, configuration(scorer)

        def score(module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
            given = (hidden_states, keys, values, kwargs)
            captured = self.captured[module.layer_idx]
            if attentions is not None or any(mine is not theirs for mine, theirs in zip(given, captured, strict=True)):
                return compute(module, hidden_states, keys, values, attentions, kwargs)
            key = (module.layer_idx, kind)
            if key not in self.scores:
                self.scores[key] = compute(module, hidden_states, keys, values, attentions, kwargs)
            return self.scores[key].clone()

        return score
