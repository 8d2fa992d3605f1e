"""`minillm serve` as a client sees it: the official `openai` client and httpx against a real server.

One server for the module (a subprocess, a free port, --threads 1), ``server``: default settings;
greedy parity, logprobs, cancellation, 16 clients, bad requests, the bench. The small server's
tests (loading, the queue limit, the timeout, schemathesis) are test_serve_small.py's.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from helpers import run_bench
from servers import MODEL, SECOND, SERVERS, chat_body, metrics, running_server

import minillm

pytestmark = pytest.mark.slow


# --- servers -----------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=list(SERVERS))
def server(tmp_path_factory, request):
    """One model's server, then a several-model server (``servers.SERVERS``): every test runs on both."""
    with running_server(tmp_path_factory.mktemp("serve"), *SERVERS[request.param]) as (url, log):
        yield url, log


@pytest.fixture(scope="module")
def model():
    return minillm.load(MODEL, progress=False, warmup=False, threads=1)


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


# --- greedy parity -----------------------------------------------------------------------------
CASES = [  # (chat?, prompt, stop)
    (True, "What is the capital of France?", None),
    (True, "Write one word about the sea 🌊.", None),
    (True, "日本の首都はどこですか？", None),
    (True, "Count: one, two, three,", [" five"]),
    (True, "Say hello in French.", "."),
    (False, "The capital of France is", None),
    (False, "Emoji weather report: ☀️ 🌧️", None),
    (False, "中国的首都是", None),
    (False, "1, 2, 3, 4,", [" 6"]),
    (False, "def add(a, b):", "\n\n"),
]


@pytest.mark.parametrize(("chat", "prompt", "stop"), CASES)
def test_greedy_stream_equals_nonstream_equals_in_process(client, model, chat, prompt, stop):
    n = 12
    messages = [{"role": "user", "content": prompt}]
    expected = minillm.generate(
        model, messages if chat else prompt, minillm.SamplingParams(temperature=0), max_new_tokens=n, stop=stop
    )
    n_prompt = len(minillm.tokenize(model, messages if chat else prompt))
    common = {"model": MODEL, "max_tokens": n, "temperature": 0, "stop": stop}
    if chat:
        full = client.chat.completions.create(messages=messages, **common)
        text, finish = full.choices[0].message.content, full.choices[0].finish_reason
        chunks = list(
            client.chat.completions.create(
                messages=messages, stream=True, stream_options={"include_usage": True}, **common
            )
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        full = client.completions.create(prompt=prompt, **common)
        text, finish = full.choices[0].text, full.choices[0].finish_reason
        chunks = list(
            client.completions.create(prompt=prompt, stream=True, stream_options={"include_usage": True}, **common)
        )
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected.text
    assert streamed == expected.text
    assert full.usage.prompt_tokens == n_prompt
    assert full.usage.completion_tokens == len(expected.ids)
    assert chunks[-1].usage.prompt_tokens == n_prompt  # the include_usage chunk, last, no choices
    assert chunks[-1].usage.completion_tokens == len(expected.ids) and chunks[-1].choices == []
    assert full.usage.total_tokens == chunks[-1].usage.total_tokens == n_prompt + len(expected.ids)
    reasons = {"eos": "stop", "stop string": "stop", "max new tokens": "length"}
    assert finish == reasons[expected.stop_reason.value]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [finish]
    if stop is not None and expected.stop_reason is minillm.StopReason.STOP_STRING:
        assert all(s not in text for s in ([stop] if isinstance(stop, str) else stop))


STOP_KINDS = [  # (max_tokens, stop) for the chat "Say hi.": SmolLM2's greedy answer ends on ...
    (30, None),  # its EOS ("Hello there! I'm here to help ... What can I help you with?", 24 ids)
    (5, None),  # max_tokens
    (30, ["!"]),  # the stop string, after "Hello there"
]


def test_streamed_finish_reason_equals_the_unstreamed_one_for_every_stop_kind(client, model):
    """Through the real server: for an EOS, max_tokens and a stop string, the streamed chunk that
    ends the answer carries the non-streamed finish_reason and minillm_stop_reason, and both
    usages count the same tokens, total = prompt + completion."""
    messages = [{"role": "user", "content": "Say hi."}]
    n_prompt = len(minillm.tokenize(model, messages))
    kinds = []
    for n, stop in STOP_KINDS:
        expected = minillm.generate(model, messages, minillm.SamplingParams(temperature=0), max_new_tokens=n, stop=stop)
        kinds.append(expected.stop_reason.value)
        common = {"model": MODEL, "messages": messages, "max_tokens": n, "temperature": 0, "stop": stop}
        full = client.chat.completions.create(**common)
        chunks = list(client.chat.completions.create(**common, stream=True, stream_options={"include_usage": True}))
        whole = full.choices[0]
        ends = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason is not None]
        assert [(e.finish_reason, e.minillm_stop_reason) for e in ends] == [
            (whole.finish_reason, whole.minillm_stop_reason)
        ]
        assert whole.minillm_stop_reason == expected.stop_reason.value and whole.message.content == expected.text
        assert full.usage.prompt_tokens == n_prompt and full.usage.completion_tokens == len(expected.ids)
        assert full.usage.total_tokens == n_prompt + len(expected.ids)
        usage = chunks[-1].usage  # its prompt_tokens_details differ: the second request finds cached blocks
        assert chunks[-1].choices == [] and (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
            full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens
        )
    assert kinds == ["eos", "max new tokens", "stop string"]


