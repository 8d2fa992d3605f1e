"""A student's units inside the real model (issue 43): ``minillm run --units DIR`` and
``minillm.load(name, units=DIR)`` run the request on the student's code through the seam
(``model/kernels.py``'s ``UnitKernels``), and the trace names the units."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import minillm
from minillm import exercises
from minillm.exercises.units import BY_NAME, solution_source
from minillm.model.kernels import MODEL_UNITS
from minillm.runtime.units import UnitsError, unit_kernels

PROMPT = "The capital of France is"


def run_ids(tmp_path, *extra) -> tuple[list[int], dict]:
    """``minillm run`` greedy, 8 new tokens: the new ids (from the trace) and the load event's data."""
    trace = tmp_path / f"trace{len(list(tmp_path.glob('trace*')))}.jsonl"
    argv = ["run", PROMPT, "--temperature", "0", "-n", "8", "--trace-json", str(trace), *extra]
    proc = subprocess.run([sys.executable, "-m", "minillm", *argv], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    decode = [e["data"] for e in events if e["phase"] == "decode"]
    load = next(e["data"] for e in events if e["phase"] == "load")
    return [decode[0]["input_token"]] + [d["token"] for d in decode], load


@pytest.fixture(scope="module")
def textbook_units(tmp_path_factory):
    """A folder whose every unit of the forward holds the textbook's own code (the rest: stubs)."""
    folder = tmp_path_factory.mktemp("units")
    exercises.start(folder)
    for name in MODEL_UNITS:
        (folder / f"{name}.py").write_text(solution_source(BY_NAME[name]))
    return folder


def test_run_on_the_textbooks_units_gives_the_same_ids_and_the_trace_names_them(tmp_path, textbook_units):
    plain, plain_load = run_ids(tmp_path)
    mine, load = run_ids(tmp_path, "--units", str(textbook_units))
    assert len(mine) == 8 and mine == plain
    assert plain_load["kernels"]["name"] == "tuned"
    assert load["kernels"] == {
        "name": "plain + the student's causal_mask, sliding_window_mask, softmax, rms_norm, apply_rope, attention, "
        "silu, KVCache",
        "source": str(textbook_units),
    }


def test_a_wrong_attention_changes_the_ids_and_check_names_it(tmp_path, textbook_units):
    folder = tmp_path / "wrong"
    exercises.start(folder)
    (folder / "attention.py").write_text(
        "import numpy as np\n\n"
        "def attention(q, k, v, mask, scale):\n"
        "    group = q.shape[0] // k.shape[0]\n"
        "    k, v = np.tile(k, (group, 1, 1)), np.tile(v, (group, 1, 1))  # GQA in the wrong order\n"
        "    s = q @ k.transpose(0, 2, 1) * scale + mask\n"
        "    p = np.exp(s - s.max(-1, keepdims=True))\n"
        "    p = (p / p.sum(-1, keepdims=True)).astype(np.float32)\n"
        "    return (p @ v).astype(np.float32), p\n"
    )
    plain, _ = run_ids(tmp_path)
    wrong, load = run_ids(tmp_path, "--units", str(folder))
    assert load["kernels"]["name"] == "plain + the student's attention"
    assert wrong != plain
    out = subprocess.run(
        [sys.executable, "-m", "minillm", "exercises", "check", "--dir", str(folder), "--json"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert out.returncode == 1
    failed = [u for u in json.loads(out.stdout)["units"] if u["status"] == "failed"]
    assert [u["unit"] for u in failed] == ["attention"]
    assert "np.repeat, not np.tile" in failed[0]["hint"]


def test_the_students_code_cannot_change_the_models_weights(tmp_path):
    exercises.start(tmp_path)
    (tmp_path / "rms_norm.py").write_text(
        "import numpy as np\n\ndef rms_norm(x, weight, eps):\n    weight *= 2  # a student's slip\n"
        "    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight\n"
    )
    with pytest.raises(ValueError, match="read-only"):
        minillm.load("smollm2-135m-instruct", units=tmp_path, progress=False)  # the warm-up runs it


def test_load_with_units_runs_the_students_cache_and_refuses_what_it_cannot(tmp_path, smollm2, textbook_units):
    model = minillm.load("smollm2-135m-instruct", units=textbook_units, progress=False, warmup=False)
    cache = model.transformer.kernels.new_cache(model.config, 16)
    assert type(cache).__name__.startswith("StudentKVCache")
    ids = minillm.tokenize(model, PROMPT)
    got = model.transformer.forward(ids, cache, last_only=True)
    want = smollm2.transformer.forward(ids, None, last_only=True)
    assert cache.length == len(ids)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    with pytest.raises(UnitsError, match="does not exist"):
        unit_kernels(tmp_path / "nowhere")
    fresh = tmp_path / "fresh"
    exercises.start(fresh)
    with pytest.raises(UnitsError, match="still raise NotImplementedError"):
        unit_kernels(fresh, ["softmax"])
    with pytest.raises(UnitsError, match="not units of the forward"):
        unit_kernels(textbook_units, ["blocks_for"])
