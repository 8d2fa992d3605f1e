"""Logprobs are the model's own, streamed chunk by chunk, and a speculative usage counts what it returned
(issue 47, part B), through a real server (``minillm serve`` in a subprocess) and the official client.

The reference is computed here: one forward of this process's SmolLM2 over the prompt and the answer's
ids gives the logits at every position; ``log_softmax`` of each row (float64) is what OpenAI's
``logprobs`` mean, whatever ``temperature``, ``top_p``, ``top_k`` or ``min_p`` the sampler used.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from servers import MODEL, running_server

from minillm.runtime.steps import prepare

# float32 logits of the server's batched pass and of this forward differ by rounding only
TOL = 1e-4
# sampler settings that keep few ids (top_k=2 keeps two, top_p=0.2 mostly one): the logprobs must not care
WARPS = [
    {"temperature": 1.3, "top_p": 0.2, "seed": 1},
    {"temperature": 0.7, "extra_body": {"top_k": 2}, "seed": 2},
    {"temperature": 1.0, "extra_body": {"min_p": 0.5}, "seed": 3},
    {"temperature": 0},
]
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3,"
PARTY = "Party time 🎉🎉 日本語 𝄞 and again: 🎉🎉 日本語"  # greedy: emoji and CJK split over tokens


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("logprobs-model")) as (base, _):
        yield base


@pytest.fixture(scope="module")
def client(url):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def id_of(smollm2) -> dict[bytes, int]:
    """Each token's bytes -> its id (SmolLM2's 49,152 byte strings are all different)."""
    tok = smollm2.tokenizer
    return {tok.token_bytes(i): i for i in range(smollm2.config.vocab_size)}


def log_softmax(row: np.ndarray) -> np.ndarray:
    """``log softmax`` of one row of logits, in float64."""
    z = row.astype(np.float64) - row.max()
    return z - np.log(np.exp(z).sum())


def reference(model, prompt, chat: bool, ids: list[int]) -> np.ndarray:
    """The model's log softmax ``float64 [len(ids), vocab]`` before each of ``ids``, after ``prompt``."""
    prompt_ids = prepare(model, prompt, chat=chat)[1].tolist()
    logits = model.transformer.forward(np.asarray(prompt_ids + ids[:-1]), None)  # [seq, vocab] float32
    return np.stack([log_softmax(row) for row in logits[len(prompt_ids) - 1 :]])


def check_chat_entries(model, id_of, messages, content, n: int) -> float:
    """Each entry of ``content`` and its ``n`` alternatives are the model's own log-probabilities: the
    largest difference from the reference."""
    ids = [id_of[bytes(e.bytes)] for e in content]
    ref = reference(model, messages, True, ids)
    worst = 0.0
    for e, row, token in zip(content, ref, ids, strict=True):
        assert len(e.top_logprobs) == n  # never fewer than asked, whatever the sampler kept
        alts = [id_of[bytes(t.bytes)] for t in e.top_logprobs]
        want = np.argsort(-row, kind="stable")[:n]
        np.testing.assert_allclose(np.sort(row[alts]), np.sort(row[want]), atol=TOL)  # the n most likely
        got = np.array([e.logprob, *(t.logprob for t in e.top_logprobs)])
        worst = max(worst, float(np.abs(got - row[[token, *alts]]).max()))
    assert worst < TOL
    return worst


