"""The correctness stage: every CUDA code path against its reference on the device, one row of correctness.csv each.

Each check returns a status (pass, fail, info) and a detail; ``Checks`` records an exception as an error and runs the
next check.
"""

import argparse
import csv
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from gpu_check_stages.common import median_seconds, save_fragment


@dataclass
class Check:
    check: str
    dtype: str
    status: str  # pass, fail, info, error
    detail: str
    seconds: float = 0.0


class Checks:
    """Runs each check on its own: an exception is recorded as an error and the next check runs.

    correctness.csv and the summary fragment are rewritten after every check, so a stage stopped at its time limit
    still reports the checks it finished.
    """

    def __init__(self, device: str, out: Path, work: Path):
        self.device, self.out, self.work = device, out, work
        self.rows: list[Check] = []
        self.notes: list[str] = []

    def write(self) -> None:
        with (self.out / "correctness.csv").open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["check", "device", "dtype", "status", "seconds", "detail"])
            for row in self.rows:
                writer.writerow([row.check, self.device, row.dtype, row.status, f"{row.seconds:.1f}", row.detail])
        lines = [
            "| check | dtype | status | detail |",
            "|---|---|---|---|",
            *(f"| {row.check} | {row.dtype} | **{row.status}** | {row.detail} |" for row in self.rows),
            *self.notes,
        ]
        save_fragment(self.work, "correctness", {"lines": lines})

    def run(self, name: str, dtype: str, fn: Callable[[], tuple[str, str]]) -> None:
        start = time.perf_counter()
        try:
            status, detail = fn()
        except Exception as error:
            traceback.print_exc()
            status, detail = "error", f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        row = Check(name, dtype, status, detail, time.perf_counter() - start)
        self.rows.append(row)
        self.write()
        print(f"[{row.status}] {row.check} ({row.dtype}, {row.seconds:.1f} s): {row.detail}", flush=True)


def deterministic(enabled: bool) -> None:
    """torch's deterministic settings (the bf16 checks); warn_only, so an op without a deterministic kernel warns."""
    import torch

    torch.use_deterministic_algorithms(enabled, warn_only=True)
    torch.backends.cudnn.deterministic = enabled
    torch.backends.cudnn.benchmark = False


def fixed_scores_class():
    import torch
    from kvpress.presses.scorer_press import ScorerPress

    @dataclass
    class FixedScores(ScorerPress):
        """A scorer returning given scores, so that two presses are compared on the same ones (tests/test_presses)."""

        scores: torch.Tensor | None = None

        def score(self, module, hidden_states, keys, values, attentions, kwargs):
            return self.scores

    return FixedScores


def random_scores(kind: str, kv_len: int, generator):
    """The score families of tests/test_presses.py: ties, sparse spikes, signed and uniform scores."""
    import torch

    shape = (1, 2, kv_len)
    if kind == "ties":
        return torch.randint(0, 3, shape, generator=generator).float()
    if kind == "sparse":
        return torch.rand(shape, generator=generator).pow(8).mul(torch.rand(shape, generator=generator) < 0.2)
    if kind == "signed":
        return torch.randn(shape, generator=generator)
    return torch.rand(shape, generator=generator)


def kept_positions(press, scores) -> list[int]:
    """Positions ``press.compress`` keeps when its scorer returns ``scores``, on the scores' device."""
    import torch

    kv_len = scores.shape[-1]
    keys = torch.arange(kv_len, dtype=torch.float32, device=scores.device).view(1, 1, kv_len, 1)
    keys = keys.expand(1, scores.shape[1], kv_len, 2)
    compressed, _ = press.compress(SimpleNamespace(head_dim=2), None, keys, keys.clone(), None, {})
    return compressed[0, 0, :, 0].long().tolist()


