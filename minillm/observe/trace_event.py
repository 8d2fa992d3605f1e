"""One trace event as plain data: a phase, when it started, how long it took, and what it carried.

``events.Tracer`` makes them, ``render.Renderer`` prints them, JSON lines carry them between processes.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class TraceEvent:
    """One phase: ``start`` is seconds since the tracer was made, ``duration`` seconds."""

    phase: str
    start: float
    duration: float
    data: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        """One JSON line; NumPy values and enums become plain JSON values."""
        return json.dumps(asdict(self), default=_jsonable)

    @classmethod
    def from_json(cls, line: str) -> TraceEvent:
        return cls(**json.loads(line))


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "value"):  # enums such as StopReason
        return value.value
    return str(value)
