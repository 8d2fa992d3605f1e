"""A server a teacher puts on a classroom's network (issue 45): keys, scopes, quotas, private prompts.

One server subprocess for the module (``classroom``): inference keys from a key file (with comments),
one from ``--api-key`` and one from ``MINILLM_API_KEY``, an observer key, and small quotas: 5 requests
a minute, 120 tokens a minute and 2 requests in flight per key. Each test uses keys of its own, so the
quotas one test spends never reach another's. Clients are the official ``openai`` client and httpx.
The checks that need no server (the refusal to start, the flags, a quota's minute) run in this process.
"""

from __future__ import annotations

import json
import secrets
import socket
import time
from contextlib import ExitStack

import httpx
import pytest
from access import CALLERS, ROUTES, declared_routes, self_signed_certificate, walk
from cli_runs import run_cli
from event_reader import Reader
from prometheus_client import CollectorRegistry
from servers import MODEL, chat_body, metrics, server_process

from minillm.serve.auth import Caller, KeyRing, QuotaLimits, access_from_args, label
from minillm.serve.quotas import Quotas
from minillm.serve.responses import APIError

pytestmark = pytest.mark.slow

#: Keys of this run (random: nothing but the test knows them), by who uses them.
FILE_KEYS = {who: f"{who}-{secrets.token_hex(12)}" for who in ("walker", "rpm", "tpm", "conc", "alice", "logger")}
FLAG_KEY, ENV_KEY, OBSERVER = (f"{who}-{secrets.token_hex(12)}" for who in ("bob", "carol", "projector"))
EVERY_KEY = (*FILE_KEYS.values(), FLAG_KEY, ENV_KEY, OBSERVER)


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def client(url: str, key: str):
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def classroom(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("classroom")
    key_file = tmp / "keys.txt"
    lines = [f"{key}  # {who}" for who, key in FILE_KEYS.items()]
    key_file.write_text("# the class's keys, one a line\n\n" + "\n".join(lines) + "\n")
    flags = ("--api-key-file", str(key_file), "--api-key", FLAG_KEY, "--observer-key", OBSERVER,
             "--requests-per-minute", "5", "--tokens-per-minute", "120", "--max-concurrent-per-key", "2",
             "--kv-cache-mib", "64")  # fmt: skip
    with server_process(tmp, *flags, env={"MINILLM_API_KEY": ENV_KEY}) as (_, url, log):
        yield url, log


# --- every route, every caller ---------------------------------------------------------------------
def test_every_route_the_app_declares_answers_each_caller_as_documented(classroom):
    url, _ = classroom
    routes = declared_routes(several=False)
    assert routes - set(ROUTES) == set()  # a route the app declares needs its documented row in access.ROUTES
    walker = FILE_KEYS["walker"]
    keys = dict(zip(CALLERS, (None, "not-" + walker, OBSERVER, walker), strict=True))
    bodies = {"/v1/chat/completions": chat_body(), "/v1/completions": {"model": MODEL, "prompt": "Hi", "max_tokens": 1}}
    with httpx.Client(base_url=url, timeout=120) as http:
        own = http.post("/v1/chat/completions", json=chat_body(), headers=bearer(walker))
        assert own.status_code == 200, own.text
        calls = walk(http, routes, keys, {"request_id": own.json()["id"], "model_id": MODEL}, bodies)
        page = http.get("/ui", headers={"accept": "text/html"})  # a browser opening the page without a key
    assert [c for c in calls if c[2] != c[3]] == []
    assert len(calls) == 4 * len(routes) == 4 * 13
    assert page.status_code == 401 and page.headers["www-authenticate"] == 'Bearer realm="minillm"'
    assert "<title>minillm live</title>" in page.text and 'id="key-box"' in page.text  # the page asks for the key


def test_the_official_client_meets_401_403_and_429_on_the_sixth_request_of_a_minute(classroom):
    from openai import AuthenticationError, PermissionDeniedError, RateLimitError

    url, _ = classroom
    with pytest.raises(AuthenticationError) as wrong:
        client(url, "sk-" + secrets.token_hex(8)).completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert wrong.value.status_code == 401 and wrong.value.code == "invalid_api_key"
    assert wrong.value.response.headers["www-authenticate"] == 'Bearer realm="minillm", error="invalid_token"'
    with pytest.raises(PermissionDeniedError) as observer:
        client(url, OBSERVER).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    assert observer.value.status_code == 403 and observer.value.code == "insufficient_scope"
    mine = client(url, FILE_KEYS["rpm"])
    usages = [mine.completions.create(model=MODEL, prompt=f"Count to {n}:", max_tokens=1).usage for n in range(5)]
    with pytest.raises(RateLimitError) as limited:
        mine.completions.create(model=MODEL, prompt="Count to 5:", max_tokens=1)
    assert limited.value.status_code == 429 and limited.value.code == "rate_limit_exceeded"
    assert 1 <= int(limited.value.response.headers["retry-after"]) <= 60
    assert "--requests-per-minute 5" in limited.value.message
    m, key = metrics(url, bearer(OBSERVER)), label(FILE_KEYS["rpm"])
    assert m[f"minillm_key_requests_total{{key={key}}}"] == 5  # the five it sent and were served
    assert m[f"minillm_key_rate_limited_total{{key={key},limit=requests_per_minute}}"] == 1
    assert m[f"minillm_key_prompt_tokens_total{{key={key}}}"] == sum(u.prompt_tokens for u in usages)
    assert m[f"minillm_key_completion_tokens_total{{key={key}}}"] == sum(u.completion_tokens for u in usages) == 5
    assert not any(k in name for name in m for k in EVERY_KEY)  # keys are counted by label, never by key


def test_a_token_quota_stops_the_key_that_spent_it_while_another_key_is_served(classroom):
    from openai import RateLimitError

    url, _ = classroom
    spender, other = client(url, FILE_KEYS["tpm"]), client(url, ENV_KEY)  # ENV_KEY: from MINILLM_API_KEY
    spent = spender.completions.create(model=MODEL, prompt=" ".join(["lighthouse"] * 130), max_tokens=1).usage
    assert spent.total_tokens >= 120  # the minute's 120 tokens, in one request
    with pytest.raises(RateLimitError) as stopped:
        spender.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert stopped.value.code == "rate_limit_exceeded" and stopped.value.type == "tokens"
    assert f"spent {spent.total_tokens:,} tokens" in stopped.value.message
    assert 1 <= int(stopped.value.response.headers["retry-after"]) <= 60
    served = other.completions.create(model=MODEL, prompt="Hi", max_tokens=1)  # its own minute
    assert served.usage.completion_tokens == 1
    m = metrics(url, bearer(OBSERVER))
    spender_key, other_key = label(FILE_KEYS["tpm"]), label(ENV_KEY)
    assert m[f"minillm_key_rate_limited_total{{key={spender_key},limit=tokens_per_minute}}"] == 1
    assert m[f"minillm_key_prompt_tokens_total{{key={spender_key}}}"] == spent.prompt_tokens
    assert m[f"minillm_key_requests_total{{key={other_key}}}"] == 1
    assert m[f"minillm_key_prompt_tokens_total{{key={other_key}}}"] == served.usage.prompt_tokens


def test_a_third_request_of_one_key_in_flight_gets_429_until_one_ends(classroom):
    url, _ = classroom
    key = FILE_KEYS["conc"]
    slow = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 50, "stream": True, "slow_motion_s": 2}
    one = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    with httpx.Client(base_url=url, headers=bearer(key), timeout=120) as http:
        with ExitStack() as stack:  # two streams held open: both in flight (each sits out 2 s per step)
            held = [stack.enter_context(http.stream("POST", "/v1/completions", json=slow)) for _ in range(2)]
            assert [r.status_code for r in held] == [200, 200]
            ids = [r.headers["x-request-id"] for r in held]
            third = http.post("/v1/completions", json=one)
            assert third.status_code == 429, third.text
            assert third.json()["error"]["code"] == "rate_limit_exceeded" and third.headers["retry-after"] == "1"
            assert "--max-concurrent-per-key 2" in third.json()["error"]["message"]
        # both streams closed: the server cancels them; their ends give the key its places back
        deadline = time.monotonic() + 60
        while any(http.get(f"/v1/traces/{rid}").status_code == 404 for rid in ids):
            assert time.monotonic() < deadline, "the closed streams never ended"
            time.sleep(0.05)
        assert [http.get(f"/v1/traces/{rid}").json()["stop_reason"] for rid in ids] == ["cancelled", "cancelled"]
        assert http.post("/v1/completions", json=one).status_code == 200
    m = metrics(url, bearer(OBSERVER))
    assert m[f"minillm_key_rate_limited_total{{key={label(key)},limit=concurrent}}"] == 1
    assert m[f"minillm_key_requests_total{{key={label(key)}}}"] == 3


