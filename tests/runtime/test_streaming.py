"""A request from prompt to stop: every stop condition through ``stream`` / ``generate``, with a
scripted model (exact values, milliseconds) and the real SmolLM2; the CLI flags and Ctrl-C."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import minillm
from minillm import KVCache, SamplingParams, StopReason, Tracer
from minillm.text.detokenize import REPLACEMENT_CHAR, detokenize
from minillm.errors import ContextWindowExceeded, InvalidRequestError
from minillm.text.tokenizer import Tokenizer

from scripted import EOT, ids_of, scripted_model, word_tokenizer_folder
from tokenizer_folders import byte_fallback_folder

ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0.0)
ISSUE_PIECES = ["AB", "C", "DEF", "G", "HI", "J", "KL"]


@pytest.fixture(scope="module")
def wtok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_folder(word_tokenizer_folder(tmp_path_factory.mktemp("words")))


@pytest.fixture(scope="module")
def bytetok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_folder(byte_fallback_folder(tmp_path_factory.mktemp("bytes")))


def run(model, prompt="X", **kwargs):
    """Stream a request; return (deltas, result)."""
    result: list = []
    kwargs.setdefault("max_new_tokens", 20)
    deltas = list(minillm.stream(model, prompt, kwargs.pop("params", GREEDY), result=result, **kwargs))
    assert "".join(deltas) == result[0].text  # the stream and the result agree
    assert "" not in deltas  # nothing empty is ever yielded
    return deltas, result[0]


# --- stop strings ------------------------------------------------------------------------------
def test_issue_pieces_with_stop_string_stream_exactly_abc(wtok):
    model = scripted_model(wtok, ids_of(wtok, *ISSUE_PIECES))
    deltas, r = run(model, stop=["DEFGHIJ"])
    assert deltas == ["AB", "C"] and r.text == "ABC"
    assert r.stop_reason is StopReason.STOP_STRING and r.stop_condition == "DEFGHIJ"
    assert r.ids == ids_of(wtok, "AB", "C", "DEF", "G", "HI", "J")  # the tokens the model did write
    assert model.transformer.calls == 6  # prefill + 5 decode steps: no forward pass after 'J'


def test_include_stop_string(wtok):
    deltas, r = run(scripted_model(wtok, ids_of(wtok, *ISSUE_PIECES)), stop=["DEFGHIJ"], include_stop_string=True)
    assert deltas == ["AB", "C", "DEFGHIJ"] and r.stop_reason is StopReason.STOP_STRING


def test_held_prefix_released_when_ruled_out(wtok):
    deltas, r = run(scripted_model(wtok, ids_of(wtok, "DE", "X")), stop=["DEFGHIJ"], max_new_tokens=2)
    assert deltas == ["DEX"] and r.stop_reason is StopReason.MAX_NEW_TOKENS


def test_held_prefix_flushed_at_max_tokens(wtok):
    deltas, r = run(scripted_model(wtok, ids_of(wtok, "AB", "DEF")), stop=["DEFGHIJ"], max_new_tokens=2)
    assert deltas == ["AB", "DEF"] and r.text == "ABDEF" and r.stop_reason is StopReason.MAX_NEW_TOKENS


def test_stop_string_inside_a_token_cuts_mid_token(wtok):
    deltas, r = run(scripted_model(wtok, ids_of(wtok, "AB", "DEF", "G")), stop=["EF"])
    assert deltas == ["AB", "D"] and r.stop_condition == "EF"


@pytest.mark.parametrize("stop", [[""], ["ok", ""]])
def test_empty_stop_string_is_an_invalid_request(wtok, stop):
    model = scripted_model(wtok, [])
    with pytest.raises(InvalidRequestError, match="stop string is empty"):
        minillm.generate(model, "X", stop=stop)
    assert model.transformer.calls == 0


# --- stop-token sequences ----------------------------------------------------------------------
def test_stop_token_sequence(wtok):
    script = ids_of(wtok, "AB", "C", "DEF", "G", "KL")
    seq = ids_of(wtok, "DEF", "G")
    deltas, r = run(scripted_model(wtok, script), stop_token_ids=[seq])
    assert deltas == ["AB", "C"] and r.stop_reason is StopReason.STOP_SEQUENCE and r.stop_condition == seq
    assert r.ids == script[:4]
    deltas, r = run(scripted_model(wtok, script), stop_token_ids=[seq], include_stop_string=True)
    assert deltas == ["AB", "C", "DEFG"]
    deltas, r = run(scripted_model(wtok, script), stop_token_ids=[ids_of(wtok, "DEF", "X")], max_new_tokens=5)
    assert deltas == ["AB", "C", "DEFG", "KL"] and r.stop_reason is StopReason.MAX_NEW_TOKENS  # held 'DEF' released


def test_empty_stop_sequence_is_an_invalid_request(wtok):
    with pytest.raises(InvalidRequestError, match="stop-token sequence is empty"):
        minillm.generate(scripted_model(wtok, []), "X", stop_token_ids=[[]])


# --- EOS set -----------------------------------------------------------------------------------
def test_second_eos_id_stops_and_prints_nothing(wtok):
    assert wtok.eos_token_ids == frozenset({1, EOT})  # tokenizer eos + generation_config [1, 106]
    assert wtok.decode([EOT]) == "<end_of_turn>"  # a plain token here: it *would* print if fed
    deltas, r = run(scripted_model(wtok, ids_of(wtok, "AB", "C") + [EOT, *ids_of(wtok, "KL")]))
    assert deltas == ["AB", "C"] and r.text == "ABC" and "<end_of_turn>" not in r.text
    assert r.ids[-1] == EOT and r.stop_reason is StopReason.EOS and r.stop_condition == EOT
    _, r = run(scripted_model(wtok, ids_of(wtok, "AB") + [1]))
    assert r.text == "AB" and r.stop_reason is StopReason.EOS


def test_eos_releases_a_held_stop_prefix(wtok):
    deltas, r = run(scripted_model(wtok, ids_of(wtok, "AB", "DEF") + [EOT]), stop=["DEFGHIJ"])
    assert deltas == ["AB", "DEF"] and r.stop_reason is StopReason.EOS


# --- the context window ------------------------------------------------------------------------
def twenty_token_prompt(tok) -> str:
    prompt = " ".join(["w"] * 19)  # + the <bos> the post-processor prepends
    assert len(minillm.tokenize(scripted_model(tok, []), prompt)) == 20
    return prompt


def test_context_of_32_prompt_20_gives_exactly_12_new_tokens(wtok):
    model = scripted_model(wtok, [], filler=ids_of(wtok, "C")[0], context=32)
    deltas, r = run(model, twenty_token_prompt(wtok), max_new_tokens=50)
    assert len(r.ids) == 12 and r.stop_reason is StopReason.CONTEXT_FULL and r.text == "C" * 12
    assert r.metrics.kv_bytes_used == 31 * r.metrics.kv_bytes_per_token  # the 12th token is never fed


def test_kv_cache_of_32_gives_exactly_12_new_tokens(wtok):
    model = scripted_model(wtok, [], context=4096)
    cache = KVCache.for_model(model.config, max_seq_len=32)
    _, r = run(model, twenty_token_prompt(wtok), max_new_tokens=50, cache=cache)
    assert len(r.ids) == 12 and r.stop_reason is StopReason.CONTEXT_FULL
    _, r = run(model, twenty_token_prompt(wtok), max_new_tokens=50, max_seq_len=32)
    assert len(r.ids) == 12 and r.stop_reason is StopReason.CONTEXT_FULL


def test_prompt_longer_than_the_context_fails_before_prefill(wtok):
    model = scripted_model(wtok, [], context=32)
    with pytest.raises(ContextWindowExceeded,
                       match=r"prompt is 40 tokens but the model holds 32 positions.*shorten the prompt to at most 31"):
        minillm.generate(model, " ".join(["w"] * 39))
    with pytest.raises(ContextWindowExceeded, match="prompt is 32 tokens .* no room for a new token"):
        minillm.generate(model, " ".join(["w"] * 31))
    assert model.transformer.calls == 0  # no forward pass ran
    big = scripted_model(wtok, [], context=4096)
    with pytest.raises(ContextWindowExceeded, match=r"KV cache holds 32 positions.*larger max_seq_len \(the model holds 4,096\)"):
        minillm.generate(big, " ".join(["w"] * 39), cache=KVCache.for_model(big.config, max_seq_len=32))


# --- cancellation, timeout, closing the stream -------------------------------------------------
def test_cancel_event_set_after_the_third_delta_stops_at_three_tokens(wtok):
    model = scripted_model(wtok, ids_of(wtok, *ISSUE_PIECES))
    cancel, result, deltas = threading.Event(), [], []
    for delta in minillm.stream(model, "X", GREEDY, cancel=cancel, result=result):
        deltas.append(delta)
        if len(deltas) == 3:
            cancel.set()
    r = result[0]
    assert deltas == ["AB", "C", "DEF"] and r.text == "ABCDEF" and len(r.ids) == 3
    assert r.stop_reason is StopReason.CANCELLED and r.stop_condition == "the cancel event was set"
    assert model.transformer.calls == 3  # the cancel was seen before a 4th forward pass


def test_cancel_callable_before_start_does_no_work(wtok):
    model = scripted_model(wtok, ids_of(wtok, "AB"))
    deltas, r = run(model, cancel=lambda: True)
    assert deltas == [] and r.ids == [] and r.stop_reason is StopReason.CANCELLED
    assert model.transformer.calls == 0
    with pytest.raises(InvalidRequestError, match="cancel must be"):
        minillm.generate(model, "X", cancel="yes")


@pytest.mark.parametrize("at, expected_text", [(0, ""), (2, "ABC")])
def test_keyboard_interrupt_during_the_forward_pass_is_a_clean_cancel(wtok, at, expected_text):
    model = scripted_model(wtok, ids_of(wtok, *ISSUE_PIECES), interrupt_at=at)
    cache = KVCache.for_model(model.config, max_seq_len=64)
    tracer = Tracer()
    _, r = run(model, cache=cache, tracer=tracer)
    assert r.text == expected_text and len(r.ids) == at
    assert r.stop_reason is StopReason.CANCELLED and r.stop_condition == "KeyboardInterrupt (Ctrl-C)"
    assert cache.length == 0  # request state freed
    stop = [e for e in tracer.events if e.phase == "stop"][0].data
    assert stop["reason"] == "cancelled" and "Ctrl-C" in stop["detail"]


def test_timeout_stops_between_steps(wtok):
    model = scripted_model(wtok, [], filler=ids_of(wtok, "C")[0], delay_s=0.05)
    _, r = run(model, timeout_s=0.12, max_new_tokens=100)
    assert r.stop_reason is StopReason.TIMEOUT and r.stop_condition == 0.12
    # Each step sleeps 0.05 s: checked between steps, the deadline lets at most 3 through (a busy
    # machine makes steps slower, so fewer), never the 100 asked for.
    assert 1 <= len(r.ids) <= 3 and r.text == "C" * len(r.ids)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), "1"])
def test_bad_timeout(wtok, bad):
    with pytest.raises(InvalidRequestError, match="timeout_s must be"):
        minillm.generate(scripted_model(wtok, []), "X", timeout_s=bad)


def test_closing_the_stream_early_is_a_cancel_and_frees_the_cache(wtok):
    model = scripted_model(wtok, ids_of(wtok, *ISSUE_PIECES))
    cache = KVCache.for_model(model.config, max_seq_len=64)
    result: list = []
    gen = minillm.stream(model, "X", GREEDY, cache=cache, result=result)
    assert next(gen) == "AB"
    gen.close()
    assert result[0].stop_reason is StopReason.CANCELLED and result[0].text == "AB" and cache.length == 0


# --- request state and the repetition penalty --------------------------------------------------
def test_second_request_on_the_same_cache_equals_a_fresh_one(wtok):
    model = scripted_model(wtok, ids_of(wtok, *ISSUE_PIECES))
    cache = KVCache.for_model(model.config, max_seq_len=64)
    first = minillm.generate(model, "X Y", cache=cache, stop=["DEF"])
    assert cache.length == 0 and cache.max_seq_len == 64  # emptied, memory kept
    again = minillm.generate(model, "X", cache=cache, max_new_tokens=5)
    fresh = minillm.generate(model, "X", max_new_tokens=5)
    assert (again.text, again.ids, again.stop_reason) == (fresh.text, fresh.ids, fresh.stop_reason) == \
        ("ABCDEFGHI", ids_of(wtok, *ISSUE_PIECES[:5]), StopReason.MAX_NEW_TOKENS)
    assert first.text == "ABC"


def test_repetition_penalty_counts_the_prompt_ids(wtok):
    c, g = ids_of(wtok, "C", "G")
    logits = np.full(wtok.vocab_size, -10.0, dtype=np.float32)
    logits[c], logits[g] = 2.0, 1.5
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    model = scripted_model(wtok, [], logits=logits)
    # 'C' is in the prompt: 2.0 / 2 = 1.0 < 1.5, so 'G' first; then both are seen: C 1.0 > G 0.75.
    assert minillm.generate(model, "C", params, max_new_tokens=4).ids == [g, c, c, c]
    assert minillm.generate(model, "X", params, max_new_tokens=4).ids == [c, g, c, c]


# --- detokenization inside a request -----------------------------------------------------------
def test_byte_fallback_character_streams_whole(bytetok):
    script = [bytetok.backend.token_to_id(f"<0x{b}>") for b in ("E5", "BE", "88")]
    deltas, r = run(scripted_model(bytetok, script), "a", max_new_tokens=3)
    assert deltas == ["很"] and r.text == "很"


def test_cut_mid_character_at_max_tokens_flushes_without_raising(bytetok):
    script = [bytetok.backend.token_to_id(f"<0x{b}>") for b in ("E5", "BE", "88")]
    deltas, r = run(scripted_model(bytetok, script), "a", max_new_tokens=2)
    assert r.stop_reason is StopReason.MAX_NEW_TOKENS
    assert r.text == detokenize(bytetok, script[:2]) and r.text.endswith(REPLACEMENT_CHAR)


def test_completion_keeps_the_first_space_a_chat_answer_does_not(bytetok):
    paris = bytetok.encode("Paris", add_special_tokens=False).tolist()  # ['▁Paris']
    assert run(scripted_model(bytetok, paris), "a", max_new_tokens=len(paris))[0] == [" Paris"]
    chat_tok = Tokenizer(bytetok.backend, special_tokens=bytetok.special_tokens,
                         chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    _, r = run(scripted_model(chat_tok, paris), [{"role": "user", "content": "a"}], max_new_tokens=len(paris))
    assert r.text == "Paris" == detokenize(bytetok, paris)  # a fresh text, as transformers decodes it


# --- chat template and BOS ---------------------------------------------------------------------
def test_chat_ids_have_exactly_one_bos(wtok):
    model = scripted_model(wtok, [])
    messages = [{"role": "user", "content": "AB"}]
    ids = minillm.tokenize(model, messages).tolist()
    assert ids == [2, *ids_of(wtok, "<start_of_turn>", "user", "AB"), EOT, *ids_of(wtok, "<start_of_turn>", "model")]
    # The trap avoided: the rendered text holds <bos>; the post-processor would add a second.
    rendered = wtok.apply_chat_template(messages)
    assert wtok.encode(rendered, add_special_tokens=True).tolist()[:2] == [2, 2]
    assert minillm.tokenize(model, "AB").tolist() == [2, 3]  # completion: the post-processor's one BOS


# --- the trace's stop event --------------------------------------------------------------------
def stop_event(tracer):
    (event,) = [e for e in tracer.events if e.phase == "stop"]
    return event.data


def test_trace_names_the_reason_and_the_condition(wtok):
    from rich.console import Console

    console = Console(record=True, width=100)
    tracer = Tracer(console, verbosity="summary")
    run(scripted_model(wtok, ids_of(wtok, *ISSUE_PIECES)), stop=["XYZ", "DEFGHIJ"], tracer=tracer)
    d = stop_event(tracer)
    assert (d["reason"], d["condition"], d["text"]) == ("stop string", "DEFGHIJ", "ABC")
    assert d["detail"] == "stop string 'DEFGHIJ' appeared in the text; output cut before it"
    shown = console.export_text()
    assert "stop: stop string" in shown and "'DEFGHIJ'" in shown

    tracer = Tracer()
    run(scripted_model(wtok, [], context=32), twenty_token_prompt(wtok), max_new_tokens=50, tracer=tracer)
    d = stop_event(tracer)
    assert d["reason"] == "context full"
    assert d["detail"] == "prompt 20 + new 12 = 32 positions fill the context of 32"

    tracer = Tracer()
    run(scripted_model(wtok, ids_of(wtok, "AB") + [EOT]), tracer=tracer)
    assert stop_event(tracer)["detail"] == "token 106 '<end_of_turn>' is in the EOS set [1, 106]"


# --- the real model ----------------------------------------------------------------------------
REAL_20 = "The capital of France is a city that has been the center of many important events in history, and"


def test_real_model_context_of_32_gives_12_tokens(smollm2):
    assert len(minillm.tokenize(smollm2, REAL_20)) == 20
    r = minillm.generate(smollm2, REAL_20, GREEDY, max_new_tokens=50, max_seq_len=32)
    assert len(r.ids) == 12 and r.stop_reason is StopReason.CONTEXT_FULL
    cache = KVCache.for_model(smollm2.config, max_seq_len=32)
    again = minillm.generate(smollm2, REAL_20, GREEDY, max_new_tokens=50, cache=cache)
    assert again.ids == r.ids and again.stop_reason is StopReason.CONTEXT_FULL


def test_real_model_prompt_longer_than_context_fails_fast(smollm2, monkeypatch):
    calls = []
    forward = smollm2.transformer.forward
    monkeypatch.setattr(smollm2.transformer, "forward", lambda *a, **k: calls.append(a) or forward(*a, **k))
    with pytest.raises(ContextWindowExceeded, match=r"prompt is 8,200 tokens but the model holds 8,192 positions"):
        minillm.generate(smollm2, " a" * 8200)  # ' a' is one token each
    assert calls == []  # refused before any forward pass: no prefill over 8,192 positions ran
    with pytest.raises(ContextWindowExceeded, match="prompt is 20 tokens but the KV cache holds 16"):
        minillm.generate(smollm2, REAL_20, max_seq_len=16)


def test_real_model_stop_string_and_cache_reuse(smollm2):
    cache = KVCache.for_model(smollm2.config, max_seq_len=64)
    first = minillm.generate(smollm2, "The capital of France is", GREEDY, max_new_tokens=8, stop=["\n"], cache=cache)
    assert first.text == " Paris." and first.stop_reason is StopReason.STOP_STRING and first.stop_condition == "\n"
    assert cache.length == 0
    second = minillm.generate(smollm2, "Once upon a time", GREEDY, max_new_tokens=6, cache=cache)
    fresh = minillm.generate(smollm2, "Once upon a time", GREEDY, max_new_tokens=6)
    assert (second.text, second.ids) == (fresh.text, fresh.ids)


def test_real_model_chat_ids_start_with_im_start_and_nothing_is_prepended(smollm2):
    messages = [{"role": "user", "content": "Hi!"}]
    rendered = smollm2.tokenizer.apply_chat_template(messages)
    ids = minillm.tokenize(smollm2, messages).tolist()
    assert rendered.startswith("<|im_start|>system\n")
    assert ids[0] == 1 and ids[1] != 1  # <|im_start|> once, nothing before it
    assert ids == smollm2.tokenizer.encode(rendered, add_special_tokens=False).tolist()
    assert minillm.tokenize(smollm2, "The capital").tolist()[0] == 504  # completion: no BOS added either


def test_real_model_seeded_sampling_repeats(smollm2):
    params = SamplingParams(temperature=1.0, top_k=20, seed=123)
    a = minillm.generate(smollm2, "Once upon a time", params, max_new_tokens=6)
    b = minillm.generate(smollm2, "Once upon a time", params, max_new_tokens=6)
    assert a.ids == b.ids


@pytest.mark.parametrize("params, most", [
    (SamplingParams(temperature=0.7, top_k=3, seed=0), 3),
    (SamplingParams(temperature=1.0, top_p=0.5, seed=0), 5),
])
def test_trace_shows_kept_candidates_and_their_probabilities(smollm2, hf_smollm2, params, most):
    """The prefill's candidates are transformers' processors applied to transformers' logits."""
    import torch
    from transformers.generation import logits_process as lp

    tracer = Tracer()
    prompt = "The capital of France is"
    minillm.generate(smollm2, prompt, params, max_new_tokens=4, tracer=tracer)
    (prefill,) = [e.data for e in tracer.events if e.phase == "prefill"]
    ids = torch.tensor([minillm.tokenize(smollm2, prompt).tolist()])
    with torch.no_grad():
        scores = hf_smollm2(ids).logits[:, -1, :]  # [1, vocab], the reference's own logits
    chain = [lp.TemperatureLogitsWarper(params.temperature)]
    chain += [lp.TopKLogitsWarper(params.top_k)] if params.top_k else []
    chain += [lp.TopPLogitsWarper(params.top_p)] if params.top_p < 1 else []
    for processor in chain:
        scores = processor(ids, scores)
    probs = torch.softmax(scores, dim=-1)[0].numpy()
    kept = np.flatnonzero(probs > 0)
    expected = sorted(kept.tolist(), key=lambda i: -probs[i])[:5]
    assert [p for p, _ in prefill["candidates"]] == [smollm2.tokenizer.piece_for_display(i) for i in expected]
    np.testing.assert_allclose([q for _, q in prefill["candidates"]], probs[expected], atol=1e-4)
    steps = [e.data for e in tracer.events if e.phase == "decode"]
    assert len(steps) == 3
    for d in steps:
        assert 1 <= len(d["candidates"]) <= most
        assert d["piece"] in [p for p, _ in d["candidates"]]  # the chosen token was a kept one
        if len(d["candidates"]) < 5:  # every kept candidate is shown: the renormalised mass is 1
            assert abs(sum(q for _, q in d["candidates"]) - 1.0) < 1e-5
    if params.top_k:
        assert len(prefill["candidates"]) == 3 and len(kept) == 3


