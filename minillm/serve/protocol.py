"""OpenAI's request and response objects as pydantic classes (named as in OpenAI's API, like vLLM).

Requests accept OpenAI's fields plus minillm's own sampling extras (``top_k``, ``min_p``,
``repetition_penalty``), sent as extra body fields the way vLLM accepts them
(``client.chat.completions.create(..., extra_body={"top_k": 40})``). Every OpenAI field is either
implemented with OpenAI's meaning or refused: an OpenAI field minillm does not implement (``n`` > 1,
``echo``, ``best_of``, ``suffix``, audio, tools, ...) is a 400 naming it (``UNSUPPORTED``), never
dropped in silence. Fields that are not OpenAI's (other servers' extras) are ignored. Ranges are
declared on the fields, so a bad value gets a 400 naming the field and its range, and
/openapi.json documents them.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat's top_logprobs
MAX_LEGACY_LOGPROBS = 5  # OpenAI's limit for /v1/completions' logprobs

_TOOLS = "tool calling is not implemented by minillm's server"
#: OpenAI fields minillm does not implement: field -> (values that mean "off", why). Any other value
#: is a 400 naming the field.
UNSUPPORTED_CHAT: dict[str, tuple[tuple, str]] = {
    "audio": ((None,), "audio output is not implemented (the models make text)"),
    "modalities": ((None, ["text"]), "only text output is implemented"),
    "tools": ((None, []), _TOOLS),
    "tool_choice": ((None, "none"), _TOOLS),
    "functions": ((None, []), _TOOLS),
    "function_call": ((None, "none"), _TOOLS),
    "parallel_tool_calls": ((None,), _TOOLS),
    "prediction": ((None,), "predicted outputs are not implemented"),
    "web_search_options": ((None,), "web search is not implemented"),
    "reasoning_effort": ((None,), "reasoning effort applies to reasoning models; minillm's have none"),
    "verbosity": ((None,), "verbosity (answer length) control is not implemented"),
    "store": ((None, False), "minillm stores no completions"),
    "metadata": ((None, {}), "metadata is kept with stored completions, which minillm does not implement"),
    "service_tier": ((None, "auto", "default"), "minillm has one service tier"),
    "moderation": ((None,), "moderation is not implemented"),
    "prompt_cache_retention": ((None, "in_memory"), "the prefix cache lives in memory only"),
    "prompt_cache_options": ((None,), "prompt cache options are not implemented"),
}
UNSUPPORTED_COMPLETIONS: dict[str, tuple[tuple, str]] = {
    "echo": ((None, False), "echoing the prompt is not implemented"),
    "suffix": ((None, ""), "insertion (a suffix after the completion) is not implemented"),
    "best_of": ((None, 1), "minillm runs one sequence per request"),
}


class StreamOptions(BaseModel):
    include_usage: bool = False  # a last chunk with usage (and no choices)


class TestFault(BaseModel):
    """The test hook of ``minillm serve --test-faults`` (``reliability.py``): raise on purpose, or
    hold the request in admission (out of the queue, not yet in the scheduler)."""

    stage: Literal["sampler", "detokenizer", "stop", "admission"]
    at_token: int = Field(1, ge=1, le=100_000, description="raise while making this new token (1 = the first)")
    hold_s: float = Field(
        30.0, gt=0, le=600, description="admission: hold at most this long, seconds (until another request comes)"
    )


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
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="minus count x this per generated id")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="minus this once per generated id")
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        None, description="token id (as a string) -> bias added to its logit; -100 bans, 100 forces"
    )
    # identifiers that, as OpenAI documents, do not change the output
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # minillm's prefix cache needs no key: a shared prefix is found
    # minillm's extras (vLLM-style extra body fields)
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens (0 = off)")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    slow_motion_s: float = Field(
        0.0,
        ge=0.0,
        le=10.0,
        description="seconds this request sits out after each of its steps (the live page's slow motion; "
        "other requests keep their pace; its latencies are left out of /metrics)",
    )
    minillm_test_fault: TestFault | None = Field(None, description="test hook; refused unless --test-faults")

    speculative: str | None = Field(
        None,
        description="speculative decoding's draft: ngram | self-int8 | self-gguf | layers:K | off "
        "(default: the server's --speculative); the output's distribution is the model's either way",
    )
    num_speculative_tokens: int | None = Field(None, ge=1, le=16, description="tokens drafted per pass")

    UNSUPPORTED: ClassVar[dict[str, tuple[tuple, str]]] = {}

    @model_validator(mode="before")
    @classmethod
    def refuse_unsupported(cls, data: Any) -> Any:
        """A 400 naming the first OpenAI field minillm does not implement (with a value that is not "off")."""
        if isinstance(data, dict):
            for name, (off, why) in cls.UNSUPPORTED.items():
                if name in data and data[name] not in off:
                    raise PydanticCustomError(
                        "unsupported_field",
                        "{field} is not supported: {why}; leave it out" + (" or send {off}" if off[1:] else ""),
                        {"field": name, "why": why, "off": " or ".join(repr(v) for v in off[1:])},
                    )
        return data


class ChatMessage(BaseModel):
    role: str  # the chat template decides which roles it accepts (its message comes back as a 400)
    content: str
    name: str | None = None


class JSONSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``: the schema under ``schema`` (``strict`` is always
    honoured: the output is masked to the schema)."""

    model_config = ConfigDict(populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict = Field(alias="schema", description="the JSON schema the answer must follow")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class ChatCompletionRequest(SamplingFields):
    UNSUPPORTED: ClassVar[dict[str, tuple[tuple, str]]] = UNSUPPORTED_CHAT
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="OpenAI's newer name for max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None


class CompletionRequest(SamplingFields):
    UNSUPPORTED: ClassVar[dict[str, tuple[tuple, str]]] = UNSUPPORTED_COMPLETIONS
    prompt: str = Field(min_length=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LEGACY_LOGPROBS, description="legacy: alternatives per token")


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose keys and values the pool's prefix cache already held


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    load_s: float = 0.0  # minillm: seconds of the model load this request waited for (ollama's load_duration)
    # minillm's extras, with speculative decoding: forward passes of the model, tokens drafted and kept,
    # and the passes that rejected a draft (alpha per position checked = kept / (kept + rejections))
    target_passes: int | None = None
    drafted_tokens: int | None = None
    accepted_tokens: int | None = None
    rejections: int | None = None


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


class _Choice(BaseModel):
    """What every choice carries: its index and why it ended (None in a streamed chunk before the last)."""

    index: int = 0
    finish_reason: str | None = None
    minillm_stop_reason: str | None = None  # minillm's own StopReason, e.g. "timed out"


class ChatCompletionChoice(_Choice):
    message: ChatMessageOut
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None  # required in a whole response
    minillm_error: str | None = None  # e.g. why a constrained answer is not a whole document


class _Envelope(BaseModel):
    """The fields every OpenAI response and chunk opens with; each subclass fixes ``object``."""

    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class ChatCompletion(_Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatCompletionChunkChoice(_Choice):
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    minillm_error: str | None = None


class CompletionChoice(_Choice):
    text: str
    logprobs: CompletionLogprobs | None = None


class ChatCompletionChunk(_Envelope):
    """One streamed /v1/chat/completions event; ``usage`` only in the last (stream_options.include_usage)."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatCompletionChunkChoice]
    usage: UsageInfo | None = None


class Completion(_Envelope):
    """A /v1/completions response, and (with ``usage`` None) each streamed chunk of one."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


SERVED_SINCE = int(time.time())  # a served model's "created": when this process began serving (Unix s)


class ModelCard(BaseModel):
    model_config = ConfigDict(extra="allow")  # a multi-model server adds state, weight_dtype, resident bytes
    id: str
    object: Literal["model"] = "model"
    created: int = SERVED_SINCE  # the same in every answer (GET /v1/models and /v1/models/{id})
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
