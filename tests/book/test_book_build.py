"""How ``minillm book`` gets its lessons and refuses to publish a wrong book (issue 44), on lessons of one
or two cells executed by real kernels: a lesson that failed in the test run stops the build and is named
(its older passing copy is never published), a build executes what it lacks and keeps it (the cache), a
missing tool names the book extra, and the site's offline and link rules catch what they exist for.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from mkdocs.structure.toc import AnchorLink

from minillm.book import course, hooks, pages
from minillm.book.lessons import BY_TESTS, gather, record_of
from minillm.book.site import build_book, external_references
from minillm.cli import main
from minillm.errors import BookError

ROOT = Path(__file__).resolve().parents[2]


def lesson(folder: Path, name: str, *sources: str) -> Path:
    """A lesson of one markdown title and these code cells, written to ``folder/notebooks/<name>.ipynb``."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(f"# Lesson: {name}\n\nIt computes.")])
    nb.cells += [nbformat.v4.new_code_cell(s) for s in sources]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = folder / "notebooks" / f"{name}.ipynb"
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(path))
    return path


def run_the_lessons(folder: Path, kept: Path) -> subprocess.CompletedProcess:
    """``python -m pytest --nbmake notebooks`` in ``folder`` with the suite's plugin keeping what it executes."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "support"), str(ROOT)])}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "kept_lessons",
                           "--nbmake", "--kept-lessons", str(kept), "notebooks"],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip


def test_a_lesson_that_failed_in_the_run_stops_the_book_and_is_named(tmp_path):
    kept = tmp_path / "kept"
    lesson(tmp_path, "01_adds", "print(6 * 7)")
    lesson(tmp_path, "02_divides", "print(1 / 2)")
    first = run_the_lessons(tmp_path, kept)
    assert first.returncode == 0, first.stdout + first.stderr
    assert [record_of(kept / f"{n}.ipynb")["status"] for n in ("01_adds", "02_divides")] == ["passed", "passed"]
    lesson(tmp_path, "02_divides", "print(1 / 0)")  # the lesson changes and now fails in the next run
    second = run_the_lessons(tmp_path, kept)
    assert second.returncode == 1 and "1 failed, 1 passed" in second.stdout
    record = record_of(kept / "02_divides.ipynb")
    assert (record["status"], record["executed_by"]) == ("failed", BY_TESTS)
    assert "ZeroDivisionError" in record["error"] and record["run"] == record_of(kept / "01_adds.ipynb")["run"]
    with pytest.raises(BookError) as stop:
        build_book(tmp_path, tmp_path / "site", kept=kept, execute_missing=False)
    message = str(stop.value)
    assert "02_divides" in message and "ZeroDivisionError" in message and "01_adds" not in message
    assert "publishes no older outputs" in message and not (tmp_path / "site").exists()


def test_a_build_executes_what_it_lacks_once_and_keeps_it(tmp_path):
    kept, notebooks = tmp_path / "kept", tmp_path / "notebooks"
    lesson(tmp_path, "01_adds", "print(6 * 7)")
    lesson(tmp_path, "02_adds_more", "print(6 * 8)")
    executed = []
    first = gather(notebooks, kept, on_execute=lambda src: executed.append(src.stem))
    assert executed == ["01_adds", "02_adds_more"] and [x.name for x in first] == executed
    assert nbformat.read(str(kept / "01_adds.ipynb"), as_version=4).cells[1].outputs[0]["text"] == "42\n"
    executed.clear()
    again = gather(notebooks, kept, on_execute=lambda src: executed.append(src.stem))
    assert executed == [] and [x.record for x in again] == [x.record for x in first]  # the cache
    lesson(tmp_path, "02_adds_more", "print(6 * 9)")  # a changed lesson is executed again, alone
    third = gather(notebooks, kept, on_execute=lambda src: executed.append(src.stem))
    assert executed == ["02_adds_more"] and third[0].record == first[0].record
    with pytest.raises(BookError, match="no executed copy of today's 01_adds"):
        gather(notebooks, tmp_path / "empty", execute_missing=False)
    with pytest.raises(BookError, match="no lesson 03_missing .* the lessons are: 01_adds, 02_adds_more"):
        gather(notebooks, kept, ["03_missing"])


def test_without_the_book_extra_the_command_names_it(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    monkeypatch.setitem(sys.modules, "mkdocs_jupyter", None)  # as if not installed
    assert main(["book", "--out", "/nonexistent/book"]) == 2
    said = " ".join(capsys.readouterr().err.split())
    assert "MissingExtraError" in said and "mkdocs_jupyter" in said and 'pip install -e ".[book]"' in said


def test_outside_a_checkout_the_command_says_where_to_run_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["book"]) == 2
    assert "run it in the folder that holds notebooks/" in " ".join(capsys.readouterr().err.split())


def test_a_folder_that_is_not_a_book_is_never_emptied(tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "thesis.tex").write_text("keep me")
    with pytest.raises(BookError, match="holds files that are not a book"):
        build_book(ROOT, tmp_path / "site", ["01_lifecycle"], execute_missing=False)
    assert (tmp_path / "site" / "thesis.tex").read_text() == "keep me"


def test_every_lesson_has_its_line_and_its_extras_on_the_map():
    names = [p.stem for p in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))]
    assert list(course.LINES) == names and len(names) >= 17
    extras = {n: course.extras_needed(ROOT / "notebooks" / f"{n}.ipynb", ROOT) for n in names}
    assert extras["01_lifecycle"] == ["notebooks"]
    assert extras["04_prefill_vs_decode"] == ["notebooks", "reference"]  # transformers, the reference
    assert "serve" in extras["10_request_as_api_call"] and "constrained" in extras["16_the_samplers_controls"]
    assert "deploy" in extras["18_from_one_server_to_a_fleet"]  # it starts `minillm deploy` (Ray Serve)
    assert extras["12_what_precision_costs"] == ["notebooks", "lessons"]  # llama.cpp's wheel: only `lessons`


def test_a_readme_section_becomes_a_page():
    code = "```bash\n# a comment, not a heading\n```"
    readme = f"# minillm\n\n## Exercises: your turn\n\n{code}\n\n### Grading\n\nTwice.\n\n## Lessons\n\nSeventeen.\n"
    page = pages.readme_section(readme, "## Exercises")
    assert page == f"# Exercises: your turn\n\n{code}\n\n## Grading\n\nTwice.\n"  # from its heading to the next
    with pytest.raises(BookError, match="README.md has no section '## Speed'"):
        pages.readme_section(readme, "## Speed")


def test_a_resource_from_another_host_is_found_and_a_link_is_not(tmp_path):
    (tmp_path / "a.html").write_text(
        '<script src="https://cdn.example/x.js"></script><link rel="stylesheet" href="//fonts.example/f.css">'
        '<img src="data:image/png;base64,AAAA"><img srcset="ok.png 1x, http://img.example/i.png 2x">'
        '<a href="https://example.org/paper">a paper</a><link rel="stylesheet" href="assets/own.css">'
    )
    (tmp_path / "b.css").write_text('@import "https://fonts.example/a.css"; .x { background: url(img/own.png) }')
    assert external_references(tmp_path) == [
        "a.html: https://cdn.example/x.js", "a.html: //fonts.example/f.css", "a.html: http://img.example/i.png",
        "b.css: https://fonts.example/a.css",
    ]  # fmt: skip


def test_a_lesson_page_loses_nbconverts_cdn_loaders_and_its_contents_point_at_its_headings(tmp_path):
    from mkdocs_jupyter.convert import nb2html

    source = lesson(tmp_path, "01_titled", "x = 1")
    nb = nbformat.read(str(source), as_version=4)
    nb.cells.append(nbformat.v4.new_markdown_cell("## The same request with `generate`"))
    nbformat.write(nb, str(source))
    html = nb2html(str(source), custom_mathjax_url="https://cdnjs.cloudflare.com/mathjax.js")
    assert "cdnjs.cloudflare.com" in html  # what nbconvert writes

    class Page:  # what the hook reads of MkDocs' page: its file and its table of contents
        file = type("File", (), {"src_path": "lessons/01_titled.ipynb"})
        toc = [AnchorLink("Lesson: 01_titled", "lesson-01_titled", 1)]
        toc[0].children = [AnchorLink("The same request with", "the-same-request-with", 2)]

    out = hooks.on_page_content(html, Page, None, None)
    assert "cdnjs" not in out and "MathJax.Hub" not in out and "import(" not in out  # MathJax's and mermaid's loaders
    entry = Page.toc[0].children[0]
    assert (entry.id, entry.title) == ("the-same-request-with-generate", "The same request with generate")
    assert f'id="{entry.id}"' in out


def test_a_lesson_page_says_which_machine_ran_it():
    blas = {"internal_api": "openblas", "version": "0.3.31", "architecture": "Haswell", "num_threads": 1}
    record = {"executed_by": BY_TESTS, "run": "abc123", "finished": "2026-12-05T14:03:12+00:00", "seconds": 48.4,
              "machine": {"cpu": "AMD EPYC", "cores": 2, "numpy": "2.4.6", "blas": [blas]}}
    assert pages.ran_on(record) == (
        "**The outputs on this page** come from the test run (pytest, nbmake), run `abc123`, which executed "
        "this lesson on 2026-12-05 at 14:03 UTC in 48 s, on AMD EPYC (2 cores) with NumPy 2.4.6 and BLAS openblas "
        "0.3.31, kernel Haswell, 1 thread. The timings in this lesson are that machine's."
    )
