"""minillm: a from-scratch NumPy runtime for decoder-only transformers, built to teach inference.

    model = minillm.load("smollm2-135m-instruct")
    ids = minillm.tokenize(model, "The capital of France is")
    cache = minillm.KVCache.for_model(model.config, max_seq_len=256)
    logits = minillm.prefill(model, ids, cache)          # [vocab]; cache.length == len(ids)
    tok = minillm.sample(logits, minillm.SamplingParams(temperature=0.0))
    logits = minillm.decode_step(model, tok, cache)      # cache.length += 1
    print(minillm.detokenize(model, [tok]))
"""

from .config import ModelConfig
from .errors import MiniLLMError
from .kv_cache import KVCache
from .lifecycle import (
    GenerationResult,
    Model,
    decode_step,
    detokenize,
    generate,
    load,
    prefill,
    sample,
    stream,
    tokenize,
)
from .sampling import SamplingParams
from .stopping import StopReason
from .loading import run_warmup
from .trace import TraceEvent, Tracer, plot_timeline

__all__ = [
    "GenerationResult", "KVCache", "MiniLLMError", "Model", "ModelConfig", "SamplingParams", "StopReason",
    "TraceEvent", "Tracer", "decode_step", "detokenize", "generate", "load", "prefill", "plot_timeline", "run_warmup", "sample", "stream", "tokenize",
]
__version__ = "0.1.0"
