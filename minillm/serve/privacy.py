"""What one caller sees of another's requests, and what the server's console prints of a request.

Who sees what on ``GET /v1/events``, ``GET /v1/traces/{id}`` and the live page that reads them:

    caller                       its own requests    other keys' requests                 steps, pool, load
    no keys (an open server)     -                   whole                                 whole
    an inference key             whole               nothing (their traces: 404)           whole
    an observer key              -                   token counts and shapes; whole only   whole
                                                     with ``--show-prompts``

"Token counts and shapes": an event keeps its ids, counts, positions, probabilities and blocks,
and its text fields (:data:`PRIVATE_FIELDS`) become null with ``"redacted": true``; a trace keeps
its phases, times and numbers (:func:`shapes_only`), not a token id nor a piece of text. The step
and pool events name requests and their blocks, never their text.

The console (the server's log) prints a request's text only with ``--log-prompts``; otherwise each
request's trace shows only the phases without text (:func:`request_tracer`). Keys never appear in
either: requests are named by their key's label (``auth.label``).
"""

from __future__ import annotations

from dataclasses import dataclass

import minillm

#: The fields of the live events that hold a request's text (its prompt, its tokens, its answer).
PRIVATE_FIELDS = {
    "request.admitted": ("prompt",),
    "request.token": ("token_id", "piece", "text", "top"),
    "request.text": ("text",),
    "request.finished": ("text",),
}
#: Numbers in a trace that are token ids (a token id is text: the tokenizer turns it back).
TOKEN_ID_FIELDS = frozenset({"token", "input_token", "ids", "token_id", "special_ids", "forced", "allowed_ids"})
#: Strings in a trace that describe the machine or the run, never the request's text.
SAFE_STRINGS = frozenset({"reason", "kv_dtype", "cache", "dominant", "phase", "model"})


@dataclass(frozen=True)
class Viewer:
    """What a subscriber or a trace reader may see: ``key`` is its own key's label (None: it has no
    requests of its own); ``others`` is how it sees other keys' requests: ``whole``, ``shapes`` or ``none``."""

    key: str | None
    others: str


EVERYTHING = Viewer(None, "whole")


def viewer_for(scope: str, key: str | None, show_prompts: bool) -> Viewer:
    """The :class:`Viewer` of a caller: its ``scope`` (``open``, ``inference``, ``observer``), its key's
    label, and whether the server shows other keys' text to observers (``--show-prompts``)."""
    if scope == "inference":
        return Viewer(key, "none")
    if scope == "observer":
        return Viewer(None, "whole" if show_prompts else "shapes")
    return EVERYTHING


def redacted(kind: str, data: dict) -> dict | None:
    """An event's data with its text fields null and ``"redacted": true``; None when it has no text."""
    fields = PRIVATE_FIELDS.get(kind)
    if not fields:
        return None
    return {**data, **dict.fromkeys(fields), "redacted": True}


def frame_for(viewer: Viewer, owner: str | None, frame: bytes, shapes: bytes | None) -> bytes | None:
    """The frame of an event owned by ``owner`` (a key's label; None: nobody's) that ``viewer`` gets:
    the whole ``frame``, its ``shapes`` (the redacted frame; None: it has no text), or None (not sent)."""
    if owner is None or viewer.others == "whole" or owner == viewer.key:
        return frame
    if viewer.others == "shapes":
        return frame if shapes is None else shapes
    return None


def trace_for(record: dict | None, viewer: Viewer) -> dict | None:
    """The trace record ``viewer`` may read: whole, its shapes (``"redacted": true``), or None (a 404)."""
    if record is None:
        return None
    owner = record.get("key")
    if owner is None or viewer.others == "whole" or owner == viewer.key:
        return record
    if viewer.others == "none":
        return None
    events = [{**e, "data": shapes_only(e.get("data") or {})} for e in record["events"]]
    return {**record, "events": events, "redacted": True}


def shapes_only(value, name: str | None = None):
    """``value`` with every string (but :data:`SAFE_STRINGS`) and every token id dropped, recursively:
    what is left are counts, positions, times, probabilities and bytes."""
    if isinstance(value, dict):
        kept = {k: shapes_only(v, k) for k, v in value.items() if k not in TOKEN_ID_FIELDS}
        return {k: v for k, v in kept.items() if v is not _DROPPED}
    if isinstance(value, list):
        return value if all(isinstance(v, int | float) for v in value) else _DROPPED
    if isinstance(value, str):
        return value if name in SAFE_STRINGS else _DROPPED
    return value


_DROPPED = object()


def request_tracer(console, verbosity: str, log_prompts: bool) -> minillm.Tracer:
    """The tracer of one request of the server: printed on ``console`` at ``verbosity`` (nothing when
    ``quiet``), its text (prompt, tokens, answer) only when ``log_prompts``; every event kept for its trace."""
    console = console if verbosity != "quiet" else None
    return minillm.Tracer(console, verbosity=verbosity, live=False, hide_text=not log_prompts)
