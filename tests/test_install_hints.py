"""Every install hint names this project's distribution (``minillm-edu``): ``pip install minillm``
installs an unrelated project from PyPI. And a flag that needs an extra is refused before any model
is loaded or fetched."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from minillm.errors import DISTRIBUTION, InvalidRequestError, MissingExtraError, install_command

ROOT = Path(__file__).resolve().parent.parent

# A `pip install` and what follows it on the line (up to a closing backtick, quote-free end or `&&`).
PIP_INSTALL = re.compile(r"pip3? install\s+([^`&;)\n]*)")
# A requirement named `minillm` alone or with extras: minillm, 'minillm[serve]', "minillm[...]".
WRONG_NAME = re.compile(r"""(?:^|\s)['"]?minillm(?:\[[^\]]*\])?['"]?(?=\s|$|\.$)""")


def wrong_hints(text: str) -> list[str]:
    """The ``pip install`` commands in ``text`` that name ``minillm`` (the other project) as a package."""
    return [m[0] for m in PIP_INSTALL.finditer(text) if WRONG_NAME.search(m[1])]


def _texts():
    """(path, text) of every file a user reads an install hint in: the package, README, lessons, benchmarks."""
    for path in sorted([*ROOT.joinpath("minillm").rglob("*.py"), ROOT / "README.md", ROOT / ".ci" / "run",
                        *ROOT.joinpath("benchmarks").glob("*.py"), *ROOT.joinpath("docs").rglob("*.md")]):
        yield path, path.read_text(encoding="utf-8")
    for path in sorted(ROOT.joinpath("notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        yield path, "\n".join("".join(c["source"]) for c in cells)


@pytest.mark.parametrize("planted", [
    "pip install minillm",
    "run: pip install 'minillm[constrained]' first",
    'pip install "minillm[serve]"',
    "`pip install minillm[serve,test]`",
    "pip install -U minillm.",
])
def test_a_planted_wrong_hint_is_found(planted):
    found = wrong_hints(planted)
    assert len(found) == 1 and found[0].startswith("pip install") and "minillm" in found[0]


@pytest.mark.parametrize("right", [
    'pip install "minillm-edu[constrained]"',
    "pip install minillm-edu",
    'pip install -e ".[serve]"',
    "pip install torch==2.13.0",
    "the project `minillm` is unrelated (pip install -e .)",
])
def test_a_right_hint_is_not_flagged(right):
    assert wrong_hints(right) == []


def test_no_install_hint_in_the_package_readme_or_lessons_names_the_other_project():
    found = {str(path.relative_to(ROOT)): hints for path, text in _texts() if (hints := wrong_hints(text))}
    assert found == {}


def test_the_install_command_is_built_from_the_distribution_name():
    assert install_command("constrained") == (
        'pip install "minillm-edu[constrained]" (in a source checkout: pip install -e ".[constrained]")'
    )
    assert DISTRIBUTION == "minillm-edu"
    assert install_command("serve") in str(MissingExtraError.for_module("fastapi", "serve", "minillm serve"))


def test_without_llguidance_the_engine_check_names_the_flag_and_the_extra(monkeypatch):
    from minillm.runtime.constraint import require_engine

    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance -> ImportError
    with pytest.raises(InvalidRequestError) as err:
        require_engine("--regex")
    assert str(err.value).startswith("--regex: constrained decoding needs the grammar engine llguidance")
    assert install_command("constrained") in str(err.value)
    assert wrong_hints(str(err.value)) == []


HIDDEN = "import sys; sys.modules['llguidance'] = None; from minillm.cli import main; sys.exit(main(sys.argv[1:]))"


@pytest.mark.parametrize("flag, value", [
    ("--json-schema", '{"type": "object"}'),
    ("--regex", "[0-9]+"),
    ("--grammar", 'start: "yes" | "no"'),
])
def test_a_constraint_flag_without_llguidance_exits_2_before_the_model_is_fetched(tmp_path, flag, value):
    """An empty model cache stays empty: the refusal comes before the default model is fetched or loaded."""
    cache = tmp_path / "cache"
    cache.mkdir()
    env = {"MINILLM_CACHE": str(cache), "PATH": "/usr/bin:/bin", "COLUMNS": "200", "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", HIDDEN, "run", flag, value, "The capital of France is"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    message = " ".join(done.stderr.split())
    assert f"{flag}: constrained decoding needs the grammar engine llguidance" in message
    assert 'pip install "minillm-edu[constrained]"' in message
    assert list(cache.iterdir()) == []  # nothing fetched, nothing converted
    assert "load" not in done.stdout  # no load rule: the model was never loaded
