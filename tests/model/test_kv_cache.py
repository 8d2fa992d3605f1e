"""Lesson 1's KV cache (minillm/model/kv_cache.py) refuses a write past its size and a model of another shape,
with the numbers and the fix; a refused write changes nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
from broken_folders import load
from tiny_models import CONTEXT, HEADS, KV_HEADS, D

import minillm
from minillm.errors import ContextWindowExceeded, KVCacheFullError, KVCacheMismatchError
from minillm.model.kv_cache import KVCache


def test_kv_cache_full_and_built_for_another_model(folder):
    model = load(folder)
    cache = KVCache.for_model(model.config, max_seq_len=6)
    model.transformer.forward(np.arange(4), cache)
    with pytest.raises(KVCacheFullError, match=r"the KV cache holds 6 positions, 4 are filled and 3 more were asked "
                                               "for; shorten the prompt, lower max_new_tokens or build the cache"):
        model.transformer.forward(np.arange(3), cache)
    assert cache.length == 4  # a refused write changes nothing
    other = KVCache(num_layers=2, num_kv_heads=KV_HEADS, head_dim=D // HEADS, max_seq_len=6)
    with pytest.raises(KVCacheMismatchError, match=r"this KV cache is shaped \(layers, kv_heads, head_dim\)=\(2, 1, 4\) "
                                                   r"but the model needs \(1, 1, 4\); build one with KVCache.for_model"):
        model.transformer.forward(np.arange(3), other)
    with pytest.raises(KVCacheFullError, match=f"max_seq_len=33 is longer than the model's context of {CONTEXT}"):
        KVCache.for_model(model.config, max_seq_len=CONTEXT + 1)
    # prefill's prompt meets the forward's one room check: the numbers and the fix
    with pytest.raises(ContextWindowExceeded, match=r"the KV cache holds 2 positions, 0 are filled and 4 more were "
                                                    r"asked for; shorten the prompt"):
        minillm.prefill(model, np.arange(4), KVCache.for_model(model.config, max_seq_len=2))