@pytest.mark.parametrize("warp", WARPS, ids=["top_p", "top_k", "min_p", "greedy"])
def test_chat_logprobs_are_the_models_own_whatever_the_sampler_keeps(client, smollm2, id_of, warp):
    messages = [{"role": "user", "content": "Name three colours."}]
    body = dict(model=MODEL, messages=messages, max_tokens=10, logprobs=True, top_logprobs=20, **warp)
    whole = client.chat.completions.create(**body)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens - (whole.choices[0].finish_reason == "stop")
    check_chat_entries(smollm2, id_of, messages, content, 20)
    # a token the sampler was certain of (top_p / top_k / min_p left it alone) keeps the model's doubt
    if warp.get("temperature"):
        assert min(e.logprob for e in content) < -0.05
    chunks = list(client.chat.completions.create(**body, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    check_chat_entries(smollm2, id_of, messages, streamed, 20)


@pytest.mark.parametrize("warp", WARPS[:3], ids=["top_p", "top_k", "min_p"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_legacy_logprobs_are_the_models_own_whatever_the_sampler_keeps(client, smollm2, id_of, warp, stream):
    prompt = "The three primary colours are"
    body = dict(model=MODEL, prompt=prompt, max_tokens=8, logprobs=5, **warp)
    if stream:
        parts = [c.choices[0].logprobs for c in client.completions.create(**body, stream=True) if c.choices]
        tokens = [t for lp in parts if lp for t in lp.tokens]
        values = [v for lp in parts if lp for v in lp.token_logprobs]
        tops = [d for lp in parts if lp for d in lp.top_logprobs]
    else:
        lp = client.completions.create(**body).choices[0].logprobs
        tokens, values, tops = lp.tokens, lp.token_logprobs, lp.top_logprobs
    ids = [id_of[t.encode("utf-8")] for t in tokens]  # plain-text tokens here: their text is their bytes
    assert len(ids) == 8
    ref = reference(smollm2, prompt, False, ids)
    np.testing.assert_allclose(values, ref[np.arange(8), ids], atol=TOL)
    for d, row in zip(tops, ref, strict=True):
        assert len(d) == 5  # five alternatives, though top_k=2 or top_p=0.2 kept fewer
        np.testing.assert_allclose(sorted(d.values(), reverse=True), np.sort(row)[::-1][:5], atol=TOL)


# --- structured output: the grammar's forced tokens have the model's logprobs too --------------------------
CITY = {"type": "object", "properties": {"capital_city_of_france": {"type": "string"}},
        "required": ["capital_city_of_france"], "additionalProperties": False}  # fmt: skip


def test_a_forced_keys_tokens_have_the_models_own_logprobs(client, smollm2, id_of):
    """Under a JSON schema the grammar forces the key's tokens; with logprobs they are taken one a pass
    (minillm/runtime/request.py, ``take``), so each has 20 alternatives and the model's own logprob, and
    the answer is the one given without logprobs. Before: the forced tokens came with logprob 0.0 and
    one alternative."""
    messages = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    body = dict(model=MODEL, messages=messages, max_tokens=30, temperature=0, response_format=fmt)
    plain = client.chat.completions.create(**body).choices[0].message.content
    asked = client.chat.completions.create(**body, logprobs=True, top_logprobs=20).choices[0]
    assert asked.message.content == plain and "capital_city_of_france" in json.loads(plain)
    content = asked.logprobs.content
    assert joined(content).decode() == plain
    check_chat_entries(smollm2, id_of, messages, content, 20)
    # the key's tokens (forced: no choice) are there, and the model did not give them probability 1
    key = [e for e in content if e.token.strip('"_ ') and e.token.strip('"_ ') in "capital_city_of_france"]
    assert len(key) >= 3 and min(e.logprob for e in key) < -1e-3
    chunks = list(client.chat.completions.create(**body, logprobs=True, top_logprobs=20, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert joined(streamed) == joined(content)
    check_chat_entries(smollm2, id_of, messages, streamed, 20)


def joined(entries) -> bytes:
    return b"".join(bytes(e.bytes) for e in entries)


# --- streamed: each chunk carries its own tokens' logprobs, as OpenAI sends them --------------------------
def test_each_chunk_carries_the_logprobs_of_its_own_text(client):
    messages = [{"role": "user", "content": f"Repeat exactly, nothing else: {PARTY}"}]
    body = dict(model=MODEL, messages=messages, max_tokens=24, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**body).choices[0].logprobs.content
    chunks = [c.choices[0] for c in client.chat.completions.create(**body, stream=True) if c.choices]
    carrying = 0
    for c in chunks:
        entries = c.logprobs.content if c.logprobs else []
        text = c.delta.content or ""
        # its text's tokens, no other (bytes that never make a character are shown as U+FFFD)
        assert b"".join(bytes(e.bytes) for e in entries).decode("utf-8", errors="replace") == text
        carrying += bool(text)
    assert carrying >= 10  # many chunks, each with its own (not all of them in the last one)
    streamed = [e for c in chunks if c.logprobs for e in c.logprobs.content]
    assert [e.bytes for e in streamed] == [e.bytes for e in whole]  # half-emoji tokens ride with the emoji
    np.testing.assert_allclose([e.logprob for e in streamed], [e.logprob for e in whole], atol=TOL)


def test_legacy_chunks_carry_their_tokens_and_a_cut_stop_strings_come_last(client):
    body = dict(model=MODEL, prompt=PARTY, max_tokens=24, temperature=0, logprobs=2)
    whole = client.completions.create(**body).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**body, stream=True) if c.choices]
    for c in chunks[:-1]:
        assert "".join(c.logprobs.tokens) == c.text or "\\x" in "".join(c.logprobs.tokens)
        assert len(c.logprobs.tokens) >= 1 and c.text
    tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
    assert tokens == whole.logprobs.tokens and len(tokens) == 24
    assert [o for c in chunks if c.logprobs for o in c.logprobs.text_offset] == whole.logprobs.text_offset
    # a stop string: its tokens were held back, then cut; their logprobs come with the last chunk
    body = dict(model=MODEL, prompt=COUNTING, max_tokens=30, temperature=0, logprobs=1, stop=[" 9,"])
    whole = client.completions.create(**body).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**body, stream=True) if c.choices]
    assert whole.text == "".join(c.text for c in chunks) == " 4, 5, 6, 7, 8,"
    assert chunks[-1].finish_reason == "stop" and "".join(chunks[-1].logprobs.tokens) == " 9,"
    for c in chunks[:-1]:
        assert "".join(c.logprobs.tokens) == c.text
    assert [t for c in chunks for t in c.logprobs.tokens] == whole.logprobs.tokens


# --- speculative: usage counts the tokens returned, and the drafts kept ------------------------------------
@pytest.mark.parametrize(
    ("where", "draft"), [(["7"], "ngram"), ([" 9,"], "ngram"), (None, "self-int8")], ids=["7", "9", "eos"]
)
def test_speculative_usage_counts_what_was_returned(client, where, draft):
    """A stop string (or EOS) inside an accepted run of drafts: the same answer and completion_tokens as
    plain decoding, and ``accepted_tokens`` only the drafts kept (every returned id but the prefill's is a
    kept draft or a verify pass's own token; the last pass has none when the stop lands on a draft)."""
    if where is None:
        ask = dict(messages=[{"role": "user", "content": "Say hi"}], max_tokens=40)
        create = client.chat.completions.create
        text_of = lambda r: r.choices[0].message.content  # noqa: E731
    else:
        ask = dict(prompt=COUNTING, max_tokens=30, stop=where)
        create, text_of = client.completions.create, lambda r: r.choices[0].text
    plain = create(model=MODEL, temperature=0, **ask)
    extra = {"speculative": draft, "num_speculative_tokens": 4}
    spec = create(model=MODEL, temperature=0, extra_body=extra, **ask)
    assert text_of(spec) == text_of(plain) and spec.choices[0].finish_reason == "stop"
    n, u = plain.usage.completion_tokens, spec.usage
    assert u.completion_tokens == n and u.total_tokens == plain.usage.total_tokens
    assert u.accepted_tokens > 0 and n - u.target_passes <= u.accepted_tokens <= n - u.target_passes + 1
    streamed = list(create(model=MODEL, temperature=0, extra_body=extra, stream=True,
                           stream_options={"include_usage": True}, **ask))  # fmt: skip
    assert streamed[-1].usage.completion_tokens == n
