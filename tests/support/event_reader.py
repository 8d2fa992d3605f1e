"""A subscriber of a server's ``GET /v1/events`` on its own thread, as a client reads it (httpx)."""

from __future__ import annotations

import json
import threading
import time

import httpx


class Reader:
    """A subscriber on its own thread: every event (with its id) and comment it receives.

    ``headers``: sent with the request (a key: ``Authorization: Bearer ...``); ``verify``: httpx's
    (an ``ssl.SSLContext`` trusting a test's own certificate, for an HTTPS server).
    """

    def __init__(self, url: str, last_id: str | None = None, headers: dict | None = None, verify=True):
        self.events, self.comments, self.hellos, self.stop = [], [], [], threading.Event()
        self.status: int | None = None  # the stream's HTTP status, once answered
        headers = {**(headers or {}), **({"Last-Event-ID": last_id} if last_id is not None else {})}
        self.thread = threading.Thread(target=self._read, args=(url, headers, verify), daemon=True)
        self.thread.start()

    def _read(self, url, headers, verify):
        try:
            self._lines(url, headers, verify)
        except httpx.HTTPError:  # the server stopped at the end of the module
            pass

    def _lines(self, url, headers, verify):
        with httpx.stream("GET", url + "/v1/events", headers=headers, timeout=None, verify=verify) as r:
            self.status = r.status_code
            eid = None
            for line in r.iter_lines():
                if line.startswith(":"):
                    self.comments.append(line)
                elif line.startswith("id: "):
                    eid = int(line[4:])
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if event["type"] == "hello":  # each stream's first, without an id: which server this is
                        self.hellos.append(event)
                    else:
                        self.events.append((eid, event))
                if self.stop.is_set():
                    return

    def wait(self, done, timeout=300.0):
        deadline = time.monotonic() + timeout
        while not done(self.events):
            assert time.monotonic() < deadline, f"timed out; last events {self.events[-3:]}"
            time.sleep(0.02)

    def of(self, request_id: str) -> list[dict]:
        """The events about one request (``request.*`` with its id), in order."""
        return [e for _, e in self.events if e["type"].startswith("request.") and e.get("id") == request_id]
