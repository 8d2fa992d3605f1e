"""minillm: a from-scratch NumPy runtime for decoder-only transformers, built to teach inference.

    model = minillm.load("smollm2-135m-instruct")
    ids = minillm.tokenize(model, "The capital of France is")
    cache = minillm.KVCache.for_model(model.config, max_seq_len=256)
    logits = minillm.prefill(model, ids, cache)          # [vocab]; cache.length == len(ids)
    tok = minillm.sample(logits, minillm.SamplingParams(temperature=0.0))
    logits = minillm.decode_step(model, tok, cache)      # cache.length += 1
    print(minillm.detokenize(model, [tok]))

The folder reads as the system: ``model/`` (the math), ``text/`` (tokens <-> text),
``runtime/`` (the request lifecycle), ``observe/`` (trace, metrics, diagnosis: listeners),
``sources/`` (finding and fetching models).
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _installed_version

from minillm.errors import DISTRIBUTION, MiniLLMError
from minillm.model.config import ModelConfig
from minillm.model.kv_cache import KVCache
from minillm.model.paged_kv_cache import KVCachePool
from minillm.observe.events import TraceEvent, Tracer, plot_timeline
from minillm.runtime.constraint import Constraint
from minillm.runtime.conversation import Conversation
from minillm.runtime.generate import generate, generate_batch, stream
from minillm.runtime.loading import Model, load, run_warmup
from minillm.runtime.request import GenerationResult
from minillm.runtime.sampling import SamplingParams
from minillm.runtime.speculative import Speculative
from minillm.runtime.steps import decode_step, detokenize, prefill, sample, tokenize
from minillm.runtime.stopping import StopReason

__all__ = [
    "Conversation",
    "Constraint",
    "GenerationResult",
    "KVCache",
    "KVCachePool",
    "MiniLLMError",
    "Model",
    "ModelConfig",
    "SamplingParams",
    "Speculative",
    "StopReason",
    "TraceEvent",
    "Tracer",
    "decode_step",
    "detokenize",
    "generate",
    "generate_batch",
    "load",
    "plot_timeline",
    "prefill",
    "run_warmup",
    "sample",
    "stream",
    "tokenize",
]

try:  # the installed distribution's version (pyproject.toml's, when pip installed this checkout)
    __version__ = _installed_version(DISTRIBUTION)
except PackageNotFoundError:  # a source checkout on the path that pip did not install
    __version__ = "0.1.0"
