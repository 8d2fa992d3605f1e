"""The prefix cache's identity beyond a model's name, folder and config (issue 49).

Two models built in memory can agree on all three and still differ in their weights (a student's
edited copy, a fine-tune loaded into the same folder name, two random initialisations): their keys
and values for the same ids differ, so a block one computed must never be served to the other.
``kv_identity`` names the very weights object for that; here two tiny Llamas (tests/support/
tiny_models.py, NumPy only) share name, path and config and differ only in their weights' values.
"""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import tiny_tensors, tiny_word_model

import minillm
from minillm.model.transformer import Transformer
from minillm.model.weights import load_weights
from minillm.runtime.kv_identity import kv_identity
from minillm.runtime.loading import Model

PROMPT = "AB C DEF G HI J KL X Y Z"  # 11 ids with <bos>: two full blocks of 4 to share
BLOCK = 4


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """(a, b): the same name, path and config; b's weights are a's with the attention scaled."""
    a = tiny_word_model(tmp_path_factory.mktemp("twin-a"))
    other = tiny_tensors(108)
    for name in other:
        if "self_attn" in name:
            other[name] = other[name] * np.float32(3.0)
    folder_b = tiny_word_model(tmp_path_factory.mktemp("twin-b"), other).path
    b = Model(a.name, a.path, a.config, a.tokenizer, Transformer(a.config, load_weights(folder_b, a.config)), None)
    assert (b.name, b.path, repr(b.config)) == (a.name, a.path, repr(a.config))
    return a, b


def new_pool(model):
    return minillm.KVCachePool.for_model(model.config, kv_cache_mib=0.05, block_size=BLOCK)


def run(model, pool):
    """Greedy ids of PROMPT through ``pool`` and how many prompt tokens came from its cache."""
    r = minillm.generate_batch(model, [PROMPT], max_new_tokens=6, pool=pool)[0]
    return r.ids, r.metrics.cached_prompt_tokens


def test_two_in_memory_models_of_one_name_path_and_config_never_share_blocks(twins):
    a, b = twins
    pool = new_pool(a)
    first, cached = run(a, pool)
    assert cached == 0
    again, cached = run(a, pool)  # the cache works within one model: (11 - 1) // 4 = 2 blocks
    assert (again, cached) == (first, 8)
    shared, cached = run(b, pool)
    cold, _ = run(b, new_pool(b))
    assert cached == 0 and shared == cold
    assert cold != first  # b answers otherwise, so a block of a's served to b would show
    assert kv_identity(a) != kv_identity(b)


def test_the_same_weights_under_another_model_object_share(twins):
    """The identity is the weights, not the Model object: a second Model around a's transformer finds a's blocks."""
    a, _ = twins
    same = Model(a.name, a.path, a.config, a.tokenizer, a.transformer, None)
    assert kv_identity(same) == kv_identity(a)
    pool = new_pool(a)
    first, _ = run(a, pool)
    assert run(same, pool) == (first, 8)
