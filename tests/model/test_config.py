"""config.json's fields (minillm/model/config.py): an unsupported family or a missing or inconsistent field is
a ConfigError naming the field and the fix; at load it names the file.
"""

from __future__ import annotations

import json
import re

import pytest
from broken_folders import load
from tiny_models import tiny_config

from minillm.errors import ConfigError
from minillm.model.config import ModelConfig

BASE = tiny_config(300)


@pytest.mark.parametrize("model_type", ["mamba", None])
def test_unknown_model_type_lists_the_supported_families(model_type):
    with pytest.raises(ConfigError, match=rf"model_type {model_type!r} is not supported; minillm implements: "
                                          r"llama \(llama\), gpt2 \(gpt2\), qwen2 \(qwen2\), qwen3 \(qwen3\), "
                                          r"gemma3_text \(gemma3\)\. Use a model of one of these families"):
        ModelConfig.from_dict({**BASE, "model_type": model_type})


@pytest.mark.parametrize("edit, match", [
    ({"num_attention_heads": 3}, "num_attention_heads=3 does not divide hidden_size=8 and no head_dim is given; "
                                 "fix the config or add head_dim"),
    ({"num_attention_heads": 4, "num_key_value_heads": 3},
     "num_key_value_heads=3 does not divide num_attention_heads=4; grouped-query attention needs a whole number"),
    ({"vocab_size": None}, "required field 'vocab_size' is missing; add it to config.json"),
    ({"intermediate_size": None}, "required field 'intermediate_size' is missing"),
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0; fix config.json"),
    ({"hidden_size": "8"}, "hidden_size must be a positive integer, got '8'"),
    ({"max_position_embeddings": -1}, "max_position_embeddings must be a positive integer, got -1"),
])
def test_missing_or_inconsistent_config_fields(edit, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict({**BASE, **edit}, source="x/config.json")


def test_config_errors_at_load_name_the_file(folder, no_forward):
    (folder / "config.json").write_text(json.dumps({**tiny_config(10), "num_key_value_heads": 3}))
    with pytest.raises(ConfigError, match=rf"{re.escape(str(folder / 'config.json'))}: num_key_value_heads=3"):
        load(folder)
    (folder / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(ConfigError, match="config.json is not valid JSON .*re-download the model"):
        load(folder)
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="expected a JSON object of fields, got list"):
        load(folder)
