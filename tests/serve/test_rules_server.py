"""`minillm serve` at its exact limits, as a client meets them (issue 49). One server for the module:
the tiny NumPy Llama (tests/support/tiny_models.py, context 32) from a local folder, started as a
subprocess with ``--max-request-bytes 400 --shutdown-timeout 600``.

- ``--max-request-bytes N``: a body of exactly N bytes is served; N + 1 gets 413 in OpenAI's shape,
  whether it declares its length or arrives chunked without one.
- The in-flight table after a request answered with an error: a SIGTERM with nothing running drains
  0 requests and exits 0 at once, instead of waiting out the 600 s ``--shutdown-timeout`` for a
  request that already had its answer. (Last in the module: it ends the server.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from tiny_models import tiny_word_model

from benchmarks.server_process import free_port, ready, wait_for

LIMIT = 400
MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rules-server") / "tiny"
    folder.mkdir()
    tiny_word_model(folder)
    port = free_port()
    log = folder.parent / "serve.log"
    cmd = [sys.executable, "-m", "minillm", "serve", str(folder), "--served-model-name", MODEL, "--port", str(port),
           "--threads", "1", "--verbosity", "quiet", "--max-request-bytes", str(LIMIT),
           "--shutdown-timeout", "600"]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "COLUMNS": "200"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(url, ready, proc, log)
        yield proc, url, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def body_of(size: int) -> bytes:
    """A valid completion request of exactly ``size`` bytes (JSON padded with spaces)."""
    text = json.dumps({"model": MODEL, "prompt": "AB C", "max_tokens": 2, "temperature": 0})
    assert len(text) <= size
    return (text[:-1] + " " * (size - len(text)) + "}").encode()


def post(url: str, content, **headers) -> httpx.Response:
    return httpx.post(url + "/v1/completions", content=content, headers={"content-type": "application/json", **headers},
                      timeout=60)  # fmt: skip


def test_a_body_of_exactly_max_request_bytes_is_served_and_one_byte_more_is_refused(server):
    _, url, _ = server
    exact, over = body_of(LIMIT), body_of(LIMIT + 1)
    assert (len(exact), len(over)) == (LIMIT, LIMIT + 1)
    for name, send in [("declared", lambda b: b), ("chunked", lambda b: iter([b[:100], b[100:]]))]:
        ok = post(url, send(exact))
        assert ok.status_code == 200, (name, ok.text)
        assert ok.json()["usage"]["completion_tokens"] == 2
        refused = post(url, send(over))
        assert refused.status_code == 413, (name, refused.text)
        error = refused.json()["error"]
        assert error["code"] == "request_too_large" and f"{LIMIT:,} bytes" in error["message"], name


def test_sigterm_after_a_request_answered_with_an_error_drains_nothing_and_exits(server):
    proc, url, log = server
    long = post(url, json.dumps({"model": MODEL, "prompt": "AB " * 40, "max_tokens": 2}).encode())
    assert long.status_code == 400 and long.json()["error"]["code"] == "ContextWindowExceeded"  # 41 tokens > 32
    assert post(url, body_of(200)).status_code == 200  # and one answered in full
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 60  # the line is printed on the signal; this bound only stops a broken run
    while "SIGTERM: draining" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "SIGTERM: draining 0 requests in flight" in log.read_text()
    assert proc.wait(timeout=60) == 0
    assert "drained 0 requests (0 finished, 0 cancelled or failed); exiting" in log.read_text()
