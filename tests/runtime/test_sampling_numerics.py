"""Sampling never produces NaN or infinite probabilities (issue 18, item 2).

Every check runs under ``np.errstate(all="raise")``, so an overflow, an invalid operation or a
division by zero anywhere in the sampler fails the test (underflow to 0 is allowed inside the
sampler, explicitly: it is the right float32 answer). Expected values are by hand: the limit of
softmax(logits / t) as t -> 0 is all probability on the largest logit, so a temperature whose
scaled logits overflow must pick the argmax.
"""

from __future__ import annotations

import contextlib
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from minillm.errors import InvalidRequestError
from minillm.runtime.sampling import (
    SamplingParams,
    SeedWithoutRngWarning,
    apply_repetition_penalty,
    apply_temperature,
    candidates,
    probabilities,
    process_logits,
    sample,
    sample_with_probs,
)

RAISE = {"all": "raise"}


def strict():
    """Every floating-point warning an error: numpy's overflow, invalid and divide raise, and any
    RuntimeWarning too (underflow to 0 is allowed inside the sampler, which says so where it happens)."""
    stack = contextlib.ExitStack()
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("error")
    stack.enter_context(np.errstate(**RAISE))
    return stack


def test_a_tiny_temperature_is_greedy():
    """The issue's case: [1, 3, 2, 0] at temperature 1e-40 overflowed to inf, softmax gave NaN and
    the sampler picked the last id (3). The argmax is id 1 (by hand)."""
    with np.errstate(**RAISE):
        for seed in range(20):
            assert sample([1, 3, 2, 0], SamplingParams(temperature=1e-40), np.random.default_rng(seed)) == 1
        token, probs = sample_with_probs([1, 3, 2, 0], SamplingParams(temperature=1e-40), np.random.default_rng(0))
        assert token == 1 and probs.tolist() == [0.0, 1.0, 0.0, 0.0]
        # Below float32's smallest subnormal (1e-46 rounds to 0 in float32): still greedy, no division by 0.
        assert sample([1, 3, 2, 0], SamplingParams(temperature=1e-300), np.random.default_rng(0)) == 1
        # Negative logits overflow towards -inf: the largest (-1, id 2) still wins.
        assert sample([-3, -2, -1, -5], SamplingParams(temperature=1e-40), np.random.default_rng(0)) == 2
        # A small temperature that stays in range is ordinary sampling, not the limit: by hand,
        # (3 - 2) / 0.5 = 2 apart, so id 2 has probability e^-2 / (1 + e^-2 + ...) > 0.
        probs = probabilities(apply_temperature([1, 3, 2, 0], 0.5))
        np.testing.assert_allclose(probs[1] / probs[2], np.exp(2.0), rtol=1e-6)


def test_extreme_repetition_penalties_are_limits_not_nan():
    with np.errstate(**RAISE):
        # By hand: id 0's logit 1 / 1e-45 is beyond float32 (3.4e38): it takes all the probability.
        out = apply_repetition_penalty([1, 3, 2, 0], [0], 1e-45)
        assert out.tolist() == [0.0, -np.inf, -np.inf, -np.inf]
        assert sample([1, 3, 2, 0], SamplingParams(repetition_penalty=1e-45), np.random.default_rng(0), [0]) == 0
        # A huge penalty multiplies id 0's -5 to -5e38 (beyond float32): id 1 (the largest) wins.
        assert sample([-5, 3], SamplingParams(repetition_penalty=1e38), np.random.default_rng(1), [0]) == 1


def test_nan_logits_raise_a_clear_error():
    params = SamplingParams(temperature=0.7)
    with pytest.raises(InvalidRequestError, match=r"logits contain NaN at 1 of 4 ids \(first: id 2\); the forward "
                                                  r"pass produced NaN .*check the weights"):
        sample([1.0, 2.0, np.nan, 0.0], params)
    with pytest.raises(InvalidRequestError, match="logits contain NaN"):
        sample([1.0, 2.0, np.nan, 0.0], SamplingParams(temperature=0.0))  # greedy too: argmax of NaN is a lie
    with pytest.raises(InvalidRequestError, match="every logit is -inf: all ids are masked"):
        sample([-np.inf, -np.inf], params)


