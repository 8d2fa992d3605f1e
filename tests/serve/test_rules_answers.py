"""What an answer reports, pinned on a scripted model in the server's own worker (issue 49).

- logprobs of an answer that ends on EOS: one entry per token of the text, the EOS (which ends the
  text and is never shown) left out, so the entries' bytes join to exactly the text's UTF-8;
- ``usage`` with cached prompt tokens: ``prompt_tokens`` counts the whole prompt, cached tokens among
  it (OpenAI's ``prompt_tokens_details.cached_tokens``), and ``total_tokens`` is prompt + completion.

The worker is stepped by hand (tests/support/helpers.py: no HTTP, no thread) around a chain model
(tests/support/scripted.py) whose greedy answer after "C" is "DEF G HI" then EOS: exact, milliseconds.
"""

from __future__ import annotations

import pytest
from helpers import finish, job, stepped_worker
from scripted import chain_model, word_tokenizer_folder

import minillm
from minillm.serve import logprobs as lp
from minillm.serve.responses import chat_logprobs, completion_logprobs, usage
from minillm.text.tokenizer import Tokenizer

PROMPT = "AB KL X Y Z J KL C"  # 9 ids with <bos>: two full blocks of 4 before the last id


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tokenizer = Tokenizer.from_folder(word_tokenizer_folder(tmp_path_factory.mktemp("rules-answers")))
    return chain_model(tokenizer, ["C", "DEF", "G", "HI"], end=1)  # ... HI -> <eos> (id 1)


def answer(worker, **options):
    j = job(PROMPT, **options)
    worker.submit(j)
    finish(worker)
    kind, outcome = j.channel.end
    assert kind == "done"
    return outcome


def test_logprobs_of_an_answer_that_ends_on_eos_join_to_its_text(model):
    outcome = answer(stepped_worker(model, block_size=4), max_tokens=10, top_logprobs=2)
    assert outcome.stop_reason is minillm.StopReason.EOS
    assert (outcome.text, outcome.completion_tokens) == ("DEFGHI", 4)  # DEF, G, HI and the EOS
    entries = outcome.logprobs
    assert [e["token"] for e in entries] == ["DEF", "G", "HI"]  # no entry for the EOS
    assert lp.joined_bytes(entries) == outcome.text.encode()
    assert all(len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["token"] == e["token"] for e in entries)
    # both of OpenAI's shapes carry the same entries
    assert [e.token for e in chat_logprobs(outcome).content] == ["DEF", "G", "HI"]
    legacy = completion_logprobs(outcome)
    assert (legacy.tokens, legacy.text_offset) == (["DEF", "G", "HI"], [0, 3, 4])


def test_usage_counts_cached_prompt_tokens_inside_prompt_tokens(model):
    worker = stepped_worker(model, block_size=4)
    first = usage(answer(worker, max_tokens=10))
    second = usage(answer(worker, max_tokens=10))  # the same prompt: its two full blocks come from the cache
    assert (first.prompt_tokens, first.completion_tokens, first.total_tokens) == (9, 4, 13)
    assert first.prompt_tokens_details.cached_tokens == 0
    assert (second.prompt_tokens, second.completion_tokens, second.total_tokens) == (9, 4, 13)
    assert second.prompt_tokens_details.cached_tokens == 8
