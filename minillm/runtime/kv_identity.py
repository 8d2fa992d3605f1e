"""What a block of keys and values depends on besides its token ids: the prefix cache's identity.

A paged pool names a full block by a hash chained over token ids (``paged_kv_cache.py``). The same
ids give other keys and values under another model, another precision of its weights, other LoRA
adapters or scales, another KV dtype, other kernels, or another BLAS kernel or thread count (another order of
the sums, so other float32 roundings). :func:`kv_identity` turns all of these into 16 bytes that
start the chain, so a block is found again only under the very setting that computed it (vLLM
mixes its LoRA id into the first block's hash the same way).
"""

from __future__ import annotations

import hashlib
import json

from minillm.kernels.products import blas_kernel, blas_threads
from minillm.runtime.loading import Model


def kv_identity(model: Model, kv_dtype: str = "float32") -> bytes:
    """16 bytes naming every input of a KV block but its token ids, as the model is set *now*.

    Covered: the model (name, folder, config, and the very weights object: two models of one shape
    never share), the weights' precision (``weight_dtype``: float32, bfloat16, int8, gguf), adapters
    merged at load (name, folder, scale), the active unmerged LoRA deltas (per layer and weight:
    module, rows, rank, scale, and the adapter they belong to), ``kv_dtype`` (how the pool holds
    entries), the kernels (plain or tuned: other formulations sum in another order), the BLAS kernel
    and its thread count.
    """
    weights = model.transformer.weights
    owner = {id(d): (a.name, str(a.path)) for a in model.adapters for d in a.deltas}
    active = [
        [i, name, d.module, [d.rows.start, d.rows.stop], d.rank, float(d.scaling), owner.get(id(d), f"unnamed {id(d)}")]
        for i, layer in enumerate(weights.layers)
        for name, deltas in sorted(layer.lora.items())
        for d in deltas
    ]
    merged = [[a.name, str(a.path), float(a.scaling)] for a in model.adapters if a.mode == "merged"]
    facts = {
        "model": [model.name, str(model.path), repr(model.config), id(weights)],
        "weight_dtype": weights.weight_dtype,
        "merged": merged,
        "active": active,
        "kv_dtype": kv_dtype,
        "kernels": model.transformer.kernels.name,
        "blas": [blas_kernel(), blas_threads()],
    }
    text = json.dumps(facts, sort_keys=True, default=str).encode("utf-8")
    return hashlib.blake2b(text, digest_size=16, person=b"minillm-kv-id").digest()
