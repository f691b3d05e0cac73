"""Whether a decoding-time press compressed at all: kvpress's ``DecodingPress`` compresses a row's cache to
``target_size`` pairs every ``compression_interval`` steps, and a row whose cache never outgrows its target (a short
answer, a large target, an interval longer than the answer) is answered by the uncompressed model. Each generated
row under such a press records whether a compression removed pairs of its cache before its answer ended
(``decoding_compressed``); a run's record counts them (run.json's ``decoding``), so that a run whose press never
compressed says so instead of passing for a press that holds the uncompressed score."""

from collections.abc import Iterable

DECODING_COMPRESSED = "decoding_compressed"


def decoding_record(rows: Iterable[dict]) -> dict[str, int] | None:
    """run.json's ``decoding``: how many of the answered rows a decoding-time press compressed, of how many; None
    when no row was answered under one."""
    flags = [row[DECODING_COMPRESSED] for row in rows if row.get(DECODING_COMPRESSED) is not None]
    if not flags:
        return None
    return {"rows_compressed": sum(flags), "rows": len(flags)}