def test_a_stop_string_case_really_stops(client, model):
    """At least one of the CASES ends on its stop string (so parity covered the cut)."""
    hits = [
        p
        for chat, p, stop in CASES
        if stop
        and minillm.generate(
            model,
            [{"role": "user", "content": p}] if chat else p,
            minillm.SamplingParams(temperature=0),
            max_new_tokens=12,
            stop=stop,
        ).stop_reason
        is minillm.StopReason.STOP_STRING
    ]
    assert hits


def test_logprobs_chat_and_legacy_shapes(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi!"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = r.choices[0].logprobs.content
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:  # greedy: the chosen token is the most likely candidate
        assert len(e.top_logprobs) == 3
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == pytest.approx(e.logprob)
        assert e.logprob <= 0 and e.bytes == list(e.token.encode())
    c = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0, logprobs=2
    )
    lp = c.choices[0].logprobs
    assert "".join(lp.tokens) == c.choices[0].text and len(lp.tokens) == c.usage.completion_tokens == 5
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    assert all(len(d) <= 2 and max(d.values()) == pytest.approx(v) for d, v in zip(lp.top_logprobs, lp.token_logprobs))


# --- ids, traces, console -------------------------------------------------------------------------
def test_request_id_header_body_trace_and_console(server):
    url, log = server
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 0})
    rid = r.headers["x-request-id"]
    assert r.json()["id"] == rid and rid.startswith("cmpl-")
    trace = httpx.get(f"{url}/v1/traces/{rid}").json()
    phases = [e["phase"] for e in trace["events"]]
    assert phases[:3] == ["prepare", "tokenize", "prefill"] and phases[-2:] == ["stop", "summary"]
    assert trace["stop_reason"] == "max new tokens" and phases.count("decode") == 2
    assert f"request {rid}" in log.read_text()  # the console trace (summary verbosity) names the request
    one = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 1})
    summary = httpx.get(f"{url}/v1/traces/{one.headers['x-request-id']}").json()["events"][-1]["data"]
    assert summary["tpot_s"] is None and summary["new_tokens"] == 1  # no decode step: NaN in Python, null in JSON
    missing = httpx.get(f"{url}/v1/traces/cmpl-nope")
    assert missing.status_code == 404 and "cmpl-nope" in missing.json()["error"]["message"]


