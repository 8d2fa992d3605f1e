"""Minillm on Ray Serve (issue 46): two replicas of the same server, through Ray's proxy, compared
with one ``minillm serve``, routed by prefix, rolled to other weights. One deployment runs at a time
(the run's memory budget: a deployment of two replicas and Ray's processes hold about 3.5 GB).

- greedy answers through two replicas (Ray's default router: its proxy in front of the replicas'
  FastAPI app) and through the prefix router equal one ``minillm serve``'s on 5 prompts, streamed
  and not, through the official ``openai`` client;
- both replicas answer, each names itself (``x-minillm-replica``), and its /metrics carry its id as
  a label, as Ray Serve's own metrics do (``--metrics-port``); each printed its load phases and
  "ready (warmed)" before taking traffic;
- the 4-system-prompt workload (benchmarks/shared_prefixes.py), one request at a time, on pools of
  10 MiB (room for about two of the four system prompts): the cached prompt tokens summed over the
  answers (``usage.prompt_tokens_details.cached_tokens``) are at least 1.5x those of Ray's
  power-of-two-choices router, and every greedy answer is the same under both routers;
- a rolling update (the config file's ``weight_dtype`` float32 -> bfloat16) while 20 streams are in
  flight: 0 failed, every stream's text equal to the undisturbed run's, and afterwards every answer
  comes from a new replica holding bfloat16 weights; each old replica stopped after its streams;
- a rolling update to a LoRA adapter (the config file's ``adapters`` [] -> [FOLDER]) while 6 streams
  are in flight: 0 failed, every stream's text the base model's, and afterwards each new replica
  answers with the adapter merged (its text equal to ``minillm.generate`` on the model loaded with
  the adapter in this process, ``x-minillm-adapters`` and its /v1/models card naming it);
- after SIGINT, no process of a deployment (the command, Ray's, the replicas) is left.
"""

from __future__ import annotations

import gc
import json
import re
import threading
import time

import httpx
import pytest
import yaml
from deployments import MODEL, running_deployment, wait_for_line
from lora_folders import smollm2_adapter
from openai import OpenAI
from servers import running_server

import minillm
from benchmarks.server_process import free_port
from benchmarks.shared_prefixes import run_workload
from minillm.deploy.config import DeployConfig

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 2 + 2?",
    "Give one tip for learning to code.",
]


def answers(url: str) -> dict[str, list[str]]:
    """Each question's greedy answer (12 tokens), not streamed and streamed, via the openai client."""
    c = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    plain, streamed = [], []
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        out = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
        plain.append(out.choices[0].message.content)
        chunks = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True)
        streamed.append("".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices))
    return {"plain": plain, "streamed": streamed}


def ray_serve_metrics(port: int, replicas: set[str], timeout: float = 90.0) -> str:
    """Ray's own Prometheus text once it counts requests of both ``replicas`` (Ray reports every few seconds)."""
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        counted = re.findall(r'ray_serve_deployment_request_counter_total\{[^}]*replica="([^"]+)"', text)
        if all(any(r in tag for tag in counted) for r in replicas):
            break
        time.sleep(1.0)
    return text


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``minillm serve``'s answers (one process, stopped before any deployment starts)."""
    with running_server(tmp_path_factory.mktemp("serve")) as (url, _):
        return answers(url)


@pytest.fixture(scope="module")
def default_fleet(tmp_path_factory, served):
    """What two replicas behind Ray's default router answered: the 5 questions, the workload, the
    replica ids on /health's headers, /metrics, and the command's log; the deployment stopped after."""
    tmp = tmp_path_factory.mktemp("default")
    ray_port = free_port()
    flags = ("--replicas", "2", "--router", "default", "--kv-cache-mib", "10", "--metrics-port", str(ray_port))
    with running_deployment(tmp, *flags) as (_, url, log):
        run = {"answers": answers(url), "workload": run_workload(url, MODEL, concurrency=1)}
        run["seen"] = {httpx.get(url + "/health").headers["x-minillm-replica"] for _ in range(12)}
        run["metrics"] = httpx.get(url + "/metrics").text
        run["ray_metrics"] = ray_serve_metrics(ray_port, run["seen"])
    run["log"] = log.read_text()
    return run


def test_greedy_answers_through_ray_serve_equal_minillm_serve(served, default_fleet):
    assert all(served["plain"]) and served["plain"] == served["streamed"]
    assert default_fleet["answers"] == served