# --- what one key sees of another's requests ---------------------------------------------------------
SECRET = "Zanzibarite"


def finished(request_id):
    return lambda events: any(e["type"] == "request.finished" and e["id"] == request_id for _, e in events)


def test_an_inference_key_sees_none_of_another_keys_text_and_an_observer_only_its_shapes(classroom):
    url, _ = classroom
    alice, bob = FILE_KEYS["alice"], FLAG_KEY  # bob's key came from --api-key
    who_is_who = (("alice", alice), ("bob", bob), ("observer", OBSERVER))
    readers = {who: Reader(url, headers=bearer(key)) for who, key in who_is_who}
    deadline = time.monotonic() + 60
    while not all(r.hellos for r in readers.values()):  # every stream open before the request
        assert time.monotonic() < deadline
        time.sleep(0.02)
    asked = [{"role": "user", "content": f"Describe {SECRET} in one line."}]
    body = chat_body(messages=asked, max_tokens=6, temperature=0)
    answer = httpx.post(url + "/v1/chat/completions", json=body, headers=bearer(alice), timeout=120)
    assert answer.status_code == 200, answer.text
    rid, usage = answer.json()["id"], answer.json()["usage"]
    readers["alice"].wait(finished(rid))
    readers["observer"].wait(finished(rid))
    own = httpx.post(url + "/v1/chat/completions", json=chat_body(), headers=bearer(bob), timeout=120).json()
    readers["bob"].wait(finished(own["id"]))  # events arrive in order: alice's have all passed by then
    for reader in readers.values():
        reader.stop.set()
    # bob: nothing of alice's request but the steps' shapes; her trace is not his to read
    assert readers["bob"].of(rid) == [] and readers["bob"].of(own["id"])
    assert SECRET not in json.dumps(readers["bob"].events)
    theirs = httpx.get(f"{url}/v1/traces/{rid}", headers=bearer(bob))
    assert theirs.status_code == 404 and theirs.json()["error"]["message"].startswith(f"no trace for request {rid!r}")
    # the observer (no --show-prompts): counts and shapes, no text
    seen = readers["observer"].of(rid)
    admitted = next(e for e in seen if e["type"] == "request.admitted")
    assert admitted["redacted"] is True and admitted["prompt"] is None
    assert admitted["prompt_tokens"] == usage["prompt_tokens"]
    tokens = [e for e in seen if e["type"] == "request.token"]
    assert [t["n"] for t in tokens] == list(range(usage["completion_tokens"]))
    assert all(t["piece"] is None and t["text"] is None and t["top"] is None for t in tokens)
    done = next(e for e in seen if e["type"] == "request.finished")
    assert done["completion_tokens"] == usage["completion_tokens"] and done["text"] is None
    assert SECRET not in json.dumps(readers["observer"].events)
    trace = httpx.get(f"{url}/v1/traces/{rid}", headers=bearer(OBSERVER)).json()
    assert trace["redacted"] is True and trace["key"] == label(alice) and SECRET not in json.dumps(trace)
    summary = next(e for e in trace["events"] if e["phase"] == "summary")["data"]
    assert summary["prompt_tokens"] == usage["prompt_tokens"] and summary["new_tokens"] == usage["completion_tokens"]
    # alice: her own request whole, in her events and her trace
    mine = readers["alice"].of(rid)
    prompt = next(e for e in mine if e["type"] == "request.admitted")["prompt"]
    assert SECRET in "".join(piece for _, piece in prompt)
    assert next(e for e in mine if e["type"] == "request.finished")["text"] == answer.json()["choices"][0]["message"][
        "content"
    ]
    whole = httpx.get(f"{url}/v1/traces/{rid}", headers=bearer(alice)).json()
    assert "redacted" not in whole and SECRET in json.dumps(whole)


