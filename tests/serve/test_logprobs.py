"""Logprobs are the tokens' own bytes and the model's own numbers (issue 31, kind 1; issue 47).

SmolLM2's byte-level tokenizer splits '🎉' into 'ðŁ' (b'\\xf0\\x9f'), 'İ' (b'\\x8e') and 'ī'
(b'\\x89'): no token of it is a character. OpenAI's ``bytes`` let a client join such tokens back
into the text; ``token`` writes the bytes that are part of a character as ``\\xNN`` escapes.
"""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest
from helpers import finish, job, stepped_worker

import minillm
from minillm.serve import logprobs as lp

TEXT = "🎉🎉 日本語 𝄞"
# SmolLM2's ids for TEXT and their bytes (by hand from tokenizer.json's byte-level pieces)
IDS = [10813, 232, 227, 10813, 232, 227, 17097, 241, 115, 40993, 179, 120, 248, 216, 23159, 222, 248]
BYTES = [b"\xf0\x9f", b"\x8e", b"\x89", b"\xf0\x9f", b"\x8e", b"\x89", b" \xe6", b"\x97", b"\xa5", "本".encode(),
         b"\xe8", b"\xaa", b"\x9e", b" ", b"\xf0\x9d", b"\x84", b"\x9e"]  # fmt: skip
# A completion prompt SmolLM2 continues greedily with emoji, CJK and a musical symbol
PROMPT = "Party time 🎉🎉 日本語 𝄞 and again: 🎉🎉 日本語"


def test_token_bytes_are_the_pieces_bytes_and_join_to_the_text(smollm2):
    tok = smollm2.tokenizer
    assert tok.encode(TEXT).tolist() == IDS
    assert [tok.token_bytes(i) for i in IDS] == BYTES
    assert b"".join(BYTES) == TEXT.encode("utf-8")
    assert tok.token_bytes(tok.encode(" capital")[0]) == b" capital"
    assert tok.piece_for_display(10813) == "\\xf0\\x9f" and tok.piece_for_display(17097) == "␣\\xe6"


def test_entries_carry_real_bytes_escaped_tokens_and_the_given_probabilities(smollm2):
    tok = smollm2.tokenizer
    # steps as the sampler records them: (chosen id, its probability, top candidates by id)
    steps = [(i, 0.5, [(i, 0.5), (IDS[(n + 1) % len(IDS)], 0.25)]) for n, i in enumerate(IDS)]
    entries = lp.content(tok, steps, IDS, top=2)
    assert [bytes(e["bytes"]) for e in entries] == BYTES
    assert lp.joined_bytes(entries) == TEXT.encode("utf-8")
    assert [e["token"] for e in entries[:3]] == ["\\xf0\\x9f", "\\x8e", "\\x89"]
    assert entries[9]["token"] == "本" and entries[6]["token"] == " \\xe6"
    for n, e in enumerate(entries):
        assert e["logprob"] == math.log(0.5)
        assert e["top_logprobs"][0] == {"token": e["token"], "logprob": math.log(0.5), "bytes": e["bytes"]}
        assert e["top_logprobs"][1]["bytes"] == list(BYTES[(n + 1) % len(IDS)])
        json.dumps(e, ensure_ascii=False).encode("utf-8")  # valid UTF-8 text throughout
    # the legacy text_offset: characters before each token; a token inside a character starts at it
    assert lp.text_offsets(entries) == [0, 0, 0, 1, 1, 1, 2, 3, 3, 4, 5, 5, 5, 6, 7, 7, 7]
    with pytest.raises(ValueError, match="chose id 10813 where the output has 232"):
        lp.content(tok, steps, [232], top=0)


def _worker_outcome(model, prompt, chat, params=None, top=5, max_tokens=24):
    worker = stepped_worker(model)
    j = job(prompt, chat=chat, max_tokens=max_tokens, top_logprobs=top, params=params)
    worker.submit(j)
    finish(worker)
    kind, outcome = j.channel.end
    assert kind == "done"
    return outcome


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_logprobs_of_emoji_and_cjk_join_to_the_answer_greedy(smollm2, chat):
    prompt = [{"role": "user", "content": f"Repeat exactly, nothing else: {TEXT}"}] if chat else PROMPT
    o = _worker_outcome(smollm2, prompt, chat)
    assert len(o.logprobs) == o.completion_tokens == 24
    assert lp.joined_bytes(o.logprobs) == o.text.encode("utf-8")
    assert any(e["bytes"] == [240, 159] and e["token"] == "\\xf0\\x9f" for e in o.logprobs)  # half an emoji
    for e in o.logprobs:  # greedy: the chosen token is the most likely one, with the model's number
        top = e["top_logprobs"]
        assert len(top) == 5 and top[0] == {k: e[k] for k in ("token", "logprob", "bytes")}
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert e["logprob"] < 0 and e["bytes"] != [239, 191, 189]
        for t in top:
            assert lp.token_text(bytes(t["bytes"])) == t["token"] and b"\\x" not in bytes(t["bytes"])


