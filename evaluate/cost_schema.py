"""The cost of a run as run.json records it: one dataclass whose fields are run.json's cost keys.

The recorder writes them from it (evaluate/run/recorder.py), the report reads its cost columns off it
(evaluate/report/), the tracking logs them (evaluate/run/tracking.py) and docs/run-directory.md's table lists them;
tests/test_cost_schema.py fails when any of them drifts. Adding a cost metric means a field here and the line that
measures it. It imports nothing, so the torch-free readers may import it.
"""

from dataclasses import asdict, dataclass, field, fields
from typing import Literal

# How the report prints a field: a measured number (two decimals), a count, or bytes shown in MiB.
Shown = Literal["number", "count", "mib"]


def _cost(unit: str, meaning: str, shown: Shown = "number", column: str | None = None, optional: bool = False) -> dict:
    """``optional``: measured for some runs only (conversations): a column of the report's cost table where one of
    its runs has it."""
    return {"unit": unit, "meaning": meaning, "shown": shown, "column": column, "optional": optional}


@dataclass(frozen=True)
class RunCost:
    """run.json's cost fields, cumulative over every session of the run (None where nothing was measured)."""

    prefill_seconds: float | None = field(
        default=None, metadata=_cost("s", "the run's share of its contexts' prefills (each second in one stage only)")
    )
    compress_seconds: float | None = field(default=None, metadata=_cost("s", "its share of the compression"))
    decode_seconds: float | None = field(default=None, metadata=_cost("s", "its share of the decoding steps"))
    likelihood_seconds: float | None = field(
        default=None, metadata=_cost("s", "its share of the teacher-forced passes of the likelihood fields")
    )
    retention_seconds: float | None = field(
        default=None,
        metadata=_cost("s", "its share of answer retention's kept sets and answer spans (diagnostics=)", optional=True),
    )
    attention_recall_seconds: float | None = field(
        default=None,
        metadata=_cost("s", "its share of attention recall's eager passes (diagnostics=attention)", optional=True),
    )
    generated_tokens: int | None = field(default=None, metadata=_cost("tokens", "tokens generated", "count"))
    decode_tokens_per_second: float | None = field(
        default=None, metadata=_cost("tokens/s", "generated tokens over decode seconds")
    )
    forward_passes_per_question: float | None = field(
        default=None, metadata=_cost("passes", "forward passes of the model per question answered (its share)")
    )
    prefills_per_conversation: float | None = field(
        default=None,
        metadata=_cost(
            "prefills",
            "prefills of a context per conversation answered (its share of shared ones): 1 under turns=multi, where "
            "every turn reuses the cache; one per group of turns asked on its own under turns=independent; none "
            "without conversations",
            optional=True,
        ),
    )
    kv_bytes_held_per_context: float | None = field(
        default=None,
        metadata=_cost("bytes", "bytes the compressed cache physically holds, per context", "mib", "KV MiB held"),
    )
    kv_bytes_kept_per_context: float | None = field(
        default=None,
        metadata=_cost(
            "bytes", "bytes of the pairs the press counts as kept, per context (fewer where it masks)", "mib",
            "KV MiB kept",
        ),
    )  # fmt: skip
    wall_seconds: float | None = field(
        default=None,
        metadata=_cost(
            "s",
            "the run's share of the elapsed time while it was answered: the answering loop's time shared among the "
            "runs it answered in proportion to their stage seconds, so a sweep's points sum to its answering time",
        ),
    )
    peak_memory_mb: float | None = field(
        default=None, metadata=_cost("MiB", "peak memory of the device (CUDA) or of the process (CPU)")
    )

    def record(self) -> dict:
        """The fields as run.json holds them."""
        return asdict(self)


COST_KEYS: tuple[str, ...] = tuple(cost.name for cost in fields(RunCost))


def cost_metadata(key: str) -> dict:
    """A cost key's unit, meaning, how the report shows it, and its column header where it is not the key."""
    return dict(next(cost for cost in fields(RunCost) if cost.name == key).metadata)


def docs_table() -> str:
    """The Markdown table of the cost keys, as docs/run-directory.md holds it."""
    lines = ["| key | unit | meaning |", "|---|---|---|"]
    lines += [f"| `{key}` | {cost_metadata(key)['unit']} | {cost_metadata(key)['meaning']} |" for key in COST_KEYS]
    return "\n".join(lines)