def check_eg_selection(device: str) -> tuple[str, str]:
    """EG-ChunkKV keeps exactly kvpress's EntropyGatedChunkKVPress positions on the device (the CPU test's grid)."""
    import torch
    from kvpress import EntropyGatedChunkKVPress as Upstream

    from presses.eg_chunkkv import EntropyGatedChunkKVPress

    fixed = fixed_scores_class()
    cases = mismatches = cpu_differs = 0
    first = ""
    for kind in ("ties", "sparse", "signed", "uniform"):
        for kv_len in (1, 4, 9, 10, 11, 21, 40, 97, 256, 523):
            generator = torch.Generator().manual_seed(kv_len)
            for cr in (0.05, 0.25, 0.5, 0.75, 0.9, 0.97, 0.99):
                for _ in range(4):
                    scores = random_scores(kind, kv_len, generator)
                    on_device = fixed(compression_ratio=cr, scores=scores.to(device))
                    ours = kept_positions(
                        EntropyGatedChunkKVPress(press=on_device, chunk_length=10, low_entropy_chunk_length=4),
                        on_device.scores,
                    )
                    upstream = kept_positions(
                        Upstream(press=on_device, chunk_length=10, low_entropy_chunk_length=4), on_device.scores
                    )
                    on_cpu = fixed(compression_ratio=cr, scores=scores)
                    cpu = kept_positions(
                        EntropyGatedChunkKVPress(press=on_cpu, chunk_length=10, low_entropy_chunk_length=4), scores
                    )
                    cases += 1
                    cpu_differs += sorted(ours) != sorted(cpu)
                    if ours != upstream or len(ours) != max(1, int(kv_len * (1 - cr))):
                        mismatches += 1
                        first = first or f"first: {kind}, kv_len {kv_len}, cr {cr}"
    detail = (
        f"{cases - mismatches}/{cases} score vectors keep the same positions as kvpress's class on {device}; "
        f"{cpu_differs} differ from the same press on cpu (tie-breaking of topk/argsort across devices)"
    )
    return ("pass" if mismatches == 0 else "fail"), detail + (f"; {first}" if first else "")


def check_eg_syncs(device: str) -> tuple[str, str]:
    """Host-device synchronisations of one compress call (torch.cuda sync debug mode), ours against upstream."""
    import torch
    from kvpress import EntropyGatedChunkKVPress as Upstream

    from presses.eg_chunkkv import EntropyGatedChunkKVPress

    if not device.startswith("cuda"):
        return "info", "not applicable on cpu"
    fixed = fixed_scores_class()
    generator = torch.Generator().manual_seed(0)
    parts = []
    worst = 0
    for cr in (0.5, 0.9):
        scorer = fixed(compression_ratio=cr, scores=torch.rand(1, 8, 4096, generator=generator).to(device))
        for name, press in (
            ("eg_chunkkv", EntropyGatedChunkKVPress(press=scorer, chunk_length=10)),
            ("kvpress", Upstream(press=scorer, chunk_length=10)),
        ):
            kept_positions(press, scorer.scores)  # warm-up
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    keys = torch.zeros(1, 8, 4096, 2, device=device)
                    press.compress(SimpleNamespace(head_dim=2), None, keys, keys, None, {})
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            syncs = sum("synchroniz" in str(warning.message) for warning in caught)
            seconds = median_seconds(
                lambda p=press, k=keys: p.compress(SimpleNamespace(head_dim=2), None, k, k, None, {}), device, 2, 10
            )
            if name == "eg_chunkkv":
                worst = max(worst, syncs)
            parts.append(f"{name} cr {cr}: {syncs} syncs, {seconds * 1e3:.2f} ms")
    detail = "4096 tokens, 8 heads, fixed scores: " + "; ".join(parts)
    return ("pass" if worst <= 3 else "fail"), detail + " (docstring: at most 3 per layer)"


def test_grid() -> tuple[list[str], list[str], dict]:
    """The press x scorer x case grid of tests/test_presses.py (imported, so that it follows the tests)."""
    from tests import test_presses

    return list(test_presses.PRESSES), list(test_presses.SCORERS), dict(test_presses.CASES)


def prefill(model, press, context_length: int, seed: int = 0):
    import torch
    from transformers import DynamicCache

    input_ids = torch.randint(
        0, model.config.vocab_size, (1, context_length), generator=torch.Generator().manual_seed(seed)
    ).to(model.device)
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model(input_ids, past_key_values=cache)
    return cache