def test_masked_ids_stay_masked_and_plus_inf_is_certain():
    with np.errstate(**RAISE):
        logits = np.array([5.0, -np.inf, 4.0, -np.inf], np.float32)
        for params in (SamplingParams(temperature=1e-40), SamplingParams(temperature=1e30),
                       SamplingParams(temperature=2.0, top_p=0.99, min_p=0.01), SamplingParams(top_k=3)):
            probs = probabilities(process_logits(logits, params))
            assert probs[1] == 0 and probs[3] == 0 and np.isclose(probs.sum(), 1)
        # A +inf logit (by hand: the limit of a logit growing without bound) is certain.
        assert probabilities([0.0, np.inf, 1.0]).tolist() == [0.0, 1.0, 0.0]
        assert sample([0.0, np.inf, 1.0], SamplingParams(), np.random.default_rng(3)) == 1
        # A huge temperature flattens to uniform over the unmasked ids (by hand: logits / 1e30 ~ 0).
        np.testing.assert_allclose(probabilities(apply_temperature(logits, 1e30)), [0.5, 0, 0.5, 0], atol=1e-6)


LOGITS = hnp.arrays(np.float32, st.integers(2, 40),
                    elements=st.one_of(st.floats(-1e4, 1e4, width=32), st.just(-np.inf)))
TEMPERATURE = st.one_of(st.just(0.0), st.floats(1e-300, 1e300), st.sampled_from([1e-45, 1e-40, 1e-30, 1e-3, 1e38]))
PENALTY = st.one_of(st.floats(1e-300, 1e300), st.sampled_from([1e-45, 1e-38, 0.5, 1.0, 1.3, 1e38]))


@settings(max_examples=400, deadline=None)
@given(logits=LOGITS, t=TEMPERATURE, k=st.integers(0, 50), p=st.floats(0, 1), min_p=st.floats(0, 1),
       penalty=PENALTY, data=st.data())
def test_no_valid_parameters_give_nan_or_inf(logits, t, k, p, min_p, penalty, data):
    """Any valid SamplingParams on any logits with at least one unmasked id: the probabilities are
    finite, non-negative, sum to 1, masked ids stay at 0, and the drawn id has probability > 0."""
    if np.isneginf(logits).all():
        logits[0] = 0.0
    seen = data.draw(st.lists(st.integers(0, len(logits) - 1), max_size=5))
    params = SamplingParams(temperature=t, top_k=k, top_p=p, min_p=min_p, repetition_penalty=penalty)
    with strict():
        token, probs = sample_with_probs(logits, params, np.random.default_rng(0), seen_ids=seen)
        assert np.isfinite(probs).all() and (probs >= 0).all()
        assert abs(float(probs.sum(dtype=np.float64)) - 1.0) < 1e-5
        assert (probs[np.isneginf(logits)] == 0).all()
        assert probs[token] > 0 and np.isfinite(logits[token])
        assert sample(logits, params, np.random.default_rng(0), seen_ids=seen) == token
        assert all(np.isfinite(q) for _, q in candidates(logits, params, seen))


SMALLEST = float(np.finfo(np.float32).smallest_subnormal)  # 1.4e-45, the smallest positive float32
# At most 0.01 / 120: logits at least 0.01 apart are then >= 120 apart once scaled, beyond the ~104
# below the largest where float32's exp is 0 (exp(-104) < 1.4e-45 / 2 rounds to 0).
SMALL_TEMPERATURE = st.one_of(st.floats(SMALLEST, 0.01 / 120),
                              st.sampled_from([SMALLEST, 1e-40, 2.5e-40, 5e-37, 1e-30, 0.01 / 120]))


def test_logits_apart_by_more_than_float32_holds_are_greedy_without_overflow():
    """The issue's case: [0.01, -0.03] / 1e-40 = [1e38, -3e38], each inside float32's range but
    4e38 apart; softmax's subtraction of the largest overflowed (a RuntimeWarning). By hand: id 0 is
    4e38 above id 1, so it takes all the probability."""
    with strict():
        assert apply_temperature([0.01, -0.03], 1e-40).tolist() == [0.0, -np.inf]
        token, probs = sample_with_probs([0.01, -0.03], SamplingParams(temperature=1e-40), np.random.default_rng(0))
        assert token == 0 and probs.tolist() == [1.0, 0.0]
        # raw logits as far apart (no temperature at all): the same distribution, no overflow
        assert probabilities([3e38, -3e38, 2.9e38]).tolist() == pytest.approx([1.0, 0.0, 0.0])
        assert sample([3e38, -3e38], SamplingParams(temperature=0.0)) == 0
        # one logit scaled beyond float32's range (-3e38 / 2^-126), the two largest 1 apart once
        # scaled (2^-125 and 2^-126, powers of two: exact): not greedy; softmax of [0, -1, -inf] by
        # hand is e / (1 + e), 1 / (1 + e), 0
        tiny = 2.0**-126
        assert apply_temperature([2 * tiny, tiny, -3e38], tiny).tolist() == [0.0, -1.0, -np.inf]
        probs = probabilities(apply_temperature([2 * tiny, tiny, -3e38], tiny))
        np.testing.assert_allclose(probs, [np.e / (1 + np.e), 1 / (1 + np.e), 0.0], rtol=1e-6)


