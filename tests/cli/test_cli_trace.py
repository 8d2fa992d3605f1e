"""The trace `minillm run` prints (issue 41): ``-v`` alone is accepted (it means ``full``), and with
colours forced into a pipe (no terminal) the answer is printed once, never as repeated "streaming:" lines.

Fast tests run the CLI in process on the scripted model (tests/support/scripted.py); one runs
`minillm run` on the default model as a subprocess, as a user with ``FORCE_COLOR=1`` piping it would.
"""

from __future__ import annotations

import io
import os
import re

import pytest
from cli_runs import run_cli
from rich.console import Console
from scripted import ids_of, scripted_model

import minillm
from minillm.cli import build_parser, main
from minillm.cli.options import bare_verbosity
from minillm.observe.render import on_a_terminal

PROMPT = "The capital of France is"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # colours, cursor moves and line erases


@pytest.mark.parametrize(
    ("argv", "verbosity", "prompt"),
    [
        (["run", PROMPT, "-v"], "full", PROMPT),  # last
        (["run", "-v", PROMPT], "full", PROMPT),  # before the prompt: not taken for a level
        (["run", "-v", "-n", "3", PROMPT], "full", PROMPT),  # before another option
        (["run", "--verbosity", PROMPT], "full", PROMPT),
        (["run", "-v", "steps", PROMPT], "steps", PROMPT),  # a level stays a level
        (["run", PROMPT, "-v", "summary"], "summary", PROMPT),
        (["run", PROMPT], None, PROMPT),  # no -v: the command's default (steps for run)
        (["chat", "-v", "Hi there"], "full", "Hi there"),
        (["run", "--", "-v"], None, "-v"),  # after --, -v is the prompt
    ],
)
def test_bare_v_means_full_wherever_it_stands(argv, verbosity, prompt):
    args = build_parser().parse_args(bare_verbosity(argv))
    assert (args.verbosity, args.prompt) == (verbosity, prompt)


def test_a_misspelt_level_is_still_refused_with_the_levels_named(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(bare_verbosity(["run", "-v", "summry", PROMPT]))
    assert exit_.value.code == 2
    err = " ".join(capsys.readouterr().err.split()).replace("'", "")  # Python 3.12.8 stopped quoting the choices
    assert "argument --verbosity/-v: invalid choice: summry (choose from quiet, summary, steps, full)" in err


def test_help_says_what_v_alone_means(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    assert "-v alone means -v full" in " ".join(capsys.readouterr().out.split())


@pytest.fixture()
def scripted_load(monkeypatch, wtok):
    """``minillm.load`` returns a scripted model whose greedy answer is 'ABCDEFGHI'."""
    monkeypatch.setattr(minillm, "load", lambda name=None, **kw: scripted_model(
        wtok, ids_of(wtok, "AB", "C", "DEF", "G", "HI")))
    monkeypatch.setenv("COLUMNS", "100")


def test_bare_v_runs_a_request_at_full_verbosity(scripted_load, capsys):
    """Exit 0 (argparse said 'expected one argument', exit 2, before); every step and the full summary."""
    assert main(["run", "AB C", "-n", "5", "--no-warmup", "-v"]) == 0
    out = capsys.readouterr().out
    assert "output: ABCDEFGHI" in out
    steps = [line.split()[4] for line in out.splitlines() if re.match(r"^\s+\d+\s+\d+\s+\S+ -> ", line)]
    assert steps == ["C", "DEF", "G", "HI"]  # steps 1-4, none folded
    assert "causal mask" in out and "memory: 0 parameters, context 256" in out  # full's own sections


def test_forced_colours_without_a_terminal_print_the_text_once(wtok):
    """A console with colours forced (as FORCE_COLOR makes rich's) writing to a pipe: no Live view,
    whose redraws would stay in the output as "streaming:" lines (10 here before, and the answer 3 times)."""
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=100)
    assert console.is_terminal and not on_a_terminal(console)
    tracer = minillm.Tracer(console, verbosity="full")
    minillm.generate(scripted_model(wtok, ids_of(wtok, "AB", "C", "DEF", "G", "HI")), "AB C", max_new_tokens=5,
                     tracer=tracer)
    out = ANSI.sub("", buffer.getvalue())
    assert "streaming:" not in out and "\r" not in out
    assert out.count("ABCDEFGHI") == 1 and "output: ABCDEFGHI\n" in out


def test_a_real_terminal_gets_the_live_view():
    """On a pseudo-terminal the streamed text shows live at the bottom, as before."""
    import pty

    leader, follower = pty.openpty()
    try:
        with os.fdopen(follower, "w", closefd=False) as tty:
            console = Console(file=tty, width=100)
            assert on_a_terminal(console)
            assert minillm.Tracer(console)._renderer.use_live
    finally:
        os.close(leader)
        os.close(follower)


def test_cli_with_forced_colour_into_a_pipe_prints_the_answer_once(smollm2):  # smollm2: the model is in the cache
    """`FORCE_COLOR=1 minillm run ... -v` with stdout a pipe, on the default model: exit 0, the full
    trace, the answer once, no "streaming:" line (14 of them before, and `-v` alone was an error)."""
    proc = run_cli("run", PROMPT, "-n", "8", "--threads", "1", "-v", env={"FORCE_COLOR": "1", "COLUMNS": "100"})
    assert proc.returncode == 0, proc.stderr
    assert "\x1b[" in proc.stdout  # the colours were forced
    out = ANSI.sub("", proc.stdout)
    assert "streaming:" not in out and "\r" not in out
    assert out.count(" Paris.\n\nThe answer is:") == 1 and "output:  Paris.\n\nThe answer is:\n" in out
    rows = [line.split()[2:5] for line in out.splitlines() if re.match(r"^\s+\d+\s+\d+\s+\S+ -> ", line)]
    assert rows == [["␣Paris", "->", "."], [".", "->", "↵"], ["↵", "->", "↵"], ["↵", "->", "The"],
                    ["The", "->", "␣answer"], ["␣answer", "->", "␣is"], ["␣is", "->", ":"]]  # full: every step
    for section in ("config", "tokenizer", "memory: 134,515,008 parameters, context 8,192", "causal mask"):
        assert section in out, section
