"""OpenAI's sampling fields and a grammar on the command line (issue 29): `minillm run` and `minillm chat`
take --frequency-penalty, --presence-penalty, --logit-bias ID=BIAS and --json-schema / --regex / --grammar,
and they mean there what they mean in the library.

The parsing tests need no model; the last one runs the real SmolLM2 (the session's, not loaded again).
"""

from __future__ import annotations

import json

import jsonschema
import pytest

import minillm
from minillm import Constraint, SamplingParams
from minillm.cli import build_parser, main
from minillm.cli.options import constraint_of


def parse(*argv: str):
    return build_parser().parse_args(["run", "Hi", *argv])


def test_the_flags_are_the_sampling_params():
    args = parse("--frequency-penalty", "0.5", "--presence-penalty", "-1", "--logit-bias", "28=-100",
                 "--logit-bias", "2=5", "--seed", "3", "-t", "0.7")
    p = SamplingParams.from_fields(args)
    assert (p.frequency_penalty, p.presence_penalty, p.logit_bias, p.seed, p.temperature) == (
        0.5, -1.0, ((2, 5.0), (28, -100.0)), 3, 0.7)
    assert SamplingParams.from_fields(parse()) == SamplingParams(temperature=0.0)  # no flag: greedy, nothing else


def test_the_constraint_flags_take_text_or_a_file(tmp_path):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    assert constraint_of(parse("--json-schema", json.dumps(schema))) == Constraint.json_schema(schema)
    (tmp_path / "s.json").write_text(json.dumps(schema))
    assert constraint_of(parse("--json-schema", str(tmp_path / "s.json"))) == Constraint.json_schema(schema)
    assert constraint_of(parse("--regex", "[0-9]+")) == Constraint.regex("[0-9]+")
    (tmp_path / "g.lark").write_text('start: "yes" | "no"')
    assert constraint_of(parse("--grammar", str(tmp_path / "g.lark"))) == Constraint.lark('start: "yes" | "no"')
    assert constraint_of(parse()) is None


def test_bad_flags_name_the_form_or_the_range(capsys, monkeypatch):
    def load(*args, **kwargs):
        raise AssertionError("a bad flag must be refused before the model loads")

    monkeypatch.setattr(minillm, "load", load)
    with pytest.raises(SystemExit) as exit_:
        parse("--logit-bias", "28:-100")
    assert exit_.value.code == 2 and "expected ID=BIAS such as 28=-100, got '28:-100'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse("--regex", "a", "--grammar", "b")  # one constraint at a time
    assert "not allowed with argument" in capsys.readouterr().err
    # refused before any model is loaded
    assert main(["run", "Hi", "--frequency-penalty", "3", "-v", "quiet"]) == 2
    assert "frequency_penalty must be in [-2, 2]" in capsys.readouterr().err
    assert main(["run", "Hi", "--json-schema", "{not json", "-v", "quiet"]) == 2
    assert "--json-schema is neither a file nor JSON" in capsys.readouterr().err


@pytest.mark.slow
def test_run_and_chat_follow_the_bias_and_the_schema(smollm2, monkeypatch, capsys):
    monkeypatch.setattr(minillm, "load", lambda *args, **kwargs: smollm2)
    assert main(["run", "List five fruits:", "--logit-bias", "28=100", "-n", "6", "-v", "quiet"]) == 0
    assert capsys.readouterr().out == ",,,,,,\n"  # id 28 is ","
    schema = {"type": "object", "properties": {"fruit": {"enum": ["apple", "pear"]}, "count": {"type": "integer",
              "minimum": 1, "maximum": 9}}, "required": ["fruit", "count"], "additionalProperties": False}
    assert main(["chat", "Name a fruit and a count, as JSON.", "--json-schema", json.dumps(schema), "-n", "40",
                 "-t", "1", "--seed", "0", "-v", "quiet"]) == 0
    jsonschema.validate(json.loads(capsys.readouterr().out), schema)


def test_top_logprobs_prints_each_tokens_logprob_and_its_alternatives(smollm2, monkeypatch, capsys):
    """--top-logprobs N: after the answer, one row per new token with the numbers generate gives."""
    monkeypatch.setattr(minillm, "load", lambda *args, **kwargs: smollm2)
    assert SamplingParams.from_fields(parse("--top-logprobs", "2")).top_logprobs == 2
    assert main(["run", "The capital of France is", "-n", "3", "--top-logprobs", "2", "-v", "quiet"]) == 0
    out = capsys.readouterr().out
    want = minillm.generate(smollm2, "The capital of France is", SamplingParams(temperature=0.0, top_logprobs=2),
                            max_new_tokens=3)
    assert out.startswith(want.text + "\n")
    rows = [line for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [int(r.split()[0]) for r in rows] == [0, 1, 2]
    for row, lp in zip(rows, want.logprobs):
        assert f" {lp['id']} " in row and f" {lp['logprob']:.4f} " in row
        assert len(lp["top"]) == 2 and all(f" {v:.3f}" in row for _, v in lp["top"])
    assert main(["run", "Hi", "--top-logprobs", "21", "-v", "quiet"]) == 2
    assert "top_logprobs must be None or a whole number in [0, 20]" in " ".join(capsys.readouterr().err.split())