def test_each_replica_names_itself_and_labels_its_metrics(default_fleet):
    counted = re.findall(
        r'ray_serve_deployment_request_counter_total\{[^}]*replica="([^"]+)"', default_fleet["ray_metrics"]
    )
    assert all(any(r in tag for tag in counted) for r in default_fleet["seen"])  # Ray Serve's own, per replica
    assert len(default_fleet["seen"]) == 2  # both replicas answered
    assert any(
        f'minillm_kv_cache_blocks_total{{replica="{r}"}}' in default_fleet["metrics"] for r in default_fleet["seen"]
    )
    ready = re.findall(r"replica (\S+) \(float32\): resolve .* warmup .* s; ready \(warmed\)", default_fleet["log"])
    assert set(ready) == default_fleet["seen"]


SETTINGS = {"model": MODEL, "replicas": 2, "threads": 1, "kv_cache_mib": 10.0}


def write_config(path, **changes) -> None:
    config = DeployConfig.from_args({**SETTINGS, **changes})
    path.write_text(yaml.safe_dump(config.serve_config()))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, default_fleet):
    """(base url, log, config path) of a prefix-routed deployment started from a config file."""
    tmp = tmp_path_factory.mktemp("fleet")
    config = tmp / "fleet.yaml"
    write_config(config, router="prefix")
    with running_deployment(tmp, "--config", str(config), model=None) as (_, url, log):
        yield url, log, config


def test_prefix_router_caches_more_than_the_default_router(default_fleet, fleet, served):
    url, _, _ = fleet
    prefix = run_workload(url, MODEL, concurrency=1)
    default = default_fleet["workload"]
    assert prefix["prompt_tokens"] == default["prompt_tokens"]
    assert prefix["answers"] == default["answers"]  # greedy answers unchanged by the routing
    assert len(prefix["replicas"]) == 2  # both replicas served: the prompts were spread, not piled up
    assert prefix["cached_tokens"] >= 1.5 * default["cached_tokens"], (prefix, default)
    assert answers(url) == served  # the relay in front of the router changes no answer
    for replica in prefix["replicas"]:  # a client may follow one replica (the live page's /ui?replica=ID)
        got = {httpx.get(url + "/health", headers={"x-minillm-replica": replica}).headers["x-minillm-replica"]}
        got |= {httpx.get(url + "/health", headers={"x-minillm-replica": replica}).headers["x-minillm-replica"]}
        assert got == {replica}


PROMPTS = ["The capital of France is", "One, two, three,", "Water boils at", "The sky is", "Once upon a time"]


