"""The several-model server with keys, over HTTPS, with what a teacher may open (issue 45).

One server subprocess for the module (``projector``), a module apart from test_auth.py so that its
server has exited first: a several-model server (``--keep-alive -1``: ``models.py``'s registry, one
model) with two inference keys and an observer key, ``--show-prompts`` and ``--log-prompts``, one
allowed origin, and HTTPS with a certificate the test makes and trusts. It is the server of the live
page's key test (Chromium), of ``minillm bench --api-key`` and of the switching bench, and its last
test drains it with SIGTERM.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from access import CALLERS, ROUTES, declared_routes, self_signed_certificate, trusting, walk
from event_reader import Reader
from helpers import run_bench
from servers import MODEL, chat_body, metrics, server_process

from minillm.serve.auth import label

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ is not installed
from benchmarks import ui_page  # noqa: E402

pytestmark = pytest.mark.slow

KEY_A, KEY_B, OBSERVER = "class-key-ada-5c1e9a07", "class-key-ben-0b7d44e2", "projector-key-9f31c6aa"
ORIGIN = "https://projector.example"


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def projector(tmp_path_factory):
    """(process, base URL https://..., log, certificate, an SSL context trusting it)."""
    tmp = tmp_path_factory.mktemp("projector")
    cert, key = self_signed_certificate(tmp)
    flags = ("--keep-alive", "-1", "--api-key", KEY_A, "--api-key", KEY_B, "--observer-key", OBSERVER,
             "--show-prompts", "--log-prompts", "--allowed-origin", ORIGIN, "--ssl-certfile", str(cert),
             "--ssl-keyfile", str(key), "--kv-cache-mib", "64", "--shutdown-timeout", "60")  # fmt: skip
    with server_process(tmp, *flags, verify=trusting(cert)) as (proc, url, log):
        yield proc, url, log, cert, trusting(cert)


def test_https_with_the_tests_own_certificate_and_the_official_client(projector):
    from openai import OpenAI

    _, url, _, _, tls = projector
    assert url.startswith("https://")
    client = OpenAI(base_url=url + "/v1", api_key=KEY_A, max_retries=0, http_client=httpx.Client(verify=tls))
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert answer.usage.completion_tokens == 2 and answer.model == MODEL
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(url + "/health")  # a client that does not trust the test's certificate
    with pytest.raises(httpx.HTTPError):
        httpx.get(url.replace("https://", "http://") + "/health")  # no plain HTTP on that port


def test_the_several_model_server_answers_every_route_as_documented(projector):
    _, url, _, _, tls = projector
    routes = declared_routes(several=True)
    assert routes - set(ROUTES) == set() and routes == set(ROUTES)  # this app declares every documented route
    keys = dict(zip(CALLERS, (None, KEY_A + "x", OBSERVER, KEY_A), strict=True))
    bodies = {"/v1/chat/completions": chat_body(), "/v1/completions": {"model": MODEL, "prompt": "Hi", "max_tokens": 1}}
    with httpx.Client(base_url=url, timeout=120, verify=tls) as http:
        own = http.post("/v1/completions", json=bodies["/v1/completions"], headers=bearer(KEY_A))
        assert own.status_code == 200, own.text
        calls = walk(http, routes, keys, {"request_id": own.json()["id"], "model_id": MODEL}, bodies)
        plan = http.get(f"/v1/models/{MODEL}/plan", headers=bearer(OBSERVER)).json()
    assert [c for c in calls if c[2] != c[3]] == []
    assert len(calls) == 4 * 14 and plan["state"] == "loaded"


SECRET = "Pachycephalosaurus"


def test_with_show_prompts_an_observer_sees_other_keys_text_and_the_log_holds_it(projector):
    _, url, log, _, tls = projector
    observer, other = Reader(url, headers=bearer(OBSERVER), verify=tls), Reader(url, headers=bearer(KEY_B), verify=tls)
    deadline = time.monotonic() + 60
    while not (observer.hellos and other.hellos):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    body = chat_body(messages=[{"role": "user", "content": f"Spell {SECRET}."}], max_tokens=4, temperature=0)
    answer = httpx.post(url + "/v1/chat/completions", json=body, headers=bearer(KEY_A), timeout=120, verify=tls).json()
    rid = answer["id"]
    observer.wait(lambda evs: any(e["type"] == "request.finished" and e["id"] == rid for _, e in evs))
    mine = httpx.post(url + "/v1/chat/completions", json=chat_body(), headers=bearer(KEY_B), timeout=120, verify=tls)
    other.wait(lambda evs: any(e["type"] == "request.finished" and e["id"] == mine.json()["id"] for _, e in evs))
    observer.stop.set()
    other.stop.set()
    seen = observer.of(rid)  # the several-model server publishes what the one-model server does (issue 47)
    types = [e["type"] for e in seen]
    assert types[0] == "request.queued" and types[-1] == "request.finished" and "request.admitted" in types
    assert not [e for e in seen if "redacted" in e]  # --show-prompts: the observer sees every text field
    admitted = next(e for e in seen if e["type"] == "request.admitted")
    assert SECRET in "".join(piece for _, piece in admitted["prompt"])
    assert seen[-1]["text"] == answer["choices"][0]["message"]["content"] and seen[-1]["completion_tokens"] == 4
    trace = httpx.get(f"{url}/v1/traces/{rid}", headers=bearer(OBSERVER), verify=tls).json()
    assert "redacted" not in trace and SECRET in json.dumps(trace) and trace["key"] == label(KEY_A)
    # another inference key still sees nothing of it: --show-prompts is for observers
    assert other.of(rid) == [] and SECRET not in json.dumps(other.events)
    assert httpx.get(f"{url}/v1/traces/{rid}", headers=bearer(KEY_B), verify=tls).status_code == 404
    text = " ".join(log.read_text().split())
    said = " ".join(answer["choices"][0]["message"]["content"].split())
    assert f"output: {said}" in text  # --log-prompts: the console's trace (summary verbosity) holds the answer
    assert [k for k in (KEY_A, KEY_B, OBSERVER) if k in text] == []  # never a key


def test_an_allowed_origin_gets_cors_headers_and_another_none(projector):
    _, url, _, _, tls = projector
    asked = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    path = url + "/v1/chat/completions"
    allowed = httpx.options(path, headers={"Origin": ORIGIN, **asked}, verify=tls)
    other = httpx.options(path, headers={"Origin": "https://elsewhere.example", **asked}, verify=tls)
    refused = httpx.get(url + "/v1/models", headers={"Origin": ORIGIN}, verify=tls)  # no key: a 401 the page can read
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in allowed.headers["access-control-allow-headers"]
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ORIGIN


def test_the_live_page_asks_for_its_key_once_and_keeps_it_for_the_tab_only(projector):
    from playwright.sync_api import sync_playwright

    _, url, _, _, tls = projector
    with sync_playwright() as pw:
        browser = ui_page.launch(pw)
        context = browser.new_context(ignore_https_errors=True, viewport={"width": 1280, "height": 720})
        page = context.new_page()
        sent, errors = [], []
        page.on("request", lambda r: sent.append((r.url, r.headers.get("authorization"))))
        page.on("pageerror", lambda e: errors.append(str(e)))
        assert page.goto(url + "/ui").status == 401  # the page itself, which asks for the key
        page.wait_for_selector("#key-box:not([hidden])")
        page.fill("#key", OBSERVER)
        page.click("#key-use")
        page.wait_for_function("document.getElementById('conn').textContent.startsWith('live')")
        body = chat_body(messages=[{"role": "user", "content": "Name a colour."}], max_tokens=3, temperature=0)
        answer = httpx.post(url + "/v1/chat/completions", json=body, headers=bearer(KEY_A), timeout=120, verify=tls)
        rid = answer.json()["id"]
        page.wait_for_function(f"window.minillmLive.requests.get({rid!r})?.finished != null")
        page.locator(f'.req-row[data-request-id="{rid}"] .lane-label').click()
        assert page.text_content("#d-text") == answer.json()["choices"][0]["message"]["content"]  # --show-prompts
        assert page.evaluate("sessionStorage.getItem('minillm-key')") == OBSERVER
        page.reload()  # the same tab: the key is kept, nothing is asked
        page.wait_for_function("document.getElementById('conn').textContent.startsWith('live')")
        assert page.evaluate("document.getElementById('key-box').hidden") is True
        ui_page.send_from_page(page, "Hi", 2)  # an observer key may not generate: the page says why
        page.wait_for_function("document.getElementById('send-status').textContent.startsWith('403: ')")
        fresh = context.new_page()  # another tab: its own session, so it asks again
        fresh.goto(url + "/ui")
        fresh.wait_for_selector("#key-box:not([hidden])")
        assert fresh.evaluate("sessionStorage.getItem('minillm-key')") is None
        browser.close()
    streams = [auth for u, auth in sent if u == url + "/v1/events"]
    assert streams and set(streams) <= {None, f"Bearer {OBSERVER}"} and f"Bearer {OBSERVER}" in streams
    assert [u for u, _ in sent if OBSERVER in u] == [] and errors == []  # never a key in a URL


def test_bench_and_the_switching_bench_send_their_api_key(projector, tmp_path):
    _, url, _, cert, tls = projector
    env = {"SSL_CERT_FILE": str(cert)}  # httpx in the bench trusts the test's certificate
    refused = run_bench(url, MODEL, tmp_path / "none.json", concurrency="1", requests=1, prompt_tokens=8,
                        max_tokens=2, env={**env, "MINILLM_API_KEY": ""})  # fmt: skip
    assert refused.returncode == 2 and "401" in refused.stderr
    before = metrics(url, bearer(OBSERVER), verify=tls)[f"minillm_key_requests_total{{key={label(KEY_B)}}}"]
    bench = run_bench(url, MODEL, tmp_path / "bench.json", concurrency="1,2", requests=2, prompt_tokens=8,
                      max_tokens=2, extra=("--api-key", KEY_B), env=env)  # fmt: skip
    assert bench.returncode == 0, bench.stdout + bench.stderr
    levels = json.loads((tmp_path / "bench.json").read_text())["levels"]
    assert [(lv["ok"], lv["errors"]) for lv in levels] == [(2, 0), (2, 0)]
    after = metrics(url, bearer(OBSERVER), verify=tls)[f"minillm_key_requests_total{{key={label(KEY_B)}}}"]
    assert after - before == 4 + 3  # the four measured requests and the three probes that sized the prompt
    switch = run_bench(url, MODEL, tmp_path / "switch.json", concurrency="1", requests=2, prompt_tokens=8,
                       max_tokens=2, extra=("--api-key", KEY_B, "--models", f"{MODEL},{MODEL}"), env=env)  # fmt: skip
    assert switch.returncode == 0, switch.stdout + switch.stderr
    patterns = json.loads((tmp_path / "switch.json").read_text())["patterns"]
    assert [(p["ok"], p["switches"], p["evictions"]) for p in patterns] == [(2, 0, 0), (2, 0, 0)]  # /metrics was read


def test_sigterm_drains_a_keyed_stream_and_keys_still_hold_while_draining(projector):
    """Last in the module: the server exits."""
    proc, url, log, _, tls = projector
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 40, "temperature": 0, "stream": True}
    chunks, ready = [], threading.Event()

    def stream():
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=bearer(KEY_A), timeout=120,
                          verify=tls) as r:  # fmt: skip
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    ready.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert ready.wait(60)
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    while (health := httpx.get(url + "/health", verify=tls)).status_code == 200:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    late = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi"}, headers=bearer(KEY_B), verify=tls)
    keyless = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi"}, verify=tls)
    reader.join(120)
    assert proc.wait(timeout=120) == 0
    assert health.json()["status"] == "draining" and late.status_code == 503 and keyless.status_code == 401
    assert late.json()["error"]["code"] == "draining"
    assert sum(len(c["choices"][0]["text"]) > 0 for c in chunks if c["choices"]) >= 1
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"  # ran to its end
    assert "drained 1 requests (1 finished, 0 cancelled or failed)" in " ".join(log.read_text().split())