def check_budgets(device: str, scratch: Path, smoke: bool) -> tuple[str, str]:
    """Every press x scorer keeps its budget in every layer (tests/test_presses.py's check) on the device."""
    from hydra.utils import instantiate

    from evaluate.engine.cost import measure_kept_ratio
    from evaluate.models.random_models import TinyRandomModel
    from tests.support import compose_config, kept_bounds

    presses, scorers, cases = test_grid()
    if smoke:
        scorers = [scorer for scorer in scorers if scorer in ("snapkv", "dropkv")]
    model = TinyRandomModel().load_model(device, "float32", "sdpa")
    failures, checked, first = 0, 0, ""
    for press_name in presses:
        for scorer in scorers:
            for cr, lengths in cases.items():
                cfg = compose_config(scratch, f"press={press_name}", f"scorer={scorer}", f"cr={cr}")
                press = instantiate(cfg.press.press)
                for context_length in lengths:
                    cache = prefill(model, press, context_length)
                    low, high = kept_bounds(press_name, context_length, cr)
                    lengths_ = [layer.keys.shape[2] for layer in cache.layers]
                    kept = measure_kept_ratio(model, cache, context_length) * context_length
                    ok = low - 1e-3 <= kept <= high + 1e-3
                    if press_name != "adakv":
                        ok = ok and all(low <= length <= high for length in lengths_)
                    checked += 1
                    if not ok:
                        failures += 1
                        first = first or f"first: {press_name}/{scorer} cr {cr} L {context_length}: {lengths_} vs {low}"
    detail = f"{checked - failures}/{checked} prefills within budget ({len(presses)} presses x {len(scorers)} scorers)"
    return ("pass" if not failures else "fail"), detail + (f"; {first}" if first else "")


def check_eg_real_prefill(device: str, scratch: Path) -> tuple[str, str]:
    """EG-ChunkKV and kvpress's class compress a real prefill identically, for every scorer, on the device."""
    import torch
    from hydra.utils import instantiate

    from evaluate.models.random_models import TinyRandomModel
    from tests.support import compose_config

    _, scorers, _ = test_grid()
    model = TinyRandomModel().load_model(device, "float32", "sdpa")
    differing = []
    for scorer in scorers:
        caches = [
            prefill(model, instantiate(compose_config(scratch, f"press={name}", f"scorer={scorer}").press.press), 523)
            for name in ("eg_chunkkv", "eg_chunkkv_upstream")
        ]
        same = all(
            torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
            for a, b in zip(caches[0].layers, caches[1].layers, strict=True)
        )
        if not same:
            differing.append(scorer)
    detail = f"{len(scorers) - len(differing)}/{len(scorers)} scorers give identical caches (523 tokens, cr 0.5)"
    return ("pass" if not differing else "fail"), detail + (f"; differ: {', '.join(differing)}" if differing else "")


def check_dropkv(device: str) -> tuple[str, str]:
    """DropKV's closed form on the device against brute-force eviction in float64 (tests/test_dropkv.py's cases)."""
    import torch

    from scorers.dropkv import dropkv_scores
    from tests.test_dropkv import brute_force_scores, sink_inputs

    worst = 0.0
    failures = []
    for heads, kv_heads in ((4, 2), (3, 3), (4, 1)):
        queries, keys, values, scaling = sink_inputs(heads, kv_heads)
        expected = brute_force_scores(queries, keys, values, scaling)
        actual = dropkv_scores(queries.to(device), keys.to(device), values.to(device), scaling, epsilon=0.0)
        error = ((actual.double().cpu() - expected).abs() / (expected.abs() * 1e-4 + 1e-6 * expected.max())).max()
        worst = max(worst, float(error))
        try:
            torch.testing.assert_close(actual.double().cpu(), expected, rtol=1e-4, atol=1e-6 * expected.max().item())
        except AssertionError:
            failures.append(f"{heads}/{kv_heads}")
    detail = f"3 head layouts, fp32 on {device} vs float64 brute force; worst error {worst:.2f} of the test's tolerance"
    return ("pass" if not failures else "fail"), detail + (f"; outside: {', '.join(failures)}" if failures else "")