def test_the_log_holds_no_key_and_no_prompt(classroom):
    url, log = classroom
    key = FILE_KEYS["logger"]
    secret = "Quetzalcoatlus"
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": f"The {secret} flew over", "max_tokens": 3},
                   headers=bearer(key), timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    rid, deadline = r.json()["id"], time.monotonic() + 60
    while httpx.get(f"{url}/v1/traces/{rid}", headers=bearer(key)).status_code != 200:  # kept: its trace was printed
        assert time.monotonic() < deadline
        time.sleep(0.05)
    text = log.read_text()
    assert f"request {rid} (key {label(key)}, waited" in " ".join(text.split())  # the request, named by its label
    assert "summary" in text and "TTFT" in text  # its trace's text-free phases
    assert secret not in text and r.json()["choices"][0]["text"] not in text
    assert [k for k in EVERY_KEY if k in text] == []


def test_no_cors_header_unless_an_origin_is_allowed(classroom):
    url, _ = classroom
    origin = {"Origin": "https://elsewhere.example"}
    preflight = httpx.options(url + "/v1/completions", headers={**origin, "Access-Control-Request-Method": "POST"})
    answer = httpx.get(url + "/v1/models", headers={**origin, **bearer(OBSERVER)})
    assert preflight.status_code == 401 and answer.status_code == 200
    assert [h for r in (preflight, answer) for h in r.headers if h.startswith("access-control-")] == []


