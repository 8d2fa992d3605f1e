"""The 4-system-prompt workload: requests that share a long system prompt, four prompts in turn, sent
over HTTP by a few clients at once; what the replicas' prefix caches saved, from the answers' usage.

    run_workload(url)  -> {"cached_tokens": sum over requests of usage.prompt_tokens_details.cached_tokens,
                           "prompt_tokens": ..., "answers": {(system, question): text}, "replicas": {id: n}}

Used by the deploy tests (tests/deploy) and lesson 18 to compare request routers on the same work.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

ROLES = [
    "a patient chemistry tutor for first-year students",
    "a travel agent who plans trips through Europe by train",
    "a support engineer for a company that sells routers",
    "a librarian who recommends classic novels",
]
QUESTIONS = [
    "Say hello.",
    "What can you do?",
    "Give one tip.",
    "Name a topic.",
    "Ask me a question.",
    "What is your name?",
    "Help me start.",
    "Tell me something new.",
    "What should I read first?",
    "Say bye.",
]


def system_prompt(role: str) -> str:
    """A system prompt of several KV blocks: the role, then rules every answer follows."""
    rules = (
        "Answer in one short sentence. Be kind and precise. Never invent facts; say when you do not know. "
        "Use plain words a beginner understands, give an example when it helps, and keep a friendly tone. "
        "Stay on the topic of your role and politely decline questions that fall outside of it."
    )
    return f"You are {role}. {rules}"


def requests() -> list[tuple[int, str]]:
    """(system prompt index, question) for every request, the four prompts interleaved."""
    return [(s, q) for q in QUESTIONS for s in range(len(ROLES))]


def run_workload(url: str, model: str, concurrency: int = 4, max_tokens: int = 4, timeout: float = 300.0) -> dict:
    """Send :func:`requests` to ``url`` (chat completions, greedy, ``max_tokens`` each) from
    ``concurrency`` clients; sum the usage. Raises httpx.HTTPStatusError on any answer but 200."""

    def one(item: tuple[int, str]) -> tuple[tuple[int, str], dict, str]:
        s, question = item
        body = {
            "model": model,
            "messages": [{"role": "system", "content": system_prompt(ROLES[s])}, {"role": "user", "content": question}],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        answer = httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout)
        answer.raise_for_status()
        return item, answer.json(), answer.headers.get("x-minillm-replica", "?")

    with ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(one, requests()))
    replicas: dict[str, int] = {}
    for _, _, replica in done:
        replicas[replica] = replicas.get(replica, 0) + 1
    return {
        "cached_tokens": sum(d["usage"]["prompt_tokens_details"]["cached_tokens"] for _, d, _ in done),
        "prompt_tokens": sum(d["usage"]["prompt_tokens"] for _, d, _ in done),
        "answers": {item: d["choices"][0]["message"]["content"] for item, d, _ in done},
        "replicas": replicas,
    }
