"""OpenAI's sampling fields in the library: logit_bias, frequency and presence penalties, top_logprobs.

The unit tests need no model; the rest use the real SmolLM2 and check the processed distribution
(what the sampler draws from, the trace's) against OpenAI's formula computed here by hand, and the
logprobs against the model's own log softmax (before any processor, as OpenAI and vLLM report them):

    logit[j] + bias[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty,  c over new ids
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import minillm
from minillm import KVCache, SamplingParams
from minillm.errors import InvalidRequestError, SamplingParamsError
from minillm.runtime.sampling import penalize, process_logits, sample

COMMA, EOS = 28, 2  # SmolLM2's "," and <|im_end|>
LIST = [{"role": "user", "content": "List ten fruits, separated by commas."}]


# --- no model ------------------------------------------------------------------------------------
def test_penalties_and_bias_follow_openais_formula_on_small_logits():
    logits = np.array([1.0, 2.0, 3.0, 0.5, -1.0], dtype=np.float32)
    params = SamplingParams(temperature=0, logit_bias={"2": -100, 4: 5}, frequency_penalty=0.5, presence_penalty=1)
    out = penalize(logits, params, seen_ids=[0, 1, 2, 3], generated_ids=[1, 1, 3, 1])
    # id 1: 3 times -> 2 - 1.5 - 1; id 3: once -> 0.5 - 0.5 - 1; id 2: biased only; the prompt never counts
    np.testing.assert_array_equal(out, np.array([1.0, -0.5, -97.0, -1.0, 4.0], dtype=np.float32))


def test_negative_penalties_encourage_repeats():
    out = penalize(np.zeros(3, np.float32), SamplingParams(frequency_penalty=-1, presence_penalty=-0.5), (), [2, 2])
    np.testing.assert_array_equal(out, [0, 0, 2.5])


def test_penalties_apply_before_temperature():
    logits = np.array([2.0, 1.0, 0.0], dtype=np.float32)
    params = SamplingParams(temperature=0.5, presence_penalty=2.0)
    np.testing.assert_allclose(process_logits(logits, params, generated_ids=[0]), [0.0, 2.0, 0.0])
    assert sample(logits, SamplingParams(temperature=0, presence_penalty=2.0), generated_ids=[0]) == 1


def test_mask_applies_before_top_k():
    logits = np.array([5.0, 4.0, 3.0, 2.0], dtype=np.float32)
    allowed = np.array([False, False, True, True])
    out = process_logits(logits, SamplingParams(top_k=1), allowed=allowed)
    assert np.isfinite(out).tolist() == [False, False, True, False]  # top-1 of the allowed ids


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"frequency_penalty": 2.5}, ["frequency_penalty", "[-2, 2]"]),
        ({"presence_penalty": -3}, ["presence_penalty", "[-2, 2]"]),
        ({"logit_bias": {28: 101}}, ["logit_bias[28]", "[-100, 100]"]),
        ({"logit_bias": {"comma": 1}}, ["logit_bias key 'comma'", "token id"]),
        ({"logit_bias": {-1: 1}}, ["logit_bias key -1"]),
        ({"top_logprobs": 21}, ["top_logprobs", "[0, 20]"]),
    ],
)
def test_bad_openai_fields_name_the_field_and_range(kwargs, words):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**kwargs)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_logit_bias_is_kept_hashable_and_sorted():
    p = SamplingParams(logit_bias={"9": 1, 3: -2.0})
    assert p.logit_bias == ((3, -2.0), (9, 1.0)) and hash(p) == hash(SamplingParams(logit_bias=[(9, 1), (3, -2)]))


# --- the real model ------------------------------------------------------------------------------
@pytest.mark.slow
def test_logit_bias_outside_the_vocabulary_is_refused_before_model_work(smollm2):
    with pytest.raises(InvalidRequestError, match="logit_bias names token id 49152"):
        minillm.generate(smollm2, "Hi", SamplingParams(logit_bias={49152: 1}))


def _hand_logprobs(model, prompt_ids, new_ids, k, params) -> tuple[np.ndarray, np.ndarray]:
    """At step ``k``, from raw logits of a fresh prefill (float64): the model's own log softmax, and the
    log softmax of OpenAI's formula (the distribution sampled from)."""
    ids = np.array(list(prompt_ids) + list(new_ids[:k]), dtype=np.int64)
    raw = minillm.prefill(model, ids, KVCache.for_model(model.config, len(ids))).astype(np.float64)
    own = raw - (raw.max() + np.log(np.exp(raw - raw.max()).sum()))
    for token, bias in params.logit_bias:
        raw[token] += bias
    for token, c in Counter(new_ids[:k]).items():
        raw[token] = raw[token] - c * params.frequency_penalty - (c > 0) * params.presence_penalty
    raw /= params.temperature
    return own, raw - (raw.max() + np.log(np.exp(raw - raw.max()).sum()))


