"""Speculative decoding under preemption through ``minillm serve`` (issue 47; generate_batch's sweep:
tests/runtime/test_speculative_preemption.py).

One server with ``--speculative ngram`` (adaptive k, as the server always drafts) and a KV pool of one
request's blocks (``--kv-cache-mib``, blocks of 4 positions, no warm-up: it would not fit). The
reference: each prompt alone with ``speculative: "off"`` (one request in the pool: no preemption).
Then eight requests at once, ``num_speculative_tokens`` 1..8, on three prompts that repeat themselves:
the two shorter prompts fit the pool together, their decodes outgrow it and the newer is preempted
(the live event stream says ``request.preempted``). Every answer's text and token count equal the
plain greedy one's.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from event_reader import Reader
from servers import MODEL, running_server

pytestmark = pytest.mark.slow

PROMPTS = ("a b c a b c a b", "one two one two one", "the cat sat on the mat. the cat sat on the")
PROMPT_TOKENS = (8, 5, 12)  # checked against each answer's usage
NEW = 12
BLOCK = 4
BYTES_PER_POSITION = 2 * 30 * 3 * 64 * 4  # SmolLM2-135M: keys and values, 30 layers, 3 KV heads of 64, float32
ONE_REQUEST_BLOCKS = max(-(-(n + NEW - 1) // BLOCK) for n in PROMPT_TOKENS)  # the 12-token prompt's: 6
POOL_MIB = ONE_REQUEST_BLOCKS * BLOCK * BYTES_PER_POSITION / 2**20


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    flags = ("--speculative", "ngram", "--num-speculative-tokens", "8", "--kv-cache-mib", f"{POOL_MIB!r}",
             "--block-size", str(BLOCK), "--no-warmup", "-v", "quiet")  # fmt: skip
    with running_server(tmp_path_factory.mktemp("spec-preemption"), *flags) as (base, _log):
        yield base


def complete(url: str, prompt: str, **fields) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": NEW, "temperature": 0, **fields}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def test_eight_speculative_requests_preempted_answer_as_plain_greedy(url):
    plain = {}
    for prompt, n in zip(PROMPTS, PROMPT_TOKENS, strict=True):
        answer = complete(url, prompt, speculative="off")
        assert answer["usage"]["prompt_tokens"] == n and answer["usage"]["completion_tokens"] == NEW
        plain[prompt] = answer["choices"][0]["text"]
    reader = Reader(url)
    reader.wait(lambda events: reader.hellos)  # subscribed: the server now publishes its events
    try:
        jobs = [(PROMPTS[k % 3], k) for k in range(1, 9)]
        with ThreadPoolExecutor(len(jobs)) as pool:
            answers = list(pool.map(lambda job: complete(url, job[0], num_speculative_tokens=job[1]), jobs))
        finished = lambda events: sum(e["type"] == "request.finished" for _, e in events) >= len(jobs)  # noqa: E731
        reader.wait(finished)
    finally:
        reader.stop.set()
    for (prompt, k), answer in zip(jobs, answers, strict=True):
        assert answer["choices"][0]["text"] == plain[prompt], (k, answer)
        assert answer["usage"]["completion_tokens"] == NEW, answer
        assert 0 <= answer["usage"]["accepted_tokens"] <= answer["usage"]["drafted_tokens"], answer
    # A row drafts only when a block is free for its drafts, and who finds one free depends on when the
    # eight requests arrive: some may decode every step without drafts. The speculative ones drafted:
    assert sum(a["usage"]["drafted_tokens"] > 0 for a in answers) > 0, [a["usage"] for a in answers]
    preempted = {e["id"] for _, e in reader.events if e["type"] == "request.preempted"}
    assert preempted, [e["type"] for _, e in reader.events]
    kept = {a["id"] for a in answers if a["usage"]["accepted_tokens"] > 0}
    assert preempted & kept  # a request that had kept drafts was preempted and recomputed
