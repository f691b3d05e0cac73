"""Stages of scripts/gpu_check.sh: PressBench's CUDA code paths checked for correctness and timed.

    python scripts/gpu_check.py env          --device cuda --out OUT --work WORK   # versions, imports, ruler_synth data
    python scripts/gpu_check.py correctness  --device cuda --out OUT --work WORK   # -> OUT/correctness.csv
    python scripts/gpu_check.py throughput   --device cuda --out OUT --work WORK   # -> OUT/throughput.csv
    python scripts/gpu_check.py launcher     --device cuda --out OUT --work WORK   # hydra/launcher=gpus
    python scripts/gpu_check.py summarize    --device cuda --out OUT --work WORK   # -> OUT/summary.md

Each stage leaves a JSON fragment in WORK that ``summarize`` turns into summary.md together with the stage
statuses gpu_check.sh records (WORK/stages.tsv) and the tables of scripts/bench_presses.py and bench_sweep.py.
``--smoke 1`` scales every model and context down so that all stages run in minutes on a 2-core CPU.
docs/gpu.md says what each stage measures and why.
"""

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# The work of an 8B model, against which the throughput stage sets its timings: a prefill of 4096 tokens and a
# decoding step's weight reads. Their reference times are these over the GPU's ceilings (--peak-tflops, --peak-tbs).
REFERENCE_PREFILL_TFLOP = 70.0
REFERENCE_DECODE_GB = 16.0

PACKAGES = (
    "torch transformers tokenizers huggingface-hub safetensors accelerate kvpress hydra-core omegaconf "
    "antlr4-python3-runtime datasets pyarrow pandas numpy fsspec dill multiprocess fire cachetools wonderwords nltk "
    "needlehaystack pressbench"
).split()
IMPORTS = (
    "evaluate.engine.pipeline",
    "evaluate.run.entry",
    "evaluate.engine.decoding_pool",
    "evaluate.models.random_models",
    "evaluate.benchmarks.ruler_synth",
    "presses.eg_chunkkv",
    "scorers.dropkv",
    "hydra_plugins.pressbench_gpus_launcher.gpus_launcher",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=["env", "correctness", "throughput", "launcher", "summarize"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, required=True, help="folder of the files that come back")
    parser.add_argument("--work", type=Path, required=True, help="scratch folder shared by the stages")
    parser.add_argument("--smoke", type=int, default=0, help="1: scaled-down shapes for a CPU dry run")
    parser.add_argument("--budget", type=int, help="summarize: the script's time budget in seconds")
    # Datasheet ceilings of the GPU the check runs on; the defaults are an H200's (dense bf16, HBM3e).
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="throughput: the GPU's dense bf16 TFLOP/s")
    parser.add_argument("--peak-tbs", type=float, default=4.8, help="throughput: the GPU's memory bandwidth, TB/s")
    return parser.parse_args(argv)


def save_fragment(work: Path, stage: str, fragment: dict) -> None:
    work.mkdir(parents=True, exist_ok=True)
    (work / f"{stage}.json").write_text(json.dumps(fragment, indent=1, default=str))


def synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def median_seconds(fn: Callable[[], object], device: str, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# --- env --------------------------------------------------------------------------------------------------------


def stage_env(args: argparse.Namespace) -> int:
    lines, failures = [], 0
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "missing"
    import torch

    gpu = "none"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = (
            f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs, "
            f"capability {props.major}.{props.minor}, CUDA {torch.version.cuda}"
        )
    smi = ""
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        smi = "nvidia-smi not available"
    lines += [
        f"- python {platform.python_version()} ({sys.executable}), {os.cpu_count()} CPUs, {platform.platform()}",
        f"- torch {torch.__version__}; GPU: {gpu}; nvidia-smi: {smi or 'n/a'}",
        "- packages: " + ", ".join(f"{name} {version}" for name, version in versions.items()),
    ]
    for module in IMPORTS:
        try:
            __import__(module)
        except Exception as error:  # report every failing import, not only the first
            failures += 1
            lines.append(f"- **import {module} failed**: {type(error).__name__}: {error}")
    try:
        import datasets

        if getattr(datasets, "STUB", False):
            lines.append("- datasets did not import on this machine and is a stub (kvpress only needs the name)")
    except Exception as error:
        failures += 1
        lines.append(f"- **import datasets failed**: {type(error).__name__}: {error}")
    import kvpress
    import transformers

    lines.append(
        f"- transformers from {Path(transformers.__file__).parent}, kvpress from {Path(kvpress.__file__).parent}"
    )

    # ruler_synth's offline data: essays (needlehaystack), Punkt (nltk) and word keys (wonderwords).
    try:
        from hydra.utils import instantiate

        from evaluate.models.random_models import build_tiny_tokenizer
        from tests.support import compose_config

        tokenizer = build_tiny_tokenizer()
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as scratch:
            cfg = compose_config(
                Path(scratch), "benchmark.max_seq_length=4096", "benchmark.tasks=[niah_single_2,niah_single_1]"
            )
            samples = instantiate(cfg.benchmark).load(tokenizer, 1)
        lines.append(
            f"- ruler_synth data: {len(samples)} samples ({', '.join(sample.task for sample in samples)}) generated "
            f"offline in {time.perf_counter() - start:.1f} s"
        )
        if len(samples) != 2:
            failures += 1
    except Exception as error:
        failures += 1
        lines.append(f"- **ruler_synth data check failed**: {type(error).__name__}: {error}")
    save_fragment(args.work, "env", {"lines": lines})
    print("\n".join(lines))
    return 1 if failures else 0


# --- correctness ------------------------------------------------------------------------------------------------


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

    from evaluate.engine.pipeline import PrefillProbe
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
    from evaluate.engine.decoding_pool import decode_all
    from evaluate.engine.pipeline import make_pipeline
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
    detail = "; ".join(
        f"{arch} pool of {size}: {rows} of {count} rows differ, {tokens}/{total} tokens"
        + (f" ({first})" if first else "")
        for arch, size, count, rows, tokens, total, first in results
    )
    if dtype == "float32":
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


# --- throughput -------------------------------------------------------------------------------------------------

SMOKE_SHAPE = {
    "num_hidden_layers": 2,
    "hidden_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "intermediate_size": 1024,
    "vocab_size": 8192,
}


def profiler_summary(profile, device: str) -> tuple[str, list[str]]:
    """One line for a profiled step (kernel time, CPU time, launches, top op) and the top rows of its table."""
    averages = profile.key_averages()

    def device_time(event) -> float:
        return getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0))

    cpu_ms = sum(event.self_cpu_time_total for event in averages) / 1e3
    if device.startswith("cuda"):
        kernels = [e for e in profile.events() if str(getattr(e, "device_type", "")).endswith("CUDA")]
        kernel_ms = sum(e.time_range.elapsed_us() for e in kernels) / 1e3
        device_ms = sum(device_time(event) for event in averages) / 1e3
        top = max(averages, key=device_time)
        line = (
            f"{kernel_ms:.2f} ms in {len(kernels)} CUDA kernels ({device_ms:.2f} ms self CUDA over all ops), "
            f"{cpu_ms:.2f} ms CPU (self, all ops); top: {top.key} {device_time(top) / 1e3:.2f} ms"
        )
        table = profile.key_averages().table(sort_by="self_cuda_time_total", row_limit=8)
    else:
        top = max(averages, key=lambda event: event.self_cpu_time_total)
        line = f"{cpu_ms:.2f} ms CPU (self, all ops); top: {top.key} {top.self_cpu_time_total / 1e3:.2f} ms"
        table = profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=8)
    return line, table.splitlines()