def check_prefill_probe(device: str) -> tuple[str, str]:
    """runner.PrefillProbe on the device: it records the context length and times the prefill (with its sync)."""
    import torch
    from transformers import DynamicCache

    from evaluate.engine.pipeline_hooks import PrefillProbe
    from evaluate.models.random_models import TinyRandomModel

    model = TinyRandomModel().load_model(device, "float32", "sdpa")
    probe = PrefillProbe(model)
    try:
        input_ids = torch.randint(0, model.config.vocab_size, (1, 777), device=device)
        with torch.no_grad():
            model.model(input_ids=input_ids, past_key_values=DynamicCache())
            model.model(input_ids=input_ids[:, :1], past_key_values=DynamicCache())  # not the prefill: ignored
    finally:
        probe.close()
    ok = probe.context_length == 777 and probe.seconds > 0
    return ("pass" if ok else "fail"), f"context_length {probe.context_length}, prefill {probe.seconds * 1e3:.2f} ms"


def token_lists(answers: list[str]) -> list[list[str]]:
    return [answer.split() for answer in answers]


def compare_tokens(expected: list[str], got: list[str]) -> tuple[int, int, int, str]:
    """Rows that differ, tokens that differ (positions, plus the length difference), tokens compared, first place."""
    rows = tokens = total = 0
    first = ""
    for index, (a, b) in enumerate(zip(token_lists(expected), token_lists(got), strict=True)):
        total += max(len(a), len(b))
        positions = [i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y]
        differing = len(positions) + abs(len(a) - len(b))
        if differing:
            rows += 1
            tokens += differing
            where = positions[0] if positions else min(len(a), len(b))
            first = first or f"first at row {index}, token {where} of {len(a)}"
    return rows, tokens, total, first


def ids_tokenizer(tokenizer):
    """The tokenizer, decoding to the token ids themselves: greedy answers are compared token by token."""
    tokenizer.decode = lambda ids, skip_special_tokens=False, **kwargs: " ".join(str(int(token)) for token in ids)
    return tokenizer


def check_batched_decoding(device: str, dtype: str, smoke: bool) -> tuple[str, str]:
    """evaluate/engine/decoding_pool.py's pool against kvpress's pipeline one question at a time
    (tests/test_decoding.py's rows: caches of five presses, uneven ChunkKV layers, AdaKV masks, three question
    lengths and budgets)."""
    from evaluate.engine.context_budget import make_pipeline
    from evaluate.engine.decoding_pool import decode_all
    from evaluate.models.layer_masks import fit_masks_to_layers
    from evaluate.models.random_models import TinyRandomModel
    from tests.test_decoding import pipeline_tokens, requests_over_points

    results = []
    for architecture in ("llama",) if smoke else ("llama", "qwen3"):
        source = TinyRandomModel(architecture=architecture, weight_scale=3.0)
        tokenizer = source.load_tokenizer()
        model = source.load_model(device, dtype, "sdpa")
        fit_masks_to_layers(model)
        pipe = make_pipeline(model, tokenizer, device)
        requests = requests_over_points(model, pipe, [40, 17, 1])
        expected = [" ".join(map(str, pipeline_tokens(model, pipe, request))) for request in requests]
        for batch_size in (1, 16):
            got = [" ".join(map(str, tokens)) for tokens in decode_all(model, requests, batch_size)]
            results.append((architecture, batch_size, len(requests), *compare_tokens(expected, got)))
    differing = sum(row[3] for row in results)
    # A pool of one row equals the pipeline in every dtype (tests/test_dtype_agreement.py); a batched pool in half
    # precision rounds otherwise, which is measured, not failed.
    alone = sum(row[3] for row in results if row[1] == 1)
    detail = "; ".join(
        f"{arch} pool of {size}: {rows} of {count} rows differ, {tokens}/{total} tokens"
        + (f" ({first})" if first else "")
        for arch, size, count, rows, tokens, total, first in results
    )
    if dtype == "float32" or alone:
        return ("pass" if differing == 0 else "fail"), detail
    return ("pass" if differing == 0 else "info"), detail


def sweep_points() -> list[tuple[str, ...]]:
    from tests import test_sweep

    return [tuple(point) for point in test_sweep.POINTS]