# --- no server needed ------------------------------------------------------------------------------
def test_a_non_loopback_host_without_keys_is_refused_before_any_socket_is_bound():
    """The port is held (on 127.0.0.1, listening): binding 0.0.0.0 to it would fail and say so first."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        run = run_cli("serve", MODEL, "--host", "0.0.0.0", "--port", str(port), env={"MINILLM_API_KEY": ""})
    message = " ".join(run.stderr.split())
    assert run.returncode == 2, run.stdout + run.stderr
    assert "refusing to serve on --host 0.0.0.0 without API keys" in message
    assert "--api-key KEY" in message and "--no-auth" in message
    assert "already in use" not in message and run.stdout == ""  # no bind, no banner


def args_of(*flags: str):
    from minillm.cli import build_parser

    return build_parser().parse_args(["serve", MODEL, *flags])


@pytest.mark.parametrize(
    ("host", "refused"),
    [("0.0.0.0", True), ("192.168.1.20", True), ("::", True), ("classroom.local", True),
     ("127.0.0.1", False), ("127.0.0.2", False), ("localhost", False), ("::1", False)],
)  # fmt: skip
def test_only_a_loopback_host_may_go_without_keys(host, refused, monkeypatch):
    monkeypatch.delenv("MINILLM_API_KEY", raising=False)
    if refused:
        with pytest.raises(ValueError, match="--api-key KEY .* or pass --no-auth"):
            access_from_args(args_of("--host", host))
        assert access_from_args(args_of("--host", host, "--no-auth")).keys.enabled is False  # meant: open
        assert access_from_args(args_of("--host", host, "--api-key", "k1")).keys.enabled is True
    else:
        assert access_from_args(args_of("--host", host)).keys.enabled is False


def test_access_flags_read_key_files_and_refuse_contradictions(tmp_path, monkeypatch):
    monkeypatch.setenv("MINILLM_API_KEY", "env-key")
    keys = tmp_path / "keys.txt"
    keys.write_text("# teacher's file\nfile-key-1\n\n  file-key-2   # second row\n#file-key-3\n")
    access = access_from_args(args_of("--api-key-file", str(keys), "--api-key", "flag-key", "--observer-key", "obs"))
    assert [(c.scope, c.label) for c in access.keys.labels()] == [
        ("inference", label(k)) for k in ("flag-key", "file-key-1", "file-key-2", "env-key")
    ] + [("observer", label("obs"))]
    assert access.keys.identify("file-key-2") == Caller("inference", label("file-key-2"))
    assert access.keys.identify("file-key-3") is None and access.keys.identify("file-key-") is None
    assert "file-key" not in access.banner() and label("obs") in access.banner()
    monkeypatch.delenv("MINILLM_API_KEY")
    (tmp_path / "empty.txt").write_text("# nothing yet\n")
    for flags, said in [
        (("--api-key-file", str(tmp_path / "missing.txt")), "cannot read --api-key-file"),
        (("--api-key-file", str(tmp_path / "empty.txt")), "holds no key"),
        (("--api-key", "k", "--observer-key", "k"), "both as --api-key and as --observer-key"),
        (("--api-key", "k", "--no-auth"), "--no-auth and API keys contradict"),
        (("--requests-per-minute", "5"), "quotas are per key"),
        (("--api-key", "k", "--tokens-per-minute", "0"), "must be >= 1"),
        (("--api-key", "two words"), "one word, no spaces"),
    ]:
        with pytest.raises(ValueError, match=said):
            access_from_args(args_of(*flags))


def test_a_quota_counts_the_last_minute_and_says_when_to_retry():
    now = [1000.0]
    limits = QuotaLimits(requests_per_minute=2, tokens_per_minute=100)
    quotas = Quotas(CollectorRegistry(), limits, clock=lambda: now[0])
    outcome = type("Outcome", (), {"prompt_tokens": 90, "completion_tokens": 30})()
    for step in (0.0, 10.0):
        now[0] += step
        quotas.check("k")
        quotas.started("k")
    with pytest.raises(APIError) as requests:
        quotas.check("k")
    assert (requests.value.status, requests.value.type) == (429, "requests")
    assert requests.value.headers == {"Retry-After": "50"}  # the first start (1000) leaves the minute at 1060
    quotas.check("other")  # another key: its own minute
    quotas.ended("k", ("done", outcome))  # 120 tokens spent at 1010
    now[0] = 1060.0  # the first start (1000) has left the minute: the token quota is what stops it now
    with pytest.raises(APIError) as tokens:
        quotas.check("k")
    assert (tokens.value.type, tokens.value.headers) == ("tokens", {"Retry-After": "10"})  # 1010 + 60 - 1060
    now[0] = 1070.0
    quotas.check("k")  # both have left the minute
    assert KeyRing(["a"]).identify("a") == Caller("inference", label("a")) and not KeyRing().enabled


def test_https_flags_come_as_a_pair_that_loads(tmp_path):
    from minillm.serve.server import tls_problem

    cert, key = self_signed_certificate(tmp_path)
    (tmp_path / "bad.pem").write_text("not a certificate\n")
    assert tls_problem(args_of()) is None
    assert tls_problem(args_of("--ssl-certfile", str(cert), "--ssl-keyfile", str(key))) is None
    assert "needs both --ssl-certfile and --ssl-keyfile" in tls_problem(args_of("--ssl-certfile", str(cert)))
    bad = tls_problem(args_of("--ssl-certfile", str(tmp_path / "bad.pem"), "--ssl-keyfile", str(key)))
    assert bad.startswith(f"cannot use --ssl-certfile {tmp_path / 'bad.pem'}") and "PEM" in bad
