"""What a new user hits first, on the run's side (issue 34): settings that cannot load the model are refused before
any folder exists, a failure after the run opened is recorded ``failed``, a generation that cannot fit is refused,
``press=none`` is one run in a sweep of ratios, your own press's code is part of the run, and run.json says which
engine answered."""

from dataclasses import dataclass

import pytest
from omegaconf import OmegaConf, open_dict

from evaluate import rundir
from evaluate.benchmarks import Sample
from evaluate.errors import ConfigError
from evaluate.models.loading import Models
from evaluate.points.config import run_dir, run_name, validate_context_lengths
from evaluate.points.overrides import check_overrides
from evaluate.points.resolve import resolve
from evaluate.run import entry
from evaluate.run.entry import run, run_sweep
from evaluate.run.summary import run_summary
from tests.support import SharedContextBenchmark, compose_config, evaluate_cli, with_shared_context

TWO_SAMPLES = ("benchmark.tasks=[niah_single_1]", "limit=2")


@pytest.mark.slow  # a python -m evaluate process each (~8 s on 2 CPU cores)
@pytest.mark.parametrize(
    ("setting", "line"),
    [
        ("dtype=flaot16", "error: dtype=flaot16 is not a torch dtype; use auto, float32, float16 or bfloat16"),
        ("device=gpu", "error: device=gpu is not a device; use auto, cpu, cuda or cuda:N"),
        ("attn_implementation=sdpaa", "error: attn_implementation=sdpaa is not an attention transformers knows; use "
         "null (kvpress's rule), eager, sdpa, flash_attention_2, flash_attention_3 or flex_attention"),
        # kvpress's runner has no such setting: its rule (ours at null) falls back to sdpa without flash_attn. Asked
        # for by name, flash attention is refused where it cannot run rather than silently replaced.
        ("attn_implementation=flash_attention_2", "error: attn_implementation=flash_attention_2 needs a CUDA GPU and "
         "the flash_attn package, which this machine lacks (device=cpu); install it on a GPU machine, or use "
         "attn_implementation=null: kvpress's rule, flash_attention_2 where flash_attn imports, else sdpa"),
    ],
)  # fmt: skip
def test_a_setting_the_model_cannot_load_with_is_refused_in_one_line_before_any_folder(tmp_path, setting, line):
    out = tmp_path / "runs"
    result = evaluate_cli("model=tiny_random", "device=cpu", f"output_dir={out}", *TWO_SAMPLES, setting)
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == line
    assert "Traceback" not in result.stderr
    assert not out.exists()