def stream(url: str, prompt: str, started: threading.Event, out: dict) -> None:
    """One streaming completion (greedy, slow motion: it stays in flight); its text or its error in ``out``."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True, "slow_motion_s": 0.3}
    text = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as answer:
            answer.raise_for_status()
            for line in answer.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text.append(json.loads(line[6:])["choices"][0]["text"] or "")
                    started.set()
        out["text"] = "".join(text)
    except Exception as exc:  # noqa: BLE001 - counted as a failed request
        out["error"] = repr(exc)
        started.set()


def twenty_streams(url: str, during=None, count: int = 20) -> list[dict]:
    """20 (``count``) streams at once (the 5 prompts in turn); ``during()`` runs once every one has its first chunk."""
    outs = [{} for _ in range(count)]
    started = [threading.Event() for _ in range(count)]
    threads = [
        threading.Thread(target=stream, args=(url, PROMPTS[i % 5], started[i], outs[i]), daemon=True)
        for i in range(count)
    ]
    for t in threads:
        t.start()
    for s in started:
        assert s.wait(120)
    if during is not None:
        during()
    for t in threads:
        t.join(300)
    return outs


def test_rolling_update_under_20_streams(fleet):
    url, log, config = fleet
    undisturbed = twenty_streams(url)
    assert all("text" in o and o["text"] for o in undisturbed), undisturbed
    before = {httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
              .headers["x-minillm-replica"] for _ in range(8)}  # fmt: skip
    mark = len(log.read_text())
    disturbed = twenty_streams(url, during=lambda: write_config(config, router="prefix", weight_dtype="bfloat16"))
    assert [o.get("error") for o in disturbed] == [None] * 20  # 0 failed requests
    assert [o["text"] for o in disturbed] == [o["text"] for o in undisturbed]
    wait_for_line(log, r"config changed: rolling update", None, 30, after=mark)
    deadline = time.monotonic() + 300
    while len(re.findall(r"\(bfloat16\).*ready \(warmed\)", log.read_text()[mark:])) < 2:
        assert time.monotonic() < deadline, log.read_text()[mark:]
        time.sleep(0.5)
    wait_for_line(log, r"config applied: replicas running 2 \(healthy\)", None, 120, after=mark)
    after = [
        httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1}) for _ in range(8)
    ]
    assert {a.headers["x-minillm-weight-dtype"] for a in after} == {"bfloat16"}
    assert not {a.headers["x-minillm-replica"] for a in after} & before
    assert (
        len(re.findall(r"replica (\S+) stopped: Ray let the requests it served end first", log.read_text()[mark:])) == 2
    )


ADAPTER = "smollm2-lora-test"  # tests/support/lora_folders.py's adapter, in a folder of this name


def adapted_answers(weight_dtype: str, adapter) -> dict[str, str]:
    """Each of the PROMPTS' greedy completion (8 tokens, as ``stream``'s) by the model held at
    ``weight_dtype`` with ``adapter`` merged, in this process (the model freed after)."""
    model = minillm.load(MODEL, weight_dtype=weight_dtype, adapters=[adapter], threads=1, progress=False)
    greedy = minillm.SamplingParams(temperature=0.0)
    answers = {p: minillm.generate(model, p, greedy, max_new_tokens=8).text for p in PROMPTS}
    del model
    gc.collect()
    return answers


def test_rolling_update_to_an_adapter_under_6_streams(fleet, tmp_path_factory):
    """From no adapter to one: the fleet's weight dtype is kept (float32, or bfloat16 after the test above)."""
    url, log, config = fleet
    held = DeployConfig.from_file(config).weight_dtype
    adapter = smollm2_adapter(tmp_path_factory.mktemp("lora") / ADAPTER)
    expected = adapted_answers(held, adapter)
    undisturbed = twenty_streams(url, count=6)
    base = {PROMPTS[i % 5]: o.get("text") for i, o in enumerate(undisturbed)}
    assert all(base.values()) and all(expected[p] != base[p] for p in base), (base, expected)  # the adapter shows
    plain = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert plain.headers["x-minillm-adapters"] == "none"
    mark = len(log.read_text())
    change = lambda: write_config(config, router="prefix", weight_dtype=held, adapters=[str(adapter)])  # noqa: E731
    disturbed = twenty_streams(url, during=change, count=6)
    assert [o.get("error") for o in disturbed] == [None] * 6  # 0 failed requests
    assert [o["text"] for o in disturbed] == [o["text"] for o in undisturbed]  # begun on the base weights
    wait_for_line(log, r"config changed: rolling update", None, 30, after=mark)
    deadline = time.monotonic() + 300
    ready = rf"replica (\S+) \({held}, adapter {ADAPTER}\).*ready \(warmed\)"
    while len(new := re.findall(ready, log.read_text()[mark:])) < 2:
        assert time.monotonic() < deadline, log.read_text()[mark:]
        time.sleep(0.5)
    wait_for_line(log, r"config applied: replicas running 2 \(healthy\)", None, 120, after=mark)
    for replica in new:  # each new replica, asked by name: the adapter's text, and its card names it
        pinned = {"x-minillm-replica": replica}
        for prompt in PROMPTS[:2]:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
            answer = httpx.post(url + "/v1/completions", json=body, headers=pinned, timeout=300)
            assert answer.headers["x-minillm-replica"] == replica and answer.headers["x-minillm-adapters"] == ADAPTER
            assert answer.json()["choices"][0]["text"] == expected[prompt]
        card = httpx.get(url + f"/v1/models/{MODEL}", headers=pinned).json()
        assert card["adapters"] == [ADAPTER]
    said = r"replica (\S+) stopped: Ray let the requests it served end first"
    while len(stopped := re.findall(said, log.read_text()[mark:])) < 2:  # Ray's workers' lines reach the log late
        assert time.monotonic() < deadline, log.read_text()[mark:]
        time.sleep(0.5)
    assert len(stopped) == 2 and not set(stopped) & set(new)  # the two old replicas, each after its requests
