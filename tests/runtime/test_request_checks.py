"""A request's options are checked before prefill (minillm/runtime/request_checks.py): an empty prompt, one longer
than the context, max_new_tokens, sampling values, empty stop strings and misspelt options.
"""

from __future__ import annotations

import pytest
from scripted import scripted_model

import minillm
from minillm.errors import ContextWindowExceeded, InvalidRequestError, SamplingParamsError


@pytest.mark.parametrize("prompt", ["", []])
def test_empty_prompt(wtok, prompt):
    with pytest.raises(InvalidRequestError, match=r"the prompt is empty; give at least one character \(or one "
                                                  r"message\)"):
        minillm.generate(scripted_model(wtok, []), prompt)


def test_prompt_longer_than_the_context(wtok):
    model = scripted_model(wtok, [], context=8)
    with pytest.raises(ContextWindowExceeded, match=r"prompt is 11 tokens but the model holds 8 positions, which "
                                                    r"leaves no room for a new token; shorten the prompt to at most "
                                                    r"7 tokens"):
        minillm.generate(model, "AB " * 10)
    assert model.transformer.fed == []  # refused before prefill


@pytest.mark.parametrize("n", [0, -3])
def test_max_new_tokens_not_positive(wtok, n):
    with pytest.raises(InvalidRequestError, match=f"max_new_tokens must be >= 1, got {n}"):
        minillm.generate(scripted_model(wtok, []), "AB", max_new_tokens=n)


@pytest.mark.parametrize("kwargs, match", [
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 1.5}, r"top_p must be in \[0, 1\] \(1 disables\), got 1.5"),
    ({"top_k": -1}, r"top_k must be an integer >= 0 \(0 disables\), got -1"),
    ({"min_p": -0.1}, r"min_p must be in \[0, 1\] \(0 disables\), got -0.1"),
    ({"temperature": float("nan")}, "temperature must be a finite number"),
])
def test_sampling_values_out_of_range(kwargs, match):
    with pytest.raises(SamplingParamsError, match=match):
        minillm.SamplingParams(**kwargs)


@pytest.mark.parametrize("stop", ["", ["ok", ""]])
def test_empty_stop_strings(wtok, stop):
    with pytest.raises(InvalidRequestError, match=r"a stop string is empty \(it would match before any text\); "
                                                  "remove it"):
        minillm.generate(scripted_model(wtok, []), "AB", stop=stop)



def test_an_unknown_request_option_is_named(smollm2):
    """A misspelt keyword (``max_tokens`` for ``max_new_tokens``) is refused with the list of options."""
    import inspect

    from minillm.runtime.request import Request

    # listener (the tracer's wiring), prepared (the server's worker hands over the ids it sized the
    # request by), new_cache (a batched request's paged sequence) and cached_ids (a conversation's turn)
    # are Request's own callers' arguments, not options of stream
    internal = {"self", "model", "prompt", "params", "listener", "prepared", "new_cache", "cached_ids"}
    signature = set(inspect.signature(Request.__init__).parameters) - internal
    assert Request.OPTIONS == signature  # stream's documented options are exactly what Request takes
    with pytest.raises(InvalidRequestError, match=r"unknown request option\(s\) \['max_tokens'\]; the options are "):
        minillm.generate(smollm2, "Hi", max_tokens=4)
