"""The course book built from this run's lessons and read in a real browser (issue 44).

pytest executes the lessons first (nbmake); tests/support/kept_lessons.py keeps each executed copy in
build/lessons and moves these tests (marked ``book``) after every other test. The module builds the
book once, with ``minillm book``'s own function, from exactly the lessons this run executed (in CI all
seventeen), executing none itself; run alone (no lesson in this run), it has lessons 1 and 4 executed
by the build instead. Debian's headless Chromium, driven by Playwright as the live page's test does
(``benchmarks/ui_page.py``), opens every page from a static server on the built folder: a request to
anywhere else is refused and fails the test.
"""

from __future__ import annotations

import sys
from datetime import datetime
from pathlib import Path

import kept_lessons
import nbformat
import pytest
from site_checks import broken_links, served, visit

from minillm.book import course, pages
from minillm.book.lessons import BY_BOOK, BY_TESTS
from minillm.book.site import build_book, external_references

pytestmark = pytest.mark.book
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # benchmarks/ is not installed
from benchmarks import speed_results, ui_page  # noqa: E402

ALONE = ["01_lifecycle", "04_prefill_vs_decode"]  # what a run of the book's tests alone has executed
IMAGES = ("image/png", "image/jpeg")


@pytest.fixture(scope="module")
def book(request, tmp_path_factory):
    kept = kept_lessons.plugin(request.config)
    names = sorted(kept.kept) or ALONE
    built = build_book(ROOT, tmp_path_factory.mktemp("book") / "site", names, kept=kept.folder,
                       execute_missing=not kept.kept, rerun=not kept.kept)  # fmt: skip
    return built, kept


@pytest.fixture(scope="module")
def site(book):
    with served(book[0].out) as base:
        yield base


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = ui_page.launch(pw)
        yield browser
        browser.close()


def clean(seen) -> None:
    """Nothing went wrong while the page loaded: no console error, no request elsewhere, no failed load."""
    assert (seen.console_errors, seen.outside, seen.failed) == ([], [], [])


def test_the_book_holds_the_lessons_as_this_run_executed_them_once(book):
    built, kept = book
    names = [lesson.name for lesson in built.lessons]
    if kept.kept:  # the lessons ran in this run: the book publishes exactly them, executed once, by the tests
        assert names == sorted(kept.kept) and built.executed == []
        for lesson in built.lessons:
            assert (lesson.record["run"], lesson.record["executed_by"]) == (kept.run, BY_TESTS)
            assert kept.executions[lesson.name] == 1 and lesson.record["status"] == "passed"
    else:  # run alone: the build executed what it lacked, once each
        assert names == built.executed == ALONE
        assert {lesson.record["executed_by"] for lesson in built.lessons} == {BY_BOOK}
    assert {p.stem for p in (built.out / "lessons").glob("*.html")} == set(names)


def test_every_lesson_page_loads_with_its_images_and_no_error(book, site, browser):
    for lesson in book[0].lessons:
        seen = visit(browser, site, f"lessons/{lesson.name}.html")
        clean(seen)
        nb = nbformat.read(str(lesson.copy), as_version=4)
        outputs = [o for cell in nb.cells for o in cell.get("outputs", [])]
        assert not [o for o in outputs if o["output_type"] == "error"], lesson.name
        expected = [f"data:{m};base64,{''.join(o['data'][m].split())}" for o in outputs for m in IMAGES
                    if m in o.get("data", {})]  # fmt: skip
        shown = seen.page.evaluate(
            "[...document.querySelectorAll('.jp-OutputArea-output img')]"
            ".map(i => [i.getAttribute('src').replace(/\\s/g, ''), i.complete && i.naturalWidth > 0])"
        )
        assert [src for src, _ in shown] == expected, lesson.name  # every image output, in order, none else
        assert all(loaded for _, loaded in shown), lesson.name
        # an error output is IPython's traceback (an exception a lesson catches and prints is its prose)
        assert "Traceback (most recent call last)" not in seen.page.inner_text("article"), lesson.name
        seen.page.context.close()


def test_every_other_page_loads_with_no_error_and_nothing_from_elsewhere(book, site, browser):
    built = book[0]
    others = sorted(p.relative_to(built.out).as_posix() for p in built.out.rglob("*.html") if p.parent == built.out)
    assert set(others) == {"index.html", "404.html", *(p.replace(".md", ".html") for p in pages.PAGES)}
    for path in others:
        seen = visit(browser, site, path)
        clean(seen)
        assert not seen.page.evaluate("[...document.images].filter(i => !(i.complete && i.naturalWidth > 0)).length")
        seen.page.context.close()


def test_search_for_prefill_finds_lessons_1_and_4(book, site, browser):
    assert {"01_lifecycle", "04_prefill_vs_decode"} <= {lesson.name for lesson in book[0].lessons}, (
        "run lessons 1 and 4 in the same run as the book's tests"
    )
    seen = visit(browser, site, "index.html")
    seen.page.locator("input.md-search__input").click()
    seen.page.locator("input.md-search__input").press_sequentially("prefill", delay=30)
    seen.page.wait_for_selector(".md-search-result__link", timeout=30_000)
    found: set[str] = set()
    for _ in range(20):  # the results list grows as it scrolls
        found |= set(seen.page.evaluate("[...document.querySelectorAll('.md-search-result__link')]"
                                        ".map(a => new URL(a.href).pathname)"))  # fmt: skip
        if {"/lessons/01_lifecycle.html", "/lessons/04_prefill_vs_decode.html"} <= found:
            break
        seen.page.locator(".md-search-result__scrollwrap").evaluate("e => e.scrollTo(0, e.scrollHeight)")
        seen.page.wait_for_timeout(200)
    assert {"/lessons/01_lifecycle.html", "/lessons/04_prefill_vs_decode.html"} <= found, found
    clean(seen)
    seen.page.context.close()