def stage_throughput(args: argparse.Namespace) -> int:
    import torch
    from transformers import DynamicCache

    from evaluate.models.random_models import RandomModel

    device = args.device
    is_cuda = device.startswith("cuda")
    dtype = "bfloat16" if is_cuda else "float32"
    shape = SMOKE_SHAPE if args.smoke else {}
    tokens = 512 if args.smoke else 4096
    batches = (1, 4) if args.smoke else (1, 4, 16)
    source = RandomModel(**shape)
    start = time.perf_counter()
    model = source.load_model(device, dtype, "sdpa")
    synchronize(device)
    build_seconds = time.perf_counter() - start
    element = torch.finfo(getattr(torch, dtype)).bits // 8
    weight_bytes = source.parameter_count() * element
    layers, heads = source.num_hidden_layers, source.num_attention_heads
    head_dim = source.hidden_size // heads
    kv_bytes_per_token = 2 * layers * source.num_key_value_heads * head_dim * element
    input_ids = torch.randint(0, source.vocab_size - 3, (1, tokens), device=device)
    rows = []

    with torch.no_grad():

        def run_prefill():
            cache = DynamicCache()
            model.model(input_ids=input_ids, past_key_values=cache)
            return cache

        prefill_seconds = median_seconds(run_prefill, device, 1, 3)
        # Dense FLOPs without the output layer (kvpress's prefill runs the bare decoder), plus causal attention.
        flops = (
            2 * source.parameter_count(embeddings=False) * tokens
            + 2 * 2 * layers * heads * head_dim * tokens * (tokens + 1) / 2
        )
        reference_tflop, reference_seconds = REFERENCE_PREFILL_TFLOP, REFERENCE_PREFILL_TFLOP / args.peak_tflops
        rows.append(
            {
                "measure": "prefill",
                "batch": 1,
                "tokens": tokens,
                "ms": prefill_seconds * 1e3,
                "tflops": flops / prefill_seconds / 1e12,
                "tb_per_s": "",
                "fraction_of_peak": flops / prefill_seconds / 1e12 / args.peak_tflops,
                "fraction_of_reference": reference_seconds / prefill_seconds,
                "note": f"{flops / 1e12:.1f} TFLOP; reference {reference_tflop} TFLOP in {reference_seconds:.3g} s",
            }
        )
        cache = run_prefill()
        profile_line, profile_table = "", []
        for cached in (tokens, max(1, int(tokens * 0.1))):
            for batch in batches:
                step_cache = DynamicCache()
                for index, layer in enumerate(cache.layers):
                    step_cache.update(
                        layer.keys[:, :, :cached].expand(batch, -1, -1, -1).contiguous(),
                        layer.values[:, :, :cached].expand(batch, -1, -1, -1).contiguous(),
                        index,
                    )
                step_ids = torch.randint(0, source.vocab_size - 3, (batch, 1), device=device)
                positions = torch.full((batch, 1), tokens, device=device)

                def step(c=step_cache, i=step_ids, p=positions, n=cached):
                    model(input_ids=i, past_key_values=c, position_ids=p)
                    c.crop(n)

                seconds = median_seconds(step, device, 3, 10 if args.smoke else 20)
                moved = weight_bytes + batch * cached * kv_bytes_per_token
                reference_gb, reference_step = REFERENCE_DECODE_GB, REFERENCE_DECODE_GB / 1e3 / args.peak_tbs
                rows.append(
                    {
                        "measure": "decode step",
                        "batch": batch,
                        "tokens": cached,
                        "ms": seconds * 1e3,
                        "tflops": "",
                        "tb_per_s": moved / seconds / 1e12,
                        "fraction_of_peak": moved / seconds / 1e12 / args.peak_tbs,
                        "fraction_of_reference": reference_step / seconds,
                        "note": f"{moved / 1e9:.2f} GB read (weights + cache); reference {reference_gb} GB in "
                        f"{reference_step * 1e3:.2g} ms",
                    }
                )
                if cached == tokens and batch == 1:
                    activities = [torch.profiler.ProfilerActivity.CPU]
                    if is_cuda:
                        activities.append(torch.profiler.ProfilerActivity.CUDA)
                    with torch.profiler.profile(activities=activities) as profile:
                        step()
                        synchronize(device)
                    profile_line, profile_table = profiler_summary(profile, device)
                del step_cache
    peak = torch.cuda.max_memory_allocated() / 2**30 if is_cuda else None
    with (args.out / "throughput.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:
            writer.writerow({key: f"{value:.4g}" if isinstance(value, float) else value for key, value in row.items()})

    def cell(value, digits=3):
        return f"{value:.{digits}g}" if isinstance(value, float) else str(value)

    name = "Llama-3.1-8B's shape" if not args.smoke else f"smoke shape {shape}"
    lines = [
        f"Random-weight model of {name} ({source.parameter_count() / 1e9:.2f} B parameters, {dtype}, sdpa), built on "
        f"{device} in {build_seconds:.1f} s" + (f"; peak {peak:.1f} GiB allocated" if peak else "") + ".",
        f"Ceilings (--peak-tflops, --peak-tbs): {args.peak_tflops:.0f} TFLOP/s bf16, {args.peak_tbs} TB/s. "
        f"`of reference`: an 8B model's work at those ceilings (prefill of 4096 tokens, {REFERENCE_PREFILL_TFLOP:.0f} "
        f"TFLOP: {REFERENCE_PREFILL_TFLOP / args.peak_tflops * 1e3:.0f} ms; decode step, {REFERENCE_DECODE_GB:.0f} GB "
        f"of weights: {REFERENCE_DECODE_GB / args.peak_tbs:.1f} ms) over the measured time.",
        "",
        "| measure | batch | tokens | ms | TFLOP/s | TB/s | of peak | of reference |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {r['measure']} | {r['batch']} | {r['tokens']} | {r['ms']:.2f} | {cell(r['tflops'])} | "
            f"{cell(r['tb_per_s'])} | {cell(r['fraction_of_peak'])} | {cell(r['fraction_of_reference'])} |"
            for r in rows
        ),
        "",
        f"torch.profiler, one decode step (batch 1, {tokens} cached tokens): {profile_line}",
        "",
        "```",
        *profile_table,
        "```",
    ]
    save_fragment(args.work, "throughput", {"lines": lines})
    print("\n".join(lines))
    return 0


