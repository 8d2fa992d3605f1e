"""Constrained decoding with llguidance on the real SmolLM2: JSON schemas, regexes, grammars.

What must hold: sampled outputs parse and validate; the mask only removes ids (the rest keep their
relative probabilities); a forbidden id is never drawn; a schema that allows what greedy says
anyway changes nothing; each request in a batch follows its own constraint.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

import minillm
from minillm import Constraint, SamplingParams
from minillm.errors import InvalidRequestError
from minillm.runtime.constraint import ConstraintState
from minillm.runtime.sampling import probabilities, sample_with_probs

pytestmark = pytest.mark.slow
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "role": {"enum": ["admin", "user", "guest"]},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "role", "age", "tags", "address"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a user of a web site as JSON."}]


def test_fifty_seeds_at_temperature_1_all_parse_and_validate(smollm2):
    results = minillm.generate_batch(
        smollm2,
        [ASK] * 50,
        [SamplingParams(temperature=1.0, seed=s) for s in range(50)],
        max_new_tokens=160,
        constraint=PERSON,
    )
    texts = set()
    for r in results:
        assert r.stop_reason is minillm.StopReason.EOS and r.incomplete is None, (r.text, r.stop_reason)
        jsonschema.validate(json.loads(r.text), PERSON)
        texts.add(r.text)
    assert len(texts) > 40  # sampled: different documents, each valid


@pytest.fixture(scope="module")
def person_greedy(smollm2):
    """The greedy answer to ASK under PERSON (its ids), for steps inside a JSON document."""
    return minillm.generate(smollm2, ASK, max_new_tokens=160, constraint=PERSON).ids


def step_after(model, ids: list[int], text_before: str) -> int:
    """The first step whose output so far, without whitespace, ends with ``text_before``."""
    decoded = (re.sub(r"\s", "", model.tokenizer.decode(ids[:j])) for j in range(len(ids)))
    return next(j for j, text in enumerate(decoded) if text.endswith(text_before))


def check_masked_distribution(model, logits, allowed) -> None:
    """Masked == unmasked restricted to ``allowed`` and renormalised (1e-6); 500 draws at
    temperature 2 never leave ``allowed``."""
    params = SamplingParams(temperature=0.7)
    _, masked = sample_with_probs(logits, params, np.random.default_rng(0), allowed=allowed)
    _, free = sample_with_probs(logits, params, np.random.default_rng(0))
    expected = np.where(allowed, free, 0) / free[allowed].sum()
    np.testing.assert_allclose(masked, expected, atol=1e-6)
    assert masked[~allowed].max() == 0
    rng = np.random.default_rng(1)
    draws = {sample_with_probs(logits, SamplingParams(temperature=2.0), rng, allowed=allowed)[0] for _ in range(500)}
    assert draws <= set(np.flatnonzero(allowed).tolist()) and len(draws) >= 2


def test_masked_distribution_is_the_unmasked_restricted_and_renormalised(smollm2):
    ids = minillm.tokenize(smollm2, ASK)
    logits = minillm.prefill(smollm2, ids, minillm.KVCache.for_model(smollm2.config, len(ids)))
    state = ConstraintState(smollm2, Constraint.regex(r"(Yes|No|Maybe)[.!]"))
    allowed = state.allowed()
    assert 3 <= allowed.sum() < 50 and not allowed[2]  # a few ids; EOS not yet
    check_masked_distribution(smollm2, logits, allowed)
    favourite = int(np.argmax(probabilities(logits)))  # a forbidden id is never drawn, even the model's favourite
    assert not allowed[favourite] and probabilities(logits)[favourite] > 0.05


@pytest.mark.parametrize(("before", "choice"), [('"role":"', "the enum"), ('"age":', "the integer range")])
def test_inside_a_json_schema_the_mask_only_renormalises(smollm2, person_greedy, before, choice):
    j = step_after(smollm2, person_greedy, before)
    state = ConstraintState(smollm2, PERSON)
    for token in person_greedy[:j]:
        state.consume(token)
    allowed = state.allowed()
    assert 2 <= allowed.sum() < 1000, (choice, int(allowed.sum()))  # a real choice, but most ids forbidden
    ids = list(minillm.tokenize(smollm2, ASK)) + person_greedy[:j]
    logits = minillm.prefill(smollm2, ids, minillm.KVCache.for_model(smollm2.config, len(ids)))
    assert probabilities(logits)[~allowed].sum() > 1e-3  # the model would have said something else sometimes
    check_masked_distribution(smollm2, logits, allowed)


def test_greedy_under_a_schema_that_allows_what_it_says_anyway_is_unchanged(smollm2):
    prompt = [{"role": "user", "content": 'Reply with exactly this JSON: {"answer": "Paris"}'}]
    free = minillm.generate(smollm2, prompt, max_new_tokens=20)
    assert json.loads(free.text) == {"answer": "Paris"}, free.text
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    tracer = minillm.Tracer(None)
    constrained = minillm.generate(smollm2, prompt, max_new_tokens=20, constraint=schema, tracer=tracer)
    assert constrained.ids == free.ids and constrained.text == free.text
    masks = [e for e in tracer.events if e.phase == "mask"]
    assert masks and all(0 < e.data["allowed"] <= e.data["vocab"] == 49152 for e in masks)


def test_forced_runs_are_fed_in_one_pass(smollm2):
    tracer = minillm.Tracer(None)
    schema = {"type": "object", "properties": {"capital_city_of_france": {"type": "string"}},
              "required": ["capital_city_of_france"], "additionalProperties": False}
    r = minillm.generate(smollm2, ASK, max_new_tokens=40, constraint=schema, tracer=tracer)
    assert "capital_city_of_france" in json.loads(r.text)
    forced = [e.data["forced"] for e in tracer.events if e.phase == "mask" and e.data["forced"]]
    assert forced and max(len(f) for f in forced) >= 2  # the long key: several tokens with no choice
    steps = [e for e in tracer.events if e.phase in ("prefill", "decode")]
    assert len(steps) + sum(len(f) for f in forced) == len(r.ids)  # forced tokens took no step of their own


def test_regex_and_lark_grammar(smollm2):
    r = minillm.generate(smollm2, "The answer is", SamplingParams(temperature=1.0, seed=0), max_new_tokens=10,
                         constraint=Constraint.regex(r" (yes|no)\."))
    assert r.text in (" yes.", " no.")
    grammar = 'start: "Color: " COLOR\nCOLOR: "red" | "green" | "blue"'
    r = minillm.generate(smollm2, "Pick a color.", max_new_tokens=10, constraint=Constraint.lark(grammar))
    assert r.text in ("Color: red", "Color: green", "Color: blue")


def test_batch_requests_each_follow_their_own_constraint(smollm2):
    per_prompt = [{"constraint": Constraint.regex(r"[0-9]{3}")}, {}, {"constraint": {"type": "boolean"}}]
    out = minillm.generate_batch(smollm2, ["Number:", "Hello", "True or false:"], max_new_tokens=8,
                                 per_prompt=per_prompt)
    assert len(out[0].text) == 3 and out[0].text.isdigit()
    assert out[1].text == minillm.generate(smollm2, "Hello", max_new_tokens=8).text
    assert out[2].text in ("true", "false")


def test_max_tokens_cutting_a_document_short_says_so(smollm2):
    r = minillm.generate(smollm2, ASK, max_new_tokens=6, constraint=PERSON)
    assert r.stop_reason is minillm.StopReason.MAX_NEW_TOKENS
    assert r.incomplete is not None and "max_new_tokens" in r.incomplete and "6" in r.incomplete
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.text)


@pytest.mark.parametrize(
    ("constraint", "words"),
    [
        ({"type": "object", "properties": {"age": {"type": "integr"}}}, ["$.properties.age.type", "integr"]),
        ({"type": "object", "required": "name"}, ["$.required", "'name'"]),
        (Constraint.regex("[a-z"), ["regex", "unclosed character class"]),
        (Constraint.lark("start: foo"), ["grammar", "foo"]),
    ],
)
def test_invalid_constraints_name_what_is_wrong(smollm2, constraint, words):
    with pytest.raises(InvalidRequestError) as err:
        minillm.generate(smollm2, "Hi", max_new_tokens=2, constraint=constraint)
    assert all(w in str(err.value) for w in words), str(err.value)
