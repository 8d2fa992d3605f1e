"""Autoscaling on ongoing requests (issue 46): one replica at start, between 1 and 2, a target of 1
ongoing request per replica. Under a sustained load of 6 streams at a time, Ray Serve's status (the
counts ``minillm deploy`` prints from ``serve.status()``) rises to 2 running replicas, the new one
having printed its load phases and "ready (warmed)" first; after the load stops it falls back to 1.
"""

from __future__ import annotations

import threading
import time

import httpx
from deployments import MODEL, replica_counts, running_deployment

FLAGS = ("--min-replicas", "1", "--replicas", "1", "--max-replicas", "2", "--target-ongoing-requests", "1")


def keep_busy(url: str, stop: threading.Event, failures: list) -> None:
    """Streams one after another (slow motion: each stays ongoing for a while) until ``stop``."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "stream": True, "slow_motion_s": 0.2}
    while not stop.is_set():
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as answer:
                answer.raise_for_status()
                for _ in answer.iter_lines():
                    pass
        except Exception as exc:  # noqa: BLE001 - counted, asserted empty
            failures.append(repr(exc))


def wait_until(log, condition, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition(replica_counts(log)):
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)


def test_replicas_rise_to_the_maximum_under_load_and_fall_back(tmp_path):
    with running_deployment(tmp_path, *FLAGS) as (_, url, log):
        assert replica_counts(log) == [1]
        stop, failures = threading.Event(), []
        clients = [threading.Thread(target=keep_busy, args=(url, stop, failures), daemon=True) for _ in range(6)]
        for c in clients:
            c.start()
        try:
            wait_until(log, lambda counts: counts[-1] == 2, 240)
        finally:
            stop.set()
            for c in clients:
                c.join(120)
        text = log.read_text()
        assert text.count("ready (warmed)") == 2  # the new replica reported its load before it ran
        assert text.rindex("ready (warmed)") < text.index("replicas running 2")
        wait_until(log, lambda counts: counts[-1] == 1, 240)
    assert failures == []
    counts = replica_counts(log)
    assert counts[0] == 1 and max(counts) == 2 and counts[-1] == 1