@pytest.mark.slow
def test_logprobs_are_the_models_own_and_the_sampled_distribution_is_openais_formula(smollm2):
    """The logprobs are the model's log softmax, before any processor (OpenAI's and vLLM's default); the
    distribution sampled from (``sampled_logprob``, the trace's candidates) is OpenAI's formula."""
    params = SamplingParams(
        temperature=0.8,
        seed=5,
        frequency_penalty=-0.9,  # negative: repeats, so counts above 1 are exercised
        presence_penalty=0.6,
        logit_bias={COMMA: 3.0, EOS: -100},
        top_logprobs=20,
    )
    tracer = minillm.Tracer(None)
    result = minillm.generate(smollm2, "1, 2, 3, 4, 5,", params, max_new_tokens=14, tracer=tracer)
    assert len(result.ids) == 14 and len(result.logprobs) == 14
    assert len(set(result.ids)) < 14  # some ids repeat: the penalties had counts > 1 to work on
    steps = [e for e in tracer.events if e.phase in ("prefill", "decode")]
    for k, (step, event) in enumerate(zip(result.logprobs, steps, strict=True)):
        own, hand = _hand_logprobs(smollm2, result.prompt_ids, result.ids, k, params)
        assert step["id"] == result.ids[k]
        assert step["logprob"] == pytest.approx(own[result.ids[k]], abs=2e-4)
        assert step["sampled_logprob"] == pytest.approx(hand[result.ids[k]], abs=2e-4)
        assert len(step["top"]) == 20
        for token, logprob in step["top"]:
            assert logprob == pytest.approx(own[token], abs=2e-4)
        assert [t for t, _ in step["top"]] == np.argsort(-own, kind="stable")[:20].tolist()  # the top 20
        # the trace's candidates are the processed distribution
        cand_probs = [q for _, q in event.data["candidates"]]  # (piece, probability)
        np.testing.assert_allclose(cand_probs, np.exp(np.sort(hand)[::-1][:5]), atol=2e-5)


@pytest.mark.slow
def test_logit_bias_minus_100_never_yields_the_id_over_200_tokens(smollm2):
    free = minillm.generate(smollm2, LIST, SamplingParams(temperature=1.0, seed=0, logit_bias={EOS: -100}),
                            max_new_tokens=200)
    assert COMMA in free.ids  # without the ban, the model writes commas here
    banned = minillm.generate(
        smollm2, LIST, SamplingParams(temperature=1.0, seed=0, logit_bias={COMMA: -100, EOS: -100}), max_new_tokens=200
    )
    assert len(banned.ids) == 200 and COMMA not in banned.ids


@pytest.mark.slow
def test_logit_bias_plus_100_yields_the_id_at_every_step(smollm2):
    result = minillm.generate(smollm2, LIST, SamplingParams(temperature=1.0, seed=1, logit_bias={COMMA: 100}),
                              max_new_tokens=40)
    assert result.ids == [COMMA] * 40 and result.text == "," * 40


@pytest.mark.slow
def test_frequency_penalty_counts_generated_ids_not_the_prompt(smollm2):
    prompt = "apple, apple, apple, apple, apple,"
    plain = minillm.generate(smollm2, prompt, SamplingParams(temperature=0), max_new_tokens=8)
    apple = plain.ids[0]
    assert smollm2.tokenizer.decode([apple]) == " apple" and plain.ids.count(apple) >= 3  # greedy repeats it
    # the prompt's five apples do not count: the first token is the same; repeats are then penalised
    penalised = minillm.generate(smollm2, prompt, SamplingParams(temperature=0, frequency_penalty=2.0),
                                 max_new_tokens=8)
    assert penalised.ids[0] == apple and penalised.ids.count(apple) < plain.ids.count(apple)
    # the repetition penalty counts the prompt: the first token changes
    assert minillm.generate(smollm2, prompt, SamplingParams(temperature=0, repetition_penalty=3.0),
                            max_new_tokens=1).ids[0] != apple