def test_models_endpoint_lists_and_retrieves_each_served_model(client, server, request):
    """GET /v1/models and OpenAI's GET /v1/models/{id} (the client's ``models.retrieve``): each listed
    model retrieves as OpenAI's model object; another name is a 404 in OpenAI's shape."""
    import openai

    served = [MODEL, SECOND] if request.node.callspec.params["server"] == "several" else [MODEL]
    listed = {m.id: m for m in client.models.list().data}
    assert list(listed) == served
    for name in served:
        card = client.models.retrieve(name)
        assert (card.id, card.object, card.owned_by) == (name, "model", "minillm")
        assert card.created == listed[name].created == client.models.retrieve(name).created  # a fixed Unix time
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4o")
    names = ", ".join(map(repr, served))
    assert err.value.body == {
        "message": f"model 'gpt-4o' not found; this server serves {names} (GET /v1/models)",
        "type": "not_found_error",
        "param": "model",
        "code": "model_not_found",
    }


# --- cancellation --------------------------------------------------------------------------------
def test_disconnect_mid_stream_cancels_and_frees_the_cache(server):
    url, _ = server
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", url + "/v1/completions", json=body) as r:
        rid = r.headers["x-request-id"]
        lines = r.iter_lines()  # held in a name: leaving a `for` over it would close the connection at once
        chunks = 0
        while chunks < 3:
            chunks += next(lines).startswith("data: ")
        during = metrics(url)  # still connected
    # leaving the block closed the connection mid-stream
    left = time.monotonic()
    while time.monotonic() - left < 2.0:
        after = metrics(url)
        if after["minillm_num_requests_running"] == 0 and after["minillm_kv_cache_bytes_in_use"] == 0:
            break
        time.sleep(0.02)
    assert during["minillm_num_requests_running"] == 1 and during["minillm_kv_cache_bytes_in_use"] > 0
    assert during["minillm_kv_cache_bytes_reserved"] >= during["minillm_kv_cache_bytes_in_use"]
    assert after["minillm_num_requests_running"] == 0
    assert after["minillm_kv_cache_bytes_in_use"] == 0 and after["minillm_kv_cache_bytes_reserved"] == 0
    trace = httpx.get(f"{url}/v1/traces/{rid}").json()
    assert trace["stop_reason"] == "cancelled"
    stop = next(e for e in trace["events"] if e["phase"] == "stop")
    assert stop["data"]["reason"] == "cancelled"
    decoded = sum(e["phase"] == "decode" for e in trace["events"])
    assert 2 <= decoded < 100  # stopped long before the 400-token budget


# --- many clients --------------------------------------------------------------------------------
def test_16_concurrent_streams_all_complete_batched(server, model):
    url, _ = server
    prompts = [f"Tell me a fact about the number {i}." for i in range(4)]
    expected = {
        p: minillm.generate(
            model, [{"role": "user", "content": p}], minillm.SamplingParams(temperature=0), max_new_tokens=6
        ).text
        for p in prompts
    }
    before = metrics(url)
    texts: dict[int, str] = {}

    def one(i: int) -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompts[i % 4]}],
            "max_tokens": 6,
            "temperature": 0,
            "stream": True,
        }
        parts = []
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choices = json.loads(line[6:])["choices"]
                    parts += [c["delta"].get("content") or "" for c in choices]
        texts[i] = "".join(parts)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = metrics(url)
    assert len(texts) == 16
    assert all(texts[i] == expected[prompts[i % 4]] for i in range(16))
    wait_count = after["minillm_request_queue_time_seconds_count"] - before["minillm_request_queue_time_seconds_count"]
    assert wait_count == 16
    # Continuous batching: a request joins the running batch at the next step instead of waiting for
    # the others to finish, so the 16 waits together are a small part of the 16 end-to-end times
    # (one at a time, the last would have waited for ~15 others: waits summing to well over half).
    waited = after["minillm_request_queue_time_seconds_sum"] - before["minillm_request_queue_time_seconds_sum"]
    e2e = after["minillm_e2e_request_latency_seconds_sum"] - before["minillm_e2e_request_latency_seconds_sum"]
    assert waited < 0.25 * e2e


