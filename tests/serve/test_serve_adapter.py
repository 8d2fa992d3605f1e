"""`minillm serve MODEL --adapter FOLDER`: a PEFT LoRA adapter merged into the served weights at load.

- through the official ``openai`` client, greedy chat and completion answers (8 tokens) equal
  ``minillm.generate`` on ``minillm.load(MODEL, adapters=[FOLDER])`` in this process, and differ from
  the base model's; GET /v1/models' card names the adapter;
- with several models (``SERVERS["several"]``: MODEL and its int8 twin, a budget for one) every model
  merges the adapter at its load: both answer as ``minillm.load(MODEL, weight_dtype, adapters=[FOLDER])``
  does here (the int8 one loaded on demand, after MODEL's eviction) and both cards name it;
- a model held as packed GGUF blocks (``MODEL:gguf``) cannot merge it (as
  ``minillm.load`` refuses it): refused before anything loads (exit status 2, the problem and the fix);
- a folder that is no adapter (missing, or without adapter_config.json) is refused before the bind
  with the message ``minillm.load`` gives; an adapter whose shapes do not fit fails the load, and
  GET /health answers 503 with that error (the pattern of every load failure).

The adapter is tests/support/lora_folders.py's: seeded, rank 4 on the last two layers' down_proj.
"""

from __future__ import annotations

import gc

import httpx
import pytest
from cli_runs import run_cli
from lora_folders import smollm2_adapter
from openai import OpenAI
from servers import MODEL, SECOND, SERVERS, running_server, wait_for

import minillm
from benchmarks.server_process import free_port
from minillm.errors import AdapterError, InvalidRequestError
from minillm.model import lora

PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TOKENS = 8
NAME = "smollm2-lora-test"  # the adapter's folder, so its name


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    return smollm2_adapter(tmp_path_factory.mktemp("lora") / NAME)


def greedy_answers(model) -> dict[str, str]:
    """The completion of PROMPT and the chat answer to QUESTION, greedy, TOKENS tokens, in this process."""
    greedy = minillm.SamplingParams(temperature=0.0)
    return {
        "completion": minillm.generate(model, PROMPT, greedy, max_new_tokens=TOKENS).text,
        "chat": minillm.generate(model, QUESTION, greedy, max_new_tokens=TOKENS).text,
    }


@pytest.fixture(scope="module")
def expected(smollm2, adapter):
    """The base model's answers (the session's SmolLM2) and the adapted model's at float32 and int8
    (each loaded here, freed after)."""
    answers = {"base": greedy_answers(smollm2)}
    for key, weight_dtype in (("adapted", "float32"), ("adapted int8", "int8")):
        adapted = minillm.load(MODEL, adapters=[adapter], weight_dtype=weight_dtype, progress=False)
        assert [a.name for a in adapted.adapters] == [NAME] and adapted.adapters[0].mode == "merged"
        answers[key] = greedy_answers(adapted)
        del adapted
        gc.collect()
    return answers


def test_the_adapter_changes_both_answers(expected):
    """The helper's adapter really changes greedy text (else the server test below could not fail)."""
    for kind in ("completion", "chat"):
        assert expected["base"][kind] and expected["adapted"][kind]
        assert expected["adapted"][kind] != expected["base"][kind], kind


def test_the_server_answers_with_the_adapter_merged(tmp_path, adapter, expected):
    with running_server(tmp_path, "--adapter", str(adapter), "--verbosity", "quiet") as (url, log):
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=TOKENS, temperature=0)
        completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=TOKENS, temperature=0)
        cards = httpx.get(url + "/v1/models").json()["data"]
        card = httpx.get(url + f"/v1/models/{MODEL}").json()
    got = {"completion": completion.choices[0].text, "chat": chat.choices[0].message.content}
    assert got == expected["adapted"]
    assert got["completion"] != expected["base"]["completion"] and got["chat"] != expected["base"]["chat"]
    assert [(c["id"], c["adapters"]) for c in cards] == [(MODEL, [NAME])] and card["adapters"] == [NAME]
    assert f"minillm serve: {MODEL} + adapter {adapter} on " in " ".join(log.read_text().split())


