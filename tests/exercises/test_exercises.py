"""The exercises (issue 43): stubs, grading against the textbook and inside SmolLM2, robustness.

Every check here grades real files in a real folder through the same path as ``minillm exercises
check`` (each unit in a forked process, SmolLM2 loaded once per grading), or through the command
itself as a subprocess where the exit status and the printed output are what is asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from exercise_mistakes import MESSAGE_PHRASES, MISTAKES

from minillm import exercises
from minillm.exercises.grade import Grading, grade_folder
from minillm.exercises.inside import ModelReference
from minillm.exercises.units import UNITS, solution_source, stub_source
from minillm.runtime.units import UnitsError

SEEDS = (0, 1, 2)


def minillm_cli(*args, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "minillm", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.fixture(scope="module")
def gradings(smollm2):
    """One grading per seed, all on the session's SmolLM2 (the in-model stage's reference: its weights
    on the textbook's plain kernels)."""
    reference = ModelReference(smollm2)
    return {seed: Grading(seed=seed, _reference=reference) for seed in SEEDS}


@pytest.fixture(scope="module")
def textbook_folder(tmp_path_factory):
    """A started folder holding the textbook's own definitions of every unit."""
    folder = tmp_path_factory.mktemp("textbook")
    exercises.start(folder)
    for unit in UNITS:
        (folder / unit.file).write_text(solution_source(unit))
    return folder


def test_the_unit_list_is_the_issues():
    assert [u.name for u in UNITS] == [
        "causal_mask", "sliding_window_mask", "softmax", "rms_norm", "apply_rope", "attention", "silu", "KVCache",
        "apply_temperature", "apply_top_k", "apply_top_p", "apply_min_p", "apply_repetition_penalty",
        "IncrementalDetokenizer", "blocks_for", "slots", "block_hashes", "acceptance_probability", "residual",
    ]  # fmt: skip


@pytest.mark.parametrize("seed", SEEDS)
def test_the_textbook_grades_100_percent(textbook_folder, gradings, seed):
    verdicts = grade_folder(textbook_folder, grading=gradings[seed])
    assert [(v.unit, v.status) for v in verdicts] == [(u.name, "passed") for u in UNITS], [v.message for v in verdicts]
    stages = {v.unit: v.stage for v in verdicts}
    assert stages["attention"] == stages["KVCache"] == "in the model"
    assert stages["apply_top_p"] == stages["residual"] == "closed form"
    assert stages["blocks_for"] == "unit cases"


def test_at_least_twenty_mistakes_cover_every_unit():
    assert len(MISTAKES) >= 20
    assert {m[0] for m in MISTAKES} == {u.name for u in UNITS}


@pytest.mark.parametrize(("unit", "label", "source", "hint"), MISTAKES, ids=[f"{m[0]}: {m[1]}" for m in MISTAKES])
def test_each_mistake_fails_under_every_seed_with_its_unit_and_hint(tmp_path, gradings, unit, label, source, hint):
    (tmp_path / f"{unit}.py").write_text(source)
    for seed in SEEDS:
        (verdict,) = grade_folder(tmp_path, [unit], grading=gradings[seed])
        assert (verdict.unit, verdict.status) == (unit, "failed"), (seed, verdict)
        assert verdict.stage == "unit cases" and verdict.case, (seed, verdict)
        if hint is not None:
            assert verdict.hint is not None and hint in verdict.hint, (seed, verdict)
        else:
            assert MESSAGE_PHRASES[label] in verdict.message, (seed, verdict)


def test_a_fresh_folder_grades_not_started_with_exit_1_and_no_traceback(tmp_path):
    folder = tmp_path / "units"
    started = minillm_cli("exercises", "start", str(folder))
    assert started.returncode == 0, started.stderr
    assert sorted(p.name for p in folder.iterdir()) == sorted(u.file for u in UNITS)
    checked = minillm_cli("exercises", "check", "--dir", str(folder), "--json")
    assert checked.returncode == 1
    report = json.loads(checked.stdout)
    assert (report["passed"], report["failed"], report["not_started"]) == (0, 0, len(UNITS))
    assert [u["status"] for u in report["units"]] == ["not started"] * len(UNITS)
    table = minillm_cli("exercises", "check", "--dir", str(folder))
    assert table.returncode == 1 and "Traceback" not in table.stdout + table.stderr
    assert table.stdout.count("not started") == len(UNITS)


def test_start_never_overwrites_a_changed_file(tmp_path):
    exercises.start(tmp_path)
    mine = "import numpy as np\n\ndef blocks_for(positions, block_size):\n    return -(-positions // block_size)\n"
    (tmp_path / "blocks_for.py").write_text(mine)
    (tmp_path / "silu.py").unlink()
    done = exercises.start(tmp_path)
    assert done == {"written": [u.file for u in UNITS if u.file != "blocks_for.py"], "kept": ["blocks_for.py"]}
    assert (tmp_path / "blocks_for.py").read_text() == mine
    assert (tmp_path / "silu.py").read_text() == stub_source(UNITS[6], str(tmp_path))
    assert not list(tmp_path.glob(".*.tmp"))  # nothing half-written left behind
    out = minillm_cli("exercises", "start", str(tmp_path))
    assert out.returncode == 0 and "kept" in out.stdout and "blocks_for.py" in out.stdout


def test_check_names_only_the_units_asked_and_exits_0_when_they_pass(textbook_folder):
    out = minillm_cli("exercises", "check", "causal_mask", "blocks_for", "--dir", str(textbook_folder), "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    assert [(u["unit"], u["status"]) for u in json.loads(out.stdout)["units"]] == [
        ("causal_mask", "passed"),
        ("blocks_for", "passed"),
    ]
    unknown = minillm_cli("exercises", "check", "causal_musk", "--dir", str(textbook_folder))
    assert unknown.returncode == 2 and "no unit causal_musk" in unknown.stderr


