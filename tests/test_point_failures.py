"""A point's failure stays with its point: in a sweep that mixes a press that raises with healthy ones, only the
failing point's rows are recorded as failed, and every other point answers exactly as in a sweep without it, on the
pool (where rows of every point share each decoding step) and on kvpress's pipeline path, for decoding-time presses
(which raise inside a pool step, on their own row) and prefill presses (which raise while a context is compressed).

TOVA is made to raise by patching its ``score``: ``decoding_tova`` then fails in the pool's step at each row's first
compression, after its rows have decoded beside the others' (a row that stops before it never compresses and is
answered), and ``tova`` while each context is compressed. The scorers that tie in float32 on the
tiny model (tests/test_decoding_compression.py) compare in float64.
"""

import pytest
import torch
from kvpress import TOVAPress

from evaluate import rundir
from evaluate.engine import decoding_compression
from evaluate.points.config import run_dir
from evaluate.run.entry import run_sweep
from tests.support import compose_config, with_conversations
from tests.test_decoding_compression import KNOBS, LIVELY
from tests.test_decoding_compression import ruler_file as ruler_file  # noqa: F401  (the module's fixture)

HEALTHY = ("decoding_streaming_llm", "decoding_keydiff", "knorm", "snapkv")
FAILING = ("decoding_tova", "tova")


class TovaBroke(RuntimeError):
    """The failure planted in TOVA's scores."""


def _raise(*args, **kwargs):
    raise TovaBroke("planted: tova's scores failed")


def sweep(tmp_path, ruler_file, methods, decode_batch_size: int) -> dict[str, list[dict]]:
    """The rows each method's point recorded in one sweep of ``methods``."""
    cfgs = [
        compose_config(
            tmp_path,
            "benchmark=ruler",
            f"benchmark.path={ruler_file}",
            "limit=null",
            LIVELY,
            f"method={method}",
            *(f"{knob}={value}" for knob, value in KNOBS.items()),
            f"decode_batch_size={decode_batch_size}",
            "dtype=float64",
            "likelihood=false",
        )
        for method in methods
    ]
    run_sweep(cfgs)
    return {
        method: rundir.read_predictions(run_dir(cfg) / rundir.PREDICTIONS)
        for method, cfg in zip(methods, cfgs, strict=True)
    }


@pytest.mark.slow  # two sweeps of six and four points on the tiny model: about 15 s a path
@pytest.mark.parametrize("decode_batch_size", [32, 1], ids=["pool", "pipeline"])
def test_a_failing_point_fails_alone_and_the_others_answer_as_without_it(
    tmp_path, ruler_file, monkeypatch, decode_batch_size
):
    alone = sweep(tmp_path / "alone", ruler_file, HEALTHY, decode_batch_size)
    monkeypatch.setattr(TOVAPress, "score", _raise)
    mixed = sweep(tmp_path / "mixed", ruler_file, HEALTHY + FAILING, decode_batch_size)

    planted = "planted: tova's scores failed"
    # At the prefill every context is compressed; while decoding, only the rows that reach their first compression.
    assert all(planted in row["error"] for row in mixed["tova"])
    failed = [row for row in mixed["decoding_tova"] if planted in row.get("error", "")]
    assert 0 < len(failed) <= len(mixed["decoding_tova"])
    for method in HEALTHY:
        assert not [row for row in mixed[method] if row.get("error")], method
        predictions = {row["id"]: row["prediction"] for row in mixed[method]}
        assert predictions == {row["id"]: row["prediction"] for row in alone[method]}, method
        assert len(predictions) == len(alone[method]) > 1


def test_a_row_whose_fake_keys_cannot_be_found_fails_alone(monkeypatch):
    """AdaKV as a decoding press hides keys behind kvpress's fake keys, searched for all rows of a step at once; where
    one row's search raises, the others get the keys their own search gives, and the failing row is handed back."""
    real = decoding_compression.search_hyperplane

    def search(grouped):
        if torch.isnan(grouped).any():
            raise ValueError("Could not find fake keys")
        return real(grouped)

    monkeypatch.setattr(decoding_compression, "search_hyperplane", search)
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(3, 4, 1, 8, generator=generator)  # 3 slots, 4 query heads on 2 KV heads, one step
    query[1] = float("nan")
    keys = torch.randn(3, 2, 10, 8, generator=generator)
    masks = {slot: (torch.tensor([0, 1]), torch.tensor([2, 5])) for slot in range(3)}
    alone = keys.clone()
    assert decoding_compression.write_fake_keys(alone, query, {0: masks[0], 2: masks[2]}) == {}

    failures = decoding_compression.write_fake_keys(keys, query, masks)

    assert list(failures) == [1] and "Could not find fake keys" in str(failures[1])
    assert torch.equal(keys[[0, 2]], alone[[0, 2]])
    assert torch.equal(keys[1], alone[1])  # the failing row's keys are left as they were


@pytest.mark.slow  # two sweeps of conversations on the tiny model, on each path
@pytest.mark.parametrize("decode_batch_size", [32, 1], ids=["pool", "pipeline"])
def test_a_conversation_whose_press_fails_fails_its_turns_alone(tmp_path, monkeypatch, decode_batch_size):
    """A conversation's row whose decoding press raises leaves the pool with the turn it was on, and the turns it had
    left fail with it (none waits forever); the other point's conversations answer as in a sweep without it."""
    knobs = (*(f"{knob}={value}" for knob, value in KNOBS.items()), "turns=multi", "history=model", "dtype=float64")

    def conversations(output_dir, methods):
        cfgs = [
            with_conversations(
                compose_config(
                    output_dir,
                    "limit=null",
                    LIVELY,
                    f"method={method}",
                    *knobs,
                    f"decode_batch_size={decode_batch_size}",
                )
            )
            for method in methods
        ]
        run_sweep(cfgs)
        return [rundir.read_predictions(run_dir(cfg) / rundir.PREDICTIONS) for cfg in cfgs]

    (alone,) = conversations(tmp_path / "alone", ["decoding_knorm"])
    monkeypatch.setattr(TOVAPress, "score", _raise)
    mixed, failing = conversations(tmp_path / "mixed", ["decoding_knorm", "decoding_tova"])

    assert {row["id"]: row["prediction"] for row in mixed} == {row["id"]: row["prediction"] for row in alone}
    assert not [row for row in mixed if row.get("error")]
    assert len(failing) == len(alone) == 6  # every turn is recorded, answered or failed
    failed = [row for row in failing if "planted" in row.get("error", "")]
    assert failed
    # A conversation's turns after its first failed one failed too.
    for conversation in {row["conversation"] for row in failed}:
        turns = sorted((row["turn"], bool(row.get("error"))) for row in failing if row["conversation"] == conversation)
        first = next(turn for turn, error in turns if error)
        assert all(error for turn, error in turns if turn >= first)
