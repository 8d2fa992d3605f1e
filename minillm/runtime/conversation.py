"""A conversation: the turns of one chat sharing one KV cache (lesson 5's reuse, across requests).

Each turn renders the whole conversation through the chat template (the history, then the new
user message) and tokenizes it. The cache already holds the keys and values of the turns before;
the turn keeps the longest prefix its ids share with them and prefills only the ids past it::

    turn 1   <system> <user 1> <assistant opens>                                      all prefilled
    turn 2   <system> <user 1> <assistant opens> answer 1 | <end> <user 2> <assistant opens>
                            kept from turn 1 ------------^   prefilled: only these

The last token of an answer was sampled but never fed, and an answer's ids need not be how the
tokenizer splits its text: then the shared prefix is shorter and a little more is recomputed.
The ids are always those of the whole conversation, so each answer is what ``generate`` gives on
the accumulated messages (greedy: the same ids, up to float32 rounding of the shorter prefill).
"""

from __future__ import annotations

from collections.abc import Iterator

from minillm.errors import InvalidRequestError
from minillm.model.kv_cache import KVCache
from minillm.runtime.generate import run
from minillm.runtime.loading import Model
from minillm.runtime.request import GenerationResult, Request
from minillm.runtime.sampling import SamplingParams


class Turn(Request):
    """One turn of a :class:`Conversation`: a request on the conversation's cache that keeps the
    positions it shares with the cached ids (``cached_ids``, a constructor argument of every request),
    and leaves what it wrote in the cache for the next turn."""

    @property
    def kept_ids(self) -> list[int]:
        """The ids whose keys and values the cache holds now (the last sampled id was never fed)."""
        return (self.prompt_ids.tolist() + self.new_ids)[: self.cache.length]


class Conversation:
    """A multi-turn chat with one KV cache kept across turns.

        chat = minillm.Conversation(model, system="Answer in one sentence.")
        print(chat.reply("What is the capital of France?").text)
        print(chat.reply("And of Italy?").text)  # prefill covers only the new turn's tokens

    Args:
        system: an optional system message, first in the history.
        max_seq_len: the cache's positions, the whole conversation's room (default: the model's context).
        kv_dtype: ``"float32"`` | ``"float16"`` | ``"int8"``, as for :func:`~minillm.runtime.generate.stream`.

    ``messages`` is the history (user and assistant turns); ``cached_ids`` the ids the cache holds.

    Raises:
        KVCacheFullError: ``max_seq_len`` longer than the model's context.
    """

    #: the request options a turn takes (the conversation owns the cache and the chat template)
    OPTIONS = Request.OPTIONS - {"cache", "max_seq_len", "kv_dtype", "chat"}

    def __init__(self, model: Model, *, system: str | None = None, max_seq_len: int | None = None, kv_dtype="float32"):
        self.model = model
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self.cache = KVCache.for_model(model.config, max_seq_len, dtype=kv_dtype)
        self.cached_ids: list[int] = []

    def stream(
        self,
        user_text: str,
        params: SamplingParams | None = None,
        *,
        tracer=None,
        result: list | None = None,
        **options,
    ) -> Iterator[str]:
        """Answer ``user_text`` after the history; yield the answer's text as it is produced.

        At the end the user message and the answer join ``messages``. ``options``: as
        :func:`~minillm.runtime.generate.stream`'s but ``cache``, ``max_seq_len``, ``kv_dtype``, ``chat``.

        Raises:
            InvalidRequestError: an unknown option, or what :func:`~minillm.runtime.generate.stream` refuses.
            ContextWindowExceeded: the conversation no longer fits in the cache (the history is unchanged).
        """
        if unknown := sorted(set(options) - self.OPTIONS):
            raise InvalidRequestError(f"unknown turn option(s) {unknown}; a turn takes {sorted(self.OPTIONS)}.")
        messages = [*self.messages, {"role": "user", "content": user_text}]
        try:
            turn = Turn(
                self.model, messages, params, listener=tracer, cache=self.cache, cached_ids=self.cached_ids, **options
            )
        except BaseException:
            self.cached_ids = self.cached_ids[: self.cache.length]
            raise
        done: list[GenerationResult] = []
        try:
            yield from run(turn, done)
        finally:
            self.cached_ids = turn.kept_ids
        self.messages = [*messages, {"role": "assistant", "content": done[0].text}]
        if result is not None:
            result.append(done[0])

    def reply(self, user_text: str, params: SamplingParams | None = None, **options) -> GenerationResult:
        """Run one turn to its end (:meth:`stream`); returns its :class:`GenerationResult`."""
        result: list[GenerationResult] = []
        for _ in self.stream(user_text, params, result=result, **options):
            pass
        return result[0]
