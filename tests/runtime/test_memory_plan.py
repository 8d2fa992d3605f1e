"""The memory plan (minillm/runtime/memory_plan.py): sizes from the config, equal to what a load holds."""

from __future__ import annotations

import pytest
from tiny_families import CASES, build

from minillm.errors import InvalidRequestError, MemoryBudgetError
from minillm.model.config import ModelConfig
from minillm.model.weights import hold_weights, load_weights
from minillm.runtime import memory_plan as mp

MIB, GIB = 2**20, 2**30


@pytest.mark.parametrize(
    "text, n", [("2GiB", 2 * GIB), ("512MiB", 512 * MIB), ("1.5GiB", 3 * GIB // 2), ("1GB", 10**9), ("4096", 4096)]
)
def test_sizes_accept_mib_and_gib(text, n):
    assert mp.parse_size(text) == n


@pytest.mark.parametrize("text", ["2 parsecs", "-1GiB", "0MiB", "GiB", ""])
def test_a_bad_size_names_the_units(text):
    with pytest.raises(InvalidRequestError, match="MiB, GiB"):
        mp.parse_size(text)


@pytest.mark.reference
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("weight_dtype", ["float32", "bfloat16", "int8"])
def test_planned_weights_are_the_bytes_a_load_holds(name, weight_dtype, tmp_path):
    folder, _ = build(CASES[name], tmp_path)
    config = ModelConfig.from_folder(folder)
    weights = hold_weights(load_weights(folder, config), weight_dtype)
    held = {fmt: nbytes for fmt, (_, nbytes) in weights.formats().items()}
    assert mp.weight_bytes(config, weight_dtype) == held


def test_smollm2_weights_and_kv_line(smollm2):
    config = ModelConfig.from_folder(smollm2.path)
    assert mp.weight_bytes(config, "float32") == {"float32": 538_060_032}
    assert mp.weight_bytes(config, "int8") == {"int8": 135_298_560, "float32": 140_544}
    plan = mp.make_plan(config, model="smollm2", context=2048, kv_cache_mib=64, block_size=16)
    assert plan.kv_bytes_per_token == 2 * 30 * 3 * 64 * 4
    assert plan.kv_tokens == 1456  # floor(64 MiB / (16 * 46,080 B)) = 91 blocks of 16
    assert plan.kv_line() == "KV cache: 1,456 tokens, maximum concurrency at context 2,048: 0.71x"


def test_the_budget_leaves_the_pool_what_remains(smollm2):
    config = ModelConfig.from_folder(smollm2.path)
    plan = mp.make_plan(config, model="s", context=1024, budget=GIB, tokenizer=10 * MIB, runtime=80 * MIB)
    fixed = plan.weights_total + plan.activations + 90 * MIB
    per_block = 16 * plan.kv_bytes_per_token
    assert plan.kv_pool == (GIB - fixed) // per_block * per_block
    assert plan.total <= GIB < plan.total + per_block


def test_a_model_that_cannot_hold_one_request_is_refused_with_the_numbers(smollm2):
    config = ModelConfig.from_folder(smollm2.path)
    with pytest.raises(MemoryBudgetError) as info:
        mp.make_plan(config, model="smollm2", budget=256 * MIB, runtime=80 * MIB)
    msg = str(info.value)
    assert "weights 513.1 MiB" in msg and "budget is 256.0 MiB" in msg and "8,192 positions" in msg


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma3-270m"])
def test_gguf_planned_from_the_header_is_the_bytes_a_gguf_load_holds(name):
    from minillm.model.gguf_weights import load_gguf_weights
    from minillm.runtime.gguf_plan import gguf_weight_bytes
    from minillm.sources.hub import resolve_gguf, resolve_model

    config = ModelConfig.from_folder(resolve_model(name, progress=False).path)
    path = resolve_gguf(name, progress=False)
    planned = gguf_weight_bytes(path, config)
    held = {fmt: nbytes for fmt, (_, nbytes) in load_gguf_weights(path, config).formats().items()}
    assert planned == held
    if name == "smollm2-135m-instruct":  # Q4_1 layers, a Q8_0 embedding (tied), float32 norms
        assert planned == {"Q4_1": 66_355_200, "Q8_0": 30_081_024, "float32": 140_544}
    plan = mp.make_plan(config, model=name, weight_dtype="gguf", weights=planned, context=512, kv_cache_mib=32)
    assert plan.weights_total == sum(held.values()) and plan.weights == planned


def test_gguf_without_the_header_names_where_to_get_its_sizes(tmp_path):
    folder, _ = build(CASES[next(iter(CASES))], tmp_path)
    with pytest.raises(InvalidRequestError, match="gguf_weight_bytes"):
        mp.weight_bytes(ModelConfig.from_folder(folder), "gguf")
