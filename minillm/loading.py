"""Loading: a model name or folder -> a ready :class:`Model` (config, weights, tokenizer), then a
warm-up request so the first real request does not pay one-time costs.

What is loaded here lives across requests (llama2.c's "weights"); what lives for one request
(the KV cache, the detokenizer) is made in ``lifecycle.stream`` and freed at its end.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .config import ModelConfig
from .hub import ResolvedModel, resolve_model
from .kv_cache import KVCache
from .model import Transformer
from .tokenizer import Tokenizer
from .trace import Tracer
from .weights import load_weights

WARMUP_PROMPT = "Hello, world! The warm-up request."
WARMUP_DECODE_STEPS = 2


@dataclass
class Model:
    """What ``load`` returns and every request shares: config, tokenizer, weights (in ``transformer``)."""

    name: str
    path: Path
    config: ModelConfig
    tokenizer: Tokenizer
    transformer: Transformer
    resolved: ResolvedModel
    load_seconds: dict[str, float] = field(default_factory=dict)  # per step, seconds
    warmup_s: float | None = None  # seconds the warm-up took; None while none has run
    requests_served: int = 0  # real requests since load (the warm-up is not counted)

    @property
    def load_s(self) -> float:
        """Total load time in seconds (resolve + read + layout + tokenizer + allocate)."""
        return sum(self.load_seconds.values())

    @property
    def ready(self) -> bool:
        """True once a warm-up or a first request has paid the one-time costs."""
        return self.warmup_s is not None or self.requests_served > 0


def load(name_or_path: str | os.PathLike | None = None, *, tracer: Tracer | None = None,
         progress: bool = True, warmup: bool = True) -> Model:
    """Load a model by manifest name (fetched and cached on first use) or from a local folder.

    Args:
        name_or_path: a name from ``weights_manifest.toml`` (``minillm models``), or a folder with
            ``config.json``, ``*.safetensors``, ``tokenizer.json``. None: the manifest's default.
        progress: show rich progress bars while fetching or converting.
        warmup: run :func:`warmup` before returning ("ready" only after it).

    Raises:
        ModelNotFoundError, DownloadError, ChecksumMismatchError: while resolving the model.
        ConfigError, WeightsError, TokenizerError: while reading the folder.
    """
    from .manifest import default_model_name

    start = tracer.now() if tracer else 0.0
    t0 = time.perf_counter()
    resolved = resolve_model(name_or_path if name_or_path is not None else default_model_name(),
                             progress=progress)
    t1 = time.perf_counter()
    config = ModelConfig.from_folder(resolved.path)
    weights = load_weights(resolved.path, config)
    t2 = time.perf_counter()
    tokenizer = Tokenizer.from_folder(resolved.path)
    t3 = time.perf_counter()
    transformer = Transformer(config, weights)
    t4 = time.perf_counter()
    # Seconds per step: what resolving did (fetch / verify / extract / convert, when it ran), then
    # reading the weights, laying them out, the tokenizer, and allocating the model's tables.
    fetch_steps = {k: v for k, v in resolved.seconds.items() if k not in ("total", "resolve")}
    seconds = {"resolve": max(0.0, (t1 - t0) - sum(fetch_steps.values())), **fetch_steps}
    seconds.update({"config + weights": t2 - t1, "tokenizer": t3 - t2, "allocate": t4 - t3})
    model = Model(resolved.name, resolved.path, config, tokenizer, transformer, resolved, seconds)
    if tracer:
        tracer.emit(
            "load", start, t4 - t0, name=resolved.name, source=resolved.source, path=str(resolved.path),
            notes=list(resolved.notes), config=config.summary(), seconds=seconds, blas=blas_summary(),
            weights={"parameters": weights.num_parameters, "bytes_loaded": weights.nbytes,
                     "stored": dict(weights.stored_dtypes), "bytes_stored": dict(weights.stored_bytes),
                     "unused": weights.unused_tensors, "seconds": dict(weights.seconds)},
            tokenizer={"vocab_size": tokenizer.vocab_size,
                       "special": " ".join(tokenizer.decode([i], skip_special_tokens=False)
                                           for i in sorted(tokenizer.special_token_ids)[:12]),
                       "eos_ids": sorted(tokenizer.eos_token_ids)},
        )
    if warmup:
        run_warmup(model, tracer=tracer)
    return model


def blas_summary() -> list[str]:
    """Which BLAS runs the matrix multiplies, and with how many threads (threadpoolctl)."""
    from threadpoolctl import threadpool_info

    return [f"{i.get('internal_api')} {i.get('version')} ({i.get('architecture') or '?'}), "
            f"{i.get('num_threads')} threads" for i in threadpool_info() if i.get("user_api") == "blas"]


def run_warmup(model: Model, *, tracer: Tracer | None = None) -> float:
    """Run one short request (prefill + a few decode steps) and throw it away; returns seconds.

    The first forward pass after load pays one-time costs: weight pages faulted in from the
    page cache, BLAS thread pools started, RoPE tables built. A warm-up pays them before the
    model is called ready, so the first real request is timed like every other one.
    """
    start = tracer.now() if tracer else 0.0
    t0 = time.perf_counter()
    ids = model.tokenizer.encode(WARMUP_PROMPT)
    cache = KVCache.for_model(model.config, max_seq_len=len(ids) + WARMUP_DECODE_STEPS)
    logits = model.transformer.forward(ids, cache, last_only=True)[0]
    for _ in range(WARMUP_DECODE_STEPS):
        logits = model.transformer.forward(np.array([int(np.argmax(logits))]), cache)[0]
    cache.free()
    model.warmup_s = time.perf_counter() - t0
    if tracer:
        tracer.emit("warmup", start, model.warmup_s, tokens=len(ids), decode_steps=WARMUP_DECODE_STEPS)
    return model.warmup_s
