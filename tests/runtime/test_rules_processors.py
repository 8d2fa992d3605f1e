"""The order of the logit processors (``sampling.py``'s list), pinned where two steps do not commute.

    0. logit bias           logit[j] += bias[j]                (OpenAI: on the model's raw logits)
    1. repetition penalty   seen: positive / p, negative * p   (transformers)
    2. frequency, presence  logit[j] -= c[j] * f + (c[j] > 0) * pr

Adding and then dividing is not dividing and then adding, so each pair has a case whose numbers,
worked by hand, differ with the order: the bias must reach the raw logits before the penalty scales
them, and OpenAI's penalties subtract from the already scaled logits. Greedy, sampling, and the
distribution a trace and speculative decoding read all run the same chain.
"""

from __future__ import annotations

import numpy as np

from minillm.runtime.sampling import SamplingParams, penalize, probabilities, process_logits, sample
from minillm.runtime.speculative import distribution

LOGITS = np.array([2.0, -1.0, 0.0, 1.5], dtype=np.float32)


def test_logit_bias_comes_before_the_repetition_penalty():
    """id 0: (2 + 2) / 2 = 2 (the other order: 2 / 2 + 2 = 3); id 1: (-1 - 1) * 2 = -4 (the other
    order: -1 * 2 - 1 = -3); id 2 unseen keeps its bias: 0 + 1.25; id 3 untouched."""
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, logit_bias={0: 2.0, 1: -1.0, 2: 1.25})
    out = penalize(LOGITS, params, seen_ids=[0, 1])
    np.testing.assert_array_equal(out, np.array([2.0, -4.0, 1.25, 1.5], dtype=np.float32))
    # where the order decides the token: id 0 at (2 + 2) / 2 = 2 against id 3's 1.5 + 1 = 2.5
    flip = SamplingParams(temperature=0.0, repetition_penalty=2.0, logit_bias={0: 2.0, 3: 1.0})
    assert penalize(LOGITS, flip, seen_ids=[0]).tolist() == [2.0, -1.0, 0.0, 2.5]
    assert sample(LOGITS, flip, seen_ids=[0]) == 3  # penalty first would give id 0 a 3.0 and pick it


def test_openai_penalties_come_after_the_repetition_penalty():
    """id 0 seen and generated twice: 2 / 2 - 2 * 0.5 - 0.25 = -0.25 (the other order: (2 - 1.25) / 2
    = 0.375); id 1: -1 * 2 - 0.5 - 0.25 = -2.75 (the other order: (-1 - 0.75) * 2 = -3.5)."""
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    out = penalize(LOGITS, params, seen_ids=[0, 1], generated_ids=[0, 0, 1])
    np.testing.assert_array_equal(out, np.array([-0.25, -2.75, 0.0, 1.5], dtype=np.float32))


def test_every_path_reads_the_same_order():
    """The sampled distribution (temperature 0.5: the penalised logits doubled) and speculative
    decoding's ``distribution`` are softmax of the same numbers: by hand [4, -8, 2.5, 3] / ... ."""
    params = SamplingParams(temperature=0.5, repetition_penalty=2.0, logit_bias={0: 2.0, 1: -1.0, 2: 1.25})
    expected = np.array([2.0, -4.0, 1.25, 1.5]) / 0.5
    hand = np.exp(expected - expected.max()) / np.exp(expected - expected.max()).sum()
    np.testing.assert_allclose(probabilities(process_logits(LOGITS, params, [0, 1])), hand, rtol=1e-6)
    np.testing.assert_allclose(distribution(LOGITS, params, [0, 1]), hand, rtol=1e-6)