def test_8_concurrent_clients_get_what_generate_gives_alone(server, model):
    """8 clients at once, prompts of 3 to 300 tokens, different max_tokens, greedy: the batched
    server answers each exactly as minillm.generate alone (text and token counts)."""
    url, _ = server
    ids = model.tokenizer.encode("The lighthouse keeper climbed the spiral stairs every evening at dusk. " * 40)
    lengths, budgets = [3, 300, 17, 64, 150, 41, 230, 8], [12, 9, 20, 5, 16, 24, 7, 18]
    prompts = [minillm.detokenize(model, ids[:n]) for n in lengths]
    expected = [minillm.generate(model, p, max_new_tokens=k) for p, k in zip(prompts, budgets, strict=True)]
    answers: dict[int, dict] = {}

    def one(i: int) -> None:
        body = {"model": MODEL, "prompt": prompts[i], "max_tokens": budgets[i], "temperature": 0}
        answers[i] = httpx.post(url + "/v1/completions", json=body, timeout=120).json()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, want in enumerate(expected):
        assert answers[i]["choices"][0]["text"] == want.text
        assert answers[i]["usage"]["prompt_tokens"] == len(want.prompt_ids) == lengths[i]
        assert answers[i]["usage"]["completion_tokens"] == len(want.ids)


def test_a_shared_prefix_is_reported_as_cached_tokens(server, model):
    """Two requests that start with the same 256 tokens (16 blocks of 16): the second's usage says
    256 cached prompt tokens (counted by the tokenizer), the first's 0."""
    url, _ = server
    system = "Notes: " + " b" * 251 + ".\n"
    assert len(minillm.tokenize(model, system)) == 256
    usage = []
    for question in ("Q: What is two plus two?\nA:", "Q: Name a colour of the sky.\nA:"):
        body = {"model": MODEL, "prompt": system + question, "max_tokens": 2, "temperature": 0}
        usage.append(httpx.post(url + "/v1/completions", json=body, timeout=60).json()["usage"])
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in usage] == [0, 256]


# --- bad requests --------------------------------------------------------------------------------
BAD = [  # (path, body or raw text, status, words the message must contain)
    ("chat", chat_body(temperature="hot"), 400, ["temperature"]),
    ("chat", chat_body(temperature=3), 400, ["temperature", "2"]),
    ("chat", chat_body(top_p=1.5), 400, ["top_p", "1"]),
    ("chat", chat_body(max_tokens=0), 400, ["max_tokens", "1"]),
    ("chat", chat_body(max_tokens="ten"), 400, ["max_tokens"]),
    ("chat", chat_body(max_tokens=10**9), 400, ["max_tokens", "8,192"]),
    ("chat", chat_body(messages=[]), 400, ["messages"]),
    ("chat", {"model": MODEL}, 400, ["messages"]),
    ("chat", chat_body(messages=[{"role": "user", "content": 5}]), 400, ["messages.0.content"]),
    ("chat", chat_body(messages=[{"role": "user", "content": "hello " * 9000}]), 400, ["prompt is", "8,192"]),
    ("chat", "{not json", 400, ["JSON"]),
    ("chat", "[]", 400, ["body"]),
    ("chat", chat_body(n=2), 400, ["n=2", "not supported"]),
    ("chat", chat_body(model="gpt-4o"), 404, ["gpt-4o", MODEL]),
    ("chat", chat_body(stop=[""]), 400, ["stop"]),
    ("chat", chat_body(seed=-1), 400, ["seed", "0"]),
    ("chat", chat_body(top_k=-1), 400, ["top_k", "0"]),
    ("chat", chat_body(repetition_penalty=0), 400, ["repetition_penalty", "0"]),
    ("chat", chat_body(logprobs=True, top_logprobs=21), 400, ["top_logprobs", "20"]),
    ("chat", chat_body(stream=5), 400, ["stream"]),
    ("completions", {"model": MODEL, "prompt": ""}, 400, ["prompt"]),
    ("completions", {"model": MODEL, "prompt": "Hi", "logprobs": 10}, 400, ["logprobs", "5"]),
    ("completions", {"model": MODEL, "prompt": "Hi", "echo": True}, 400, ["echo"]),
]