@settings(max_examples=300, deadline=None)
@given(logits=hnp.arrays(np.float32, st.integers(2, 30), elements=st.integers(-10_000, 10_000).map(lambda i: i / 100),
                         unique=True),
       t=SMALL_TEMPERATURE, seed=st.integers(0, 2**32 - 1))
def test_any_tiny_temperature_is_greedy_without_a_warning(logits, t, seed):
    """Any temperature from the smallest float32 up to 0.01 / 120, on logits at least 0.01 apart:
    every gap / t is >= 120, more than the ~104 that takes float32's exp to 0 (or beyond float32's
    range), so the draw is the argmax (by hand: the t -> 0 limit), with no floating-point warning."""
    with strict():
        assert sample(logits, SamplingParams(temperature=t), np.random.default_rng(seed)) == int(np.argmax(logits))


BIG = float(np.finfo(np.float32).max)
FLOAT32 = st.one_of(st.floats(width=32, allow_nan=False, allow_infinity=False),
                    st.sampled_from([BIG, -BIG, 3e38, -3e38, 1e38, -1e38, 0.01, -0.03]))


@settings(max_examples=300, deadline=None)
@given(logits=hnp.arrays(np.float32, st.integers(2, 30), elements=st.one_of(FLOAT32, st.just(-np.inf))),
       t=st.one_of(SMALL_TEMPERATURE, st.floats(0.01 / 120, 1e300), st.sampled_from([0.5, 1.0, 2.0])),
       seed=st.integers(0, 2**32 - 1))
def test_any_float32_logits_at_any_temperature_never_overflow(logits, t, seed):
    """Any float32 logits (up to +-3.4e38, masked ids too) at any positive temperature: no
    floating-point warning, finite probabilities summing to 1; and wherever the largest is more
    than 120 / t above the next (by hand, in float64), the draw is the argmax."""
    if np.isneginf(logits).all():
        logits[0] = 0.0
    with strict():
        token, probs = sample_with_probs(logits, SamplingParams(temperature=t), np.random.default_rng(seed))
        assert np.isfinite(probs).all() and abs(float(probs.sum(dtype=np.float64)) - 1.0) < 1e-5
        assert probs[token] > 0 and (probs[np.isneginf(logits)] == 0).all()
    ranked = np.sort(logits.astype(np.float64))[::-1]
    scale = min(max(t, SMALLEST), BIG)  # the temperature within float32's range, as the sampler holds it
    if (ranked[0] - ranked[1]) / scale > 120:
        assert token == int(np.argmax(logits))


def test_rounding_of_the_float32_result_is_unchanged():
    """In-range temperatures still give transformers' float32 division bit for bit (x / float32(t))."""
    x = np.random.default_rng(0).normal(0, 10, 1000).astype(np.float32)
    for t in (0.7, 1.3, 1e-3, 123.456):
        np.testing.assert_array_equal(apply_temperature(x, t), x / np.float32(t))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_temperature(x, 0.7)


def test_a_seed_without_an_rng_warns_and_the_right_pattern_does_not_repeat():
    """A hand-written loop calling sample(logits, SamplingParams(seed=0)) restarts the generator each
    call: 50 steps on a uniform distribution over 1000 ids draw one id 50 times (by hand: the same
    first number of default_rng(0)). It warns, naming the fix; one rng per request does not repeat."""
    logits = np.zeros(1000, np.float32)
    params = SamplingParams(seed=0)
    with pytest.warns(SeedWithoutRngWarning, match=r"no rng: a new generator is made from the seed on every call.*"
                                                   r"rng = np.random.default_rng\(params.seed\)"):
        repeated = {sample(logits, params) for _ in range(50)}
    assert len(repeated) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the right pattern, and seed=None, do not warn
        rng = np.random.default_rng(params.seed)
        assert len({sample(logits, params, rng) for _ in range(50)}) > 40
        sample(logits, SamplingParams())
        sample(logits, SamplingParams(temperature=0.0, seed=0))  # greedy draws nothing
