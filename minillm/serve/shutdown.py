"""Graceful shutdown: the first SIGTERM or SIGINT drains, a second one exits at once.

    signal 1  -> new requests get 503 + Retry-After, GET /health 503 "draining"; the socket stays open
              -> the requests in flight run to their end, for up to --shutdown-timeout seconds
              -> past it, the rest are cancelled (finish_reason "abort", the reason in their trace)
              -> the console lists every drained request and how it ended; uvicorn stops; exit 0
    signal 2  -> uvicorn stops now, cutting open streams; exit 1

uvicorn's own handling would close the listening socket at the first signal (a new client then
meets a refused connection, not a 503) and cut streams after its graceful timeout; this server
class keeps uvicorn and changes only what a signal does.
"""

from __future__ import annotations

import signal
import threading
import time

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

#: bytes the event loop holds for one connection before a stream's writes wait for the client
#: (asyncio's default is 64 KiB); the stream's chunks then wait in its channel (--stream-buffer)
WRITE_BUFFER_HIGH = 16384


class SmallBufferH11(H11Protocol):
    """uvicorn's h11 protocol with a smaller transport write buffer (:data:`WRITE_BUFFER_HIGH`), so a
    client that stops reading is noticed after a few hundred chunks, not after thousands."""

    def connection_made(self, transport) -> None:
        transport.set_write_buffer_limits(high=WRITE_BUFFER_HIGH)
        super().connection_made(transport)


class DrainingServer(uvicorn.Server):
    """A ``uvicorn.Server`` whose first signal drains the worker before uvicorn shuts down.

    Args:
        config: the uvicorn config.
        guard: the worker's :class:`~minillm.serve.reliability.Guard` (its draining flag, in-flight
            requests, and the reason that cancels the rest).
        shutdown_timeout: seconds the requests in flight may still run after the first signal.
        console: a rich console for what the drain did.
    """

    def __init__(self, config: uvicorn.Config, guard, shutdown_timeout: float, console):
        super().__init__(config)
        self.guard, self.shutdown_timeout, self.console = guard, shutdown_timeout, console
        self.forced = False

    def handle_exit(self, sig: int, frame) -> None:
        name = signal.Signals(sig).name
        if self.guard.draining:  # the second signal: no more waiting
            self.forced = True
            self.force_exit = self.should_exit = True
            self.console.print(f"minillm serve: {name} again: exiting now, {len(self.guard.in_flight)} requests cut")
            return
        self.guard.draining = True
        n = len(self.guard.in_flight)
        self.console.print(
            f"minillm serve: {name}: draining {n} request{'s' * (n != 1)} in flight (new ones get 503; "
            f"--shutdown-timeout {self.shutdown_timeout:g} s; {name} again exits at once)"
        )
        threading.Thread(target=self._drain, name="minillm-drain", daemon=True).start()

    def _drain(self) -> None:
        guard = self.guard
        deadline = time.monotonic() + self.shutdown_timeout
        while guard.in_flight and time.monotonic() < deadline and not self.forced:
            time.sleep(0.02)
        if guard.in_flight and not self.forced:
            guard.stop_reason = f"server shutting down: --shutdown-timeout {self.shutdown_timeout:g} s passed"
            end = time.monotonic() + 10.0  # a cancel takes effect between two steps
            while guard.in_flight and time.monotonic() < end and not self.forced:
                time.sleep(0.02)
        if self.forced:
            return
        for request_id, _, how in guard.drained:
            self.console.print(f"  drained {request_id}: {how}")
        finished = sum(label == "finished" for _, label, _ in guard.drained)
        self.console.print(
            f"minillm serve: drained {len(guard.drained)} requests ({finished} finished, "
            f"{len(guard.drained) - finished} cancelled or failed); exiting"
        )
        self.should_exit = True