@pytest.mark.parametrize(("path", "body", "status", "words"), BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_request_gets_4xx_in_openai_shape(server, path, body, status, words):
    url = server[0] + ("/v1/chat/completions" if path == "chat" else "/v1/completions")
    if isinstance(body, str):
        r = httpx.post(url, content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(url, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for word in words:
        assert word in error["message"], error["message"]


def test_openai_client_raises_its_own_errors(client):
    import openai

    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature=9)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.completions.create(model="nope", prompt="Hi")


# --- the bench against this server ----------------------------------------------------------------
def histogram_median(before: dict, after: dict, name: str) -> float:
    """Median of the observations made between two scrapes, read off the histogram's buckets.

    Method (Prometheus's histogram_quantile): subtract the cumulative bucket counts of the two
    scrapes, find the first bucket whose count reaches half the total, and interpolate linearly
    between its lower and upper bound. The buckets are 15 % apart (metrics.LATENCY_BUCKETS), so the
    estimate is off by at most half a bucket, ~7 %, when the observations are close together.
    """
    buckets = sorted(
        (float(k.split("le=")[1].rstrip("}")), after[k] - before.get(k, 0.0))
        for k in after
        if k.startswith(name + "_bucket{") and "+Inf" not in k
    )
    total = after[name + "_count"] - before.get(name + "_count", 0.0)
    lower, below = 0.0, 0.0
    for upper, cumulative in buckets:
        if cumulative >= total / 2:
            return lower + (upper - lower) * (total / 2 - below) / max(cumulative - below, 1e-9)
        lower, below = upper, cumulative
    raise AssertionError("median beyond the last bucket")


def test_bench_ttft_matches_the_server_histogram(server, tmp_path):
    url, _ = server
    out = tmp_path / "bench.json"
    before = metrics(url)
    # 256 prompt tokens: prefill dominates the TTFT, so the HTTP hop (the same at any length) is a small part
    run = run_bench(url, MODEL, out, concurrency="1", requests=8, prompt_tokens=256, max_tokens=4)
    after = metrics(url)
    assert run.returncode == 0, run.stderr
    assert "TTFT" in run.stdout and str(out) in run.stdout
    results = json.loads(out.read_text())
    level = results["levels"][0]
    assert level["concurrency"] == 1 and level["ok"] == 8 and level["errors"] == 0
    assert level["usage_from_server"] and level["completion_tokens_mean"] == 4
    assert 0.85 * 256 <= level["prompt_tokens_mean"] <= 1.15 * 256  # calibrated on the server's own tokenizer
    t = level["ttft_s"]
    assert 0 < t["p50"] <= t["p90"] <= t["p99"] and level["requests_per_s"] > 0 and level["output_tokens_per_s"] > 0
    # The histogram also holds the bench's 3 calibration probes (max_tokens 1, prompts of about the
    # same length), so their TTFTs sit among the others and barely move the median.
    server_median = histogram_median(before, after, "minillm_time_to_first_token_seconds")
    assert (
        after["minillm_time_to_first_token_seconds_count"] - before["minillm_time_to_first_token_seconds_count"] == 11
    )
    assert abs(t["p50"] - server_median) <= 0.2 * server_median, (t["p50"], server_median)
