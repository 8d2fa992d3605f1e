"""The trace's candidates (minillm/runtime/candidates.py): ``top_candidates`` (one partition, then a sort of
the few) against the full stable sort of the whole distribution, the definition it replaced, ties and
zeros included; and OpenAI's logprobs (``model_logprobs``), the model's own whatever the sampler kept.
"""

from __future__ import annotations

import numpy as np

from minillm import SamplingParams
from minillm.runtime.candidates import model_logprobs, top_candidates
from minillm.runtime.sampling import probabilities, process_logits


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


def test_model_logprobs_are_the_raw_log_softmax_whatever_top_k_kept():
    logits = np.array([2.0, 5.0, 1.0, 4.0, -3.0, 2.0], dtype=np.float32)
    want = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum())
    params = SamplingParams(temperature=0.5, top_k=1, seed=0)
    drawn = probabilities(process_logits(logits, params))  # top-k keeps id 1 alone
    step = model_logprobs(logits, 1, 20, drawn)
    assert step["id"] == 1 and abs(step["logprob"] - want[1]) < 1e-12 and step["sampled_logprob"] == 0.0
    # 20 asked, 6 in the vocabulary: all of them, most likely first, ties by the lower id
    assert [i for i, _ in step["top"]] == [1, 3, 0, 5, 2, 4]
    np.testing.assert_allclose([v for _, v in step["top"]], want[[1, 3, 0, 5, 2, 4]], rtol=0, atol=1e-12)
    assert model_logprobs(logits, 4, 0)["top"] == [] and model_logprobs(logits, 4, 0)["sampled_logprob"] is None
