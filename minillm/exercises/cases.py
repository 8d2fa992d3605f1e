"""The first grading: each unit against the textbook on generated cases and on the edges that matter.

Generated cases come from hypothesis (``--seed`` seeds them; a failure is shrunk to its smallest
case); the edges are written out: offset masks for a decode step and a chunked prefill, the sliding
window's edge, position 0, GQA groups, logits of 1e4, ties at the top-p boundary, an empty cache, a
truncate to 0, a token that ends in the middle of a UTF-8 character. Every check calls the student's
function with read-only copies (:func:`compare.frozen`) and compares with the textbook's
(``minillm/model/primitives.py``, ``runtime/sampling.py``, ``model/paged_kv_cache.py``,
``runtime/speculative.py``, ``text/detokenize.py``, ``model/kv_cache.py``). Each known mistake of
the issue's list is a function here computing the mistaken result, so a failure can name it.
"""

from __future__ import annotations

from collections.abc import Callable

from minillm.exercises import cases_forward, cases_sampling, cases_state
from minillm.exercises.generated import Context

__all__ = ["CHECKS", "Context"]

#: unit -> its unit cases: ``check(ns, ctx)``, ``ns`` the student's module, raising ``Failed``.
CHECKS: dict[str, Callable] = {
    name.removeprefix("check_"): fn
    for module in (cases_forward, cases_state, cases_sampling)
    for name, fn in vars(module).items()
    if name.startswith("check_") and callable(fn)
}
