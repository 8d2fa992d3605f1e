"""Sampling: worked examples, determinism, validation, and parity with transformers' processors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from minillm.errors import InvalidRequestError, SamplingParamsError
from minillm.runtime.sampling import (
    SamplingParams, apply_min_p, apply_repetition_penalty, apply_temperature, apply_top_k, apply_top_p,
    SeedWithoutRngWarning, candidates, process_logits, sample, softmax,
)

PROBS = np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32)
LOGITS = np.log(PROBS)


def kept(logits) -> set[int]:
    return set(np.flatnonzero(np.isfinite(logits)).tolist())


# --- worked examples -----------------------------------------------------------------------------
@pytest.mark.parametrize("p, expected", [(0.0, {0}), (0.4, {0}), (0.6, {0, 1}), (0.9, {0, 1, 2}), (0.99, {0, 1, 2, 3}), (1.0, {0, 1, 2, 3})])
def test_top_p_examples(p, expected):
    assert kept(apply_top_p(LOGITS, p)) == expected


def test_top_p_renormalises():
    np.testing.assert_allclose(softmax(apply_top_p(LOGITS, 0.6)), [0.625, 0.375, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(softmax(apply_top_p(LOGITS, 0.9)), np.array([0.5, 0.3, 0.15, 0]) / 0.95, rtol=1e-6)
    np.testing.assert_allclose(softmax(apply_top_p(LOGITS, 0.99)), PROBS, rtol=1e-6)


@pytest.mark.reference
@pytest.mark.parametrize("p", [0.0, 0.4, 0.6, 0.9, 0.99])
def test_top_p_examples_match_transformers(p):
    np.testing.assert_array_equal(apply_top_p(LOGITS, p), hf(lp().TopPLogitsWarper(p), LOGITS))


@pytest.mark.reference
def test_repetition_penalty_example_matches_transformers():
    logits = np.array([2, -2, 0.5], dtype=np.float32)
    expected = hf(lp().RepetitionPenaltyLogitsProcessor(2.0), logits, input_ids=[[0, 1, 1, 0]])
    np.testing.assert_array_equal(expected, [1, -4, 0.5])
    np.testing.assert_array_equal(apply_repetition_penalty(logits, [0, 1, 1, 0], 2.0), expected)


def test_top_k_and_min_p_examples():
    assert kept(apply_top_k(LOGITS, 2)) == {0, 1}
    assert kept(apply_top_k(LOGITS, 0)) == kept(apply_top_k(LOGITS, 10)) == {0, 1, 2, 3}
    assert kept(apply_top_k(np.array([1, 2, 2, 0], np.float32), 1)) == {1, 2}  # ties with the k-th stay
    assert kept(apply_min_p(LOGITS, 0.5)) == {0, 1}  # 0.3 >= 0.25, 0.15 < 0.25
    assert kept(apply_min_p(LOGITS, 1.0)) == {0}


def test_repetition_penalty_example():
    logits = np.array([2, -2, 0.5], dtype=np.float32)
    out = apply_repetition_penalty(logits, [0, 1, 1, 0, 0], 2.0)  # duplicates count once
    np.testing.assert_array_equal(out, [1, -4, 0.5])
    np.testing.assert_array_equal(logits, [2, -2, 0.5])  # input untouched
    with pytest.raises(InvalidRequestError, match="seen id 7"):
        apply_repetition_penalty(logits, [7], 2.0)


def test_temperature_and_softmax():
    np.testing.assert_array_equal(apply_temperature(np.array([1, -2], np.float32), 0.5), [2, -4])
    p = softmax(np.array([1000, 1000, -np.inf], np.float32))  # no overflow, -inf -> 0
    assert p.dtype == np.float32 and p.tolist() == [0.5, 0.5, 0.0]
    with pytest.raises(SamplingParamsError):
        apply_temperature(LOGITS, 0.0)


# --- sample --------------------------------------------------------------------------------------
def test_greedy_is_argmax():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(1000).astype(np.float32)
    params = SamplingParams(temperature=0.0)
    assert sample(logits, params, rng) == int(np.argmax(logits))
    # the penalty still applies under greedy (as in transformers)
    best = int(np.argmax(logits))
    assert sample(logits, SamplingParams(temperature=0.0, repetition_penalty=1e6), seen_ids=[best]) != best


def test_same_seed_same_tokens():
    logits = np.random.default_rng(1).standard_normal(500).astype(np.float32)
    params = SamplingParams(temperature=1.5, top_k=50, top_p=0.95, seed=42)
    draws = lambda rng: [sample(logits, params, rng) for _ in range(20)]
    assert draws(np.random.default_rng(42)) == draws(np.random.default_rng(42))
    assert len(set(draws(np.random.default_rng(7)))) > 1
    with pytest.warns(SeedWithoutRngWarning):  # rng=None -> default_rng(seed) on each call, which warns
        assert sample(logits, params) == sample(logits, params)


def test_sample_never_picks_a_removed_token():
    logits = np.random.default_rng(2).standard_normal(200).astype(np.float32)
    params = SamplingParams(temperature=2.0, top_k=3)
    allowed = kept(process_logits(logits, params))
    rng = np.random.default_rng(0)
    draws = {sample(logits, params, rng) for _ in range(500)}
    assert draws == allowed and len(allowed) == 3


def test_sample_frequencies_follow_the_distribution():
    rng = np.random.default_rng(3)
    counts = np.bincount([sample(LOGITS, SamplingParams(), rng) for _ in range(20000)], minlength=4)
    np.testing.assert_allclose(counts / counts.sum(), PROBS, atol=0.015)


def test_candidates():
    cands = candidates(LOGITS, SamplingParams(top_p=0.6), k=5)
    assert [i for i, _ in cands] == [0, 1]
    np.testing.assert_allclose([p for _, p in cands], [0.625, 0.375], rtol=1e-6)
    greedy = candidates(LOGITS, SamplingParams(temperature=0), k=2)  # temperature-1 probabilities
    assert [i for i, _ in greedy] == [0, 1] and abs(greedy[0][1] - 0.5) < 1e-6


# --- validation ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(top_p=-0.1), r"top_p must be in \[0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \[0, 1\]"),
    (dict(top_k=-1), "top_k must be an integer >= 0"),
    (dict(top_k=2.5), "top_k must be an integer"),
    (dict(min_p=-0.1), r"min_p must be in \[0, 1\]"),
    (dict(min_p=1.1), r"min_p must be in \[0, 1\]"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(repetition_penalty=-1.0), "repetition_penalty must be > 0"),
    (dict(seed=-3), "seed must be an integer >= 0"),
])
def test_validation(kwargs, match):
    with pytest.raises(SamplingParamsError, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_error_is_an_invalid_request():
    with pytest.raises(InvalidRequestError):
        SamplingParams(top_p=2)
    with pytest.raises(InvalidRequestError, match=r"shape \[vocab\]"):
        softmax_input = np.zeros((2, 3), np.float32)
        apply_top_k(softmax_input, 1)


# --- parity with transformers (generation/logits_process.py) -------------------------------------
LOGIT_ARRAYS = hnp.arrays(np.float32, st.integers(2, 64),
                          elements=st.floats(-20, 20, width=32), unique=True)  # unique: ties make the cut arbitrary


def hf(processor, logits, input_ids=((0,),)):
    import torch  # the reference extra (README's test command installs it); missing -> ImportError, not a skip

    scores = torch.from_numpy(logits.copy())[None, :]
    return processor(torch.tensor(input_ids, dtype=torch.long), scores)[0].numpy()


def far_from_cut(values: np.ndarray, cut: float, tol: float = 1e-5) -> bool:
    """A float32 sum that lands within rounding of the threshold may fall either side of it."""
    return bool(np.all(np.abs(values - cut) > tol))


def lp():
    from transformers.generation import logits_process

    return logits_process


@pytest.mark.reference
@settings(max_examples=150, deadline=None)
@given(logits=LOGIT_ARRAYS, p=st.floats(0.0, 0.999))
def test_top_p_matches_transformers(logits, p):
    probs = np.sort(softmax(logits).astype(np.float64))[::-1]
    assume(far_from_cut(np.cumsum(probs), p))
    np.testing.assert_array_equal(apply_top_p(logits, p), hf(lp().TopPLogitsWarper(p), logits))


@pytest.mark.reference
@settings(max_examples=150, deadline=None)
@given(logits=LOGIT_ARRAYS, k=st.integers(1, 80))
def test_top_k_matches_transformers(logits, k):
    np.testing.assert_array_equal(apply_top_k(logits, k), hf(lp().TopKLogitsWarper(k), logits))


@pytest.mark.reference
@settings(max_examples=150, deadline=None)
@given(logits=LOGIT_ARRAYS, min_p=st.floats(0.001, 1.0))
def test_min_p_matches_transformers(logits, min_p):
    probs = softmax(logits).astype(np.float64)
    assume(far_from_cut(probs / probs.max(), min_p))
    np.testing.assert_array_equal(apply_min_p(logits, min_p), hf(lp().MinPLogitsWarper(min_p), logits))


@pytest.mark.reference
@settings(max_examples=150, deadline=None)
@given(logits=LOGIT_ARRAYS, t=st.floats(0.05, 5.0))
def test_temperature_matches_transformers(logits, t):
    np.testing.assert_array_equal(apply_temperature(logits, t), hf(lp().TemperatureLogitsWarper(t), logits))


@pytest.mark.reference
@settings(max_examples=150, deadline=None)
@given(data=st.data(), logits=LOGIT_ARRAYS, penalty=st.floats(0.1, 5.0))
def test_repetition_penalty_matches_transformers(data, logits, penalty):
    seen = data.draw(st.lists(st.integers(0, logits.size - 1), min_size=1, max_size=20))
    expected = hf(lp().RepetitionPenaltyLogitsProcessor(penalty), logits, input_ids=[seen])
    np.testing.assert_array_equal(apply_repetition_penalty(logits, seen, penalty), expected)


@pytest.mark.reference
@settings(max_examples=100, deadline=None)
@given(data=st.data(), logits=LOGIT_ARRAYS, t=st.floats(0.2, 3.0), k=st.integers(0, 40),
       p=st.floats(0.05, 1.0), min_p=st.floats(0.0, 0.5))
def test_process_logits_matches_transformers_chain(data, logits, t, k, p, min_p):
    seen = data.draw(st.lists(st.integers(0, logits.size - 1), min_size=1, max_size=10))
    params = SamplingParams(temperature=t, top_k=k, top_p=p, min_p=min_p, repetition_penalty=1.3)
    # Steer clear of rounding coin-flips at the top-p and min-p cuts, as above.
    before_p = apply_top_k(apply_temperature(apply_repetition_penalty(logits, seen, 1.3), t), k)
    finite = before_p[np.isfinite(before_p)]
    assume(np.unique(finite).size == finite.size)  # the penalty can make two logits tie: then the cut is arbitrary
    probs = np.sort(softmax(before_p).astype(np.float64))[::-1]
    assume(p == 1.0 or far_from_cut(np.cumsum(probs), p))
    after_p = softmax(apply_top_p(before_p, p)).astype(np.float64)
    assume(min_p == 0.0 or far_from_cut(after_p / after_p.max(), min_p))

    chain = [lp().RepetitionPenaltyLogitsProcessor(1.3), lp().TemperatureLogitsWarper(t)]
    chain += [lp().TopKLogitsWarper(k)] if k else []
    chain += [lp().TopPLogitsWarper(p)] if p < 1.0 else []
    chain += [lp().MinPLogitsWarper(min_p)] if min_p > 0 else []
    import torch

    ids, scores = torch.tensor([seen]), torch.from_numpy(logits.copy())[None, :]
    for proc in chain:
        scores = proc(ids, scores)
    np.testing.assert_array_equal(process_logits(logits, params, seen), scores[0].numpy())


# --- top-p at ties and at exact boundaries (expected: transformers' TopPLogitsWarper) -----------
@pytest.mark.parametrize("logits, p", [
    ([0.0, 0.0], 0.5),  # probabilities 0.5, 0.5: the cumulative sum hits 1 - p exactly
    ([0.0, 0.0, 0.0, 0.0], 0.5),  # 0.25 each: cumulative 0.25, 0.5 (= 1 - p), 0.75, 1
    ([0.0, 0.0, 0.0, 0.0], 0.75),
    ([0.0, 0.0, 0.0, 0.0], 0.0),  # p = 0: only one id survives
    ([1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0], 0.5),  # ties on both sides of the cut
    ([2.0, 2.0, 1.0, 1.0, 1.0, -1.0, 3.0, 3.0, 0.5, 0.5, 0.5, 0.5, 2.0, 2.0, 1.0, 1.0], 0.9),
])
def test_top_p_ties_and_exact_boundaries_match_transformers(logits, p):
    """transformers keeps one id of [0, 0] at top_p=0.5 (the later one); minillm keeps the same ids.
    Up to 16 ids, where torch's sort is stable, the tie order is defined and must agree."""
    from transformers.generation.logits_process import TopPLogitsWarper

    logits = np.array(logits, np.float32)
    expected = hf(TopPLogitsWarper(p), logits)
    np.testing.assert_array_equal(apply_top_p(logits, p), expected)


def test_params_from_fields_of_cli_arguments_and_request_bodies():
    """The CLI's parsed arguments and the server's request body build params by attribute name; the
    constructor's checks still apply (expected values: the same fields passed by keyword)."""
    import argparse

    fields = dict(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.1, seed=3)
    assert SamplingParams.from_fields(argparse.Namespace(**fields, model="x")) == SamplingParams(**fields)
    with pytest.raises(SamplingParamsError, match="top_p"):
        SamplingParams.from_fields(argparse.Namespace(**{**fields, "top_p": 1.5}))
