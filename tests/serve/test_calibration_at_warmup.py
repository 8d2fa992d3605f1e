"""A new server measures what the diagnosis reads during its warm-up, before GET /health answers 200,
never inside a request's step (issue 41: the first request's summary measured the machine and the
model's products rate on the worker thread; one step took 12.8 s and every stream froze).

The server starts on a machine not yet calibrated (``$MINILLM_CALIBRATION`` names a file that does
not exist), as a fresh install or a busy machine (whose measurement is never kept) meets it. The
asserts are on causes: how many measurements the process made (GET /health counts them), when
(the warm-up's load event on GET /v1/events carries them), and what the first request's summary
says it measured (nothing).
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from servers import MODEL, running_server

pytestmark = pytest.mark.slow


def load_events(url: str) -> list[dict]:
    """The ``load`` events the ring holds (kept from the start: a page that opens late still gets them)."""
    events, deadline = [], time.monotonic() + 120  # a ring without "ready" ends the read (keep-alives tick)
    with httpx.stream("GET", url + "/v1/events", timeout=60) as r:
        for line in r.iter_lines():
            if time.monotonic() > deadline:
                return events
            if line.startswith("data: "):
                event = json.loads(line[len("data: ") :])  # {"type": ..., "t": ..., **data}
                if event["type"] == "load":
                    events.append(event)
                    if event["phase"] == "ready":
                        return events
    return events


@pytest.mark.parametrize("several", [(), ("--keep-alive", "-1")], ids=["one-model", "several-model"])
def test_a_new_servers_first_request_measures_nothing(tmp_path, monkeypatch, several):
    from openai import OpenAI

    monkeypatch.setenv("MINILLM_CALIBRATION", str(tmp_path / "rates.json"))  # not calibrated yet
    with running_server(tmp_path, "--verbosity", "quiet", *several) as (url, _):
        ready = httpx.get(url + "/health").json()
        loads = load_events(url)  # the several-model server's page has its load line too (issue 47)
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0
        )
        trace = httpx.get(f"{url}/v1/traces/{answer.id}").json()
        after = httpx.get(url + "/health").json()
    summary = next(e["data"] for e in trace["events"] if e["phase"] == "summary")
    assert summary["calibration"]["measured_now"] is False  # read from what the warm-up measured
    # the machine and the model's products measured once each, before /health said ready ...
    assert ready["status"] == "ready" and ready["calibration"]["measurements"] == {"machine": 1, "products_rate": 1}
    assert after["calibration"]["measurements"] == {"machine": 1, "products_rate": 1}  # ... and never again
    # in the warm-up phase, before "ready"
    warmup = next(e for e in loads if e["phase"] == "warmup")
    assert warmup["calibration"]["measured_now"] is True and loads[-1]["phase"] == "ready"
    assert [e["phase"] for e in loads] == ["loading", "loaded", "warmup", "ready"]
