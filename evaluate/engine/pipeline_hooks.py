"""What the harness reads off kvpress's pipeline while it runs, without changing a step of it: the prefill's time,
passes and length (:class:`PrefillProbe`), and each answer's greedy token ids (:class:`GreedyTokens`); and the
pipeline a point's run asks with them (:class:`PipelineRun`)."""

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from kvpress import DecodingPress
from kvpress.utils import extract_keys_and_values
from transformers import Cache, DynamicCache

from evaluate.benchmarks import Sample
from evaluate.engine.attention_recall import masks_set_aside
from evaluate.engine.context_budget import chat_template_enabled, make_pipeline, templated_context_length
from evaluate.engine.decoding_compression import counting_removals
from evaluate.engine.decoding_pool import DecodingPool, stop_token_ids
from evaluate.engine.devices import input_device, synchronizer
from evaluate.engine.diagnosis import ContextDiagnosis
from evaluate.engine.kept_sets import key_fingerprints
from evaluate.engine.requests import GeneratedAnswer
from evaluate.engine.teacher_forcing import forcing_pool, reference_answer_ids
from evaluate.points.plan import Plan


class PrefillProbe:
    """Times the prefill pass, records the context length the pipeline actually fed the model, and counts passes.

    kvpress's pipeline runs the prefill as one call of the bare decoder (``model.model``) before any decoding step,
    so the first such call after ``reset`` is the prefill. Every call of the bare decoder is a forward pass (KVzip's
    reconstruction passes included); every call of the language-model head's forward generates one token.
    """

    def __init__(self, model: torch.nn.Module):
        self._synchronize = synchronizer(model)
        self._handles = [
            model.model.register_forward_pre_hook(self._before, with_kwargs=True),
            model.model.register_forward_hook(self._after, with_kwargs=True),
            model.register_forward_pre_hook(self._generates),
        ]
        self.reset()

    def reset(self) -> None:
        self.context_length: int | None = None
        self.seconds = 0.0
        self.forward_passes = 0
        self.generated_tokens = 0
        self._start: float | None = None

    def _before(self, module, args, kwargs):
        self.forward_passes += 1
        if self.context_length is None:
            self.context_length = kwargs["input_ids"].shape[1]
            self._synchronize()
            self._start = time.perf_counter()

    def _after(self, module, args, kwargs, output):
        if self._start is not None:
            self._synchronize()
            self.seconds = time.perf_counter() - self._start
            self._start = None

    def _generates(self, module, args):
        self.generated_tokens += 1

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


class GreedyTokens:
    """The token ids kvpress's pipeline generates for each question, exactly as it generates them.

    ``KVPressTextGenerationPipeline.generate_answer`` keeps its greedy ids in a local list and returns their text
    only, and text decoded with ``skip_special_tokens`` does not tokenize back to the same ids. So this wraps the
    pipeline's ``generate_answer`` (an attribute of this pipeline object only) and, while a call runs, a forward hook
    on the language model takes each pass's token the way the pipeline does: the argmax of the last position's
    logits, on the very tensor the pipeline reads. ``answers`` holds each call's answer since ``reset``.
    """

    def __init__(self, pipe, decoding: DecodingPress | None = None):
        self.stop_ids = stop_token_ids(pipe.model)
        self._model, self._generate = pipe.model, pipe.generate_answer
        pipe.generate_answer = self._generate_answer
        self.answers: list[GeneratedAnswer] = []
        self._tokens: list[int] = []
        # A decoding-time press's compressions that removed pairs of the cache (GeneratedAnswer.compressed): counted
        # from the cache's prefill on, so that a conversation's later turn counts its earlier turns' too.
        self._decoding = decoding
        self.removals = 0

    def reset(self) -> None:
        self.answers = []

    def _take(self, module, args, output) -> None:
        # Reading the token back waits for the device, as the pipeline's own stop test (``new_id.item()``) does.
        self._tokens.append(int(output.logits[0, -1].argmax()))

    def _generate_answer(self, *args, **kwargs) -> str:
        self._tokens = []
        handle = self._model.register_forward_hook(self._take)
        try:
            with counting_removals(self._decoding) as removals:
                answer = self._generate(*args, **kwargs)
        finally:
            handle.remove()
        self.removals += removals[0]
        compressed = None if self._decoding is None else self.removals > 0
        self.answers.append(GeneratedAnswer.of(self._tokens, self.stop_ids, compressed))
        return answer


