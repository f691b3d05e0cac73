"""Token budgets (``budget=N``): N KV pairs kept of each context's cache, instead of a fraction removed (``cr``).

No prefill press of kvpress 0.5.5 takes a token count: each keeps ``int(L * (1 - compression_ratio))`` pairs of an
L-token context (kvpress's ``compute_n_kept``, presses/exact_budget.py), per head or per layer. So a budget is met by
giving each context its own ratio, the one whose rounding keeps exactly N (:func:`ratio_keeping`), set on the press
right before that context is compressed (:func:`apply_budget`; both engines call it). The one press with a native
token budget, kvpress's ``DecodingPress`` (``target_size``), compresses while decoding, not the context, and is
refused, as is every press whose count of kept pairs is not that rounding of one ratio (evaluate/press_profile.py's
``why_not_budget``).

A context of at most N tokens is kept whole (ratio 0): the budget is a ceiling, as ``target_size`` is for kvpress's
``DecodingPress``. A budget that keeps every context whole would only rerun the uncompressed model and is refused.
"""

from kvpress import BasePress

from evaluate.press_profile import budget_scorer, why_not_budget


def ratio_keeping(context_length: int, budget: int) -> float:
    """The compression ratio at which ``int(context_length * (1 - ratio))``, kvpress's rounding, is exactly
    ``budget``: 0 (keep all) when the context has no more than ``budget`` tokens.

    The ratios that keep N of L pairs form the interval (1 - (N + 1) / L, 1 - N / L]; its right end, 1 - N / L,
    rounds in floating point to a ratio that keeps N - 1 for many pairs (L = 3, N = 1: 1 - 1/3 is
    0.6666666666666667, and 3 * (1 - that) is 0.9999999999999998, which keeps 0). Its middle, 1 - (N + 0.5) / L, is
    half a token from either end, far beyond any rounding error of a double."""
    if context_length <= budget:
        return 0.0
    ratio = 1 - (budget + 0.5) / context_length
    kept = int(context_length * (1 - ratio))
    if kept != budget:  # unreachable below 2**50 tokens; a wrong budget must never pass silently
        raise ArithmeticError(f"ratio {ratio!r} keeps {kept} of {context_length} tokens, not {budget}")
    return ratio


def apply_budget(press: BasePress, context_length: int, budget: int) -> float:
    """Set on ``press`` the ratio that keeps ``budget`` pairs of a ``context_length``-token context, and return it.
    Called before each context's compression: the press object serves every context of its point."""
    scorer = budget_scorer(press)
    if scorer is None:  # validate refused it before the model loaded
        raise ValueError(f"{type(press).__name__} cannot keep a token budget: {why_not_budget(press)}")
    scorer.compression_ratio = ratio_keeping(context_length, budget)
    return scorer.compression_ratio