def test_every_model_of_a_several_model_server_merges_the_adapter(tmp_path, adapter, expected):
    """MODEL is loaded at start; asking for SECOND evicts it (the budget holds one) and loads SECOND with
    the adapter merged into its float32 rows before they are held at int8."""
    flags = (*SERVERS["several"], "--adapter", str(adapter), "--verbosity", "quiet")
    with running_server(tmp_path, *flags) as (url, log):
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        got = {}
        for model in (MODEL, SECOND):
            chat = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=TOKENS, temperature=0)
            completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=TOKENS, temperature=0)
            got[model] = {"completion": completion.choices[0].text, "chat": chat.choices[0].message.content}
        cards = httpx.get(url + "/v1/models").json()["data"]
    assert got == {MODEL: expected["adapted"], SECOND: expected["adapted int8"]}
    assert [(c["id"], c["state"], c["adapters"]) for c in cards] == [
        (MODEL, "unloaded", [NAME]),
        (SECOND, "loaded", [NAME]),
    ]
    assert f"minillm serve: {MODEL}, {SECOND} + adapter {adapter} on " in " ".join(log.read_text().split())


def test_an_adapter_with_packed_gguf_weights_is_refused_before_anything_loads(adapter):
    served = f"{MODEL}:gguf"  # (--weight-dtype has no gguf choice: only a model's suffix asks for it)
    run = run_cli("serve", MODEL, "--adapter", str(adapter), "--model", served, "--port", str(free_port()), timeout=120)
    message = " ".join(run.stderr.split())
    assert run.returncode == 2, run.stdout + run.stderr
    assert message == (
        f"error: --adapter cannot be merged into {served} held at gguf: its weights stay packed GGUF blocks, and "
        "a LoRA delta is merged into float32 rows; serve it at float32, bfloat16 or int8 (drop its :gguf)"
    )
    with pytest.raises(InvalidRequestError, match="weight_dtype='gguf' keeps the GGUF's blocks packed"):
        minillm.load(MODEL, weight_dtype="gguf", adapters=[adapter])  # the load refuses it as well
    assert run.stdout == ""  # no plan, no banner: nothing loaded


@pytest.mark.parametrize("broken", ["missing", "no-config"])
def test_a_folder_that_is_no_adapter_is_refused_with_the_loads_message(tmp_path, smollm2, broken):
    folder = tmp_path / "not-an-adapter"
    if broken == "no-config":
        folder.mkdir()
        (folder / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(AdapterError) as caught:  # what minillm.load raises for it (its adapter step)
        lora.load_adapter(folder, smollm2.config, smollm2.transformer.weights)
    words = {"missing": "does not exist", "no-config": "adapter_config.json is missing"}[broken]
    assert str(folder) in str(caught.value) and words in str(caught.value)
    run = run_cli("serve", MODEL, "--adapter", str(folder), "--port", str(free_port()), timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    said = " ".join(str(caught.value).split())  # rich wraps stderr's long line
    assert " ".join(run.stderr.split()) == f"error: --adapter {folder}: AdapterError: {said}"
    assert run.stdout == ""


def test_an_adapter_that_does_not_fit_fails_the_load_and_health_says_why(tmp_path, smollm2):
    wrong = smollm2_adapter(tmp_path / "for-a-wider-model", d_model=768)  # B [768, 4]: SmolLM2's d_model is 576
    with pytest.raises(AdapterError) as caught:
        lora.load_adapter(wrong, smollm2.config, smollm2.transformer.weights)
    assert "has shape (768, 4), expected (576, 4)" in str(caught.value)
    with running_server(tmp_path, "--adapter", str(wrong), wait_ready=False) as (url, _):
        health = wait_for(url, lambda r: r is not None and r.json()["status"] == "failed", None, None)
        models = httpx.get(url + "/v1/models").json()["data"]
    assert health.status_code == 503
    assert health.json()["error"] == f"AdapterError: {caught.value}"
    assert models == [{"id": MODEL, "object": "model", "created": models[0]["created"], "owned_by": "minillm",
                       "adapters": ["for-a-wider-model"]}]  # fmt: skip
