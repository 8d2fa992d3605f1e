"""Lesson 14 on an empty model cache (issue 41): its first cell died with a TypeError there, because
``plan_folder`` returned None for a model not fetched yet whose config lives in its GGUF.

The lesson's section 1 (every cell before section 2's heading: the plan folders, the measured
runtime and tokenizers, the plans at every precision, the budget and its figure) runs in a kernel
whose ``MINILLM_CACHE`` is an empty folder. The whole lesson on an empty cache is run by hand
(it starts two servers and loads SmolLM2 several times: too long for the suite twice).
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
LESSON = ROOT / "notebooks" / "14_startup_switching_and_the_memory_plan.ipynb"


@pytest.mark.slow
def test_lesson_14_plans_both_models_on_an_empty_cache_without_converting_a_weight(tmp_path, monkeypatch):
    cache = tmp_path / "minillm-cache"
    monkeypatch.setenv("MINILLM_CACHE", str(cache))  # the kernel inherits this process's environment
    nb = nbformat.read(LESSON, as_version=4)
    section_2 = next(i for i, c in enumerate(nb.cells) if c.cell_type == "markdown" and c.source.startswith("## 2."))
    nb.cells = nb.cells[:section_2]
    assert sum(c.cell_type == "code" for c in nb.cells) >= 5
    where = {"metadata": {"path": str(LESSON.parent)}}
    NotebookClient(nb, timeout=900, kernel_name="python3", resources=where).execute()

    printed = "".join(o.get("text", "") for o in nb.cells[1].outputs)
    plans = cache / "plan"
    for name in ("smollm2-135m-instruct", "gemma3-270m"):
        assert f"{name}: config.json and the tokenizer from {plans / name}" in printed, printed
        assert (plans / name / "config.json").is_file() and (plans / name / "tokenizer.json").is_file()
    assert not (cache / "models").exists()  # planned from config and tokenizer: no model was converted
