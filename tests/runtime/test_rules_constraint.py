"""A constraint after a stop: a cut answer is never reported as a whole document (issue 49).

When a stop condition fires on a token (max_new_tokens, a stop string), the request ends there: the
grammar must not advance past that token into the run it would force next, or its matcher would
stand at the end of a document the text never reached, and ``result.incomplete`` (which reads the
matcher) would call a cut answer complete.

Model: a tiny random Llama (tests/support/tiny_models.py) with SmolLM2's tokenizer copied from the
model cache (no weights read): llguidance needs a real byte-level vocabulary. Under the regex
``hello world`` the first token is pushed to "hello" (logit_bias); the grammar then forces " world".
"""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest
from tiny_models import tiny_model

import minillm
from minillm import Constraint, SamplingParams
from minillm.sources.hub import resolve_model

HELLO_WORLD = Constraint.regex("hello world")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    source = resolve_model("smollm2-135m-instruct", progress=False).path
    folder = tmp_path_factory.mktemp("rules-constraint")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, folder / name)
    return tiny_model(folder, 49152)


def params(model) -> SamplingParams:
    (hello,) = model.tokenizer.encode("hello")
    return SamplingParams(temperature=0.0, logit_bias={hello: 100})


def test_uncut_the_document_is_whole(model):
    r = minillm.generate(model, "Say hi", params(model), max_new_tokens=5, constraint=HELLO_WORLD)
    assert (r.text, r.stop_reason, r.incomplete) == ("hello world", minillm.StopReason.EOS, None)


@pytest.mark.parametrize(
    ("options", "text", "reason"),
    [
        ({"max_new_tokens": 1}, "hello", minillm.StopReason.MAX_NEW_TOKENS),
        ({"max_new_tokens": 5, "stop": ["hello"]}, "", minillm.StopReason.STOP_STRING),
    ],
)
def test_a_stop_on_the_token_before_a_forced_run_leaves_it_incomplete(model, options, text, reason):
    """The stop fires on "hello"; " world" (forced next) is never part of the text, so the answer is
    not a document of the regex, and the result says why, naming the stop."""
    for r in (
        minillm.generate(model, "Say hi", params(model), constraint=HELLO_WORLD, **options),
        minillm.generate_batch(model, ["Say hi"], params(model), constraint=HELLO_WORLD, **options)[0],
    ):
        assert (r.text, r.stop_reason) == (text, reason)
        assert r.incomplete is not None and f"stopped ({reason.value}) before its regex was complete" in r.incomplete


LONG_RUN = Constraint.regex("hello wonderful world")  # after "hello" the grammar forces " wonderful world"


@pytest.mark.parametrize(
    ("options", "text", "reason"),
    [
        ({"max_new_tokens": 2}, "hello wonderful", minillm.StopReason.MAX_NEW_TOKENS),
        ({"max_new_tokens": 9, "stop": ["wor"]}, "hello wonderful ", minillm.StopReason.STOP_STRING),
        ({"max_new_tokens": 9, "stop": ["world"], "include_stop_string": True}, "hello wonderful world", None),
    ],
)
def test_a_cut_inside_a_forced_run_is_reported_from_the_text(model, options, text, reason):
    """A stop inside the run the grammar forces: the matcher must stand where the text ends, not at the
    end of the run it consumed whole, so ``incomplete`` agrees with the text: set when the text is cut
    (max_new_tokens inside the run, a stop string that trims "world"), None when the text is the whole
    document (the stop string kept in the text). The trace's forced runs are the ids the text got."""
    tracer = minillm.Tracer()
    for r in (
        minillm.generate(model, "Say hi", params(model), constraint=LONG_RUN, tracer=tracer, **options),
        minillm.generate_batch(model, ["Say hi"], params(model), constraint=LONG_RUN, **options)[0],
    ):
        assert r.text == text
        masks = [e.data for e in tracer.events if e.phase == "mask"]
        assert sum(1 + len(m["forced"]) for m in masks) == len(r.ids)  # each sampled id, then its forced run
        if reason is None:
            assert r.incomplete is None, r.incomplete
        else:
            assert r.stop_reason is reason
            assert r.incomplete is not None and f"stopped ({reason.value}) before its regex" in r.incomplete


# --- logprobs of a forced run (issue 47: the model's own, never a 0.0 with no alternatives) ---------------
def log_softmax(rows: np.ndarray) -> np.ndarray:
    z = rows.astype(np.float64) - rows.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


@pytest.mark.parametrize(
    "options",
    [{"max_new_tokens": 9}, {"max_new_tokens": 2}, {"max_new_tokens": 9, "stop": ["wor"]}],
    ids=["whole", "max_tokens-inside-the-run", "stop-string-inside-the-run"],
)
@pytest.mark.parametrize("path", ["generate", "generate_batch", "speculative"])
def test_a_forced_runs_logprobs_are_the_models_own_and_its_ids_unchanged(model, options, path):
    """With logprobs asked, the grammar's forced run (" wonderful world") is taken one id a pass, so each id
    has the model's own log-probability from the logits of the id before it, and ``n`` alternatives; the
    ids, the text and the reasons are those of the same request without logprobs (fed as one chunk).
    Before: each forced id reported logprob 0.0 with itself as its only alternative."""

    def run(p: SamplingParams):
        if path == "speculative":  # the prompt's n-grams would draft the run: no drafts while it is taken
            prompt = "hello wonderful world, hello wonderful world, hello wonderful world"
            return minillm.generate(model, prompt, p, constraint=LONG_RUN, speculative="ngram", **options)
        if path == "generate":
            return minillm.generate(model, "Say hi", p, constraint=LONG_RUN, **options)
        return minillm.generate_batch(model, ["Say hi"], p, constraint=LONG_RUN, **options)[0]

    plain, asked = run(params(model)), run(dataclasses.replace(params(model), top_logprobs=3))
    assert (asked.ids, asked.text, asked.stop_reason, asked.incomplete) == (
        plain.ids, plain.text, plain.stop_reason, plain.incomplete)  # fmt: skip
    assert len(plain.ids) >= 2 and [e["id"] for e in asked.logprobs] == asked.ids
    logits = model.transformer.forward(np.asarray(asked.prompt_ids + asked.ids[:-1]))  # [seq, vocab]
    want = log_softmax(logits[len(asked.prompt_ids) - 1 :])  # row j: before new id j
    for j, (entry, row) in enumerate(zip(asked.logprobs, want, strict=True)):
        assert abs(entry["logprob"] - row[entry["id"]]) < 1e-4, j
        assert [i for i, _ in entry["top"]] == np.argsort(-row, kind="stable")[:3].tolist(), j
        np.testing.assert_allclose([v for _, v in entry["top"]], np.sort(row)[::-1][:3], atol=1e-4)
    forced = asked.logprobs[1:]  # every id after "hello": the grammar left no choice
    assert forced and all(e["sampled_logprob"] == 0.0 and e["logprob"] < -1e-3 for e in forced)
