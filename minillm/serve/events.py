"""The server's live event stream, ``GET /v1/events``: a bounded ring of JSON events read as SSE.

    worker thread                           event loop (one task per subscriber)
    -------------                           ------------------------------------
    bus.publish(kind, data)                 wake: each subscriber sends ring[its cursor:]
      -> JSON, next id, ring.append    ->     "id: 42\\ndata: {"type": "step", ...}\\n\\n"
      -> one call_soon_threadsafe(wake)     a subscriber whose next event already left the ring
                                            is dropped (logged), never waited for

The worker only appends to the ring (a lock held for one append) and schedules one wake-up on
the loop: a slow or stuck subscriber cannot slow the model, it only falls behind until the ring
forgets what it has not sent, and then it is dropped. Its cursor moves only when a send completes:
a send that hangs leaves its frames counted as unsent, so a stuck reader is dropped as soon as the
ring overwrites the first of them, and a slow reader gets every frame or is dropped, never a gap.
A page that reconnects with ``Last-Event-ID: N`` gets the events after N; an id the ring does
not hold starts from the oldest kept event, which an SSE comment line says. Each stream then opens
with one ``hello`` event that has no ``id:`` (so a reconnect's Last-Event-ID is untouched):
``server`` names this process (random per start: a page that sees it change knows the server
restarted and its step numbers began again), ``oldest`` and ``newest`` the ids the ring keeps. With
no subscriber, ``active`` is False and the worker builds no event at all.

An event about one request carries its owner (the label of the key that sent it) and, when it holds
text, a redacted copy: each subscriber is sent what its viewer may see (``privacy.frame_for``: the
event, its redacted copy, or nothing), its cursor moving past what it is not sent.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from starlette.responses import Response

from .privacy import EVERYTHING, Viewer, frame_for, redacted

KEEPALIVE_S = 15.0  # a comment line this often keeps proxies from closing an idle stream
FINAL_SEND_S = 1.0  # how long a dropped subscriber's goodbye may wait for its socket


class TooManySubscribers(Exception):
    """``max_subscribers`` pages are already connected (the HTTP layer answers 503)."""


@dataclass(eq=False, kw_only=True)
class Subscriber:
    """One connected stream: ``cursor`` is the id of the last event whose send completed (or that was
    passed over: ``viewer`` says which events it may see, ``privacy.py``)."""

    number: int
    peer: str
    cursor: int
    viewer: Viewer = EVERYTHING
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    gone: asyncio.Event = field(default_factory=asyncio.Event)
    dropped: str | None = None  # why the bus dropped it


class EventBus:
    """A ring of the newest ``capacity`` events and the subscribers reading it.

    Args:
        capacity: events kept (>= 1); older ones are forgotten.
        max_subscribers: streams open at once (>= 1); one more gets TooManySubscribers.
        log: called with one line of text when a subscriber is dropped (default: logging).
    """

    def __init__(self, capacity: int = 4096, max_subscribers: int = 32, log=None):
        self.capacity, self.max_subscribers = capacity, max_subscribers
        self.log = log or logging.getLogger("minillm.serve.events").warning
        self.t0 = time.perf_counter()  # events' "t": seconds since the bus was made
        self.server = secrets.token_hex(4)  # this process's name on its streams (hello): new at each start
        # (id, SSE frame, owner's key label or None, the redacted frame or None when it holds no text)
        self._ring: deque[tuple[int, bytes, str | None, bytes | None]] = deque(maxlen=capacity)
        self._next_id = 1
        self._lock = threading.Lock()
        self._subs: set[Subscriber] = set()
        self._numbers = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake_pending = False

    @property
    def active(self) -> bool:
        """True while someone subscribes: the only check the worker makes before building events."""
        return bool(self._subs)

    @property
    def subscribers(self) -> int:
        return len(self._subs)

    def now(self) -> float:
        """Seconds since the bus was made (the events' clock)."""
        return time.perf_counter() - self.t0

    def publish(self, kind: str, data: dict, owner: str | None = None) -> int:
        """Append one event ``{"type": kind, "t": seconds, **data}``; return its id. Never blocks
        on a subscriber (any thread). ``data`` must be JSON-serialisable; ``owner``: the label of the
        key whose request it is about (None: nobody's, or a server without keys)."""
        head = {"type": kind, "t": round(self.now(), 6)}
        shapes = redacted(kind, data) if owner is not None else None
        body, shapes_body = (
            json.dumps({**head, **d}, separators=(",", ":")) if d is not None else None for d in (data, shapes)
        )
        with self._lock:
            eid = self._next_id
            self._next_id += 1
            frame = f"id: {eid}\ndata: {body}\n\n".encode()
            shapes_frame = f"id: {eid}\ndata: {shapes_body}\n\n".encode() if shapes_body else None
            self._ring.append((eid, frame, owner, shapes_frame))
        loop = self._loop
        if loop is not None and not self._wake_pending:
            self._wake_pending = True
            try:
                loop.call_soon_threadsafe(self._wake)
            except RuntimeError:  # the loop closed (shutdown): nobody is left to wake
                self._wake_pending = False
        return eid

    def _span(self) -> tuple[int, int]:
        """(oldest kept id, newest id); (next id, next id - 1) when the ring is empty."""
        with self._lock:
            if not self._ring:
                return self._next_id, self._next_id - 1
            return self._ring[0][0], self._ring[-1][0]

    def _wake(self) -> None:
        """On the loop: drop subscribers the ring has left behind, wake the others."""
        self._wake_pending = False
        for sub in list(self._subs):
            if self.behind(sub):
                self.drop(sub, self._behind_reason(sub))
            else:
                sub.wake.set()

    def behind(self, sub: Subscriber) -> bool:
        """True when an event the subscriber has not been sent (a send still under way counts as not
        sent) has left the ring."""
        return sub.cursor + 1 < self._span()[0]

    def _behind_reason(self, sub: Subscriber) -> str:
        missed = self._span()[0] - sub.cursor - 1
        return f"it fell behind: {missed} events it had not been sent left the ring of {self.capacity}"

    def drop(self, sub: Subscriber, reason: str) -> None:
        """Disconnect a subscriber and log why (on the loop)."""
        if sub in self._subs:
            self._subs.discard(sub)
            sub.dropped = reason
            self.log(
                f"events: dropped subscriber #{sub.number} ({sub.peer}): {reason}; it may reconnect with "
                f"Last-Event-ID {sub.cursor}"
            )
            sub.gone.set()

    def subscribe(self, last_event_id: str | None, peer: str, viewer: Viewer = EVERYTHING) -> tuple[Subscriber, str]:
        """A new subscriber (on the loop) that sees what ``viewer`` may, and the SSE comment that opens its stream.

        Raises:
            TooManySubscribers: ``max_subscribers`` are already connected.
        """
        if len(self._subs) >= self.max_subscribers:
            raise TooManySubscribers(
                f"{len(self._subs)} event streams are open, the most this server allows (--max-event-subscribers)"
            )
        self._loop = asyncio.get_running_loop()
        oldest, newest = self._span()
        start, note = self._start(last_event_id, oldest, newest)
        sub = Subscriber(number=next(self._numbers), peer=peer, cursor=start - 1, viewer=viewer)
        self._subs.add(sub)
        return sub, f": {note}\n\n"

    @staticmethod
    def _start(last_event_id: str | None, oldest: int, newest: int) -> tuple[int, str]:
        """The first id to send, and a sentence saying why."""
        kept = f"the ring keeps ids {oldest}..{newest}" if newest >= oldest else "the ring is empty"
        if last_event_id is None:
            return oldest, f"minillm events: starting from the oldest kept event ({kept})"
        value = last_event_id.strip()
        if value.isdigit() and oldest - 1 <= int(value) <= newest:
            return int(value) + 1, f"minillm events: resuming after Last-Event-ID {value}"
        return oldest, (
            f"minillm events: Last-Event-ID {value!r} is not in the ring ({kept}); starting from the oldest kept event"
        )

    def unsubscribe(self, sub: Subscriber) -> None:
        self._subs.discard(sub)

    def take(self, sub: Subscriber, limit: int = 256) -> list[bytes]:
        """The frames after the subscriber's cursor that its viewer may see, of the next ``limit``
        events, counted as sent at once (the cursor moves past all of them)."""
        last, frames = self.pending(sub, limit)
        sub.cursor = max(sub.cursor, last)
        return frames

    def pending(self, sub: Subscriber, limit: int = 256) -> tuple[int, list[bytes]]:
        """(id of the last of the next ``limit`` events after the cursor, the frames of them its viewer
        may see); the cursor stays until the send completes (``stream``), so while a send hangs the
        wake-up's drop check still counts those events as unsent. (cursor, []) when nothing is after
        the cursor, or when the event after it already left the ring (the wake-up drops it)."""
        with self._lock:
            if not self._ring:
                return sub.cursor, []
            first = sub.cursor + 1 - self._ring[0][0]
            if first < 0 or first >= len(self._ring):
                return sub.cursor, []
            entries = list(itertools.islice(self._ring, first, first + limit))
        frames = (frame_for(sub.viewer, owner, frame, shapes) for _, frame, owner, shapes in entries)
        return entries[-1][0], [f for f in frames if f is not None]

    async def stream(self, sub: Subscriber, opening: str, send) -> None:
        """Send the subscriber its events until it leaves or is dropped (an ASGI ``send``)."""
        await send({"type": "http.response.body", "body": (opening + self.hello()).encode(), "more_body": True})
        while sub.dropped is None:
            last, frames = self.pending(sub)
            if frames:
                await send({"type": "http.response.body", "body": b"".join(frames), "more_body": True})
            if last > sub.cursor:  # sent (or passed over: events its viewer may not see)
                sub.cursor = last
                continue
            if self.behind(sub):  # the event after its cursor left the ring before the wake-up ran
                self.drop(sub, self._behind_reason(sub))
                return
            sub.wake.clear()
            if self.take_ready(sub):  # published meanwhile
                continue
            try:
                await asyncio.wait_for(sub.wake.wait(), KEEPALIVE_S)
            except TimeoutError:
                await send({"type": "http.response.body", "body": b": keep-alive\n\n", "more_body": True})

    def hello(self) -> str:
        """The SSE frame each stream opens with: no ``id:`` line, ``data:`` ``{"type": "hello",
        "t", "server", "oldest", "newest"}`` (the ids the ring keeps now)."""
        oldest, newest = self._span()
        body = {"type": "hello", "t": round(self.now(), 6), "server": self.server, "oldest": oldest, "newest": newest}
        return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

    def take_ready(self, sub: Subscriber) -> bool:
        """True when an event after the cursor is already in the ring (published meanwhile)."""
        _, newest = self._span()
        return sub.cursor < newest


class EventStreamResponse(Response):
    """The ASGI response of ``GET /v1/events``: SSE headers, then :meth:`EventBus.stream` until
    the client disconnects or the bus drops it."""

    def __init__(self, bus: EventBus, sub: Subscriber, opening: str):
        super().__init__(media_type="text/event-stream")
        self.bus, self.sub, self.opening = bus, sub, opening

    async def __call__(self, scope, receive, send) -> None:
        headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        pump = asyncio.create_task(self.bus.stream(self.sub, self.opening, send))
        left = asyncio.create_task(_disconnected(receive))
        gone = asyncio.create_task(self.sub.gone.wait())
        try:
            await asyncio.wait({pump, left, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump, left, gone):
                task.cancel()
            self.bus.unsubscribe(self.sub)
        if left.done() and not left.cancelled():
            return  # the client went away: nothing more to send
        goodbye = f": dropped: {self.sub.dropped}\n\n".encode() if self.sub.dropped else b""
        try:  # a stuck client's socket may never take it; then the server closes the connection
            await asyncio.wait_for(
                send({"type": "http.response.body", "body": goodbye, "more_body": False}), FINAL_SEND_S
            )
        except Exception:  # noqa: BLE001 - timed out, or the socket is already closed: nothing to tell
            pass


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
