"""Every field of OpenAI's two request models, through `minillm serve`: it changes the output as
OpenAI documents it, or the server answers 400 naming it. None is dropped in silence.

The fields are read from the installed ``openai`` package's request types, so a field OpenAI adds
makes this test fail until minillm implements or refuses it.
"""

from __future__ import annotations

import json

import httpx
import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params
from servers import MODEL, SERVERS, metrics, running_server

pytestmark = pytest.mark.slow
COMMA = 28


@pytest.fixture(scope="module", params=list(SERVERS))
def url(tmp_path_factory, request):
    """One model's server, then a several-model server (``servers.SERVERS``): every field on both."""
    with running_server(tmp_path_factory.mktemp("serve-sampling"), *SERVERS[request.param]) as (base, _log):
        yield base


def post(url: str, path: str, **body) -> httpx.Response:
    """One request to ``/v1/{path}`` with the served model (``model=`` overrides it), any status."""
    return httpx.post(f"{url}/v1/{path}", json={"model": MODEL, **body}, timeout=120)


def answer(url: str, path: str, **body) -> dict:
    """:func:`post` that must succeed: the response's JSON."""
    r = post(url, path, **body)
    assert r.status_code == 200, r.text
    return r.json()


def user(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def chat(url, content="List five fruits, separated by commas.", **fields) -> dict:
    return answer(url, "chat/completions", messages=user(content), **{"max_tokens": 12, **fields})


def complete(url, prompt="1, 2, 3, 4,", **fields) -> dict:
    return answer(url, "completions", prompt=prompt, **{"max_tokens": 8, "temperature": 0, **fields})


# prompts whose greedy answer repeats tokens (the penalties' work) or writes commas (the bias's)
REPEATS = {chat: "List five fruits, separated by commas.", complete: "The cat sat on the mat. The cat sat on the"}
COMMAS = {chat: "Write one sentence about apples, pears and plums.", complete: "Apples, pears, plums,"}


def text(response: dict) -> str:
    choice = response["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def refused(url, path: str, field: str, value, base: dict) -> None:
    r = post(url, path, **{**base, field: value})
    assert r.status_code == 400, (field, r.text)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == field, error
    assert field in error["message"], error


CHAT_BASE = {"messages": user("Hi"), "max_tokens": 2}
CHAT_REFUSED = {  # OpenAI fields minillm does not implement, with a value that asks for them
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    "tool_choice": "auto",
    "functions": [{"name": "f", "parameters": {}}],
    "function_call": "auto",
    "parallel_tool_calls": True,
    "prediction": {"type": "content", "content": "Hello"},
    "web_search_options": {},
    "reasoning_effort": "high",
    "verbosity": "low",
    "store": True,
    "metadata": {"k": "v"},
    "service_tier": "flex",
    "moderation": {"enabled": True},
    "prompt_cache_retention": "24h",
    "prompt_cache_options": {"mode": "x"},
    "n": 2,
}
COMPLETION_BASE = {"prompt": "Hi", "max_tokens": 2}
COMPLETION_REFUSED = {"best_of": 2, "echo": True, "suffix": " end", "n": 3}
# Documented as identifiers that do not change the output: accepted, and the output is the same.
NO_EFFECT = {"user": "u-1", "safety_identifier": "s-1", "prompt_cache_key": "k-1"}


def check_common(url, field: str, call) -> bool:
    """The fields both endpoints share; True if ``field`` was one of them."""
    greedy = text(call(url, temperature=0))
    if field == "model":
        r = post(url, "completions", model="gpt-4o", prompt="Hi")
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    elif field == "frequency_penalty":
        plain = text(call(url, REPEATS[call], temperature=0, max_tokens=24))
        assert text(call(url, REPEATS[call], temperature=0, frequency_penalty=2.0, max_tokens=24)) != plain
    elif field == "presence_penalty":
        plain = text(call(url, REPEATS[call], temperature=0, max_tokens=24))
        assert text(call(url, REPEATS[call], temperature=0, presence_penalty=2.0, max_tokens=24)) != plain
    elif field == "logit_bias":
        plain = text(call(url, COMMAS[call], temperature=0, max_tokens=16))
        out = call(url, COMMAS[call], temperature=0, logit_bias={str(COMMA): -100}, max_tokens=16)
        assert "," in plain and "," not in text(out)
        assert text(call(url, temperature=0, logit_bias={str(COMMA): 100}, max_tokens=4)) == ",,,,"
    elif field == "seed":
        a, b = (text(call(url, temperature=1.5, seed=s)) for s in (1, 1))
        assert a == b and a != text(call(url, temperature=1.5, seed=2))
    elif field == "temperature":
        assert text(call(url, temperature=1.8, seed=3)) != greedy
    elif field == "top_p":  # top_p 0 keeps only the most likely token: greedy at any temperature
        assert text(call(url, temperature=1.8, seed=3, top_p=0.0)) == greedy
    elif field == "max_tokens":
        assert call(url, temperature=0, max_tokens=3)["usage"]["completion_tokens"] == 3
    elif field == "stop":
        cut = greedy[3:5]
        assert text(call(url, temperature=0, stop=[cut])) == greedy[: greedy.index(cut)]
    elif field == "stream_options":
        with httpx.stream(
            "POST",
            f"{url}/v1/completions",
            timeout=60,
            json={
                "model": MODEL,
                "prompt": "Hi",
                "max_tokens": 2,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: {")]
        assert '"completion_tokens":2' in lines[-1]
    elif field in NO_EFFECT:
        assert text(call(url, temperature=0, **{field: NO_EFFECT[field]})) == greedy
    else:
        return False
    return True


def test_every_chat_completion_field_changes_the_output_or_is_refused(url):
    fields = set(chat_params.CompletionCreateParamsBase.__annotations__)
    checked = set()
    for field in sorted(fields):
        if field in CHAT_REFUSED:
            refused(url, "chat/completions", field, CHAT_REFUSED[field], CHAT_BASE)
        elif check_common(url, field, chat):
            pass
        elif field == "messages":
            assert text(chat(url, "Say hello.", temperature=0)) != text(chat(url, "Say goodbye.", temperature=0))
        elif field == "max_completion_tokens":
            assert chat(url, temperature=0, max_tokens=9, max_completion_tokens=2)["usage"]["completion_tokens"] == 2
        elif field == "logprobs":
            assert chat(url, temperature=0)["choices"][0]["logprobs"] is None
            content = chat(url, temperature=0, logprobs=True, max_tokens=3)["choices"][0]["logprobs"]["content"]
            assert len(content) == 3 and all(e["logprob"] <= 0 for e in content)
        elif field == "top_logprobs":
            content = chat(url, temperature=0, logprobs=True, top_logprobs=20, max_tokens=2)["choices"][0]
            assert [len(e["top_logprobs"]) for e in content["logprobs"]["content"]] == [20, 20]
        elif field == "response_format":
            check_response_format(url)
        else:
            continue
        checked.add(field)
    assert checked == fields, f"fields neither checked nor refused: {sorted(fields - checked)}"


def test_every_completion_field_changes_the_output_or_is_refused(url):
    fields = set(completion_params.CompletionCreateParamsBase.__annotations__)
    checked = set()
    for field in sorted(fields):
        if field in COMPLETION_REFUSED:
            refused(url, "completions", field, COMPLETION_REFUSED[field], COMPLETION_BASE)
        elif check_common(url, field, complete):
            pass
        elif field == "prompt":
            assert text(complete(url, "The capital of France is")) != text(complete(url))
        elif field == "logprobs":
            lp = complete(url, logprobs=3, max_tokens=2)["choices"][0]["logprobs"]
            assert [len(d) for d in lp["top_logprobs"]] == [3, 3] and len(lp["token_logprobs"]) == 2
        else:
            continue
        checked.add(field)
    assert checked == fields, f"fields neither checked nor refused: {sorted(fields - checked)}"


def test_fields_that_are_not_openais_stay_accepted(url):
    out = chat(url, temperature=0, top_k=1, min_p=0.1, repetition_penalty=1.0, ignore_eos=False, best_of_vllm=3)
    assert text(out) == text(chat(url, temperature=0))


def test_neutral_values_of_unimplemented_fields_are_accepted(url):
    neutral = {"n": 1, "modalities": ["text"], "store": False, "tools": [], "service_tier": "auto"}
    assert text(chat(url, temperature=0, **neutral)) == text(chat(url, temperature=0))
    assert text(complete(url, echo=False, best_of=1, suffix="")) == text(complete(url))


def check_response_format(url) -> None:
    """text: unchanged; json_object: a JSON object (the free answer is not one); a bad type: 400."""
    plain = text(chat(url, temperature=0))
    assert text(chat(url, temperature=0, response_format={"type": "text"})) == plain
    with pytest.raises(json.JSONDecodeError):
        json.loads(plain)
    out = chat(url, temperature=0, response_format={"type": "json_object"}, max_tokens=60)
    assert isinstance(json.loads(text(out)), dict), text(out)
    r = post(url, "chat/completions", **CHAT_BASE, response_format={"type": "xml"})
    assert r.status_code == 400 and "response_format" in r.json()["error"]["message"]


# --- constrained decoding through the official client ----------------------------------------------
SCHEMAS = [
    {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    },
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "p": {
                "type": "object",
                "properties": {"x": {"type": "integer"}},
                "required": ["x"],
                "additionalProperties": False,
            }
        },
        "required": ["p"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 5}, "minItems": 2, "maxItems": 2},
    {"type": "string", "enum": ["yes", "no"]},
]


@pytest.fixture(scope="module")
def client(url):
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def schema_format(schema: dict, name: str = "answer") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def create(client, content: str, **fields):
    """One chat completion through the official client (a stream of chunks with ``stream=True``)."""
    return client.chat.completions.create(model=MODEL, messages=user(content), **fields)


def test_response_format_streamed_and_not_give_equal_text(client):
    kwargs = dict(temperature=0, max_tokens=40, response_format=schema_format(SCHEMAS[0]))
    content = "Which city is the capital of France? Answer in JSON."
    whole = create(client, content, **kwargs).choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or "" for c in create(client, content, **kwargs, stream=True) if c.choices
    )
    assert streamed == whole
    assert set(json.loads(whole)) == {"city"}


def test_eight_concurrent_constrained_requests_each_follow_their_own_schema(client, url):
    """In one running batch (the server's gauge seen above 1 meanwhile), each with its own grammar."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import jsonschema

    running, done = [], threading.Event()

    def watch():
        while not done.is_set():
            running.append(metrics(url)["minillm_num_requests_running"])
            done.wait(0.05)

    def ask(j: int) -> str:
        r = create(
            client,
            f"Answer {j} in JSON.",
            temperature=1.0,
            seed=j,
            max_tokens=60,
            response_format=schema_format(SCHEMAS[j], f"s{j}"),
        )
        assert r.choices[0].finish_reason == "stop", r
        return r.choices[0].message.content

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, range(8)))
    finally:
        done.set()
        watcher.join()
    assert max(running) >= 2, running  # they were batched together, not served one after another
    for schema, answer in zip(SCHEMAS, answers, strict=True):
        jsonschema.validate(json.loads(answer), schema)


def test_invalid_schema_is_a_400_naming_the_wrong_part(client):
    import openai

    bad = {"type": "object", "properties": {"age": {"type": "integr"}}}
    with pytest.raises(openai.BadRequestError) as err:
        create(client, "Hi", response_format=schema_format(bad))
    error = err.value.body
    assert error["param"] == "response_format" and "$.properties.age.type" in error["message"], error
    assert "integr" in error["message"]


def test_max_tokens_cutting_the_json_short_is_length_with_an_error(client):
    """Whole and streamed: finish_reason "length", and minillm_error says the document will not parse."""
    kwargs = dict(temperature=0, max_tokens=4, response_format=schema_format(SCHEMAS[0]))
    choice = create(client, "Which city is the capital of France? Answer in JSON.", **kwargs).choices[0]
    assert choice.finish_reason == "length" and "will not parse" in choice.model_extra["minillm_error"], choice
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice.message.content)
    chunks = [
        c
        for c in create(client, "Which city is the capital of France? Answer in JSON.", **kwargs, stream=True)
        if c.choices
    ]
    last = chunks[-1].choices[0]
    assert last.finish_reason == "length" and "will not parse" in last.model_extra["minillm_error"], last
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content


@pytest.mark.parametrize(
    ("max_tokens", "content", "cut"),
    [(2, '"affirm', True), (5, '"affirmative and final', True), (6, '"affirmative and final"', False)],
)
def test_a_cut_inside_a_const_is_reported_as_the_text_reads(client, max_tokens, content, cut):
    """A const the grammar forces to the document's end, cut by max_tokens inside it: minillm_error is
    set exactly when the text does not parse, whole and streamed alike (the matcher stands where the
    text ends, not at the end of the run it was forced to)."""
    verdict = schema_format({"const": "affirmative and final"})
    kwargs = dict(temperature=0, max_tokens=max_tokens, response_format=verdict)
    choice = create(client, "Give a verdict.", **kwargs).choices[0]
    chunks = [c for c in create(client, "Give a verdict.", **kwargs, stream=True) if c.choices]
    last = chunks[-1].choices[0]
    assert choice.message.content == "".join(c.choices[0].delta.content or "" for c in chunks) == content
    assert choice.finish_reason == last.finish_reason == "length"
    for error in (choice.model_extra["minillm_error"], last.model_extra["minillm_error"]):
        assert (error is not None and "will not parse" in error) if cut else error is None, error
    if not cut:
        assert json.loads(content) == "affirmative and final"


def test_an_invalid_schema_is_the_same_400_for_every_served_model(client):
    """Loaded or not (the several-model server's second model is not loaded yet: its schema is checked
    when it loads, at admission), an invalid schema is one 400 naming the wrong part. (Last in this
    module: on the several-model server it loads the second model, evicting the first.)"""
    import openai

    bad = {"type": "object", "properties": {"age": {"type": "integr"}}}
    bodies = []
    for card in client.models.list().data:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=card.id, messages=user("Hi"), response_format=schema_format(bad))
        bodies.append(err.value.body)
    assert len({json.dumps(b, sort_keys=True) for b in bodies}) == 1, bodies
    error = bodies[0]
    assert (error["param"], error["type"], error["code"]) == ("response_format", "invalid_request_error", None)
    assert error["message"].startswith("response_format.json_schema.schema: invalid JSON schema: at $.properties.age")