def check_sweep(device: str, dtype: str, scratch: Path, smoke: bool) -> tuple[str, str]:
    """A sweep's shared prefill + batched decoding against one pipeline run per point (tests/test_sweep.py)."""
    from evaluate import rundir
    from evaluate.models.random_models import TinyRandomModel
    from evaluate.points.config import run_dir
    from evaluate.run import entry as sweep
    from tests.support import compose_config, with_shared_context

    original = TinyRandomModel.load_tokenizer
    TinyRandomModel.load_tokenizer = lambda self: ids_tokenizer(original(self))
    try:
        points = sweep_points()[: 5 if smoke else None]
        extra = ("limit=null", "+model.source.weight_scale=3.0", f"device={device}", f"dtype={dtype}")

        def configs(out: Path):
            return [with_shared_context(compose_config(out, *point, *extra)) for point in points]

        swept = configs(scratch / f"sweep_{dtype}")
        sweep.run_sweep(swept)
        rows = tokens = total = 0
        first = ""
        prefill_seconds = []
        devices = set()
        for cfg, swept_cfg in zip(configs(scratch / f"separate_{dtype}"), swept, strict=True):
            sweep.run(cfg)
            expected = rundir.read_predictions(run_dir(cfg) / rundir.PREDICTIONS)
            got = {
                row["id"]: row["prediction"] for row in rundir.read_predictions(run_dir(swept_cfg) / rundir.PREDICTIONS)
            }
            r, t, n, f = compare_tokens(
                [row["prediction"] for row in expected], [got.get(row["id"], "") for row in expected]
            )
            rows, tokens, total = rows + r, tokens + t, total + n
            first = first or (f"{run_dir(cfg).name}: {f}" if f else "")
            record = rundir.read_json(run_dir(cfg) / rundir.RUN)
            prefill_seconds.append(record.get("prefill_seconds", 0.0))
            devices.add(record.get("device"))
    finally:
        TinyRandomModel.load_tokenizer = original
    detail = (
        f"{len(points)} points x 9 questions (tiny {dtype} model): {rows} rows differ, {tokens}/{total} tokens"
        + (f" ({first})" if first else "")
        + f"; separate runs on {', '.join(sorted(map(str, devices)))}, PrefillProbe prefill seconds > 0 in"
        f" {sum(s > 0 for s in prefill_seconds)}/{len(prefill_seconds)}"
    )
    probe_ok = all(s > 0 for s in prefill_seconds)
    if dtype == "float32":
        return ("pass" if rows == 0 and probe_ok else "fail"), detail
    return ("pass" if rows == 0 else "info"), detail


def stage_correctness(args: argparse.Namespace) -> int:
    import torch

    device, smoke = args.device, bool(args.smoke)
    torch.manual_seed(0)
    checks = Checks(device, args.out, args.work)
    nondeterministic: set[str] = set()
    with tempfile.TemporaryDirectory(dir=args.work) as scratch_name:
        scratch = Path(scratch_name)
        checks.run(
            "eg_chunkkv selection = kvpress EntropyGatedChunkKVPress", "float32", lambda: check_eg_selection(device)
        )
        checks.run("eg_chunkkv host syncs per layer", "float32", lambda: check_eg_syncs(device))
        checks.run("every press x scorer keeps its budget", "float32", lambda: check_budgets(device, scratch, smoke))
        checks.run("eg_chunkkv = upstream on a real prefill", "float32", lambda: check_eg_real_prefill(device, scratch))
        checks.run("dropkv closed form = brute force", "float32", lambda: check_dropkv(device))
        checks.run("PrefillProbe", "float32", lambda: check_prefill_probe(device))
        for dtype in ("float32", "bfloat16"):
            deterministic(dtype == "bfloat16")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                checks.run(
                    "batched decoding = pipeline", dtype, lambda d=dtype: check_batched_decoding(device, d, smoke)
                )
                checks.run(
                    "shared-prefill sweep = separate runs",
                    dtype,
                    lambda d=dtype: check_sweep(device, d, scratch, smoke),
                )
            nondeterministic |= {
                str(w.message).splitlines()[0][:160] for w in caught if "deterministic" in str(w.message)
            }
            deterministic(False)
    if nondeterministic:
        checks.notes = [
            "",
            "Ops without a deterministic kernel (bf16 checks, warn_only):",
            *(f"- {message}" for message in sorted(nondeterministic)),
        ]
    checks.write()
    return 1 if any(row.status in ("fail", "error") for row in checks.rows) else 0
