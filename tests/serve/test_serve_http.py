"""The HTTP layer's behaviour (issue 31, kind 4), in this process and in milliseconds: the FastAPI
app in front of a Worker that the test steps by hand (``Worker.attach`` / ``serve_once``, no
worker thread), serving a scripted model whose greedy answer after the prompt's last token
``model`` is AB C DEF G HI J KL, then <eos>, then 'w' forever (tests/support/scripted.py ``chain_model``).

- ``finish_reason`` and ``minillm_stop_reason`` streamed equal the non-streamed ones for every
  stop kind (EOS, max_tokens, a stop string), on both endpoints;
- ``usage.total_tokens`` is prompt + completion, streamed (include_usage) and not;
- a non-streaming client that disconnects has its request cancelled: its blocks go back to the
  pool, it is counted once as cancelled, no step runs for it after;
- ``max_queue`` N: N requests may wait (the running one not counted), the next is refused with
  429 in OpenAI's error shape, and a place that frees up is taken again.

The same parity on the real model through a ``minillm serve`` subprocess: test_serve.py
(``test_greedy_stream_equals_nonstream_equals_in_process``).
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from helpers import stepped_registry, stepped_worker
from scripted import chain_model, word_tokenizer_folder
from servers import counts

from minillm.serve.app import create_app
from minillm.text.tokenizer import Tokenizer

NAME = "chain"
ANSWER = ["AB", "C", "DEF", "G", "HI", "J", "KL"]
MESSAGES = [{"role": "user", "content": "X"}]  # the template ends with '<start_of_turn> model '
PROMPT_TOKENS = {False: 2, True: 7}  # '<bos> model'; '<bos> <start_of_turn> user X <end_of_turn> <start_of_turn> model'


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tok = Tokenizer.from_folder(word_tokenizer_folder(tmp_path_factory.mktemp("words")))
    return chain_model(tok, ["model", *ANSWER], end=1)  # 1: <eos>


@pytest.fixture(params=["one", "several"])
def kind_of_server(request) -> str:
    """The one-model server (a Worker), or several models behind one (a registry of two, issue 47): the same
    HTTP layer must hold in front of either."""
    return request.param


def served(model, kind_of_server: str, **options):
    """The app in front of one Worker, or of a registry whose slot ``NAME`` (and a twin) serve ``model``;
    returns what the test steps (the Worker, or the slot) and the app."""
    if kind_of_server == "one":
        worker = stepped_worker(model, served_name=NAME, **options)
        return worker, create_app(worker)
    registry = stepped_registry({NAME: model, f"{NAME}-twin": model}, **options)
    return registry.slots[NAME], create_app(registry)


async def call(app, worker, path: str, body: dict, max_steps: int = 500) -> httpx.Response:
    """POST ``body`` through the app; step the worker whenever it has work, until the answer."""
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://minillm") as http:
        task = asyncio.create_task(http.post(path, json=body))
        for _ in range(max_steps):
            await asyncio.sleep(0)
            if task.done():
                return task.result()
            if not worker.queue.empty() or worker.scheduler.has_work():
                worker.serve_once()
        task.cancel()
        raise AssertionError(f"no answer after {max_steps} rounds")


def body_of(chat: bool, **fields) -> tuple[str, dict]:
    if chat:
        return "/v1/chat/completions", {"model": NAME, "messages": MESSAGES, **fields}
    return "/v1/completions", {"model": NAME, "prompt": "model", **fields}


def sse_events(text: str) -> list:
    lines = [line.removeprefix("data: ") for line in text.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


KINDS = {  # stop kind: (request fields, finish_reason, minillm_stop_reason, text, completion tokens)
    "eos": ({"max_tokens": 20}, "stop", "eos", "ABCDEFGHIJKL", 8),  # the EOS id is counted, not shown
    "length": ({"max_tokens": 3}, "length", "max new tokens", "ABCDEF", 3),
    "stop string": ({"max_tokens": 20, "stop": ["HI"]}, "stop", "stop string", "ABCDEFG", 5),
}


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_streamed_finish_reason_and_usage_equal_the_unstreamed_ones(model, kind_of_server, kind, chat):
    fields, finish, reason, text, n_completion = KINDS[kind]
    worker, app = served(model, kind_of_server)
    path, body = body_of(chat, temperature=0, **fields)
    whole = asyncio.run(call(app, worker, path, body))
    assert whole.status_code == 200, whole.text
    whole = whole.json()
    choice = whole["choices"][0]
    assert (choice["message"]["content"] if chat else choice["text"]) == text
    assert (choice["finish_reason"], choice["minillm_stop_reason"]) == (finish, reason)
    usage = whole["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (PROMPT_TOKENS[chat], n_completion)
    assert usage["total_tokens"] == PROMPT_TOKENS[chat] + n_completion

    streamed = asyncio.run(call(app, worker, path, {**body, "stream": True, "stream_options": {"include_usage": True}}))
    events = sse_events(streamed.text)
    ends = [c["choices"][0] for c in events if c["choices"] and c["choices"][0]["finish_reason"] is not None]
    assert [(c["finish_reason"], c["minillm_stop_reason"]) for c in ends] == [(finish, reason)]
    pieces = [(c["choices"][0]["delta"].get("content") or "") if chat else c["choices"][0]["text"]
              for c in events if c["choices"]]  # fmt: skip
    assert "".join(pieces) == text
    assert events[-1]["choices"] == [] and events[-1]["usage"] == usage  # total_tokens included
    assert all(c["usage"] is None for c in events[:-1])


def test_a_non_streaming_client_that_disconnects_is_cancelled(model, kind_of_server):
    """The app called as an ASGI server would: the body, then the connection closes after the
    worker's third step (three tokens sampled, of up to 200). The next step ends the request
    cancelled; its blocks are back in the pool; it is counted once, as cancelled; no step runs
    after it."""
    worker, app = served(model, kind_of_server)
    body = json.dumps({"model": NAME, "prompt": "model", "max_tokens": 200, "temperature": 0}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}  # fmt: skip
    sent, gone = [], asyncio.Event()

    async def scenario():
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if messages:
                return messages.pop()
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        task = asyncio.create_task(app(scope, receive, send))
        for _ in range(100):
            await asyncio.sleep(0)
            if not worker.queue.empty():
                break
        for _ in range(3):
            worker.serve_once()
        (active,) = worker.active.values()
        assert len(active.request.new_ids) == 3 and worker.pool.num_used_blocks > 0
        gone.set()  # the client closes the connection
        for _ in range(10):
            await asyncio.sleep(0)
        worker.serve_once()
        if active.request.result is None:  # still running: the client's leaving was not seen
            task.cancel()
        else:
            await asyncio.wait_for(task, 5)
        return active.request

    request = asyncio.run(scenario())
    assert request.result is not None and request.result.stop_reason.value == "cancelled"
    assert request.result.ids == request.new_ids and len(request.new_ids) == 3  # no token after the disconnect
    assert worker.pool.num_used_blocks == 0 and not worker.scheduler.has_work() and worker.active == {}
    assert counts(worker)["finished"] == {"cancelled": 1.0}
    assert counts(worker)["generated"] == 3
    answer = json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))
    assert answer["choices"][0]["finish_reason"] == "abort" and answer["usage"]["completion_tokens"] == 3
    (trace,) = worker.traces.records.values()
    assert trace["stop_reason"] == "cancelled"


def test_max_queue_lets_exactly_n_wait_and_refuses_the_next_with_429(model, kind_of_server):
    """max_queue 3, one running at a time. One request runs; three wait (two of them moved into
    the scheduler's queue by a step: still waiting); the fifth gets 429 in OpenAI's error shape
    with Retry-After, counted as rejected. When the first ends one of the three runs: two wait,
    and a new request is accepted. Every accepted request is answered in full."""
    worker, app = served(model, kind_of_server, max_queue=3, max_num_seqs=1)
    path, body = body_of(False, max_tokens=4, temperature=0)

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://minillm") as http:

            async def post():
                task = asyncio.create_task(http.post(path, json=body))
                for _ in range(100):
                    await asyncio.sleep(0)
                    if task.done() or worker.queue.qsize() > queued:
                        return task
                task.cancel()
                raise AssertionError("the request neither queued nor was answered")

            queued = 0
            first = await post()
            worker.serve_once()  # the first runs (1 of its 4 tokens)
            assert (worker.running, worker.waiting) == (1, 0)
            waiting = []
            for n in range(3):
                queued = worker.queue.qsize()
                waiting.append(await post())
                if n == 0:
                    worker.serve_once()  # moves it into the scheduler's queue: it still waits
            assert (worker.running, worker.waiting) == (1, 3)
            queued = worker.queue.qsize()
            refused = await post()
            assert refused.done(), "a fourth request was queued beside three waiting ones"
            refused = refused.result()
            assert worker.waiting == 3
            for _ in range(10):  # the first request's last tokens
                if first.done():
                    break
                worker.serve_once()
                for _ in range(10):
                    await asyncio.sleep(0)
            assert first.done() and (worker.running, worker.waiting) == (0, 3)
            worker.serve_once()  # one of the three joins the batch
            assert (worker.running, worker.waiting) == (1, 2)
            queued = worker.queue.qsize()
            late = await post()
            assert worker.waiting == 3
            tasks = [first, *waiting, late]
            for _ in range(500):
                if all(t.done() for t in tasks):
                    break
                if not worker.queue.empty() or worker.scheduler.has_work():
                    worker.serve_once()
                await asyncio.sleep(0)
            return refused, [t.result() for t in tasks]

    refused, answered = asyncio.run(scenario())
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json() == {"error": {
        "message": "server busy: 3 requests are already waiting; retry after 1 s",
        "type": "rate_limit_error", "param": None, "code": "queue_full"}}  # fmt: skip
    assert [r.status_code for r in answered] == [200] * 5
    assert [r.json()["choices"][0]["text"] for r in answered] == ["ABCDEFG"] * 5
    assert counts(worker)["rejected"] == 1 and counts(worker)["finished"] == {"max new tokens": 5.0}


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_the_prompt_is_rendered_and_tokenized_once_per_request(model, kind_of_server, monkeypatch, chat):
    """The worker sizes the request with the prompt's ids and hands them to it (``prepared=``):
    one encode per request, and the request's trace and usage count the same ids."""
    worker, app = served(model, kind_of_server)
    encode, calls = model.tokenizer.encode, []
    monkeypatch.setattr(model.tokenizer, "encode", lambda *a, **k: calls.append(a) or encode(*a, **k))
    path, body = body_of(chat, temperature=0, max_tokens=3)
    answer = asyncio.run(call(app, worker, path, body))
    assert answer.status_code == 200, answer.text
    assert len(calls) == 1
    assert answer.json()["usage"]["prompt_tokens"] == PROMPT_TOKENS[chat]
    trace = worker.trace(answer.json()["id"])
    tokenize = next(e for e in trace["events"] if e["phase"] == "tokenize")
    assert len(tokenize["data"]["ids"]) == PROMPT_TOKENS[chat]