# --- the command -------------------------------------------------------------------------------
def test_cli_flags_for_every_parameter():
    from minillm.cli import build_parser

    args = build_parser().parse_args([
        "run", "hi", "--stop", "\n", "--stop", "END", "--stop-token-ids", "2", "--stop-token-ids", "28,29",
        "--include-stop-string", "--timeout", "1.5", "--max-seq-len", "32", "-t", "0.7", "--top-k", "5",
        "--top-p", "0.9", "--min-p", "0.05", "--repetition-penalty", "1.2", "--seed", "3"])
    assert args.stop == ["\n", "END"] and args.stop_token_ids == [[2], [28, 29]]
    assert args.include_stop_string and args.timeout == 1.5 and args.max_seq_len == 32
    assert (args.temperature, args.top_k, args.top_p, args.min_p, args.repetition_penalty, args.seed) == \
        (0.7, 5, 0.9, 0.05, 1.2, 3)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "hi", "--stop-token-ids", "a,b"])


def test_cli_stop_string_quiet(smollm2, capsys):
    from minillm.cli import main

    assert main(["run", "The capital of France is", "-n", "8", "--stop", "\n", "-v", "quiet"]) == 0
    assert capsys.readouterr().out == " Paris.\n"
    assert main(["run", "The capital of France is", "-n", "8", "--stop", "", "-v", "quiet"]) == 2
    assert "stop string is empty" in capsys.readouterr().err


