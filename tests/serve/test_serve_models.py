"""Several models behind one server (minillm/serve/models.py), as a client sees them.

Two "models" that fit this machine's test budget: SmolLM2 held at float32 and at int8
(``smollm2-135m-instruct`` and ``smollm2-135m-instruct:int8``). Servers run as subprocesses.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import httpx
import pytest
from servers import metrics, running_server

pytestmark = pytest.mark.slow
A, B = "smollm2-135m-instruct", "smollm2-135m-instruct:int8"
SMALL = ("--max-seq-len", "512", "--kv-cache-mib", "32", "--max-batched-tokens", "128")
ONE_MODEL_BUDGET = "800MiB"  # A's plan is about 680 MiB, B's adds about 215 MiB: one fits, not both
QUESTIONS = {A: "What is the capital of France?", B: "Name a primary color."}


def ask(url: str, model: str, max_tokens: int = 16) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": QUESTIONS[model]}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def summed(samples: dict[str, float], prefix: str) -> float:
    """The sum of the /metrics samples whose names (labels included) start with ``prefix``."""
    return sum(v for k, v in samples.items() if k.startswith(prefix))


def evictions(url: str) -> float:
    return summed(metrics(url), "minillm_model_evictions_total")


def loads(url: str) -> float:
    return summed(metrics(url), "minillm_model_loads_total")


def plan_vs_rss(url: str) -> tuple[float, float]:
    m = metrics(url)
    planned, measured = m["minillm_memory_planned_bytes"], m["minillm_memory_measured_bytes"]
    print(f"planned {planned / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB: {measured / planned - 1:+.1%}")
    return planned, measured


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    """Each model's greedy answer from a server holding only it."""
    out = {}
    for model in (A, B):
        with running_server(tmp_path_factory.mktemp("alone"), *SMALL, "--memory-budget", "2GiB", model=model) as (
            url,
            _,
        ):
            out[model] = ask(url, model)["choices"][0]["message"]["content"]
            out[model + " long"] = ask(url, model, max_tokens=120)["choices"][0]["message"]["content"]
    return out


def test_a_budget_for_both_evicts_nothing(tmp_path, alone):
    with running_server(tmp_path, *SMALL, "--model", B, "--memory-budget", "1500MiB", model=A) as (url, _):
        answers = [ask(url, m)["choices"][0]["message"]["content"] for m in (A, B, A, B)]
        assert answers == [alone[A], alone[B], alone[A], alone[B]]
        assert loads(url) == 2 and evictions(url) == 0
        cards = {c["id"]: c for c in httpx.get(url + "/v1/models").json()["data"]}
        assert [cards[A]["state"], cards[B]["state"]] == ["loaded", "loaded"]
        planned, measured = plan_vs_rss(url)
        assert abs(measured - planned) / planned < 0.10, (planned, measured)


GEMMA, GEMMA_INT8 = "gemma3-270m", "gemma3-270m:int8"
GEMMA_ONE_MODEL_BUDGET = "1600MiB"  # float32's plan is about 1.25 GiB, int8 adds about 440 MiB: one at a time


def test_gemma3_resident_bytes_within_10_percent_of_the_plan_at_float32_and_int8(tmp_path):
    """A 262,144-token vocabulary: its tokenizer is 100 MiB held (twice that while its JSON is parsed),
    the tied embedding is 640 MiB at float32; the plan counts what is held, not the load's transients."""
    flags = (*SMALL, "--model", GEMMA_INT8, "--memory-budget", GEMMA_ONE_MODEL_BUDGET)
    with running_server(tmp_path, *flags, model=GEMMA) as (url, log):
        planned, measured = plan_vs_rss(url)
        assert abs(measured - planned) / planned < 0.10, ("ready", planned, measured)
        for model in (GEMMA, GEMMA_INT8):  # the second load evicts the first
            body = {"model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
            r = httpx.post(url + "/v1/completions", json=body, timeout=600)
            assert r.status_code == 200, r.text
            planned, measured = plan_vs_rss(url)
            assert abs(measured - planned) / planned < 0.10, (model, planned, measured)
            plan = httpx.get(url + f"/v1/models/{model}/plan").json()
            assert plan["state"] == "loaded" and plan["tokenizer"] < 160 * 2**20  # held, not the parse's peak
        assert loads(url) == 2 and evictions(url) == 1
        assert plan["weights"] == {"int8": 269_588_480, "float32": 223_744}


def serve_cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "minillm", "serve", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})


