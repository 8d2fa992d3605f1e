"""Small PEFT LoRA adapter folders for SmolLM2-135M, built with NumPy in PEFT's layout (lesson 9's
format: ``adapter_config.json`` + ``adapter_model.safetensors``, names ``base_model.model.<module>.lora_A.weight``
``[r, in]`` and ``...lora_B.weight`` ``[out, r]``), seeded, so a server test and a deploy test can serve one.

The adapter is random, not trained: rank 4 on the last two layers' ``down_proj``, with a scaling
(``lora_alpha / r``) large enough that greedy answers change (tests/serve/test_serve_adapter.py
checks that they do, against the base model).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

#: SmolLM2-135M's sizes (its config.json): d_model, the MLP's width, layers.
D_MODEL, FFN, LAYERS = 576, 1536, 30
RANK, ALPHA = 4, 16.0  # scaling alpha / r = 4


def write_adapter(folder: Path, tensors: dict[str, np.ndarray], *, r: int = RANK, alpha: float = ALPHA) -> Path:
    """Write ``tensors`` (PEFT names -> float32 arrays) and a LoRA ``adapter_config.json`` to ``folder``."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    targets = sorted({name.split(".lora_")[0].rsplit(".", 1)[-1] for name in tensors})
    config = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": targets, "use_rslora": False,
              "fan_in_fan_out": False, "bias": "none",
              "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return folder


def smollm2_adapter(folder: Path, *, seed: int = 0, layers: tuple[int, ...] = (LAYERS - 2, LAYERS - 1),
                    d_model: int = D_MODEL) -> Path:  # fmt: skip
    """A seeded rank-4 LoRA on ``layers``' ``mlp.down_proj`` (``[d_model, FFN]``) of SmolLM2-135M.

    A ``[4, FFN]`` and B ``[d_model, 4]`` are standard normal, A divided by sqrt(FFN): the update
    ``4 * B @ A`` has entries of about 0.2, as large as the base weights' (0.18 in layer 29). ``d_model`` other than
    576 gives an adapter whose B does not fit the model (the shape error's test)."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in layers:
        name = f"base_model.model.model.layers.{i}.mlp.down_proj"
        tensors[f"{name}.lora_A.weight"] = (rng.standard_normal((RANK, FFN)) / np.sqrt(FFN)).astype(np.float32)
        tensors[f"{name}.lora_B.weight"] = rng.standard_normal((d_model, RANK)).astype(np.float32)
    return write_adapter(folder, tensors)