# --- launcher ---------------------------------------------------------------------------------------------------


def stage_launcher(args: argparse.Namespace) -> int:
    """A small multirun through hydra/launcher=gpus against the default launcher, same points."""
    base = args.work / "launcher"
    device = "auto" if args.device.startswith("cuda") else args.device
    common = [
        "model=tiny_random",
        f"device={device}",
        "press=topk,eg_chunkkv",
        "cr=0.5,0.9",
        "limit=1",
        "benchmark.tasks=[niah_single_1]",
        "benchmark.max_seq_length=1024",
    ]
    results = {}
    for launcher in ("gpus", "shared_prefill"):
        start = time.perf_counter()
        completed = subprocess.run(
            [
                sys.executable,
                "-m",
                "evaluate",
                "-m",
                *common,
                f"hydra/launcher={launcher}",
                f"output_dir={base / launcher}",
                f"hydra.sweep.dir={base / (launcher + '_sweep')}",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        print(completed.stdout[-3000:], completed.stderr[-3000:], sep="\n")
        results[launcher] = (completed.returncode, time.perf_counter() - start)
    from evaluate import rundir

    lines = [f"`python -m evaluate -m {' '.join(common)} hydra/launcher=...`", ""]
    ok = all(code == 0 for code, _ in results.values())
    lines += [f"- {name}: exit {code}, {seconds:.1f} s" for name, (code, seconds) in results.items()]
    logs = sorted((base / "gpus_sweep" / "gpus").glob("*.log")) if (base / "gpus_sweep").exists() else []
    lines.append(f"- gpus launcher worker logs: {', '.join(log.name for log in logs) or 'none'}")
    runs = sorted(path.name for path in (base / "gpus").iterdir()) if (base / "gpus").exists() else []
    same, devices = 0, set()
    for name in runs:
        record = rundir.read_json(base / "gpus" / name / rundir.RUN) or {}
        devices.add(record.get("device"))
        a = (base / "gpus" / name / rundir.PREDICTIONS).read_bytes()
        b = base / "shared_prefill" / name / rundir.PREDICTIONS
        same += b.exists() and a == b.read_bytes()
    lines.append(
        f"- {len(runs)} runs through the gpus launcher on {', '.join(map(str, sorted(devices, key=str)))}; "
        f"predictions identical to the default launcher's in {same}/{len(runs)}"
    )
    expected_device = "cuda" if args.device.startswith("cuda") else args.device
    ok = ok and len(runs) == 4 and same == len(runs) and devices == {expected_device}
    save_fragment(args.work, "launcher", {"lines": lines})
    print("\n".join(lines))
    return 0 if ok else 1


# --- summarize --------------------------------------------------------------------------------------------------


def markdown_section(path: Path, start: str | None = None) -> list[str]:
    """A file's lines, or those from the heading ``start`` to the next heading of the same level."""
    if not path.exists():
        return [f"({path.name} was not written)"]
    lines = path.read_text().splitlines()
    if start is None:
        return lines
    try:
        first = lines.index(start)
    except ValueError:
        return lines
    level = start.split(" ")[0]
    end = next((i for i in range(first + 1, len(lines)) if lines[i].startswith(level + " ")), len(lines))
    return lines[first + 1 : end]


def press_targets(path: Path) -> list[str]:
    """The setting line and the targets table of bench_presses.py's Markdown."""
    lines = markdown_section(path)
    heading = next((line for line in lines if line.startswith("## Targets")), None)
    setting = [line for line in lines if line.startswith("One attention layer")]
    if heading is None:
        return lines
    return [*setting, "", f"Targets: {heading.removeprefix('## Targets').strip()}", *markdown_section(path, heading)]


def press_ratios(path: Path) -> list[str]:
    """EG-ChunkKV's compress time over kvpress's EntropyGatedChunkKVPress's, scorer by scorer."""
    if not path.exists():
        return []
    with path.open() as handle:
        rows = {(row["press"], row["scorer"]): row for row in csv.DictReader(handle)}
    lines = []
    for (press, scorer), row in sorted(rows.items()):
        upstream = rows.get(("eg_chunkkv_upstream", scorer))
        if press == "eg_chunkkv" and upstream:
            ours, theirs = float(row["ms"]), float(upstream["ms"])
            lines.append(f"| {scorer} | {ours:.2f} | {theirs:.2f} | {ours / theirs:.2f} |")
    if not lines:
        return []
    return ["| scorer | eg_chunkkv ms | kvpress EG ms | ratio |", "|---|---:|---:|---:|", *lines]


def stage_summarize(args: argparse.Namespace) -> int:
    kind = args.device.split(":")[0]
    stages = []
    stages_path = args.work / "stages.tsv"
    if stages_path.exists():
        stages = [line.split("\t") for line in stages_path.read_text().splitlines() if line.strip()]
    log = (args.out / "log.md").read_text(errors="replace").splitlines() if (args.out / "log.md").exists() else []
    for cols in stages:
        # A failed or stopped stage: its last line of output (usually the exception) goes into the note.
        if len(cols) >= 2 and cols[1] in ("failed", "timeout"):
            start = next((i for i, line in enumerate(log) if line.startswith(f"## stage {cols[0]} ")), None)
            if start is not None:
                end = next((i for i in range(start + 1, len(log)) if log[i].startswith("## stage ")), len(log))
                tail = [line.strip() for line in log[start + 1 : end] if line.strip()]
                errors = [line for line in tail if "Error" in line or "Exception" in line]
                note = (errors or tail or [""])[-1][:200].replace("|", "/")
                cols[4:] = [f"{cols[4]} {note}".strip() if len(cols) > 4 else note]

    def fragment(name: str) -> list[str]:
        path = args.work / f"{name}.json"
        return json.loads(path.read_text())["lines"] if path.exists() else ["(not run, or did not finish)"]

    lines = [
        f"# PressBench GPU check ({args.device})",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; `bash scripts/gpu_check.sh --device {args.device}`"
        f"{' (smoke shapes)' if args.smoke else ''}, budget {args.budget} s. Full output: log.md.",
        "",
        "## Stages",
        "",
        "| stage | status | exit | seconds | note |",
        "|---|---|---:|---:|---|",
        *(f"| {' | '.join((cols + [''] * 5)[:5])} |" for cols in stages),
        "",
        "## Environment",
        "",
        *fragment("env"),
        "",
        "## Correctness",
        "",
        *fragment("correctness"),
        "",
        "## Prefill and decode throughput (random weights)",
        "",
        *fragment("throughput"),
        "",
        "## Press overhead (scripts/bench_presses.py)",
        "",
        *press_targets(args.out / f"presses_{kind}.md"),
        "",
        "EG-ChunkKV against kvpress's own EntropyGatedChunkKVPress (compress, medians):",
        "",
        *(press_ratios(args.out / f"presses_{kind}.csv") or ["(no presses table)"]),
        "",
        "## Decoding pool against one-by-one decoding (scripts/bench_decoding.py)",
        "",
        *markdown_section(args.out / f"pool_{kind}.md"),
        "",
        "## Sweep: harness against one process per point (scripts/bench_sweep.py)",
        "",
        *markdown_section(args.out / f"sweep_prefill_{kind}.md"),
        "",
        "## gpus launcher",
        "",
        *fragment("launcher"),
        "",
    ]
    (args.out / "summary.md").write_text("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    return {
        "env": stage_env,
        "correctness": stage_correctness,
        "throughput": stage_throughput,
        "launcher": stage_launcher,
        "summarize": stage_summarize,
    }[args.stage](args)


if __name__ == "__main__":
    sys.exit(main())
