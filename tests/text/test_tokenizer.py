"""minillm.text.tokenizer against transformers' tokenizer on the same SmolLM2-135M-Instruct folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from tokenizer_folders import smollm2_tokenizer_folder

from minillm.errors import ChatTemplateError, TokenizerError
from minillm.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return smollm2_tokenizer_folder(tmp_path_factory)


@pytest.fixture(scope="module")
def tok(folder) -> Tokenizer:
    return Tokenizer.from_folder(folder)


@pytest.fixture(scope="module")
def hf_tok(folder):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(folder))


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Name three primes."},
     {"role": "assistant", "content": "2, 3, 5."},
     {"role": "user", "content": "Now in Chinese: 很好 😀"}],
    [{"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!\n\nHow can I help?"},
     {"role": "user", "content": "  spaces  and\ttabs  "}],
]


# --- loading -------------------------------------------------------------------------------------
def test_special_tokens(tok):
    assert tok.vocab_size == 49152
    assert (tok.bos_token, tok.bos_token_id) == ("<|im_start|>", 1)
    assert tok.eos_token_ids == frozenset({2})
    assert {0, 1, 2} <= tok.special_token_ids
    assert tok.chat_template and "im_start" in tok.chat_template


def test_missing_tokenizer_json_names_folder_and_fix(tmp_path):
    with pytest.raises(TokenizerError, match=str(tmp_path)) as err:
        Tokenizer.from_folder(tmp_path)
    assert "tokenizer.json" in str(err.value) and "convert" in str(err.value)


def test_eos_ids_are_the_union_of_all_config_files(folder, tmp_path):
    shutil.copy(folder / "tokenizer.json", tmp_path)
    shutil.copy(folder / "tokenizer_config.json", tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 106]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert Tokenizer.from_folder(tmp_path).eos_token_ids == frozenset({1, 2, 106})


def test_template_read_from_tokenizer_config(folder, tmp_path):
    # Older transformers (and converters) keep the template inside tokenizer_config.json.
    shutil.copy(folder / "tokenizer.json", tmp_path)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = Tokenizer.from_folder(tmp_path)
    assert t.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user]hi"


# --- encode / decode -----------------------------------------------------------------------------
PLAIN = ["The capital of France is", " Paris.", "x² + y³ = ½", "很好 😀 emoji", "def f(x):\n    return 12345",
         "<|im_start|>user\nhi<|im_end|>", ""]


@pytest.mark.reference
@pytest.mark.parametrize("text", PLAIN)
def test_encode_matches_transformers(tok, hf_tok, text):
    ids = tok.encode(text)
    assert ids.dtype == np.int64 and ids.ndim == 1
    assert ids.tolist() == hf_tok.encode(text)
    assert tok.decode(ids) == hf_tok.decode(ids.tolist(), skip_special_tokens=True)


def test_decode_special_tokens(tok):
    ids = tok.encode("<|im_start|>hi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"


def test_pieces(tok):
    (capital,) = tok.encode(" capital")
    assert tok.id_to_piece(capital) == "Ġcapital"
    assert tok.piece_for_display(capital) == "␣capital"
    (newline,) = tok.encode("\n")
    assert tok.piece_for_display(newline) == "↵"
    assert tok.piece_for_display(1) == "<|im_start|>"
    with pytest.raises(TokenizerError, match="not in the vocabulary"):
        tok.id_to_piece(10**6)


def test_piece_for_display_shows_partial_utf8_escaped(tok):
    # '很' is E5 BE 88; SmolLM2 splits it into two tokens, neither a whole character.
    assert [tok.piece_for_display(i) for i in tok.encode("很")] == ["\\xe5\\xbe", "\\x88"]
    assert [tok.piece_for_display(i) for i in tok.encode("x² é\n\n")] == ["x", "²", "␣é", "↵↵"]


# --- chat templates ------------------------------------------------------------------------------
@pytest.mark.reference
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_transformers(tok, hf_tok, messages):
    expected = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(messages) == expected
    no_prompt = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == no_prompt


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_ids_have_one_bos_per_message(tok, messages):
    ids = tok.encode_chat(messages)
    assert ids.dtype == np.int64 and ids[0] == 1  # <|im_start|>, nothing prepended
    default_system = messages[0]["role"] != "system"  # SmolLM2's template adds one
    assert int((ids == 1).sum()) == len(messages) + default_system + 1  # + the assistant header
    header = tok.encode("<|im_start|>assistant\n", add_special_tokens=False).tolist()
    assert ids[-len(header):].tolist() == header


@pytest.mark.reference
def test_chat_ids_match_transformers(tok, hf_tok):
    for messages in CONVERSATIONS:
        expected = hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        if isinstance(expected, dict) or hasattr(expected, "keys"):  # transformers 5 returns a BatchEncoding
            expected = expected["input_ids"]
        assert tok.encode_chat(messages).tolist() == list(expected)


def with_template(tok: Tokenizer, template: str | None) -> Tokenizer:
    return Tokenizer(tok.backend, special_tokens=tok.special_tokens, chat_template=template)


def test_template_variables(tok):
    t = with_template(tok, "{{ bos_token }}|{{ eos_token }}|{{ add_generation_prompt }}|"
                           "{{ messages | tojson }}|{{ strftime_now('%Y') | length }}")
    out = t.apply_chat_template([{"role": "user", "content": "<é>"}])
    assert out == '<|im_start|>|<|im_end|>|True|[{"role": "user", "content": "<é>"}]|4'


def test_raise_exception_carries_the_template_message(tok):
    t = with_template(tok, "{% if messages[0].role != 'system' %}"
                           "{{ raise_exception('Conversations must start with a system message') }}{% endif %}")
    with pytest.raises(ChatTemplateError, match="Conversations must start with a system message"):
        t.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__mro__ }}",
    "{{ messages.append({'role': 'user', 'content': 'x'}) }}",  # the sandbox is immutable
    "{% set ns = namespace(__init__=1) %}",
])
def test_sandbox_blocks_internals(tok, template):
    with pytest.raises(ChatTemplateError, match="sandbox forbids"):
        with_template(tok, template).apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_syntax_and_render_errors(tok):
    with pytest.raises(ChatTemplateError, match="syntax error on line 1"):
        with_template(tok, "{% for m in messages %}").apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ChatTemplateError, match="failed to render"):
        with_template(tok, "{{ messages[0].content + 1 }}").apply_chat_template([{"role": "user", "content": "hi"}])


def test_no_template_says_use_completion_mode(tok):
    with pytest.raises(ChatTemplateError, match="no chat template.*completion mode"):
        with_template(tok, None).apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("messages, match", [
    # transformers drops a None content; SmolLM2's template then adds an undefined value (jinja2's
    # UndefinedError there too): the template's error, as a ChatTemplateError.
    ([{"role": "user", "content": None}], "failed to render: UndefinedError: 'dict object' has no attribute 'content'"),
    ([{"role": "user", "content": "hi"}, "oops"], "message 1 is a str"),
    ([], "messages is empty"),
    ("hello", "messages must be a list"),
])
def test_bad_messages(tok, messages, match):
    with pytest.raises(ChatTemplateError, match=match):
        tok.apply_chat_template(messages)


@pytest.mark.reference
def test_the_template_decides_the_roles(tok, hf_tok):
    """No fixed list of roles: SmolLM2's template writes any role, and transformers renders the same."""
    messages = [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]
    expected = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>robot\nbeep<|im_end|>" in expected
    assert tok.apply_chat_template(messages) == expected


def test_special_tokens_show_whitespace_and_their_texts_are_listed_once(tmp_path):
    """A special token's own whitespace is made visible like any piece's; the special texts
    (for the trace and the leak check) are computed once per tokenizer."""
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import WordLevel

    backend = Backend(WordLevel(vocab={"<unk>": 0, "hi": 1, "<end of\nturn>": 2}, unk_token="<unk>"))
    backend.add_special_tokens(["<unk>", "<end of\nturn>"])
    backend.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_folder(tmp_path)
    assert tok.piece_for_display(2) == "<end␣of↵turn>"
    assert tok.piece_for_display(1) == "hi"
    assert tok.special_token_texts == ("<unk>", "<end of\nturn>")
    assert tok.special_token_texts is tok.special_token_texts  # cached
