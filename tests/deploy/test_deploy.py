"""The Ray Serve deployment (issue 46) against ``minillm serve``, through the official ``openai`` client.

- greedy answers through two replicas (Ray's default router: its proxy in front of the replicas'
  FastAPI app) equal one ``minillm serve``'s on 5 prompts, streamed and not;
- each replica's /metrics carries its replica id as a label, and its answers say which replica and
  which weights (``x-minillm-replica``, ``x-minillm-weight-dtype``);
- after SIGINT, no process of the deployment (the command, Ray's, the replicas) is left.
"""

from __future__ import annotations

import httpx
from deployments import MODEL, running_deployment
from openai import OpenAI
from servers import running_server

PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 2 + 2?",
    "Give one tip for learning to code.",
]
MAX_TOKENS = 12


def client(url: str) -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def answers(url: str) -> dict[str, list[str]]:
    """Each prompt's greedy answer, not streamed and streamed."""
    c = client(url)
    plain, streamed = [], []
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        out = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        plain.append(out.choices[0].message.content)
        chunks = c.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        streamed.append("".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices))
    return {"plain": plain, "streamed": streamed}


def test_greedy_answers_through_ray_serve_equal_minillm_serve(tmp_path):
    with running_server(tmp_path) as (url, _):
        expected = answers(url)
    assert all(expected["plain"]) and expected["plain"] == expected["streamed"]
    with running_deployment(tmp_path, "--replicas", "2", "--router", "default") as (_, url, log):
        got = answers(url)
        seen = {httpx.get(url + "/health").headers["x-minillm-replica"] for _ in range(12)}
        metrics = httpx.get(url + "/metrics").text
    assert got == expected
    assert len(seen) == 2  # both replicas answered
    assert any(f'minillm_kv_cache_blocks_total{{replica="{r}"}}' in metrics for r in seen)
    assert log.read_text().count("ready (warmed)") == 2
