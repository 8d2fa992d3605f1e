"""The prefix cache's identity: every input of a KV block, not only its token ids (issue 31, kind 2).

Each test shares one paged pool across a change of one input (the active LoRA adapters, their
scale, the weights' precision, the model, the BLAS threads), then compares with a cold run on a
fresh pool: the same greedy ids, and nothing served from blocks computed under the other setting.
The models are tiny random Llamas with SmolLM2's vocabulary and tokenizer (a few MiB, seconds).
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import minillm
from minillm.runtime.kv_identity import kv_identity

PROMPT = "The quick brown fox jumps over the lazy dog, and then the dog chases the fox around the yard."
BLOCK = 4


def _tiny_folder(root, smollm2, seed: int):
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=smollm2.config.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # random weights of a wide spread: the greedy ids depend visibly on the keys
        for p in hf.parameters():
            if p.dim() == 2:
                p.mul_(20.0)
    folder = root / f"tiny-{seed}"
    hf.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2.path / name, folder / name)
    return hf, folder


def _adapter(hf, folder):
    import peft
    import torch

    torch.manual_seed(3)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(hf, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(8.0)
    model.save_pretrained(folder)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2):
    root = tmp_path_factory.mktemp("identity")
    hf, a = _tiny_folder(root, smollm2, seed=0)
    _, b = _tiny_folder(root, smollm2, seed=1)
    _adapter(hf, root / "adapter")
    return a, b, root / "adapter"


def load(folder, **kwargs):
    return minillm.load(str(folder), progress=False, warmup=False, **kwargs)


def new_pool(model):
    return minillm.KVCachePool.for_model(model.config, kv_cache_mib=1.0, block_size=BLOCK)


def run(model, pool):
    """Greedy ids of PROMPT through ``pool``, and how many prompt tokens came from its cache."""
    r = minillm.generate_batch(model, [PROMPT], max_new_tokens=12, pool=pool)[0]
    return r.ids, r.metrics.cached_prompt_tokens


def check_shared_equals_cold(before, after, pool=None):
    """Run ``before()`` then ``after()`` on one pool, ``after()`` again on a fresh pool: the same ids,
    nothing cached across the change; the same setting again finds its own blocks."""
    model_before = before()
    pool = pool or new_pool(model_before)
    first, _ = run(model_before, pool)
    model_after = after()
    shared, cached = run(model_after, pool)
    cold, _ = run(model_after, new_pool(model_after))
    assert cached == 0
    assert shared == cold
    again, cached_again = run(model_after, pool)
    assert again == cold and cached_again > 0  # the cache still works within one setting
    return first, cold


def test_lora_adapter_on_and_off(tiny):
    a, _, adapter = tiny
    model = load(a, adapters=[adapter], merge_adapters=False)
    name = model.adapters[0].name

    def base():
        model.set_active_adapters([])
        return model

    def lora():
        model.set_active_adapters([name])
        return model

    base_ids, lora_ids = check_shared_equals_cold(base, lora)
    assert base_ids != lora_ids  # the adapter changes the answer, so a stale block would show
    pool = new_pool(model)
    run(lora(), pool)
    shared, cached = run(base(), pool)  # and the reverse: base after the adapter
    assert cached == 0 and shared == base_ids


def test_lora_scale(tiny):
    a, _, adapter = tiny
    model = load(a, adapters=[adapter], merge_adapters=False)
    model.set_active_adapters([model.adapters[0].name])

    def scaled():
        for d in model.adapters[0].deltas:
            d.scaling *= 3.0
        return model

    check_shared_equals_cold(lambda: model, scaled)


@pytest.mark.parametrize("weight_dtype", ["bfloat16", "int8"])
def test_weight_precision(tiny, weight_dtype):
    a, _, _ = tiny
    check_shared_equals_cold(lambda: load(a), lambda: load(a, weight_dtype=weight_dtype))


def test_another_model_of_the_same_shape(tiny):
    a, b, _ = tiny
    first, second = check_shared_equals_cold(lambda: load(a), lambda: load(b))
    assert first != second


def test_blas_threads(tiny):
    from threadpoolctl import threadpool_limits

    a, _, _ = tiny
    model = load(a)
    pool = new_pool(model)
    with threadpool_limits(limits=1, user_api="blas"):
        one = kv_identity(model)
        run(model, pool)
    with threadpool_limits(limits=2, user_api="blas"):
        assert kv_identity(model) != one
        shared, cached = run(model, pool)
        cold, _ = run(model, new_pool(model))
    assert cached == 0 and shared == cold


def test_identity_names_the_kv_dtype_and_is_stable(tiny):
    a, _, _ = tiny
    model = load(a)
    assert kv_identity(model) == kv_identity(model) == kv_identity(model, "float32")
    assert len({kv_identity(model, d) for d in ("float32", "float16", "int8")}) == 3
    pool = new_pool(model)
    ids = np.arange(3 * BLOCK)
    assert pool.block_hashes(ids, identity=b"x")[0] != pool.block_hashes(ids)[0]
    assert pool.block_hashes(ids, identity=b"x")[1:] != pool.block_hashes(ids)[1:]  # the chain carries it


def test_kernels(tiny):
    # the same weights object under the plain and the tuned kernels (other formulations, other roundings)
    import copy

    from minillm.model.kernels import PLAIN
    from minillm.model.transformer import Transformer

    a, _, _ = tiny
    tuned = load(a)
    plain = copy.copy(tuned)
    plain.transformer = Transformer(tuned.config, tuned.transformer.weights, PLAIN)
    assert plain.transformer.weights is tuned.transformer.weights and plain.transformer.kernels is not tuned.transformer.kernels
    assert kv_identity(plain) != kv_identity(tuned)
    check_shared_equals_cold(lambda: tuned, lambda: plain)