@pytest.mark.parametrize("value", ["-5", "soon", "nan"])
def test_keep_alive_below_minus_one_or_not_a_number_is_a_cli_error(value):
    done = serve_cli(A, "--keep-alive", value)
    assert done.returncode == 2
    assert f"--keep-alive takes seconds >= 0, or -1 to never unload an idle model; got '{value}'" in done.stderr


def test_a_budget_smaller_than_the_smallest_model_is_refused_naming_both_sizes():
    done = serve_cli(A, "--model", B, "--memory-budget", "100MiB", "--max-seq-len", "512")
    assert done.returncode == 2
    text = " ".join(done.stderr.split())
    assert "MemoryBudgetError" in text and "but the memory budget is 100.0 MiB" in text
    assert f"{A} (float32) needs" in text and "weights 513.1 MiB" in text


@pytest.fixture(scope="module")
def switching(tmp_path_factory):
    """One server for the module's switching tests (A loaded at startup, B listed, a budget for one):
    started once, after the tests that start servers of their own, so it never runs beside them.
    Each test first puts A in memory (:func:`a_loaded`) and asserts what its own requests changed."""
    flags = (*SMALL, "--model", B, "--memory-budget", ONE_MODEL_BUDGET)
    with running_server(tmp_path_factory.mktemp("switching"), *flags, model=A) as (url, log):
        yield url, log


def a_loaded(url: str, log) -> tuple[dict, int]:
    """Make A the loaded model (a one-token request to it; loads it only if B is in memory), then
    return /metrics and the log's length: the baseline a test's differences start from."""
    body = {"model": A, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0}
    assert httpx.post(url + "/v1/chat/completions", json=body, timeout=300).status_code == 200
    cards = {c["id"]: c for c in httpx.get(url + "/v1/models").json()["data"]}
    assert [cards[A]["state"], cards[B]["state"]] == ["loaded", "unloaded"]
    return metrics(url), len(log.read_text())


def changed(url: str, before: dict, prefix: str) -> float:
    """How much the samples of /metrics whose names start with ``prefix`` grew since ``before``."""
    return summed(metrics(url), prefix) - summed(before, prefix)


