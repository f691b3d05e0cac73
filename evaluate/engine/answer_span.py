"""Where a row's reference answers lie in its context, as token positions of the cache kvpress's pipeline prefills.

The pipeline templates the context and tokenizes that text (``preprocess``); :class:`PrefilledText` reads the very
text it tokenizes, tokenizes it again with the tokenizer's character offsets, and maps each verbatim occurrence of a
reference answer in it to the tokens that overlap it. An answer counts where it stands as a whole word (not inside a
longer one), and answers shorter than two characters (a multiple-choice letter) are no span at all.
"""

import re
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace

import torch

from evaluate.engine.context_budget import chat_template_enabled

MIN_ANSWER_CHARACTERS = 2


class _RecordingTokenizer:
    """The tokenizer, recording the texts the pipeline's ``preprocess`` encodes."""

    def __init__(self, tokenizer):
        self._tokenizer, self.encoded = tokenizer, []

    def __getattr__(self, name: str):
        return getattr(self._tokenizer, name)

    def encode(self, text, *args, **kwargs):
        self.encoded.append(text)
        return self._tokenizer.encode(text, *args, **kwargs)


@dataclass
class PrefilledText:
    """The text the pipeline prefilled for one context, and each of its tokens' character span."""

    text: str
    offsets: torch.Tensor  # [tokens, 2]

    @classmethod
    def of(cls, tokenizer, text: str, chat_template: bool, max_context_length: int) -> "PrefilledText | None":
        """The prefilled text of ``text`` as kvpress's pipeline templates, tokenizes and cuts it; None where the
        tokenizer gives no offsets or its offsets' tokens are not the pipeline's."""
        from kvpress import KVPressTextGenerationPipeline  # imported late: kvpress patches attention globally

        recording = _RecordingTokenizer(tokenizer)
        holder = SimpleNamespace(tokenizer=recording)
        with chat_template_enabled(tokenizer, chat_template):
            context_ids = partial(KVPressTextGenerationPipeline.preprocess, holder)(text, [""], "", max_context_length)
        context_ids = context_ids["context_ids"][0].tolist()
        templated = recording.encoded[0]
        try:
            encoded = tokenizer(templated, add_special_tokens=False, return_offsets_mapping=True)
        except NotImplementedError:  # a slow tokenizer has no offsets
            return None
        if encoded["input_ids"][: len(context_ids)] != context_ids:
            return None
        return cls(templated, torch.tensor(encoded["offset_mapping"][: len(context_ids)]).reshape(-1, 2))

    def answer_positions(self, answers: list[str]) -> torch.Tensor | None:
        """The token positions overlapping any verbatim occurrence of any of ``answers`` (whole words), None where
        none occurs in what was prefilled."""
        covered = torch.zeros(len(self.offsets), dtype=torch.bool)
        for answer in {str(answer).strip() for answer in answers}:
            if len(answer) < MIN_ANSWER_CHARACTERS:
                continue
            pattern = (
                (r"\b" if answer[0].isalnum() else "") + re.escape(answer) + (r"\b" if answer[-1].isalnum() else "")
            )
            for match in re.finditer(pattern, self.text):
                start, end = match.span()
                covered |= (self.offsets[:, 0] < end) & (self.offsets[:, 1] > start)
        positions = covered.nonzero().flatten()
        return positions if positions.numel() else None
