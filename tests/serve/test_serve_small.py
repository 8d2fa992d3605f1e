"""`minillm serve` as a client sees it, on a small server: loading, the queue limit, the timeout,
a pool that could never hold a request, schemathesis (with the server's key, and without one), a chat
template's own refusal.

One server subprocess for the module (--threads 1): ``small_server``, --startup-delay 3 --max-queue 4
--max-num-seqs 1 --request-timeout 0.5 --kv-cache-mib 128, and one API key (``AUTH``) that every request
sends but schemathesis' keyless run. A module of its own (it was
test_serve.py's second server) so that test_serve.py's main server has exited before this one
starts: the two at once, beside the test process, passed the run's 4.5 GB tree budget.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from access import ROUTES
from servers import MODEL, chat_body, metrics, running_server, wait_for

KEY = "small-server-key-41d8"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def model(smollm2):
    """The session's SmolLM2 (only its folder is read here: no second copy of the weights)."""
    return smollm2


# --- the small server: loading, queue limit, timeout, schemathesis --------------------------------
STRICT_ROLES = (  # as many real templates do (Llama 2, Gemma): refuse a role the model was not trained on
    "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Only system, user and assistant roles are supported, not ' + m['role']) }}"
    "{% endif %}{% endfor %}"
)


def strict_template_folder(tmp_path: Path, model) -> Path:
    """SmolLM2's folder (files linked, not copied) with its chat template behind a role check."""
    folder = tmp_path / "smollm2-strict-roles"
    folder.mkdir()
    for file in model.path.iterdir():
        (folder / file.name).symlink_to(file)
    config = json.loads((model.path / "tokenizer_config.json").read_text())
    config["chat_template"] = STRICT_ROLES + config["chat_template"]
    (folder / "tokenizer_config.json").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def small_server(tmp_path_factory, model):
    """Loading delayed 3 s on purpose; 1 runs and 4 may wait; every request ends after 0.5 s at most;
    a KV-cache pool of 128 MiB: 182 blocks of 16 positions (46,080 bytes each on SmolLM2), 2,912 positions.
    It serves SmolLM2 from a folder whose chat template refuses unknown roles, under the usual name."""
    tmp = tmp_path_factory.mktemp("small")
    flags = ("--startup-delay", "3", "--max-queue", "4", "--max-num-seqs", "1", "--request-timeout", "0.5",
             "--kv-cache-mib", "128", "--verbosity", "quiet", "--served-model-name", MODEL,
             "--api-key", KEY)  # fmt: skip
    with running_server(tmp, *flags, wait_ready=False, model=str(strict_template_folder(tmp, model))) as (url, log):
        yield url, log


def test_health_is_503_while_loading_then_200(small_server):
    url, _ = small_server
    early = httpx.get(url + "/health")
    assert early.status_code == 503
    assert early.json()["status"] == "loading" and "--startup-delay" in early.json()["note"]
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1}, headers=AUTH)
    assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
    seen = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        seen.append(httpx.get(url + "/health").status_code)
        if seen[-1] == 200:
            break
        time.sleep(0.05)
    assert seen[-1] == 200 and set(seen) == {503, 200}
    assert httpx.get(url + "/health").json()["status"] == "ready"


def test_full_queue_answers_429_with_retry_after(small_server):
    url, _ = small_server
    wait_for(url, lambda r: r is not None and r.status_code == 200, None, None)
    before = metrics(url, AUTH)["minillm_request_rejected_total"]
    results = []

    def one():
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0}
        results.append(httpx.post(url + "/v1/completions", json=body, timeout=60, headers=AUTH))

    threads = [threading.Thread(target=one) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ok = [r for r in results if r.status_code == 200]
    busy = [r for r in results if r.status_code == 429]
    assert len(ok) + len(busy) == 16, [
        (r.status_code, r.text[:200]) for r in results if r.status_code not in (200, 429)
    ]
    # --max-queue 4 counts a request being admitted (taken from the queue, not yet running) as waiting:
    # at least the four waiting are served, five when the first runs before the burst fills the queue
    assert len(ok) >= 4
    assert len(busy) >= 1
    for r in busy:
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "queue_full"
    assert metrics(url, AUTH)["minillm_request_rejected_total"] - before == len(busy)


def test_request_timeout_ends_with_length_and_says_timed_out(small_server):
    url, _ = small_server
    r = httpx.post(
        url + "/v1/completions",
        json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000, "temperature": 0},
        timeout=60,
        headers=AUTH,
    ).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "length" and choice["minillm_stop_reason"] == "timed out"
    assert 0 < r["usage"]["completion_tokens"] < 2000