def test_unknown_model_and_too_long_requests(switching):
    url, log = switching
    before, _ = a_loaded(url, log)
    body = {"model": "llama-9000", "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(url + "/v1/chat/completions", json=body)
    assert r.status_code == 404
    assert f"'{A}', '{B}'" in r.json()["error"]["message"]
    body = {"model": B, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 600}
    r = httpx.post(url + "/v1/chat/completions", json=body)  # B unloaded: refused from its plan alone
    assert r.status_code == 400
    assert "max_tokens is 600 but the context holds 512 positions" in r.json()["error"]["message"]
    assert changed(url, before, "minillm_model_loads_total") == 0  # neither refusal loaded B
    plan = httpx.get(url + f"/v1/models/{B}/plan").json()
    assert plan["context"] == 512 and plan["kv_tokens"] == 720  # 32 MiB // (16 x 46,080 B) = 45 blocks
    assert plan["kv_line"] == "KV cache: 720 tokens, maximum concurrency at context 512: 1.41x"
    assert httpx.get(url + "/v1/models/llama-9000/plan").status_code == 404


def test_one_model_budget_a_b_a_gives_2_evictions_2_loads_and_the_same_answers(switching, alone):
    url, log = switching
    before, log_start = a_loaded(url, log)
    planned, measured = plan_vs_rss(url)
    assert abs(measured - planned) / planned < 0.10, (planned, measured)
    answers = []
    for model in (A, B, A):  # A is in memory: B's request evicts it, the last A's evicts B
        r = ask(url, model)
        answers.append(r["choices"][0]["message"]["content"])
        assert r["model"] == model
        planned, measured = plan_vs_rss(url)  # after each load: the RSS within 10 % of the plan
        assert abs(measured - planned) / planned < 0.10, (model, planned, measured)
    assert answers == [alone[A], alone[B], alone[A]]
    assert changed(url, before, "minillm_model_loads_total") == 2
    assert changed(url, before, "minillm_model_evictions_total") == 2
    assert changed(url, before, f"minillm_model_evictions_total{{model={A},reason=memory budget}}") == 1
    assert changed(url, before, f"minillm_model_evictions_total{{model={B},reason=memory budget}}") == 1
    assert changed(url, before, "minillm_model_switches_total") == 2
    new_log = log.read_text()[log_start:]
    assert new_log.count("evicted") == 2
    assert f"evicted {A} (memory budget: to load {B})" in " ".join(new_log.split())
    cards = {c["id"]: c for c in httpx.get(url + "/v1/models").json()["data"]}
    assert cards[A]["state"] == "loaded" and cards[B]["state"] == "unloaded"
    assert cards[B]["resident_bytes"] == 0 and cards[A]["weight_dtype"] == "float32"


def test_the_trace_shows_the_load_and_usage_carries_load_s(switching):
    url, log = switching
    a_loaded(url, log)
    assert ask(url, A)["usage"]["load_s"] == 0.0  # A is in memory: nothing to load
    r = ask(url, B)
    assert r["usage"]["load_s"] > 0
    events = httpx.get(url + f"/v1/traces/{r['id']}").json()["events"]
    assert events[0]["phase"] == "model_load"
    assert events[0]["data"]["evicted"] == [{"model": A, "reason": "memory budget"}]
    assert set(events[0]["data"]["seconds"]) == {"read", "convert", "other", "kv_pool", "warmup"}


def test_a_running_stream_is_never_cut_by_a_switch(switching, alone):
    url, log = switching
    before, _ = a_loaded(url, log)
    order, texts = [], {}
    body = {"model": A, "messages": [{"role": "user", "content": QUESTIONS[A]}], "max_tokens": 120}
    body |= {"temperature": 0, "stream": True}

    def b_request():
        texts[B] = ask(url, B)["choices"][0]["message"]["content"]
        order.append(B)

    chunks = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        started = None
        for line in r.iter_lines():
            if line.startswith("data: {"):
                import json

                delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
                chunks.append(delta or "")
                if started is None and delta:  # A is streaming: now B arrives
                    started = threading.Thread(target=b_request)
                    started.start()
    order.append(A)
    started.join(timeout=300)
    assert "".join(chunks) == alone[A + " long"]
    assert order == [A, B] and texts[B] == alone[B]
    assert changed(url, before, "minillm_model_evictions_total") == 1  # A's, for B, after A's stream


def test_bench_alternate_switches_every_request_sticky_once(tmp_path, switching):
    url, _ = switching
    out = tmp_path / "switch.json"
    cmd = [sys.executable, "-m", "minillm", "bench", "--url", url, "--models", f"{A},{B}",
           "--pattern", "alternate,sticky", "--requests", "4", "--prompt-tokens", "16", "--max-tokens", "4",
           "--json", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "160"})
    assert done.returncode == 0, done.stdout + done.stderr
    import json

    patterns = {p["pattern"]: p for p in json.loads(out.read_text())["patterns"]}
    # calibration ends on B; alternate A B A B: 4 loads on demand; sticky A A B B: 2
    assert [r["model"] for r in patterns["alternate"]["per_request"]] == [A, B, A, B]
    assert patterns["alternate"]["switches"] == 4 and patterns["alternate"]["evictions"] == 4
    assert patterns["sticky"]["switches"] == 2 and patterns["sticky"]["ok"] == 4
