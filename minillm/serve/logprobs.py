"""Logprobs in OpenAI's shapes, from the sampler's own numbers and the tokens' own bytes.

Each step of a request that asks for logprobs is recorded as the sampler saw it: the id it chose,
that id's probability and the most likely ids, in the distribution ``sample`` draws from (after
temperature, top-k, top-p, min-p and the repetition penalty; at temperature 0, the distribution
at temperature 1). A token's ``bytes`` are its own (``Tokenizer.token_bytes``): joined, they give
the answer's UTF-8 even where one character is split over several tokens (emoji, CJK). Its
``token`` is that text when the bytes are whole characters, else the bytes that are not written
as ``\\xNN`` escapes (``b'\\xf0\\x9f'`` -> the 8 characters ``\\xf0\\x9f``), as OpenAI does.
"""

from __future__ import annotations

import math

from minillm.runtime.sampling import top_candidates

from .protocol import MAX_TOP_LOGPROBS

# OpenAI's stand-in for "too unlikely to list".
UNKNOWN_LOGPROB = -9999.0


class LogprobRecorder:
    """A listener that keeps, for every sampled token, ``(id, probability, [(id, probability), ...])``
    (the top ``MAX_TOP_LOGPROBS``, most likely first, ties by lower id) in ``steps``."""

    def __init__(self):
        self.steps: list[tuple[int, float, list[tuple[int, float]]]] = []

    def on_event(self, phase: str, start: float, duration: float, model, facts: dict) -> None:
        """Record the prefill's and each decode step's token; other phases are ignored."""
        probs = facts.get("probs") if phase in ("prefill", "decode") else None
        if probs is not None:
            token = int(facts["token"])
            self.steps.append((token, float(probs[token]), top_candidates(probs, MAX_TOP_LOGPROBS)))


class Listeners:
    """Tells every listener of ``listeners`` each event, in order."""

    def __init__(self, *listeners):
        self.listeners = listeners

    def on_event(self, *args) -> None:
        for listener in self.listeners:
            listener.on_event(*args)


def token_text(raw: bytes) -> str:
    """OpenAI's ``token`` for a token's bytes: its text, with bytes that are part of a character
    written as ``\\xNN`` (always valid UTF-8)."""
    return raw.decode("utf-8", errors="backslashreplace")


def logprob(prob: float | None) -> float:
    """``log(prob)``; UNKNOWN_LOGPROB for a probability of 0 or None."""
    return math.log(prob) if prob else UNKNOWN_LOGPROB


def entry(tokenizer, token_id: int, prob: float | None) -> dict:
    """One ``{"token", "logprob", "bytes"}`` of OpenAI's shape for ``token_id``."""
    raw = tokenizer.token_bytes(token_id)
    return {"token": token_text(raw), "logprob": logprob(prob), "bytes": list(raw)}


def content(tokenizer, steps, ids, top: int) -> list[dict]:
    """OpenAI's ``logprobs.content``: one entry per id of ``ids`` (the output's ids, in order)
    with its ``top`` (0..5) alternatives, from the recorded ``steps`` (``LogprobRecorder.steps``).

    Raises:
        ValueError: a step records another id than ``ids`` holds at its place (a bug).
    """
    out = []
    for token_id, (chosen, prob, candidates) in zip(ids, steps, strict=False):
        if int(token_id) != chosen:
            raise ValueError(f"logprobs: the sampler chose id {chosen} where the output has {token_id}")
        item = entry(tokenizer, chosen, prob)
        item["top_logprobs"] = [entry(tokenizer, i, q) for i, q in candidates[:top]]
        out.append(item)
    return out


def text_offsets(entries: list[dict], start: int = 0) -> list[int]:
    """The legacy ``text_offset``: where each token starts in the text, in characters from
    ``start``; a token that starts inside a character starts where that character does."""
    offsets, joined = [], b""
    for e in entries:
        offsets.append(start + len(joined.decode("utf-8", errors="ignore")))
        joined += bytes(e["bytes"])
    return offsets


def joined_bytes(entries: list[dict]) -> bytes:
    """Every entry's bytes, in order: the answer's UTF-8."""
    return b"".join(bytes(e["bytes"]) for e in entries)
