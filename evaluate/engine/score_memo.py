"""Inner-scorer scores computed once per context and shared by every point that asks for them.

On the shared-prefill path every point of a context compresses the same captured layer inputs. The scores of a
ScorerPress (SnapKV's window attention, most of a point's compression time) depend on those inputs and on the
scorer's configuration, but for the scorers whose ``shares_scores`` trait is set (evaluate/press_profile.py),
not on the compression ratio, nor on which press wraps the scorer (top-k, ChunkKV, EG-ChunkKV, AdaKV...): every
such point's scores are the same tensor. :class:`ScoreMemo` computes them on the first request of a context and
hands a copy to every later one.

The trait table says which scorers were read and left out (StreamingLLM, RandomPress), and why; a class without
the trait, subclasses of the listed ones included, computes its scores for every point.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import fields

import torch
from kvpress import BasePress
from kvpress.presses.scorer_press import ScorerPress

from evaluate.press_profile import members, traits


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
        scorers = {id(member): member for member in members(press) if traits(type(member)).shares_scores}.values()
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
