"""The server's reliability rules at their exact boundaries, in process (issue 49).

- The in-flight table (``reliability.Guard.in_flight``, what a shutdown waits for): a request leaves
  it when its end is sent, whether that end is an answer or an error, draining or not.
- ``--stream-buffer N``: a stream with N chunks waiting unsent is kept; with N + 1 it is shed, once.
- The event stream (``events.EventBus``): a subscriber is dropped only when an event it was never sent
  has left the ring; one whose next event is still the ring's oldest has missed nothing and stays.

tests/serve/test_rules_server.py meets the same rules through a real server (SIGTERM, body sizes).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

import minillm
from minillm.serve.events import EventBus
from minillm.serve.metrics import ServerMetrics
from minillm.serve.reliability import Channel, Guard


# --- the in-flight table ---------------------------------------------------------------------------
def tracked(guard: Guard, request_id: str) -> Channel:
    guard.track(SimpleNamespace(request_id=request_id, arrival=0.0))
    return Channel(guard, request_id)


@pytest.mark.parametrize("draining", [False, True])
def test_a_request_answered_with_an_error_leaves_the_in_flight_table(draining):
    guard = Guard(ServerMetrics())
    failed, answered = tracked(guard, "failed"), tracked(guard, "answered")
    guard.draining = draining
    failed.put_nowait(("error", ValueError("prompt is 41 tokens but the model holds 32 positions")))
    assert list(guard.in_flight) == ["answered"]  # the error was its end: nothing left to wait for
    answered.put_nowait(("delta", "Hello"))
    assert list(guard.in_flight) == ["answered"]  # text is not an end
    answered.put_nowait(("done", SimpleNamespace(stop_reason=minillm.StopReason.EOS, completion_tokens=2)))
    assert guard.in_flight == {}
    # while draining, each end is listed once with how it ended (the console's drain report)
    expected = [("failed", "failed", "error: prompt is 41 tokens but the model holds 32 positions"),
                ("answered", "finished", "eos, 2 tokens")] if draining else []  # fmt: skip
    assert guard.drained == expected


# --- --stream-buffer ---------------------------------------------------------------------------------
class Stream:
    """What ``Guard.shed`` reads of a running request: its channel's backlog, its stop, its cancel."""

    def __init__(self, behind: int):
        self.job = SimpleNamespace(channel=SimpleNamespace(qsize=lambda: behind))
        self.request = SimpleNamespace(stop_reason=None, cancel=self.cancel)
        self.shed = False  # the worker's Active.shed: set by the guard when it cancels the stream
        self.cancelled: list[str] = []

    def cancel(self, reason: str) -> None:
        self.cancelled.append(reason)


def test_stream_buffer_keeps_exactly_n_waiting_chunks_and_sheds_n_plus_1():
    metrics = ServerMetrics()
    guard = Guard(metrics, stream_buffer=3)
    at_limit, over = Stream(3), Stream(4)
    assert guard.shed(at_limit) is False and at_limit.cancelled == []
    assert guard.shed(over) is True
    assert over.cancelled == ["the client read too slowly: 4 chunks waited unsent (--stream-buffer 3)"]
    assert guard.shed(over) is True and len(over.cancelled) == 1  # shed once, then sent nothing more
    assert metrics.registry.get_sample_value("minillm_request_shed_by_backpressure_total") == 1
    one = Guard(ServerMetrics(), stream_buffer=1)  # the smallest buffer: one chunk may wait
    assert one.shed(Stream(1)) is False and one.shed(Stream(2)) is True


# --- the event stream's drop rule ----------------------------------------------------------------------
def test_only_a_subscriber_that_missed_an_event_is_dropped():
    """Ring of 3. "caught-up" has taken ids 1..3; "never-read" has taken nothing. After id 4 the ring
    is 2..4: never-read's next event (1) is gone, dropped; caught-up's next (4) is there. After ids 5
    and 6 the ring is 4..6, its oldest exactly caught-up's next: kept. After id 7 (ring 5..7), event 4
    it was never sent is gone: dropped."""
    log: list[str] = []

    async def scenario():
        bus = EventBus(capacity=3, log=log.append)
        caught_up, _ = bus.subscribe(None, "caught-up")
        never_read, _ = bus.subscribe(None, "never-read")
        for i in (1, 2, 3):
            bus.publish("step", {"i": i})
            await asyncio.sleep(0)  # the loop runs the bus's wake-up: the drop check
        assert len(bus.take(caught_up)) == 3 and caught_up.cursor == 3
        assert (caught_up.dropped, never_read.dropped) == (None, None)  # the ring still holds id 1
        bus.publish("step", {"i": 4})
        await asyncio.sleep(0)
        assert never_read.dropped is not None and caught_up.dropped is None
        for i in (5, 6):
            bus.publish("step", {"i": i})
            await asyncio.sleep(0)
        assert bus._span() == (4, 6) and caught_up.dropped is None and bus.subscribers == 1
        bus.publish("step", {"i": 7})
        await asyncio.sleep(0)
        assert caught_up.dropped == "it fell behind: 1 events it had not been sent left the ring of 3"
        assert bus.subscribers == 0

    asyncio.run(scenario())
    assert [line.split(":")[1].strip() for line in log] == ["dropped subscriber #2 (never-read)",
                                                            "dropped subscriber #1 (caught-up)"]  # fmt: skip


def test_the_stream_buffer_flag_reaches_the_guard(tmp_path, monkeypatch):
    """``minillm serve --stream-buffer 7`` builds the guard with 7, for one model and for several (the
    apps are built, not started: no weights are read; the several-model plan reads the tiny folder's
    config and tokenizer, its measured bytes cached in a folder of the test's own)."""
    from rich.console import Console
    from tiny_models import tiny_word_model

    from minillm.cli import build_parser
    from minillm.serve.multi_server import build_registry
    from minillm.serve.server import _one_model_app

    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "tiny"
    folder.mkdir()
    tiny_word_model(folder)
    args = build_parser().parse_args(["serve", str(folder), "--stream-buffer", "7"])
    _, guard = _one_model_app(args, Console(quiet=True), None)
    assert guard.stream_buffer == 7
    assert guard.shed(Stream(7)) is False and guard.shed(Stream(8)) is True
    args = build_parser().parse_args(["serve", str(folder), "--model", f"{folder}:int8", "--stream-buffer", "7"])
    registry = build_registry(args, Console(quiet=True))
    assert [slot.guard.stream_buffer for slot in registry.slots.values()] == [7, 7]
