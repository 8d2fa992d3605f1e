"""The server's counters count every request once, by its final state, and only tokens the model
processed or produced (issue 31, kind 3). The worker is stepped by hand: no HTTP, no thread."""

from __future__ import annotations

import pytest
from helpers import finish, job, stepped_worker
from servers import counts

import minillm
from minillm.serve.worker import QueueFullError

PROMPT = "Once upon a time, in a small village by the sea, there lived"
LONG = PROMPT + " an old fisherman and his daughter, who walked down to the harbour every morning to watch the boats."


def n_prompt(model, prompt=PROMPT) -> int:
    return len(minillm.tokenize(model, prompt))


def test_finished_requests_count_computed_prompt_tokens_and_sampled_ones(smollm2):
    worker = stepped_worker(smollm2)
    first, second = job(LONG, max_tokens=4), job(LONG, max_tokens=4)
    worker.submit(first)
    finish(worker)
    worker.submit(second)  # the same prompt again: its full blocks come from the prefix cache
    finish(worker)
    cached = second.channel.end[1].cached_tokens
    assert cached == (n_prompt(smollm2, LONG) - 1) // 16 * 16 > 0
    c = counts(worker)
    assert c["finished"] == {"max new tokens": 2.0} and c["rejected"] == 0
    assert c["prompt"] == 2 * n_prompt(smollm2, LONG) - cached and c["generated"] == 8


def test_cancelled_in_the_queue_is_finished_and_processed_nothing(smollm2):
    worker = stepped_worker(smollm2)
    j = job(PROMPT, max_tokens=4)
    worker.submit(j)
    j.cancel.set()  # the client left before the worker took the job
    finish(worker)
    assert j.channel.end[1].stop_reason is minillm.StopReason.CANCELLED
    assert counts(worker) == {"finished": {"cancelled": 1.0}, "rejected": 0, "prompt": 0, "generated": 0}


def test_cancelled_while_waiting_for_a_place_in_the_batch_processed_nothing(smollm2):
    worker = stepped_worker(smollm2, max_num_seqs=1)
    running, waiting = job(PROMPT, max_tokens=6), job("A different prompt that waits", max_tokens=6)
    worker.submit(running)
    worker.submit(waiting)
    worker.serve_once()  # both reach the scheduler; one runs, the other waits for max_num_seqs
    assert [r.index for r in worker.scheduler.waiting] == [1]
    waiting.cancel.set()
    finish(worker)
    assert waiting.channel.end[1].stop_reason is minillm.StopReason.CANCELLED
    c = counts(worker)
    assert c["finished"] == {"max new tokens": 1.0, "cancelled": 1.0}
    assert c["prompt"] == n_prompt(smollm2) and c["generated"] == 6


def test_cancelled_while_running_counts_what_it_processed(smollm2):
    worker = stepped_worker(smollm2)
    j = job(PROMPT, max_tokens=50)
    worker.submit(j)
    for _ in range(3):  # the prefill (first token), then two decode steps
        worker.serve_once()
    j.cancel.set()
    finish(worker)
    outcome = j.channel.end[1]
    assert outcome.stop_reason is minillm.StopReason.CANCELLED and outcome.completion_tokens == 3
    expected = {"finished": {"cancelled": 1.0}, "rejected": 0, "prompt": n_prompt(smollm2), "generated": 3}
    assert counts(worker) == expected


def test_timed_out_in_the_queue_processed_nothing(smollm2):
    worker = stepped_worker(smollm2)
    worker.request_timeout_s = 5.0
    j = job(PROMPT, max_tokens=4)
    j.arrival -= 10.0  # it waited 10 s in the queue: over its deadline when the worker takes it
    worker.submit(j)
    finish(worker)
    assert j.channel.end[1].stop_reason is minillm.StopReason.TIMEOUT
    assert counts(worker) == {"finished": {"timed out": 1.0}, "rejected": 0, "prompt": 0, "generated": 0}


def test_refused_requests_are_counted_once_and_processed_nothing(smollm2):
    worker = stepped_worker(smollm2, max_queue=1, kv_cache_mib=1.0)  # 1 block of 16 positions
    too_long, refused = job(PROMPT, max_tokens=40), job(PROMPT, max_tokens=4)
    worker.submit(too_long)
    with pytest.raises(QueueFullError):
        worker.submit(refused)  # one already waits: 429
    finish(worker)
    assert too_long.channel.end[0] == "error"  # the pool could never hold it: 400
    assert counts(worker) == {"finished": {"refused": 1.0}, "rejected": 1.0, "prompt": 0, "generated": 0}
