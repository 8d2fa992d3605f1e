"""The README's commands are the ones CI runs, so they stay true."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci_lines = [line for line in (ROOT / ".ci/run").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    test_command = ci_lines[-1]
    assert "python -m pytest" in test_command
    assert test_command in readme.splitlines()


def test_readme_main_command_runs_the_default_model():
    readme = (ROOT / "README.md").read_text().splitlines()
    assert 'pip install -e . && minillm run "The capital of France is"' in readme


def test_readme_lesson_command_keeps_the_output_beside_the_lesson(tmp_path):
    """The README's `jupyter execute ... --output=...` writes the executed copy and leaves the lesson."""
    import re
    import subprocess
    import sys

    import nbformat

    readme = " ".join((ROOT / "README.md").read_text().split())  # the command wraps over two lines
    pattern = re.search(r"`jupyter execute notebooks/01_lifecycle\.ipynb --output='([^']+)'` writes "
                        r"`notebooks/(01_lifecycle[^`]*)`", readme)
    assert pattern, "the README's lesson command"
    lesson = tmp_path / "01_lifecycle.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(6 * 7)")]), lesson)
    before = lesson.read_bytes()
    subprocess.run([sys.executable, "-m", "jupyter", "execute", str(lesson), f"--output={pattern[1]}"],
                   check=True, capture_output=True, timeout=300)
    assert lesson.read_bytes() == before
    out = nbformat.read(tmp_path / pattern[2], as_version=4)
    assert out.cells[0].outputs[0]["text"] == "42\n"


def test_readme_trace_has_todays_shape():
    """The README's recorded trace is what `minillm run` prints by default today: a rule per phase of
    lesson 1 in order, the decode table's header as render.py writes it, and as many lines as the
    prose says, within one projector screen (40 lines at 100 columns)."""
    from minillm.observe.render import DECODE_HEADER

    section = (ROOT / "README.md").read_text().split("## What a trace looks like\n")[1].split("\n## ")[0]
    lines = section.split("```text\n")[1].split("```\n")[0].splitlines()
    rules = [line.strip("─ ").split()[0] for line in lines if line.startswith("─")]
    assert rules == ["load", "request", "tokenize", "prefill", "decode", "detokenize", "stop:", "free", "summary"]
    assert DECODE_HEADER in lines and "sample: ␣Paris (id 7042, p 0.77), the first new token (TTFT ends here)" in lines
    assert f"({len(lines)} lines here)" in " ".join(section.split()) and len(lines) <= 40
