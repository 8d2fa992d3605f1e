"""Loading: a model name or folder -> a ready :class:`Model` (config, weights, tokenizer), then a
warm-up request so the first real request does not pay one-time costs.

What is loaded here lives across requests (llama2.c's "weights"); what lives for one request
(the KV cache, the detokenizer) is made by ``request.Request`` and freed at its end.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager

from minillm.errors import InvalidRequestError
from minillm.kernels.tuned import TUNED
from minillm.model.config import ModelConfig
from minillm.model.gguf_weights import load_gguf_weights
from minillm.model.kernels import PLAIN, Kernels
from minillm.model.lora import LoraAdapter, activate, load_adapter, merge
from minillm.model.transformer import Transformer
from minillm.model.weights import hold_weights, load_weights
from minillm.runtime import steps
from minillm.runtime.loaded_model import Model
from minillm.runtime.units import unit_kernels
from minillm.sources.hub import ResolvedModel, resolve_gguf, resolve_model
from minillm.text.tokenizer import Tokenizer

WARMUP_PROMPT = "Hello, world! The warm-up request."
WARMUP_DECODE_STEPS = 2


def load(
    name_or_path: str | os.PathLike | None = None,
    *,
    tracer=None,
    progress: bool = True,
    warmup: bool = True,
    adapters: list[str | os.PathLike] | None = None,
    merge_adapters: bool = True,
    threads: int | None = None,
    weight_dtype: str = "float32",
    mmap: bool = False,
    kernels: str = "tuned",
    units: str | os.PathLike | None = None,
) -> Model:
    """Load a model by manifest name (fetched and cached on first use) or from a local folder.

    Args:
        name_or_path: a name from ``weights_manifest.toml`` (``minillm models``), or a folder with
            ``config.json``, ``*.safetensors``, ``tokenizer.json``. None: the manifest's default.
        progress: show rich progress bars while fetching or converting.
        tracer: a listener (``on_event(phase, start, duration, model, facts)``, e.g.
            ``minillm.Tracer``) told of the load and the warm-up.
        warmup: run :func:`run_warmup` before returning ("ready" only after it).
        adapters: PEFT LoRA adapter folders to apply to every request (``lora.py``).
        merge_adapters: True: fold them into the weights (no cost per token); False: keep them
            apart, computed in the forward, switchable with ``Model.set_active_adapters``.
        threads: how many threads the BLAS (OpenBLAS under NumPy) runs the matrix multiplies
            with, set through threadpoolctl for the whole process. None: leave the BLAS default
            (every core). When another busy process shares the cores, 1 can be much faster: a
            BLAS thread that loses its core stalls every multiply waiting for it (README, "Speed").
        weight_dtype: how the weight matrices are held in memory (``model/held.py``); norms and
            biases stay float32 in every mode, and the math runs in float32 either way:
            ``"float32"`` (4 bytes a weight); ``"bfloat16"`` (2 bytes, rounded to nearest even);
            ``"int8"`` (1 byte + a float32 scale per row, symmetric per output channel, quantized
            at load); ``"gguf"`` (the model's GGUF file read directly, its blocks kept packed:
            SmolLM2 Q4_1 at 5 bits a weight; ``sources.hub.resolve_gguf`` finds or fetches it).
            With LoRA adapters: merged ones are folded into the float32 weights first and then
            held at ``weight_dtype``; ``"gguf"`` refuses merging (packed blocks cannot absorb a
            delta) and runs unmerged adapters beside the packed matrices.

        mmap: leave the weights memory-mapped, as the safetensors file lays them out (llama.cpp's
            default): loading reads only the headers, and the first forward pass pages every
            weight in from the page cache or the disk. That cost lands on the first request unless
            a warm-up pays it (lesson 8 measures both). Float32 files only.
        kernels: which implementation of the forward's tuned operations (products, attention, a
            batch's decode attention) the model runs: ``"tuned"`` (``minillm/kernels``: the fastest
            formulations for this BLAS kernel) or ``"plain"`` (``minillm/model/kernels.py``: the
            textbook's NumPy). The same numbers within float32 rounding (``tests/model/test_kernels.py``).
        units: a student's exercises folder: its started units replace the textbook's (``runtime/units.py``).

    Raises:
        InvalidRequestError: ``threads`` is not a whole number >= 1; an unknown ``weight_dtype`` or
            ``kernels``;
            ``weight_dtype="gguf"`` with adapters to merge; ``mmap=True`` with adapters to merge (a
            read-only map cannot be written: pass ``merge_adapters=False``) or with a ``weight_dtype``
            other than float32 (a map is the file's own float32 bytes).
        WeightsError: ``mmap=True`` on a file that is not float32 (it would need a converted copy).
        ModelNotFoundError, DownloadError, ChecksumMismatchError: while resolving the model.
        ConfigError, WeightsError, TokenizerError: while reading the folder.
        AdapterError: an adapter is missing files, unsupported, or does not fit the model.
        UnitsError: ``units`` is missing or unreadable, or a unit's file lacks its names.
    """
    chosen = kernels_named(kernels) if units is None else unit_kernels(units)
    set_blas_threads(threads)
    check_weight_dtype(weight_dtype, adapters=bool(adapters), merge_adapters=merge_adapters)
    check_mmap(mmap, weight_dtype, adapters=bool(adapters), merge_adapters=merge_adapters)
    t0 = time.perf_counter()
    how = {"weight_dtype": weight_dtype, "mmap": mmap, "merge_adapters": merge_adapters, "threads": threads}
    model = _build_model(name_or_path, chosen, progress=progress, adapters=adapters or [], **how)
    if tracer is not None:
        tracer.on_event("load", t0, model.load_s, model, {"seconds": model.load_seconds})
    if warmup:
        run_warmup(model, tracer=tracer)
    return model


@contextmanager
def _timed(seconds: dict[str, float], step: str):
    """Time the ``with`` body (``time.perf_counter``) and add its seconds to ``seconds[step]``."""
    start = time.perf_counter()
    yield
    seconds[step] = seconds.get(step, 0.0) + time.perf_counter() - start


def _build_model(name, kernels: Kernels, *, progress, weight_dtype, mmap, adapters, merge_adapters, threads) -> Model:
    """The model resolved, its weights read, adapted and held, its tokenizer and its transformer built;
    each step timed around its call, the seconds in ``Model.load_seconds`` (:func:`_step_seconds`).
    ``name``: as :func:`load`'s ``name_or_path`` (None: the manifest's default)."""
    from minillm.sources.manifest import default_model_name

    seconds: dict[str, float] = {}
    with _timed(seconds, "resolve"):
        name = name if name is not None else default_model_name()
        resolved = resolve_model(name, progress=progress)
    with _timed(seconds, "config + weights"):
        config = ModelConfig.from_folder(resolved.path)
        if weight_dtype == "gguf":  # the GGUF's packed blocks, read directly
            weights = load_gguf_weights(resolve_gguf(name, progress=progress), config)
        else:
            weights = load_weights(resolved.path, config, mmap=mmap)
    with _timed(seconds, "adapters"):  # merged or kept apart, then the matrices held (adapters fold into float32)
        loaded = _load_adapters(adapters, merge_adapters, config, weights, resolved)
        if weight_dtype in ("bfloat16", "int8"):
            with _timed(weights.seconds, "hold " + weight_dtype):
                hold_weights(weights, weight_dtype)
    with _timed(seconds, "tokenizer"):
        tokenizer = Tokenizer.from_folder(resolved.path)
    with _timed(seconds, "allocate"):
        transformer = Transformer(config, weights, kernels)
    return Model(
        name=resolved.name,
        config=config,
        path=resolved.path,
        tokenizer=tokenizer,
        load_seconds=_step_seconds(resolved, seconds, adapters=bool(loaded)),
        transformer=transformer,
        resolved=resolved,
        adapters=loaded,
        threads=threads,
    )


def _step_seconds(resolved: ResolvedModel, seconds: dict[str, float], *, adapters: bool) -> dict[str, float]:
    """Seconds per load step, in the order they are shown: what resolving did (fetch / verify / extract
    / convert, when it ran; ``resolve`` is the rest of its time), then reading the config and weights,
    the tokenizer, allocating, and, when adapters were loaded, the adapters with the holding."""
    fetch_steps = {k: v for k, v in resolved.seconds.items() if k not in ("total", "resolve")}
    local = ("config + weights", "tokenizer", "allocate") + (("adapters",) if adapters else ())
    return {
        "resolve": max(0.0, seconds["resolve"] - sum(fetch_steps.values())),
        **fetch_steps,
        **{step: seconds[step] for step in local},
    }


def check_mmap(mmap: bool, weight_dtype: str, *, adapters: bool, merge_adapters: bool) -> None:
    """Raises InvalidRequestError if ``mmap=True`` comes with adapters to merge (a read-only map
    cannot be written) or with a ``weight_dtype`` other than float32 (a map is the file's float32 bytes)."""
    if mmap and adapters and merge_adapters:
        raise InvalidRequestError(
            "mmap=True leaves the weights as read-only views of the file, so adapters cannot be merged "
            "into them; pass merge_adapters=False (computed beside the weights) or load without mmap."
        )
    if mmap and weight_dtype != "float32":
        raise InvalidRequestError(
            f"mmap=True maps the file's own float32 bytes, so it cannot hold them as {weight_dtype!r}; "
            "pass weight_dtype='float32' or load without mmap."
        )


WEIGHT_DTYPES = ("float32", "bfloat16", "int8", "gguf")
#: ``load(..., kernels=)`` -> the kernels the model holds (``model/kernels.py``'s seam).
KERNELS: dict[str, Kernels] = {"tuned": TUNED, "plain": PLAIN}


def kernels_named(name: str) -> Kernels:
    """The kernels ``load(..., kernels=name)`` gives the model.

    Raises:
        InvalidRequestError: ``name`` is neither ``"tuned"`` nor ``"plain"``.
    """
    if not isinstance(name, str) or name not in KERNELS:
        raise InvalidRequestError(
            f"kernels must be 'tuned' (minillm/kernels: the fastest formulations) or 'plain' (minillm/model: "
            f"the textbook's NumPy); got {name!r}."
        )
    return KERNELS[name]


def check_weight_dtype(weight_dtype: str, *, adapters: bool = False, merge_adapters: bool = True) -> None:
    """Refuse an unknown ``weight_dtype``, or merging adapters into packed GGUF blocks.

    Raises:
        InvalidRequestError: naming the value and the choices, or the fix for the LoRA case.
    """
    if weight_dtype not in WEIGHT_DTYPES:
        raise InvalidRequestError(f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}; got {weight_dtype!r}.")
    if weight_dtype == "gguf" and adapters and merge_adapters:
        raise InvalidRequestError(
            "weight_dtype='gguf' keeps the GGUF's blocks packed, and a LoRA delta cannot be merged into "
            "packed blocks without requantizing them; pass merge_adapters=False (the adapter runs beside "
            "the packed matrices), or weight_dtype='float32' | 'bfloat16' | 'int8' (merged into float32 "
            "rows, then held at that precision)."
        )


def _load_adapters(paths, merge_them: bool, config: ModelConfig, weights, resolved: ResolvedModel) -> list[LoraAdapter]:
    """Read each LoRA adapter, check it against the model, then merge it or make it active."""
    from minillm.sources.manifest import load_manifest

    names: tuple = (resolved.name, resolved.path.name)
    try:
        entry = load_manifest().get(resolved.name)
        if entry is not None and entry.hub is not None:
            names += (entry.hub.repo,)  # e.g. HuggingFaceTB/SmolLM2-135M-Instruct
    except Exception:  # the manifest only adds a name to compare; never fail a load over it
        pass
    loaded = []
    for path in paths:
        adapter = load_adapter(path, config, weights, model_names=names)
        if adapter.name in {a.name for a in loaded}:
            adapter.name = f"{adapter.name}-{len(loaded)}"
        loaded.append(adapter)
    for adapter in loaded:
        t = time.perf_counter()
        if merge_them:
            merge(adapter, weights)
            adapter.seconds += time.perf_counter() - t
    if loaded and not merge_them:
        activate(loaded, weights)
    return loaded


def set_blas_threads(threads: int | None) -> None:
    """Run the BLAS's matrix multiplies on ``threads`` threads from now on (threadpoolctl); None: no change.

    Raises:
        InvalidRequestError: ``threads`` is not a whole number >= 1.
    """
    if threads is None:
        return
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise InvalidRequestError(
            f"threads must be a whole number >= 1, got {threads!r}; pass None to keep the BLAS default (all cores)."
        )
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=threads, user_api="blas")  # process-wide; not undone when load returns


def run_warmup(model: Model, *, tracer=None, pool=None) -> float:
    """Run one short request (prefill + a few decode steps) and throw it away; returns seconds.

    The first forward pass after load pays one-time costs: weight pages faulted in from the
    page cache, BLAS thread pools started, RoPE tables built. A warm-up pays them before the
    model is called ready, so the first real request is timed like every other one.

    ``pool``: a server's paged KV-cache pool (``KVCachePool``): the warm-up's keys and values are
    written there instead of into a cache of its own. The pool's memory is mapped by the kernel on
    first write (NumPy asks for 2 MiB huge pages for it), and the first write into each layer's
    and head's stretch of it is what made a server's first request slow: TTFT 0.95 s, then 0.07 s
    (measured, SmolLM2, ``--kv-cache-mib 512``). The warm-up's 12 positions fill no whole block,
    so nothing of it enters the prefix cache; its block is free again when it ends.
    """
    t0 = time.perf_counter()
    ids = model.tokenizer.encode(WARMUP_PROMPT)
    positions = len(ids) + WARMUP_DECODE_STEPS
    if pool is None:
        cache = model.transformer.kernels.new_cache(model.config, positions)
    else:
        cache = pool.sequence(positions)
        pool.grow(cache, positions)  # every slot the warm-up writes, before the first write
    logits = steps.prefill(model, ids, cache)
    for _ in range(WARMUP_DECODE_STEPS):
        logits = steps.decode_step(model, int(logits.argmax()), cache)
    cache.free()
    model.warmup_s = time.perf_counter() - t0
    if tracer is not None:
        tracer.on_event("warmup", t0, model.warmup_s, model, {"tokens": len(ids), "decode_steps": WARMUP_DECODE_STEPS})
    return model.warmup_s