def test_every_internal_link_resolves(book, tmp_path):
    assert broken_links(book[0].out) == []
    page = tmp_path / "lessons" / "a.html"  # the checker finds a missing page and a missing anchor
    page.parent.mkdir()
    page.write_text('<h2 id="here">x</h2><a href="#here">ok</a><a href="../b.html">no</a><a href="a.html#gone">x</a>')
    assert broken_links(tmp_path) == ["lessons/a.html: ../b.html", "lessons/a.html: a.html#gone (no such anchor)"]


def test_nothing_in_the_book_is_loaded_from_another_host(book):
    out = book[0].out
    assert external_references(out) == []
    texts = "".join(p.read_text(encoding="utf-8") for p in out.rglob("*") if p.suffix in (".html", ".css"))
    assert "fonts.googleapis" not in texts and "fonts.gstatic" not in texts  # theme font: false
    assert "cdnjs.cloudflare.com" not in texts and "Load mathjax" not in texts  # nbconvert's loaders taken out
    assert (out / "search" / "search_index.json").is_file()  # search reads the built folder's own index


def test_each_lesson_page_states_the_machine_that_ran_it(book, site, browser):
    for lesson in book[0].lessons:
        record, machine = lesson.record, lesson.record["machine"]
        seen = visit(browser, site, f"lessons/{lesson.name}.html")
        said = " ".join(seen.page.inner_text(".ran-on").split())
        assert said == " ".join(pages.ran_on(record).replace("**", "").replace("`", "").split())
        blas = machine["blas"][0]
        day = datetime.fromisoformat(record["finished"]).strftime("%Y-%m-%d")
        for fact in (machine["cpu"], f"{machine['cores']} cores", f"kernel {blas['architecture']}",
                     f"{blas['num_threads']} thread", day, record["executed_by"]):  # fmt: skip
            assert str(fact) in said, (lesson.name, fact)
        seen.page.context.close()


def test_the_index_is_the_course_map(book, site, browser):
    seen = visit(browser, site, "index.html")
    text = seen.page.inner_text("article")
    assert "load → tokenize (chat template) → prefill" in text and "Two timescales" in text
    rows = seen.page.evaluate("[...document.querySelectorAll('article table tbody tr')]"
                              ".map(r => [...r.cells].map(c => c.innerText.trim()))")  # fmt: skip
    lessons = book[0].lessons
    assert [r[0] for r in rows] == [lesson.name[:2] for lesson in lessons]  # in course order
    for row, lesson in zip(rows, lessons, strict=True):
        assert row[1] == course.title(lesson.source).split(": ", 1)[1]
        assert row[2] == course.LINES[lesson.name].replace("`", "")
        assert row[3] == ", ".join(course.extras_needed(lesson.source, ROOT))
    hrefs = seen.page.evaluate("[...document.querySelectorAll('article table a')].map(a => a.getAttribute('href'))")
    assert hrefs == [f"lessons/{lesson.name}.html" for lesson in lessons]
    seen.page.context.close()


def test_the_api_page_documents_the_lifecycle_and_the_servers_flags(book, site, browser):
    import minillm

    seen = visit(browser, site, "api.html")
    for name in (*pages.LIFECYCLE, *pages.CLASSES):
        section = seen.page.locator(f"[id='minillm.{name}']")
        assert section.count() == 1, name
        first_line = " ".join(getattr(minillm, name).__doc__.strip().split("\n\n")[0].split())
        assert first_line.replace("``", "")[:40] in " ".join(seen.page.inner_text("article").split()), name
    flags = seen.page.inner_text("article")
    for flag in ("--kv-cache-mib", "--max-num-seqs", "--port", "--memory-budget"):
        assert flag in flags, flag
    seen.page.context.close()


def test_the_speed_page_holds_the_table_made_from_the_tracked_results(book, site, browser):
    seen = visit(browser, site, "speed.html")
    rows = seen.page.evaluate("[...document.querySelectorAll('article table tbody tr')]"
                              ".map(r => [...r.cells].map(c => c.innerText.trim()))")  # fmt: skip
    made = [[cell.strip() for cell in line.strip("|").split("|")]
            for line in speed_results.table(speed_results.tracked()).splitlines()[2:]]  # fmt: skip
    assert rows == made and len(rows) == 3
    seen.page.context.close()


def test_the_live_page_shows_its_screenshot_and_how_to_start_it(book, site, browser):
    seen = visit(browser, site, "live-page.html")
    shot = seen.page.locator("article img[src='assets/ui-1280x720.png']")
    assert shot.count() == 1 and shot.evaluate("i => i.naturalWidth") == 1280
    text = seen.page.inner_text("article")
    assert "minillm serve --open" in text and "http://127.0.0.1:8000/ui?zoom=0.15&slow=1" in text
    seen.page.context.close()


def test_the_exercises_page_has_the_commands(book, site, browser):
    seen = visit(browser, site, "exercises.html")
    text = seen.page.inner_text("article")
    for command in ("minillm exercises start my_units", "minillm exercises check [UNIT ...] --dir my_units",
                    'minillm run --units my_units "The capital of France is"'):  # fmt: skip
        assert command in text, command
    seen.page.context.close()
