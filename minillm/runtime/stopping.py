"""Stop conditions: every way a request can end, named, so the trace can say which one fired.

Two kinds of condition:

- **checked per token** (:class:`StopCriteria`): the EOS set, the token budget, the context
  window; and, *between* steps, cancellation and the wall-clock deadline.
- **found in the output** (:class:`StopStringMatcher`, :class:`StopSequenceMatcher`): a stop
  string in the *text* (it may span several tokens) or a run of token ids. While streaming, a
  tail that could still become a match is held back, so a stop string never leaks::

      pieces   "AB"  "C"  "DEF"  "G"  "HI"  "J"        stop "DEFGHIJ"
      shown    "AB"  "C"   ""     ""   ""   ""  -> stop   (held "DEF".."DEFGHI", then cut)

``OutputStream`` chains them for one request (``request.Request`` holds one): generated ids -> stop-sequence hold ->
incremental detokenizer -> stop-string hold -> the deltas a user sees.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from minillm.errors import InvalidRequestError


class StopReason(enum.StrEnum):
    """Why generation ended. The value is the phrase the trace prints."""

    EOS = "eos"  # the model emitted an end-of-sequence id (any of the EOS set)
    MAX_NEW_TOKENS = "max new tokens"  # the request's token budget is spent
    STOP_STRING = "stop string"  # a caller's stop string appeared in the text
    STOP_SEQUENCE = "stop-token sequence"  # a caller's id sequence appeared
    CANCELLED = "cancelled"  # the caller (or Ctrl-C) asked to stop
    TIMEOUT = "timed out"  # the wall-clock deadline passed
    CONTEXT_FULL = "context full"  # no room left in the KV cache / context window


def cancel_check(cancel) -> Callable[[], bool] | None:
    """Normalise ``cancel``: None, a ``threading.Event`` (its ``is_set``) or a callable -> a callable.

    Raises:
        InvalidRequestError: anything else.
    """
    if cancel is None:
        return None
    if isinstance(cancel, threading.Event) or hasattr(cancel, "is_set"):
        return cancel.is_set
    if callable(cancel):
        return cancel
    raise InvalidRequestError(
        f"cancel must be a threading.Event or a callable returning True to stop, got {type(cancel).__name__}."
    )


@dataclass
class StopCriteria:
    """The conditions checked for every request.

    Attributes:
        eos_token_ids: the EOS *set* (tokenizer eos, generation_config and config ids, unioned).
        max_new_tokens: budget of generated tokens (>= 1).
        deadline: a ``clock()`` value (seconds) after which the request times out, or None.
        cancel: a callable (e.g. ``threading.Event().is_set``) that returns True to cancel.
        clock: where the time comes from (``time.perf_counter``; tests pass a fake one).
    """

    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    max_new_tokens: int = 64
    deadline: float | None = None
    cancel: Callable[[], bool] | None = None
    clock: Callable[[], float] = time.perf_counter

    def check(self, token_id: int, n_generated: int, room_left: int) -> StopReason | None:
        """The reason to stop after ``token_id`` (the ``n_generated``-th new token), or None.

        ``room_left`` is how many positions the context still has once ``token_id`` is part of
        the sequence; at 0, prompt + new tokens fill the context and generation must end.
        Precedence: EOS, then the budget, then the context.
        """
        if token_id in self.eos_token_ids:
            return StopReason.EOS
        if n_generated >= self.max_new_tokens:
            return StopReason.MAX_NEW_TOKENS
        if room_left <= 0:
            return StopReason.CONTEXT_FULL
        return None

    def interrupted(self) -> StopReason | None:
        """Cancellation or timeout. Checked *between* steps: before prefill and before each
        decode step, so a stop costs no further forward pass."""
        if self.cancel is not None and self.cancel():
            return StopReason.CANCELLED
        if self.deadline is not None and self.clock() >= self.deadline:
            return StopReason.TIMEOUT
        return None


def held_back(buf: Sequence, patterns: Sequence[Sequence]) -> int:
    """How much of ``buf``'s end to hold back: the longest suffix that is a proper prefix of a pattern.

    Works on text (``str`` buffer, stop strings) and on ids (``tuple`` buffer, stop sequences):
    ``held_back("xxDE", ["DEFG"]) == 2``, ``held_back((5, 28), [(28, 29)]) == 1``. Returns 0..len(buf).
    """
    longest = max((len(p) for p in patterns), default=1)
    for k in range(min(len(buf), longest - 1), 0, -1):
        tail = buf[-k:]
        if any(p[:k] == tail for p in patterns):
            return k
    return 0


# --- stop strings (in the text) ----------------------------------------------------------------
def validate_stop_strings(stop) -> list[str]:
    """``None``, one string or a list of strings -> a list. Raises InvalidRequestError for an
    empty string (it would match everywhere) or a non-string."""
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    for s in stops:
        if not isinstance(s, str):
            raise InvalidRequestError(f"stop strings must be str, got {s!r}; use stop_token_ids for ids.")
        if not s:
            raise InvalidRequestError("a stop string is empty (it would match before any text); remove it.")
    return stops


class StopStringMatcher:
    """Find stop strings in streamed text, holding back any tail that could still begin one.

    ``push(piece)`` returns the text that is now safe to show; ``flush()`` returns what is held
    at the end of the stream. The released text is the same however the text is split into
    pieces. On a match the text is cut *before* the stop string (or after it, with
    ``include_stop_string=True``) and the matcher is done: later pushes return "".

    "Earliest match" means the first stop string to be complete reading left to right (smallest
    end; of two ending at the same character, the one starting first): exactly what a stream
    would find first.

    Raises:
        InvalidRequestError: an empty stop string.
    """

    def __init__(self, stop_strings: Iterable[str] | str | None, *, include_stop_string: bool = False):
        self.stop_strings = validate_stop_strings(stop_strings)
        self.include_stop_string = include_stop_string
        self._held = ""  # a tail that could still begin a stop string
        self.text = ""  # everything released so far
        self.matched: str | None = None  # the stop string that fired
        self.match_start: int | None = None  # its position in the whole text, characters

    @property
    def held(self) -> str:
        """Text held back right now (it may yet begin a stop string)."""
        return self._held

    def _first_match(self, buf: str) -> tuple[int, str] | None:
        best = None
        for s in self.stop_strings:
            i = buf.find(s)  # first occurrence: smallest start, so smallest end for this s
            if i >= 0 and (best is None or (i + len(s), i) < (best[0] + len(best[1]), best[0])):
                best = (i, s)
        return best

    def _release(self, text: str) -> str:
        self.text += text
        return text

    def push(self, piece: str) -> str:
        """Add streamed text; return the part that can no longer be (or begin) a stop string."""
        if self.matched is not None:
            return ""
        buf = self._held + piece
        hit = self._first_match(buf)
        if hit is not None:
            start, s = hit
            self.matched, self.match_start, self._held = s, len(self.text) + start, ""
            return self._release(buf[: start + len(s)] if self.include_stop_string else buf[:start])
        keep = held_back(buf, self.stop_strings)
        self._held = buf[len(buf) - keep :]
        return self._release(buf[: len(buf) - keep])

    def flush(self) -> str:
        """End of stream (max tokens, EOS, ...): release whatever is held."""
        held, self._held = self._held, ""
        return self._release(held)


# --- stop-token sequences (in the ids) ---------------------------------------------------------
def validate_stop_token_ids(seqs) -> list[tuple[int, ...]]:
    """``None`` or a list of id lists -> a list of tuples. A flat list of ints is read as one
    sequence per id. Raises InvalidRequestError for an empty sequence or a negative id."""
    if seqs is None:
        return []
    out = []
    for seq in seqs:
        seq = (seq,) if isinstance(seq, int) else tuple(seq)
        if not seq:
            raise InvalidRequestError("a stop-token sequence is empty; give at least one id or remove it.")
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in seq):
            raise InvalidRequestError(f"stop-token ids must be integers >= 0, got {list(seq)}.")
        out.append(seq)
    return out


class StopSequenceMatcher:
    """Find runs of generated token ids, holding back ids that could still begin one.

    ``push(id)`` returns the ids now safe to detokenize; ``flush()`` the held ones. Only the
    *generated* ids are searched, not the prompt. Of two sequences completed by the same id,
    the longer one fires.
    """

    def __init__(self, sequences: Sequence[Sequence[int]], *, include: bool = False):
        self.sequences = validate_stop_token_ids(sequences)
        self.include = include
        self._held: list[int] = []
        self.matched: tuple[int, ...] | None = None

    def push(self, token_id: int) -> list[int]:
        """Add one generated id; return the ids (in order) that can no longer be part of a match."""
        if self.matched is not None:
            return []
        if not self.sequences:
            return [int(token_id)]
        buf = self._held + [int(token_id)]
        hits = [s for s in self.sequences if len(s) <= len(buf) and tuple(buf[-len(s) :]) == s]
        if hits:
            self.matched = max(hits, key=len)
            self._held = []
            return buf if self.include else buf[: len(buf) - len(self.matched)]
        keep = held_back(tuple(buf), self.sequences)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def flush(self) -> list[int]:
        """End of stream: release the held ids."""
        held, self._held = self._held, []
        return held


class OutputStream:
    """Generated ids in, text a user may see out, for one request.

        id -> StopSequenceMatcher (hold) -> IncrementalDetokenizer -> StopStringMatcher (hold) -> delta

    Args:
        detokenizer: an :class:`~minillm.text.detokenize.IncrementalDetokenizer` (``add(id) -> str``,
            ``flush() -> str``).
        stop: stop strings; ``stop_token_ids``: id sequences.
        include_stop_string: show the matched stop string (or the stop sequence's text).

    After :meth:`add` or :meth:`finish`, ``stop_reason`` is ``STOP_STRING`` / ``STOP_SEQUENCE``
    once one fired, and ``condition`` names it (the string, or the id list).
    """

    def __init__(self, detokenizer, *, stop: Iterable[str] = (), stop_token_ids=(), include_stop_string: bool = False):
        self.detokenizer = detokenizer
        self.strings = StopStringMatcher(stop, include_stop_string=include_stop_string)
        self.sequences = StopSequenceMatcher(stop_token_ids or [], include=include_stop_string)
        self.stop_reason: StopReason | None = None
        self.condition: str | list[int] | None = None

    @property
    def text(self) -> str:
        """Everything released so far."""
        return self.strings.text

    def _to_text(self, ids: list[int], final: bool = False) -> str:
        pieces = "".join(self.detokenizer.add(i) for i in ids)
        if final:
            pieces += self.detokenizer.flush()
        delta = self.strings.push(pieces)
        if self.strings.matched is not None and self.stop_reason is None:
            self.stop_reason, self.condition = StopReason.STOP_STRING, self.strings.matched
        return delta

    def add(self, token_id: int) -> str:
        """Feed one generated id (not an EOS); return the text delta it releases (often "")."""
        if self.stop_reason is not None:
            return ""
        delta = self._to_text(self.sequences.push(token_id))
        if self.sequences.matched is not None and self.stop_reason is None:
            self.stop_reason, self.condition = StopReason.STOP_SEQUENCE, list(self.sequences.matched)
            delta += self._to_text([], final=True)
        return delta

    def finish(self) -> str:
        """End of the request: release held ids and text (a held stop-string prefix included)."""
        delta = self._to_text(self.sequences.flush(), final=True) if self.stop_reason is None else ""
        return delta + (self.strings.flush() if self.strings.matched is None else "")
