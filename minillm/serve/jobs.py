"""What the HTTP layer and the worker thread hand each other: a :class:`Job` in, its items and
:class:`Outcome` out, and the worker's own record of a running job (:class:`Active`)."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import minillm

from . import logprobs as lp
from .reliability import GuardedRequest


class TextDelta(str):
    """A delta's text (a ``str``: every reader of the channel may treat it as one) with ``logprobs``, the
    OpenAI entries of the tokens whose text it released (a request that asked for logprobs)."""

    logprobs: list[dict]

    def __new__(cls, text: str, logprobs: list[dict]) -> TextDelta:
        self = super().__new__(cls, text)
        self.logprobs = logprobs
        return self


@dataclass(kw_only=True)
class Job:
    """One request as the worker sees it: what to run and where to send what it makes.

    ``channel`` receives ``("delta", text)`` (a :class:`TextDelta` with ``top_logprobs``), then either
    ``("done", Outcome)`` or ``("error", MiniLLMError)``; nothing after that.
    """

    request_id: str
    prompt: str | list[dict]  # a completion prompt, or chat messages
    chat: bool
    params: minillm.SamplingParams
    max_tokens: int | None  # None: up to the context
    stop: list[str] | None
    top_logprobs: int | None  # None: no logprobs; 0..20: that many alternatives per token
    loop: asyncio.AbstractEventLoop
    channel: asyncio.Queue
    cancel: threading.Event = field(default_factory=threading.Event)
    speculative: minillm.Speculative | None = None  # the body's, else the server's default
    arrival: float = field(default_factory=time.perf_counter)  # seconds (perf_counter)
    slow_motion_s: float = 0.0  # seconds it sits out after each of its steps (the live page's control)
    fault: dict | None = None  # --test-faults only: {"stage": ..., "at_token": N} (reliability.py)
    model: str = ""  # the served name the request named (a multi-model server routes by it)
    load_s: float = 0.0  # seconds of the model load this request waited for (models.py), else 0
    constraint: object = None  # a minillm Constraint (response_format), or None: free text
    owner: str | None = None  # the label of the key that sent it (auth.label); None on a server without keys

    def send(self, kind: str, value) -> None:
        """Hand an item to the event loop thread-safely (never blocks the worker)."""
        self.loop.call_soon_threadsafe(self.channel.put_nowait, (kind, value))


@dataclass(kw_only=True)
class Outcome:
    """How a request ended, in the units the HTTP layer needs (tokens, seconds)."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    stop_reason: minillm.StopReason
    queue_wait_s: float
    ttft_s: float | None  # from arrival (queue wait included) to the first token; None if no token
    logprobs: list[dict] | None  # one entry per output token: token, logprob, top alternatives
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the pool's prefix cache
    load_s: float = 0.0  # seconds of the model load the request waited for (ollama's load_duration)
    incomplete: str | None = None  # a constrained answer cut short: why it is not a whole document
    speculative: dict | None = None  # target_passes, drafted_tokens, accepted_tokens, rejections (speculative)

    @classmethod
    def of(cls, result, job: Job, wait: float, ttft: float | None, logprobs: list[dict] | None) -> Outcome:
        """A finished request's outcome: its ``GenerationResult``, the job, its queue wait and TTFT (s)."""
        m = result.metrics
        speculative = None
        if m.speculative_k:
            speculative = {"target_passes": m.target_passes, "drafted_tokens": m.drafted_tokens,
                           "accepted_tokens": m.accepted_tokens, "rejections": m.rejections}  # fmt: skip
        return cls(
            text=result.text,
            prompt_tokens=len(result.prompt_ids),
            completion_tokens=len(result.ids),
            stop_reason=result.stop_reason,
            queue_wait_s=wait,
            ttft_s=ttft,
            logprobs=logprobs,
            cached_tokens=m.cached_prompt_tokens,
            load_s=job.load_s,
            incomplete=result.incomplete,
            speculative=speculative,
        )


class QueueFullError(Exception):
    """More requests wait than ``max_queue`` allows (the HTTP layer answers 429)."""


@dataclass(kw_only=True)
class Active:
    """A job the scheduler is running: its request, its trace, how much text was sent."""

    job: Job
    request: GuardedRequest
    tracer: minillm.Tracer
    wait: float
    sent: int = 0  # deltas of request.deltas already sent
    logprobs_sent: int = 0  # new ids whose logprobs went with a delta already sent
    shed: bool = False  # cancelled for a client that read too slowly: no more text is sent (reliability.py)

    def delta(self, i: int, tokenizer) -> str:
        """The request's ``i``-th delta as the channel sends it: its text, with the logprobs of the tokens
        that released it when the job asked for them (a :class:`TextDelta`)."""
        text, top = self.request.deltas[i], self.job.top_logprobs
        if top is None:
            return text
        upto = self.request.delta_ids[i]
        entries = lp.of_delta(tokenizer, self.request, self.logprobs_sent, upto, top)
        self.logprobs_sent += len(entries)
        return TextDelta(text, entries)


async def watch_disconnect(request, job: Job) -> None:
    """Set the job's cancel flag when the client disconnects (the body was already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel.set()
            return
