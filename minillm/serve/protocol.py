"""OpenAI's request and response objects as pydantic classes (named as in OpenAI's API, like vLLM).

Requests accept OpenAI's fields plus minillm's own sampling extras (``top_k``, ``min_p``,
``repetition_penalty``), sent as extra body fields the way vLLM accepts them
(``client.chat.completions.create(..., extra_body={"top_k": 40})``). Unknown fields are ignored,
as OpenAI does. Ranges are declared on the fields, so a bad value gets a 400 naming the field and
its range, and /openapi.json documents them.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field

# The trace keeps the top 5 candidates of every step; logprobs cannot list more.
MAX_TOP_LOGPROBS = 5


class StreamOptions(BaseModel):
    include_usage: bool = False  # a last chunk with usage (and no choices)


class SamplingFields(BaseModel):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: str
    max_tokens: int | None = Field(None, ge=1, description="new tokens at most; default: up to the context")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 = greedy")
    top_p: float = Field(1.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = Field(None, description="stop strings (the text is cut before the match)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="only 1: minillm runs one sequence per request")
    user: str | None = None
    # minillm's extras (vLLM-style extra body fields)
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens (0 = off)")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    speculative: str | None = Field(
        None,
        description="speculative decoding's draft: ngram | self-int8 | self-gguf | layers:K | off "
        "(default: the server's --speculative); the output's distribution is the model's either way",
    )
    num_speculative_tokens: int | None = Field(None, ge=1, le=16, description="tokens drafted per pass")


class ChatMessage(BaseModel):
    role: str  # the chat template decides which roles it accepts (its message comes back as a 400)
    content: str
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="OpenAI's newer name for max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


class CompletionRequest(SamplingFields):
    prompt: str = Field(min_length=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="legacy: alternatives per token")
    echo: Literal[False] = False  # echoing the prompt is not supported


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose keys and values the pool's prefix cache already held


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    # minillm's extras, with speculative decoding: forward passes of the model, tokens drafted and kept
    target_passes: int | None = None
    drafted_tokens: int | None = None
    accepted_tokens: int | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(BaseModel):
    content: list[ChatCompletionLogprob] | None = None


class CompletionLogprobs(BaseModel):
    """The legacy shape: parallel lists, and one {token: logprob} dict per position."""

    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatCompletionChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None
    minillm_stop_reason: str | None = None  # minillm's own StopReason, e.g. "timed out"


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatCompletionChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    minillm_stop_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChunkChoice]
    usage: UsageInfo | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    minillm_stop_reason: str | None = None


class Completion(BaseModel):
    """A /v1/completions response, and (with ``usage`` None) each streamed chunk of one."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "minillm"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