class PrefillKeys:
    """The fingerprints of each layer's keys as the prefill wrote them, before the press compressed them
    (evaluate/engine/kept_sets.py): a hook on each attention layer that runs before any press's (``prepend``) and
    takes the first call of each layer after ``reset``, the prefill's."""

    def __init__(self, model: torch.nn.Module):
        layers = model.model.layers
        self._handles = [
            layer.self_attn.register_forward_hook(self._take, with_kwargs=True, prepend=True) for layer in layers
        ]
        self.fingerprints: list[torch.Tensor | None] = [None] * len(layers)

    def reset(self) -> None:
        self.fingerprints = [None] * len(self.fingerprints)

    def _take(self, module, args, kwargs, output) -> None:
        if self.fingerprints[module.layer_idx] is None:
            keys, _ = extract_keys_and_values(kwargs["past_key_values"], module.layer_idx)
            self.fingerprints[module.layer_idx] = key_fingerprints(keys)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


@dataclass
class PipelineRun:
    """One point's run on kvpress's pipeline path: the pipeline, its probes, the pool that teacher-forces its
    likelihood fields (None when the point wants none), its templated context length (``length(text,
    chat_template)``) and a fresh cache of the point's kind for each group (``new_cache()``, evaluate/kv_cache.py);
    every group of the point, single-turn or a conversation, is asked on it."""

    pipe: object
    tokens: GreedyTokens
    probe: PrefillProbe
    forcing: DecodingPool | None
    length: Callable[[str, bool], int]
    new_cache: Callable[[], Cache]
    keys: PrefillKeys | None = None  # under diagnostics=retention or attention

    @classmethod
    def start(cls, plan: Plan, model, tokenizer) -> "PipelineRun":
        pipe = make_pipeline(model, tokenizer, plan.spec.device)
        plan.spec.kv_cache.prepare(pipe)
        tokens, probe = GreedyTokens(pipe, plan.profile.decoding), PrefillProbe(model)
        # kvpress's runner seeds once before its run: a press drawing random numbers (RandomPress, Compactor's
        # sketch) draws the same ones here.
        torch.manual_seed(plan.spec.seed)
        forcing = forcing_pool(model) if plan.likelihood else None
        length = templated_context_length(pipe, tokenizer)
        keys = PrefillKeys(model) if plan.spec.diagnostics != "none" else None
        return cls(pipe, tokens, probe, forcing, length, partial(plan.spec.kv_cache.make, model), keys)

    def reset(self) -> None:
        """Before each group: its prefill, its answers and its decoding press's removals counted afresh."""
        self.probe.reset()
        self.tokens.reset()
        self.tokens.removals = 0
        if self.keys is not None:
            self.keys.reset()

    def diagnosis(
        self, plan: Plan, group: list[Sample], text: str, questions: list[str], answer_prefix: str, budget: int
    ) -> ContextDiagnosis:
        """What the group's diagnostics need of its context (evaluate/engine/diagnosis.py): the prefill's key
        fingerprints and prefilled text, and under ``diagnostics=attention`` each question's attention mass on the
        context, for which it prefills the context once more without the press (AdaKV's masks set aside). Its passes
        are not the answers' and are not counted, as on the pool's path."""
        tokenizer, model = self.pipe.tokenizer, self.pipe.model
        diagnosis = ContextDiagnosis.of(self.keys.fingerprints, tokenizer, text, group[0].chat_template, budget)
        if plan.spec.diagnostics == "attention":
            start = time.perf_counter()
            with chat_template_enabled(tokenizer, group[0].chat_template):
                tokens = self.pipe.preprocess(text, questions, answer_prefix, budget)
            uncompressed = DynamicCache()
            with torch.no_grad(), masks_set_aside(model.model.layers):
                model.model(input_ids=tokens["context_ids"].to(input_device(model)), past_key_values=uncompressed)
            answers = [reference_answer_ids(plan.benchmark, sample, tokenizer) for sample in group]
            diagnosis.add_masses(model, uncompressed, group, tokens["questions_ids"], answers)
            diagnosis.recall_seconds = time.perf_counter() - start
        return diagnosis

    def close(self) -> None:
        self.probe.close()
        if self.keys is not None:
            self.keys.close()
