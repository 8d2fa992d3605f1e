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
