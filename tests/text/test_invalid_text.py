"""Invalid text in, half characters out (issue 18, item 5).

- A prompt with a lone surrogate (``"a\\ud800b"``): transformers' tokenizer (``tokenizers``) fails
  with a bare TypeError (checked here); minillm raises InvalidRequestError naming the position
  (1, by hand), in plain and chat prompts alike.
- ``max_new_tokens`` cutting a character in half: the stream's deltas join to the full decode
  (expected text from transformers' tokenizer on the same folder, U+FFFD at the end), and the
  trace's stop detail says the output ends inside a character.
"""

from __future__ import annotations

import pytest
from scripted import scripted_model

import minillm
from minillm import SamplingParams, Tracer
from minillm.errors import InvalidRequestError


def test_lone_surrogate_is_a_clear_error(smollm2):
    with pytest.raises(TypeError):  # what the library underneath does
        smollm2.tokenizer.backend.encode("a\ud800b")
    with pytest.raises(InvalidRequestError, match=r"the text holds a lone surrogate U\+D800 at character 1 .*half of a "
                                                  r"UTF-16 pair"):
        minillm.tokenize(smollm2, "a\ud800b")
    with pytest.raises(InvalidRequestError, match=r"lone surrogate U\+DE00 at character"):
        minillm.generate(smollm2, [{"role": "user", "content": "smile \ude00"}], max_new_tokens=1)
    # A real pair, written as one character, is fine.
    assert minillm.tokenize(smollm2, "a😀b").tolist() == smollm2.tokenizer.backend.encode("a😀b").ids


@pytest.mark.reference
def test_a_character_cut_by_max_new_tokens_is_said_in_the_trace(smollm2):
    import transformers

    tok = smollm2.tokenizer
    script = tok.encode(" good 很", add_special_tokens=False).tolist()
    hf = transformers.AutoTokenizer.from_pretrained(str(smollm2.path))
    assert hf.decode(script[-3:]) == " 很" and hf.decode(script[-3:-1]) == " \ufffd"  # ' 很': three byte tokens
    model = scripted_model(tok, script)
    tracer, result = Tracer(), []
    deltas = list(minillm.stream(model, "Say it", SamplingParams(temperature=0.0), max_new_tokens=len(script) - 1,
                                 tracer=tracer, result=result))
    ids = result[0].ids
    assert ids == script[:-1]
    assert "".join(deltas) == result[0].text == hf.decode(ids) == " good \ufffd"
    (stop,) = [e.data for e in tracer.events if e.phase == "stop"]
    assert stop["detail"] == (f"{len(ids)} new tokens = max_new_tokens {len(ids)}; the output ends inside a "
                              "character: the last tokens hold only its first bytes, so the text ends in U+FFFD "
                              "'\ufffd' (as the full decode does)")
    # The whole character: no note.
    tracer = Tracer()
    out = minillm.generate(scripted_model(tok, script), "Say it", max_new_tokens=len(script), tracer=tracer)
    assert out.text == hf.decode(script) == " good 很"
    (stop,) = [e.data for e in tracer.events if e.phase == "stop"]
    assert "inside a character" not in stop["detail"]
