"""A conversation: turns sharing one KV cache (``minillm.Conversation``, ``minillm chat`` with no prompt).

What must hold: each turn's ids are ``generate``'s on the accumulated messages (greedy), and a turn
prefills only the ids past what the cache holds (the shared prefix of the cached ids and the new
templated conversation), falling back to the common prefix when an answer re-tokenizes differently.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from scripted import EOT, ids_of, scripted_model, word_tokenizer_folder

import minillm
from minillm.cli.chat import converse
from minillm.errors import ContextWindowExceeded, InvalidRequestError
from minillm.text.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
TURNS = ["What is the capital of France?", "And of Italy?", "Which one is bigger?"]


@pytest.fixture(scope="module")
def wtok(tmp_path_factory) -> Tokenizer:
    """The scripted word tokenizer; its template writes the assistant's role as "assistant" (an unknown word)."""
    return Tokenizer.from_folder(word_tokenizer_folder(tmp_path_factory.mktemp("words")))


@pytest.fixture(scope="module")
def gtok(tmp_path_factory) -> Tokenizer:
    """The same, with Gemma's habit: the assistant's turns are written as "model", as the generation prompt opens them."""
    folder = word_tokenizer_folder(tmp_path_factory.mktemp("gemma-words"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = config["chat_template"].replace(
        "{{ m['role'] }}", "{{ 'model' if m['role'] == 'assistant' else m['role'] }}")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_folder(folder)


# --- the scripted model: exactly which ids each forward pass was fed --------------------------------
def prompt_ids(model, messages) -> list[int]:
    return minillm.tokenize(model, messages).tolist()


def test_the_second_turn_feeds_only_the_ids_past_the_cached_ones(gtok):
    DEF, HI = ids_of(gtok, "DEF", "HI")
    model = scripted_model(gtok, [DEF, EOT, HI, EOT])  # turn 1 answers "DEF", turn 2 "HI"
    chat = minillm.Conversation(model, max_seq_len=64)
    first = chat.reply("AB")
    assert (first.text, first.ids) == ("DEF", [DEF, EOT])
    ids1 = prompt_ids(model, [{"role": "user", "content": "AB"}])
    assert chat.cached_ids == ids1 + [DEF]  # the EOS was sampled, never fed
    second = chat.reply("HI")
    ids2 = prompt_ids(model, chat.messages[:3])
    assert ids2[: len(ids1) + 1] == ids1 + [DEF]  # "DEF" re-tokenizes to the id the model produced
    assert model.transformer.fed[2] == ids2[len(ids1) + 1 :]  # turn 2's prefill: <end_of_turn> <start_of_turn> ...
    assert len(model.transformer.fed[2]) == 7 and second.metrics.cached_prompt_tokens == len(ids1) + 1
    assert second.text == "HI" and chat.messages[-1] == {"role": "assistant", "content": "HI"}


def test_an_answer_that_re_tokenizes_differently_is_recomputed_from_the_common_prefix(gtok):
    DEF, G, HI = ids_of(gtok, "DEF", "G", "HI")
    model = scripted_model(gtok, [DEF, G, EOT, HI, EOT])  # "DEF" + "G" decode to "DEFG": one unknown word
    chat = minillm.Conversation(model, max_seq_len=64)
    assert chat.reply("AB").text == "DEFG"
    ids1 = prompt_ids(model, [{"role": "user", "content": "AB"}])
    second = chat.reply("HI")
    ids2 = prompt_ids(model, chat.messages[:3])
    assert ids2[len(ids1)] == gtok.backend.token_to_id("<unk>")  # not DEF: the cached ids stop matching here
    assert model.transformer.fed[3] == ids2[len(ids1) :]  # fed from the common prefix on
    assert second.metrics.cached_prompt_tokens == len(ids1) and second.text == "HI"


def test_a_template_that_writes_an_earlier_turn_differently_is_recomputed_from_there(wtok):
    DEF, HI = ids_of(wtok, "DEF", "HI")
    model = scripted_model(wtok, [DEF, EOT, HI, EOT])
    chat = minillm.Conversation(model, max_seq_len=64)
    chat.reply("AB")
    ids1 = prompt_ids(model, [{"role": "user", "content": "AB"}])  # ends <start_of_turn> model
    chat.reply("HI")
    ids2 = prompt_ids(model, chat.messages[:3])  # the answer's turn reads <start_of_turn> assistant
    assert ids2[len(ids1) - 1] != ids1[-1] and ids2[: len(ids1) - 1] == ids1[:-1]
    assert model.transformer.fed[2] == ids2[len(ids1) - 1 :]


def test_a_conversation_that_outgrows_its_cache_keeps_its_history(wtok):
    DEF = ids_of(wtok, "DEF")[0]
    model = scripted_model(wtok, [DEF, EOT])
    chat = minillm.Conversation(model, max_seq_len=16)
    chat.reply("AB")
    history, cached = list(chat.messages), list(chat.cached_ids)
    with pytest.raises(ContextWindowExceeded, match="KV cache holds 16 positions"):
        chat.reply("AB C " * 4)
    assert chat.messages == history and chat.cached_ids == cached
    with pytest.raises(InvalidRequestError, match=r"unknown turn option\(s\) \['cache'\]"):
        chat.reply("AB", cache=None)


# --- the real model: three turns through stdin ------------------------------------------------------
@pytest.fixture()
def fed_lengths(smollm2, monkeypatch) -> list[int]:
    """The number of ids of every forward pass of the shared SmolLM2."""
    lengths: list[int] = []
    forward = smollm2.transformer.forward

    def spy(token_ids, cache=None, **kwargs):
        lengths.append(len(token_ids))
        return forward(token_ids, cache, **kwargs)

    monkeypatch.setattr(smollm2.transformer, "forward", spy)
    return lengths


@pytest.mark.slow
def test_three_turns_through_stdin_give_generates_ids_and_prefill_only_the_new_tokens(smollm2, fed_lengths):
    stdout = io.StringIO()
    chat = minillm.Conversation(smollm2, max_seq_len=1024)
    results = converse(chat, None, {"max_new_tokens": 24}, stdin=io.StringIO("".join(t + "\n" for t in TURNS)),
                       stdout=stdout)
    assert stdout.getvalue() == "".join(f"> {r.text}\n" for r in results) + "> \n"  # Ctrl-D (end of input) leaves
    assert [r.text for r in results] == ["The capital of France is Paris.", "The capital of Italy is Rome.",
                                         "The capital of France is Paris and the capital of Italy is Rome."]
    prefills = [i for i, n in enumerate(fed_lengths) if i == 0 or n > 1]  # decode steps feed one id
    assert len(prefills) == 3
    messages: list[dict] = []
    for k, (text, turn) in enumerate(zip(TURNS, results, strict=True)):
        messages.append({"role": "user", "content": text})
        alone = minillm.generate(smollm2, list(messages), max_new_tokens=24)
        assert (turn.prompt_ids, turn.ids) == (alone.prompt_ids, alone.ids)  # the same ids as generate, greedy
        messages.append({"role": "assistant", "content": turn.text})
        if k == 0:
            assert fed_lengths[prefills[0]] == len(turn.prompt_ids)
            continue
        before = results[k - 1]
        cached = len(before.prompt_ids) + len(before.ids) - 1  # everything but the EOS the last turn sampled
        assert turn.metrics.cached_prompt_tokens == cached  # the earlier turns re-tokenize to the cached ids
        assert fed_lengths[prefills[k]] == len(turn.prompt_ids) - cached  # prefill: only the new tokens
    assert [fed_lengths[i] for i in prefills] == [37, 15, 16]


@pytest.mark.slow
def test_minillm_chat_without_a_prompt_is_a_conversation_on_stdin(smollm2):
    env = {**os.environ, "COLUMNS": "200"}
    proc = subprocess.run([sys.executable, "-m", "minillm", "chat", "-n", "24", "--no-warmup", "--threads", "1"],
                          input="".join(t + "\n" for t in TURNS[:2]), capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "> The capital of France is Paris.\n> The capital of Italy is Rome.\n> \n"