def test_a_request_the_pool_could_never_hold_is_refused_with_400(small_server):
    """128 MiB = 182 blocks of 16 positions; "Hi" (1 token) + up to 4,000 new tokens needs 4,000
    positions = 250 blocks: refused at once, not left waiting."""
    url, _ = small_server
    wait_for(url, lambda r: r is not None and r.status_code == 200, None, None)
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4000, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60, headers=AUTH)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "4,000 positions = 250 blocks of 16" in message and "holds 182 blocks" in message
    assert "kv_cache_mib" in message


def schemathesis_statuses(url: str, headers: dict, max_examples: int) -> list[tuple[str, str, int]]:
    """``(method, path, status)`` of schemathesis' calls over every operation of /openapi.json (read with
    the server's key), valid and invalid requests generated from it, each sent with ``headers``.

    Half the generated bodies get the served model's name, so they reach the model (the server's
    --request-timeout 0.5 bounds each); the others exercise the 404 and validation paths.
    """
    import hypothesis
    import hypothesis.strategies as st
    import schemathesis
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(url + "/openapi.json", headers=AUTH)
    cases = st.one_of(schema.as_strategy(GenerationMode.POSITIVE), schema.as_strategy(GenerationMode.NEGATIVE))
    calls: list[tuple[str, str, int]] = []

    @hypothesis.settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(hypothesis.HealthCheck),
    )
    @hypothesis.given(case=cases, named=st.booleans())
    def check(case, named):
        if named and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = MODEL
        response = case.call(base_url=url, timeout=30, headers=headers)
        calls.append((case.method.upper(), case.operation.path, response.status_code))
        assert response.status_code < 500, (case.method, case.path, case.body, response.text)

    check()
    return calls


def test_schemathesis_with_the_key_finds_no_5xx(small_server):
    """Schemathesis generates valid and invalid requests from /openapi.json; none may get a 5xx."""
    url, _ = small_server
    wait_for(url, lambda r: r is not None and r.status_code == 200, None, None)
    statuses = [status for *_, status in schemathesis_statuses(url, AUTH, max_examples=80)]
    assert len(statuses) >= 40 and any(s == 200 for s in statuses) and any(400 <= s < 500 for s in statuses)
    assert 401 not in statuses and 403 not in statuses  # the key opens every operation


def test_schemathesis_without_a_key_meets_401_on_every_protected_operation(small_server):
    """The same generated requests without the key: every operation but /health answers 401 (never 200,
    never a 5xx), whatever the body; each operation of the schema is met, and each is a documented route."""
    url, _ = small_server
    wait_for(url, lambda r: r is not None and r.status_code == 200, None, None)  # /health: 200 once ready
    schema = httpx.get(url + "/openapi.json", headers=AUTH).json()["paths"]
    calls = schemathesis_statuses(url, {}, max_examples=60)
    operations = {(method, path) for method, path, _ in calls}
    assert operations == {(m.upper(), path) for path, ops in schema.items() for m in ops} and len(operations) == 8
    assert operations <= {(m, path.replace(":path}", "}")) for m, path in ROUTES}  # OpenAPI drops the converter
    wrong = [(m, p, s) for m, p, s in calls if s != (200 if p == "/health" else 401)]
    assert wrong == []


def test_a_role_the_template_refuses_is_a_400_with_its_message(small_server):
    """The chat template decides which roles exist: its own refusal comes back as a 400 in OpenAI's shape."""
    url, log = small_server
    wait_for(url, lambda r: r is not None and r.status_code == 200, None, log)
    r = httpx.post(url + "/v1/chat/completions", json=chat_body(messages=[{"role": "robot", "content": "hi"}]),
                   headers=AUTH)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "Only system, user and assistant roles are supported, not robot" in error["message"]