def test_sampled_tokens_take_their_own_probability(smollm2):
    params = minillm.SamplingParams(temperature=1.2, top_k=20, seed=7)
    o = _worker_outcome(smollm2, PROMPT, False, params=params, top=5)
    assert lp.joined_bytes(o.logprobs) == o.text.encode("utf-8")
    listed = 0
    for e in o.logprobs:
        assert e["logprob"] > math.log(1e-6)  # drawn from a top-20 distribution: never "unknown"
        for t in e["top_logprobs"]:
            if t["bytes"] == e["bytes"]:
                listed += 1
                assert t["logprob"] == e["logprob"]
    assert listed >= 12  # the sampled token is mostly among the 5 most likely


# --- over HTTP, in this process, through the openai client ----------------------------------------
@pytest.fixture(scope="module")
def app(smollm2):
    from minillm.serve.app import create_app
    from minillm.serve.metrics import ServerMetrics
    from minillm.serve.worker import Worker

    worker = Worker("test", metrics=ServerMetrics(), served_name="smollm2-135m-instruct", warmup=False,
                    kv_cache_mib=16.0)
    worker.start(smollm2)  # the worker thread serves the loaded model
    for _ in range(1000):
        if worker.status == "ready":
            break
        asyncio.run(asyncio.sleep(0.01))
    return create_app(worker)


def openai_client(app):
    import openai

    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://minillm")
    return openai.AsyncOpenAI(base_url="http://minillm/v1", api_key="none", http_client=http)


async def _chat_and_completion(app):
    client = openai_client(app)
    chat = dict(model="smollm2-135m-instruct", max_tokens=24, temperature=0, logprobs=True, top_logprobs=3,
                messages=[{"role": "user", "content": f"Repeat exactly, nothing else: {TEXT}"}])  # fmt: skip
    whole = await client.chat.completions.create(**chat)
    chunks = [c async for c in await client.chat.completions.create(**chat, stream=True)]
    comp = dict(model="smollm2-135m-instruct", prompt=PROMPT, max_tokens=24, temperature=0, logprobs=2)
    legacy = await client.completions.create(**comp)
    legacy_chunks = [c async for c in await client.completions.create(**comp, stream=True)]
    return whole, chunks, legacy, legacy_chunks


def test_http_logprobs_join_to_the_answer_streamed_and_not(app):
    whole, chunks, legacy, legacy_chunks = asyncio.run(_chat_and_completion(app))
    text = whole.choices[0].message.content
    content = whole.choices[0].logprobs.content
    assert b"".join(bytes(e.bytes) for e in content) == text.encode("utf-8") and "🎉" in text
    assert all(e.top_logprobs[0].bytes == e.bytes and e.top_logprobs[0].logprob == e.logprob for e in content)
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in content]
    # the streamed request reuses the first one's prompt blocks: the same numbers up to float32 rounding
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)
    # the legacy shape: escaped tokens, offsets in characters of the text
    lp_ = legacy.choices[0].logprobs
    assert len(lp_.tokens) == legacy.usage.completion_tokens == 24 and "\\xf0\\x9f" in lp_.tokens
    assert all(max(d.values()) == v for d, v in zip(lp_.top_logprobs, lp_.token_logprobs, strict=True))
    text = legacy.choices[0].text
    assert lp_.text_offset[0] == 0 and lp_.text_offset == sorted(lp_.text_offset) and lp_.text_offset[-1] < len(text)
    for token, offset in zip(lp_.tokens, lp_.text_offset, strict=True):
        if "\\x" not in token:  # a whole-character token sits at its offset in the text
            assert text[offset : offset + len(token)] == token
    # streamed, each chunk carries its own tokens; together they are the whole answer's, offsets too
    streamed_legacy = [c.choices[0].logprobs for c in legacy_chunks if c.choices and c.choices[0].logprobs]
    assert len(streamed_legacy) > 1
    assert [t for lp in streamed_legacy for t in lp.tokens] == lp_.tokens
    assert [o for lp in streamed_legacy for o in lp.text_offset] == lp_.text_offset
