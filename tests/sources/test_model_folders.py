"""Finding a model folder and reading its safetensors: every way a folder or a file can be broken gets an
error that names it and the fix, caught while loading (the forward pass booby-trapped: ``no_forward``).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from broken_folders import load, rewrite, shard
from tiny_models import FFN, LAYERS, D, save, tiny_tensors

import minillm
from minillm.errors import ModelNotFoundError, TokenizerError, WeightsError
from minillm.text.tokenizer import Tokenizer


def test_the_tiny_folder_loads_and_runs(folder):
    model = load(folder)  # the baseline every case below breaks
    out = minillm.generate(model, "AB C", max_new_tokens=2)
    assert len(out.ids) >= 1 and model.config.hidden_size == D


# --- finding a model -----------------------------------------------------------------------------
def test_unknown_model_name_suggests_the_closest_names(monkeypatch):
    monkeypatch.delenv("MINILLM_MANIFEST", raising=False)
    with pytest.raises(ModelNotFoundError, match=r"unknown model 'smollm2-135m-instrut': did you mean "
                                                 r"'smollm2-135m-instruct'\? `minillm models` lists"):
        minillm.load("smollm2-135m-instrut")


def test_path_that_does_not_exist(tmp_path):
    with pytest.raises(ModelNotFoundError, match=rf"no such folder: {re.escape(str(tmp_path))}/nowhere; pass a "
                                                 r"model folder \(it needs config.json"):
        load(tmp_path / "nowhere")


def test_folder_without_config_json(folder):
    (folder / "config.json").unlink()
    with pytest.raises(ModelNotFoundError, match="has no config.json, so it is not a model folder; a model folder "
                                                 "needs config.json, model.safetensors"):
        load(folder)


def test_folder_without_tokenizer_json(folder, no_forward):
    (folder / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match=rf"no tokenizer.json in {re.escape(str(folder))}; .*Download it with "
                                             "the model, or convert a GGUF"):
        load(folder)


def test_folder_without_weights(folder, no_forward):
    (folder / "model.safetensors").unlink()
    with pytest.raises(WeightsError, match=rf"no \*.safetensors weights in {re.escape(str(folder))}; download"):
        load(folder)


# --- safetensors: every way a file can be broken, all caught while loading -----------------------
def test_truncated_file(folder, no_forward):
    file = folder / "model.safetensors"
    data = file.read_bytes()
    for cut in (0, 5, 9, 100, len(data) - 1):
        file.write_bytes(data[:cut])
        with pytest.raises(WeightsError, match=rf"cannot read {re.escape(str(file))}: .*; the file is corrupt or "
                                               "truncated. Re-download it"):
            load(folder)


def test_header_length_beyond_the_file(folder, no_forward):
    file = folder / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes((10**6).to_bytes(8, "little") + data[8:])
    with pytest.raises(WeightsError, match=f"cannot read {re.escape(str(file))}: Error while deserializing header: "
                                           "invalid header length; the file is corrupt or truncated"):
        load(folder)


def test_corrupt_json_header(folder, no_forward):
    file = folder / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[8] = ord("X")  # the header's opening '{'
    file.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match="invalid JSON in header: expected value at line 1 column 1; the file is "
                                           "corrupt or truncated. Re-download it."):
        load(folder)


@pytest.mark.parametrize("offsets, match", [
    ([0, 10**7], r"invalid offset for tensor `model.norm.weight`; the file is corrupt or truncated"),
    ([-4, 28], r"invalid JSON in header: invalid value: integer `-4`, expected usize at line 1 column \d+; the file"),
    ([0, "32"], r"invalid JSON in header: invalid type: string \"32\", expected usize at line 1 column \d+; the"),
])
def test_data_offsets_outside_the_file(folder, no_forward, offsets, match):
    rewrite(folder / "model.safetensors", lambda h: h["model.norm.weight"].update(data_offsets=offsets))
    with pytest.raises(WeightsError, match=match):
        load(folder)


def test_a_dtype_minillm_does_not_read(folder, no_forward):
    tensors = tiny_tensors(Tokenizer.from_folder(folder).vocab_size)
    tensors["model.layers.0.mlp.up_proj.weight"] = np.zeros((FFN, D), np.int32)
    save(tensors, folder / "model.safetensors")
    with pytest.raises(WeightsError, match=r"tensor 'model.layers.0.mlp.up_proj.weight': model.safetensors stores "
                                           r"this tensor as I32; minillm reads F32, F16, BF16, F64. Convert"):
        load(folder)


def test_a_tensor_missing(folder, no_forward):
    tensors = tiny_tensors(Tokenizer.from_folder(folder).vocab_size)
    del tensors["model.layers.0.mlp.down_proj.weight"]
    save(tensors, folder / "model.safetensors")
    with pytest.raises(WeightsError, match=rf"tensor 'model.layers.0.mlp.down_proj.weight' is missing from "
                                           rf"{re.escape(str(folder))}; the checkpoint is incomplete"):
        load(folder)


def test_a_tensor_of_the_wrong_shape(folder, no_forward):
    tensors = tiny_tensors(Tokenizer.from_folder(folder).vocab_size)
    tensors["model.layers.0.mlp.gate_proj.weight"] = np.zeros((12, D), np.float32)
    save(tensors, folder / "model.safetensors")
    with pytest.raises(WeightsError, match=r"tensor 'model.layers.0.mlp.gate_proj.weight' has shape \(12, 8\), "
                                           r"expected \(16, 8\) from config.json; the weights and config.json"):
        load(folder)


def test_sharded_folder_loads(folder):
    shard(folder, {})
    assert load(folder).config.num_hidden_layers == LAYERS


def test_a_shard_index_naming_a_missing_shard(folder, no_forward):
    shard(folder, {})
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(WeightsError, match=r"model.safetensors.index.json names shard "
                                           r"'model-00002-of-00002.safetensors', which is missing from .*; re-download"):
        load(folder)


def test_a_corrupt_shard_index(folder, no_forward):
    shard(folder, {})
    (folder / "model.safetensors.index.json").write_text('{"weight_map": {"a": 3}}')
    with pytest.raises(WeightsError, match="is not a valid shard index .*weight_map.* re-download the model"):
        load(folder)
