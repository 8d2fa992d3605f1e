"""Stop conditions: every way a request can end, named, so the trace can say which one fired."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


class StopReason(str, enum.Enum):
    """Why generation ended. The value is the phrase the trace prints."""

    EOS = "eos"  # the model emitted an end-of-sequence id (any of the EOS set)
    MAX_NEW_TOKENS = "max new tokens"  # the request's token budget is spent
    STOP_STRING = "stop string"  # a caller's stop string appeared in the text
    STOP_SEQUENCE = "stop-token sequence"  # a caller's id sequence appeared
    CANCELLED = "cancelled"  # the caller (or Ctrl-C) asked to stop
    TIMEOUT = "timed out"  # the wall-clock deadline passed
    CONTEXT_FULL = "context full"  # no room left in the KV cache / context window


@dataclass
class StopCriteria:
    """The conditions checked after each new token.

    Attributes:
        eos_token_ids: the EOS *set* (tokenizer eos, generation_config and config ids).
        max_new_tokens: budget of generated tokens (>= 1).
        deadline: ``time.perf_counter()`` value after which the request times out, or None.
        cancel: a callable (e.g. ``threading.Event().is_set``) that returns True to cancel.
    """

    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    max_new_tokens: int = 64
    deadline: float | None = None
    cancel: object = None

    def check(self, token_id: int, n_generated: int, room_left: int) -> StopReason | None:
        """The reason to stop after ``token_id`` (the ``n_generated``-th new token), or None.

        ``room_left`` is how many positions the context still has once ``token_id`` is part of
        the sequence; at 0, prompt + new tokens fill the context and generation must end.
        """
        if token_id in self.eos_token_ids:
            return StopReason.EOS
        if n_generated >= self.max_new_tokens:
            return StopReason.MAX_NEW_TOKENS
        if room_left <= 0:
            return StopReason.CONTEXT_FULL
        return self.interrupted()

    def interrupted(self) -> StopReason | None:
        """Cancellation or timeout, checked between steps."""
        if self.cancel is not None and self.cancel():
            return StopReason.CANCELLED
        if self.deadline is not None and time.perf_counter() >= self.deadline:
            return StopReason.TIMEOUT
        return None
