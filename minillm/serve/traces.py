"""The finished requests' traces a worker keeps for GET /v1/traces/{id}: the newest N, as JSON data.

The worker thread writes a record when a request ends (answered, refused, failed or cancelled
while queued); the event loop reads one by id. A lock keeps the two apart.
"""

from __future__ import annotations

import json
import math
import threading
from collections import OrderedDict
from collections.abc import Callable


class TraceStore:
    """The newest ``keep`` finished requests' trace records, by request id.

    Args:
        keep: how many records to keep (the oldest is dropped first).
        on_record: called with every new record (the live feed's ``request.finished``).
    """

    def __init__(self, keep: int, on_record: Callable[[dict], None]):
        self.keep, self.on_record = keep, on_record
        self.records: OrderedDict[str, dict] = OrderedDict()
        self._lock = threading.Lock()  # written by the worker thread, read by the event loop

    def remember(self, job, reason, wait: float, events: list, note: str | None = None) -> None:
        """Keep ``job``'s trace: its stop reason (None: an error), queue wait (s), events and a note."""
        record = {
            "id": job.request_id,
            "stop_reason": reason.value if reason is not None else "error",
            "queue_wait_s": wait,
            "note": note,
            "slow_motion_s": job.slow_motion_s,  # seconds it sat out after each step (not in the metrics)
            "key": job.owner,  # the label of the key that sent it (who may read this record: privacy.py)
            "events": [_event_dict(e) for e in events],
        }
        with self._lock:
            self.records[job.request_id] = record
            while len(self.records) > self.keep:
                self.records.popitem(last=False)
        self.on_record(record)

    def get(self, request_id: str) -> dict | None:
        """The stored record of a finished request, or None (unknown or already dropped)."""
        with self._lock:
            return self.records.get(request_id)


def _event_dict(event) -> dict:
    """A TraceEvent as plain JSON data; NaN (e.g. TPOT of a one-token request) becomes None,
    because strict JSON, which HTTP responses use, has no NaN."""
    return _finite(json.loads(event.to_json()))


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
