"""The trace's candidates (minillm/runtime/candidates.py): ``top_candidates`` (one partition, then a sort of
the few) against the full stable sort of the whole distribution, the definition it replaced, ties and
zeros included.
"""

from __future__ import annotations

import numpy as np

from minillm.runtime.candidates import top_candidates


def _full_sort_top(probs, k):
    """The definition: every id with probability > 0, stably sorted by probability, first k."""
    kept = np.flatnonzero(probs > 0)
    top = kept[np.argsort(-probs[kept], kind="stable")[:k]]
    return [(int(i), float(probs[i])) for i in top]


def test_top_candidates_is_the_full_stable_sort():
    rng = np.random.default_rng(0)
    cases = [rng.dirichlet(np.ones(49152)).astype(np.float32) for _ in range(3)]
    tied = np.zeros(100, np.float32)
    tied[[3, 7, 11, 50, 60, 99]] = [0.1, 0.3, 0.1, 0.1, 0.3, 0.1]  # ties at the 5th place: lower ids first
    cases += [tied, np.array([0.0, 0.5, 0.0, 0.5], np.float32), np.array([1.0], np.float32)]
    for probs in cases:
        for k in (1, 5):
            assert top_candidates(probs, k) == _full_sort_top(probs, k)
    # worked by hand: ids 7 and 60 at 0.3, then the four ties at 0.1 in id order: 3, 11, 50 (k=5)
    assert [i for i, _ in top_candidates(tied, 5)] == [7, 60, 3, 11, 50]