def test_cli_context_full_and_timeout(smollm2, capsys):
    from minillm.cli import main

    assert main(["run", REAL_20, "-n", "50", "--max-seq-len", "32", "-v", "summary"]) == 0
    out = capsys.readouterr().out
    assert "stop: context full" in out and "prompt 20 + new 12 = 32 positions fill the context of 32" in out
    assert main(["run", "Once upon a time", "-n", "400", "--timeout", "0.5", "-v", "summary"]) == 0
    assert "stop: timed out" in capsys.readouterr().out


def test_cli_ctrl_c_cancels_cleanly_with_the_partial_text(smollm2):
    """SIGINT after the first decode steps: the request ends with reason 'cancelled', exit 130."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "120"}
    proc = subprocess.Popen([sys.executable, "-m", "minillm.cli", "run", "Once upon a time", "-n", "400", "-v", "full"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            decoding = any("prefill" in seen for seen in lines)  # past the tokenize table
            if decoding and re.match(r"^\s+3\s+\d+\s", line):  # decode step 3 printed: tokens flow
                proc.send_signal(signal.SIGINT)
                break
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines) + out
    assert proc.returncode == 130, err
    assert "stop: cancelled" in out and "max new tokens" not in out
    assert re.search(r"output: \S", out)  # the partial text is shown
    new_tokens = int(re.search(r"new tokens\s+(\d+)", out).group(1))
    assert 3 < new_tokens < 400
    assert "cancelled by Ctrl-C" in err and "Traceback" not in err


def test_cli_threads_flag_runs_the_blas_on_that_many_threads(smollm2):
    """In a child process: ``--threads`` sets the BLAS threads for the whole process."""
    import json

    proc = subprocess.run([sys.executable, "-m", "minillm.cli", "run", "The capital of France is", "-n", "3",
                           "--threads", "1", "--trace", "json"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    load = next(e for e in events if e["phase"] == "load")
    assert load["data"]["blas"] and all(line.endswith(", 1 thread") for line in load["data"]["blas"])
    assert next(e for e in events if e["phase"] == "stop")["data"]["text"] == " Paris.\n"