def test_a_missing_folder_is_a_clear_error(tmp_path):
    out = minillm_cli("exercises", "check", "--dir", str(tmp_path / "nowhere"))
    said = " ".join(out.stderr.split())  # rich wraps the line at the terminal's width
    assert out.returncode == 2
    assert "does not exist" in said and "minillm exercises start" in said
    with pytest.raises(UnitsError, match="is a file"):
        (tmp_path / "f").write_text("")
        grade_folder(tmp_path / "f")


def test_a_raising_unit_shows_its_own_frames_and_the_others_are_still_graded(tmp_path, gradings):
    exercises.start(tmp_path)
    (tmp_path / "blocks_for.py").write_text(solution_source(UNITS[14]))
    (tmp_path / "causal_mask.py").write_text(
        textwrap.dedent("""
        import numpy as np

        def helper(seq):
            return [1, 2][seq]

        def causal_mask(seq, ctx, offset=0):
            return helper(seq + 5)
    """)
    )
    (tmp_path / "slots.py").write_text("import numpy as np\n\ndef slots(table, positions, block_size)\n    return 0\n")
    verdicts = {v.unit: v for v in grade_folder(tmp_path, ["causal_mask", "slots", "blocks_for"], gradings[0])}
    raised = verdicts["causal_mask"]
    assert raised.status == "failed" and "IndexError" in raised.message
    assert "causal_mask.py" in raised.traceback and "in helper" in raised.traceback
    assert "minillm/exercises" not in raised.traceback and "hypothesis" not in raised.traceback
    assert verdicts["slots"].stage == "import" and "SyntaxError" in verdicts["slots"].message
    assert verdicts["blocks_for"].status == "passed"


def test_a_hanging_unit_is_stopped_after_the_stated_time(tmp_path):
    (tmp_path / "silu.py").write_text("def silu(x):\n    while True:\n        pass\n")
    (tmp_path / "blocks_for.py").write_text(solution_source(UNITS[14]))
    verdicts = grade_folder(tmp_path, ["silu", "blocks_for"], Grading(timeout=3))
    assert (verdicts[0].status, verdicts[0].stage) == ("failed", "time")
    assert "stopped after 3 s" in verdicts[0].message
    assert verdicts[1].status == "passed"


def test_wrong_shape_dtype_and_writing_into_an_input_are_named(tmp_path, gradings):
    (tmp_path / "rms_norm.py").write_text(
        "import numpy as np\n\ndef rms_norm(x, weight, eps):\n    x /= 2\n    return x\n"
    )
    (tmp_path / "silu.py").write_text(
        "import numpy as np\n\ndef silu(x):\n    return (x / (1 + np.exp(-x))).ravel()[:1]\n"
    )
    (tmp_path / "apply_min_p.py").write_text("def apply_min_p(logits, min_p):\n    return list(logits)\n")
    verdicts = {v.unit: v for v in grade_folder(tmp_path, ["rms_norm", "silu", "apply_min_p"], gradings[0])}
    assert "read-only" in verdicts["rms_norm"].hint
    assert "has shape [1]" in verdicts["silu"].message
    assert "is a list, expected a NumPy array" in verdicts["apply_min_p"].message


def test_check_from_python_shows_the_same_verdict(gradings):
    import numpy as np

    def causal_mask(seq, ctx, offset=0):
        q, k = offset + np.arange(seq)[:, None], np.arange(ctx)[None, :]
        return np.where(k <= q, np.float32(0), np.float32(-np.inf)).astype(np.float32)

    shown = exercises.check("causal_mask", causal_mask)
    assert shown.passed and shown.verdicts[0].stage == "in the model"
    assert "passed" in shown._repr_html_() and "causal_mask" in shown._repr_html_()

    def rotate_half(x):
        return np.concatenate([x[..., x.shape[-1] // 2 :], -x[..., : x.shape[-1] // 2]], -1)

    def apply_rope(x, cos, sin):
        return x * cos + rotate_half(x) * sin

    with pytest.raises(KeyError, match="rotate_half"):  # a local here, not in apply_rope's globals: pass it
        exercises.check("apply_rope", apply_rope)
    wrong = exercises.check("apply_rope", apply_rope, rotate_half=rotate_half)
    assert not wrong.passed and "[-x2, x1]" in wrong.verdicts[0].hint
    assert "apply_rope: failed" in repr(wrong)


def test_every_stub_imports_and_raises_not_implemented(tmp_path):
    from minillm.runtime.units import import_unit, is_started

    exercises.start(tmp_path)
    for unit in UNITS:
        source = (tmp_path / unit.file).read_text()
        assert not is_started(source, unit.names), unit.name
        module = import_unit(tmp_path, unit.name)  # a stub stands alone: no name it lacks
        obj = getattr(module, unit.name)
        with pytest.raises(NotImplementedError, match=f"{unit.name}: your turn"):
            code = obj.__init__.__code__ if isinstance(obj, type) else obj.__code__
            obj(*[None] * (code.co_argcount - isinstance(obj, type)))
    assert (
        "def attention(\n    q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray, scale: float\n)"
        in (tmp_path / "attention.py").read_text()
    )


def test_list_names_every_unit_and_its_lesson():
    out = minillm_cli("exercises", "list")
    assert out.returncode == 0
    rows = [line.split("│")[1:3] for line in out.stdout.splitlines() if line.startswith("│")]
    named = {unit.strip(): lesson.strip() for unit, lesson in rows if unit.strip()}
    assert named == {
        u.name: (f"lesson {int(u.lesson[:2])}" if u.lesson[0].isdigit() else "primitives.py") for u in UNITS
    }
