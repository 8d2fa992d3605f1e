"""`minillm serve` as a subprocess, the way the server tests meet it: a free port, start, wait for
/health, read /metrics, stop. And a worker's counters as /metrics would show them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.server_process import free_port, ready, stop, wait_for

#: The model every server test serves (the default model, fetched on first use).
MODEL = "smollm2-135m-instruct"
#: The second model of the several-model server (``SERVERS["several"]``): MODEL held at int8.
SECOND = MODEL + ":int8"
#: The two servers a server test's module fixture is parametrized over (issue 47: one server path):
#: ``one``, ``minillm serve MODEL`` (a Worker); ``several``, a registry (ModelRegistry) of MODEL and
#: SECOND whose memory budget holds one of them at a time (each plan fills it: MODEL's at full context
#: is about 1.27 GiB). MODEL is loaded first, so a test that names MODEL meets it ready on both.
SERVERS = {"one": (), "several": ("--model", SECOND, "--memory-budget", "1500MiB")}


@contextmanager
def running_server(tmp_path: Path, *flags: str, wait_ready: bool = True, model: str = MODEL):
    """Start ``python -m minillm serve MODEL`` on a free port; yield (base url, log path); stop it."""
    with server_process(tmp_path, *flags, wait_ready=wait_ready, model=model) as (_, url, log):
        yield url, log


@contextmanager
def server_process(tmp_path: Path, *flags: str, wait_ready: bool = True, model: str = MODEL, env=None, verify=True):
    """:func:`running_server` that also yields the process (a test may signal it): (process, base url, log
    path). ``env``: variables over the test's; ``verify``: an ``ssl.SSLContext`` trusting the certificate
    of a server started with ``--ssl-certfile`` (its URL is then ``https://``)."""
    port = free_port()
    log = tmp_path / f"serve-{port}.log"
    cmd = [sys.executable, "-m", "minillm", "serve", model, "--port", str(port), "--threads", "1", *flags]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "COLUMNS": "100", **(env or {})}
        )
    url = f"{'https' if '--ssl-certfile' in flags else 'http'}://127.0.0.1:{port}"
    try:
        wait_for(url, lambda r: r is not None, proc, log, verify=verify)  # listening (any answer)
        if wait_ready:
            wait_for(url, ready, proc, log, verify=verify)
        yield proc, url, log
    finally:
        stop(proc)


def chat_body(**fields) -> dict:
    """A /v1/chat/completions body for ``MODEL``: one user turn "Hi", 2 tokens, and ``fields`` over them."""
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields}


def metrics(url: str, headers: dict | None = None, verify=True) -> dict[str, float]:
    """/metrics as {sample name + labels: value} (``headers``: a key, for a server that holds keys)."""
    out = {}
    answer = httpx.get(url + "/metrics", headers=headers, verify=verify)
    assert answer.status_code == 200, answer.text
    for family in text_string_to_metric_families(answer.text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def counts(worker) -> dict:
    """The counters as /metrics shows them: finished by reason, rejected, prompt and generated tokens."""
    reg = worker.metrics.registry
    finished = {
        s.labels["reason"]: s.value
        for m in reg.collect()
        if m.name == "minillm_request_finished"
        for s in m.samples
        if s.name.endswith("_total")
    }
    return {
        "finished": finished,
        "rejected": reg.get_sample_value("minillm_request_rejected_total"),
        "prompt": reg.get_sample_value("minillm_prompt_tokens_total"),
        "generated": reg.get_sample_value("minillm_generation_tokens_total"),
    }