@pytest.mark.slow  # a python -m evaluate process (~8 s on 2 CPU cores)
def test_a_binary_data_file_is_refused_in_one_line_and_leaves_no_lock_behind(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_bytes(bytes(range(256)) * 4)
    out = tmp_path / "runs"
    result = evaluate_cli("model=tiny_random", "device=cpu", f"output_dir={out}", "benchmark=ruler",
                          f"benchmark.path={data}")  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (
        f"error: {data} is not UTF-8 text (byte 128: invalid start byte): benchmark.path takes .jsonl, .json or "
        ".parquet rows, a saved dataset or a folder of them; point it at the data"
    )
    assert not out.exists()


def test_a_model_that_fails_to_load_leaves_no_folder(tmp_path, monkeypatch):
    def fails(self, plan):
        raise RuntimeError("the weights are corrupt (simulated)")

    monkeypatch.setattr(Models, "model", fails)
    cfg = compose_config(tmp_path / "runs", "press=none", *TWO_SAMPLES)
    with pytest.raises(RuntimeError, match="corrupt"):
        run(cfg)
    assert not (tmp_path / "runs").exists()


def test_a_failure_after_the_run_opened_is_recorded_failed_never_left_running(tmp_path, monkeypatch):
    def fails(plan, model, tokenizer):
        raise RuntimeError("the budget could not be computed (simulated)")

    monkeypatch.setattr(entry, "context_budget", fails)
    cfg = with_shared_context(compose_config(tmp_path, "press=topk"))
    with pytest.raises(RuntimeError, match="simulated"):
        run(cfg)
    record = rundir.read_json(run_dir(cfg) / rundir.RUN)
    assert record["status"] == "failed"
    assert record["error"] == "RuntimeError: the budget could not be computed (simulated)"
    assert not (run_dir(cfg) / rundir.METRICS).exists()


@dataclass
class LongQuestionBenchmark(SharedContextBenchmark):
    """``SharedContextBenchmark`` whose first question is longer than the tiny model's 8,192 positions."""

    def load(self, tokenizer, limit: int | None = None) -> list[Sample]:
        first, *rest = super().load(tokenizer, limit)
        return [Sample(**{**first.__dict__, "question": "why " * 5000}), *rest]


@pytest.mark.parametrize(
    ("benchmark", "message"),
    [
        ({"max_new_tokens": 100000}, "6 samples of {name} cannot fit in the model's 8192 positions, e.g. doc-0-0: "
         "100000 new tokens after 6 tokens of question and answer prefix; lower the rows' max_new_tokens (or cap "
         "them with max_new_tokens=N) or shorten their questions in benchmark.path, or leave those tasks out with "
         "benchmark.tasks=[...]"),
        ({"_target_": f"{__name__}.LongQuestionBenchmark"}, "1 samples of {name} cannot fit in the model's 8192 "
         "positions, e.g. doc-0-0: 6 new tokens after 20002 tokens of question and answer prefix; lower the rows' "
         "max_new_tokens (or cap them with max_new_tokens=N) or shorten their questions in benchmark.path, or leave "
         "those tasks out with benchmark.tasks=[...]"),
    ],
)  # fmt: skip
def test_a_generation_that_cannot_fit_the_model_is_refused_before_any_folder(tmp_path, benchmark, message):
    cfg = with_shared_context(compose_config(tmp_path / "runs", "press=none"))
    cfg.benchmark = OmegaConf.create({**OmegaConf.to_container(cfg.benchmark), **benchmark})
    with pytest.raises(ConfigError) as refused:
        run(cfg)
    assert str(refused.value) == message.format(name=run_name(cfg))
    assert not (tmp_path / "runs").exists()


def test_press_none_in_a_sweep_of_ratios_runs_once_as_every_points_baseline(tmp_path, caplog):
    points = [("press=none", "cr=0.5"), ("press=none", "cr=0.9"), ("press=topk", "cr=0.5"), ("press=topk", "cr=0.9")]
    cfgs = [with_shared_context(compose_config(tmp_path, *point)) for point in points]
    metrics = run_sweep(cfgs)
    assert metrics[0] == metrics[1] and metrics[0] is not None
    assert sorted(path.name.split("__")[2:4] for path in tmp_path.glob("shared_context__*")) == [
        ["no_press", "cr0.00"],
        ["snapkv", "cr0.50"],
        ["snapkv", "cr0.90"],
    ]
    [warning] = [record.getMessage() for record in caplog.records if "compresses nothing" in record.getMessage()]
    assert warning == (
        "press=none compresses nothing: cr=0.5,0.9 is ignored and the sweep runs it once, at cr=0, as the baseline "
        "of its points"
    )
    assert rundir.read_json(run_dir(cfgs[0]) / rundir.RUN)["sessions"] == 1


def test_ratios_that_round_alike_are_named_apart(tmp_path):
    assert rundir.cr_text(0.5) == "0.50" and rundir.cr_text(0.1) == "0.10"
    assert rundir.cr_text(0.999) == "0.999" and rundir.cr_text(0.998) == "0.998"
    assert rundir.cr_text(0.9375) == "0.9375" and rundir.cr_text(0.96875) == "0.96875"
    names = [run_name(compose_config(tmp_path, "press=topk", f"cr={cr}")) for cr in (0.998, 0.999)]
    assert [name.split("__")[3] for name in names] == ["cr0.998", "cr0.999"]


def test_run_json_says_which_engine_answered_and_why(tmp_path):
    pooled = with_shared_context(compose_config(tmp_path / "pool", "press=topk"))
    one_by_one = with_shared_context(compose_config(tmp_path / "pipeline", "press=topk", "decode_batch_size=1"))
    eager = with_shared_context(compose_config(tmp_path / "eager", "press=topk", "attn_implementation=eager"))
    for cfg in (pooled, one_by_one, eager):
        run(cfg)
    assert [rundir.read_json(run_dir(cfg) / rundir.RUN)["answered_by"] for cfg in (pooled, one_by_one, eager)] == [
        {
            "path": "pool",
            "why": "the press acts only after each layer's attention, so the context's prefill is shared and its "
            "questions are decoded in the pool (decode_batch_size=32)",
        },
        {"path": "pipeline", "why": "decode_batch_size=1 asks for kvpress's pipeline path, one question at a time"},
        {
            "path": "pipeline",
            "why": "under eager attention a press may read the attention weights, which a shared prefill does not keep",
        },
    ]


OWN_SCORER = '''
from dataclasses import dataclass

from kvpress import ScorerPress


@dataclass
class LargestKeysPress(ScorerPress):
    """Keeps the keys of largest norm."""

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        return keys.norm(dim=-1){edit}
'''


def test_your_own_press_code_is_recorded_and_an_edit_refuses_the_resume(tmp_path, monkeypatch):
    code = tmp_path / "code"
    code.mkdir()
    module = code / "own_scorer_for_test.py"
    module.write_text(OWN_SCORER.format(edit=""))
    monkeypatch.syspath_prepend(str(code))
    target = "scorer.press._target_=own_scorer_for_test.LargestKeysPress"
    cfg = with_shared_context(compose_config(tmp_path / "runs", "press=topk", "scorer=knorm", target, "limit=1"))
    run(cfg)
    [recorded] = rundir.read_yaml(run_dir(cfg) / rundir.CONFIG)["sources"].items()
    assert recorded[0] == "own_scorer_for_test" and len(recorded[1]) == 16

    module.write_text(OWN_SCORER.format(edit=" * 2"))
    for more in ((), ("limit=2",)):  # a finished run and a resume that adds rows are both refused
        with pytest.raises(ConfigError) as refused:
            run(with_shared_context(compose_config(tmp_path / "runs", "press=topk", "scorer=knorm", target, *more)))
        now = rundir.read_yaml(run_dir(cfg) / rundir.CONFIG)["sources"]["own_scorer_for_test"]
        assert now == recorded[1]  # the refusal wrote nothing
        assert str(refused.value).startswith(
            f"{run_dir(cfg)} was answered by other code of its press: own_scorer_for_test was {recorded[1]}, is "
        )
        assert str(refused.value).endswith(
            "(sha256); pass overwrite=true to redo the run with this code, output_dir=... to keep both, or restore "
            "the code it was answered with to resume"
        )
    run(with_shared_context(compose_config(tmp_path / "runs", "press=topk", "scorer=knorm", target, "overwrite=true")))
    assert rundir.read_yaml(run_dir(cfg) / rundir.CONFIG)["sources"]["own_scorer_for_test"] != recorded[1]


def test_kvpress_and_pressbench_presses_record_no_sources(tmp_path):
    cfg = with_shared_context(compose_config(tmp_path, "press=eg_chunkkv", "scorer=dropkv", "limit=1"))
    run(cfg)
    assert "sources" not in rundir.read_yaml(run_dir(cfg) / rundir.CONFIG)


def test_configs_on_hydra_searchpath_are_options(tmp_path):
    (tmp_path / "scorer").mkdir()
    (tmp_path / "scorer" / "mine.yaml").write_text(
        "name: mine\nmin_context: 0\npress:\n  _target_: kvpress.KnormPress\n"
    )
    with pytest.raises(ConfigError, match="scorer=mine is not an option of scorer"):
        check_overrides(["scorer=mine"])
    check_overrides([f"hydra.searchpath=[file://{tmp_path}]", "scorer=mine", "scorer.press._target_=x.Y"])
    check_overrides([f"hydra.searchpath=[file://{tmp_path}]", "scorer=knorm,mine"])
    with pytest.raises(ConfigError) as refused:
        check_overrides([f"hydra.searchpath=[file://{tmp_path}/nosuch]", "scorer=mine"])
    assert str(refused.value) == (
        f"hydra.searchpath names {tmp_path}/nosuch, which is not a folder; give file:///absolute/path"
    )


def test_the_suggested_sweep_keeps_your_press_its_knobs_and_config_folders(tmp_path):
    overrides = ["hydra.searchpath=[file:///my/conf]", "press=chunkkv", "scorer=mine", "scorer.press.window_size=4",
                 "+press.press.chunk_length=5", "cr=0.3", "limit=2"]  # fmt: skip
    cfg = with_shared_context(compose_config(tmp_path, "press=chunkkv", "cr=0.3", "limit=2"))
    metrics = run(cfg)
    [sweep] = [line for line in run_summary(resolve(cfg), metrics, overrides).splitlines() if "(a sweep:" in line]
    assert sweep.split("   (a sweep")[0].split() == [
        "python", "-m", "evaluate", "-m", "press=chunkkv", "scorer=mine", "scorer.press.window_size=4",
        "+press.press.chunk_length=5", "'hydra.searchpath=[file:///my/conf]'", "limit=2", "cr=0.5,0.7,0.9",
    ]  # fmt: skip


def test_a_scorer_yaml_may_leave_min_context_out(tmp_path):
    """A scorer without an observation window needs no ``min_context``: its YAML's name and press are enough."""
    cfg = compose_config(tmp_path, "press=topk", "scorer=knorm", "benchmark.tasks=[niah_single_1]")
    with open_dict(cfg):
        del cfg.scorer["min_context"]
    validate_context_lengths(resolve(cfg), 1)
    assert run(cfg)["tasks"]["niah_single_1"]["n"] == 3
    with open_dict(cfg):
        cfg.scorer.min_context = 5
    with pytest.raises(ConfigError, match="needs contexts longer than 5 tokens but the shortest context has 5"):
        validate_context_lengths(resolve(cfg), 5)
