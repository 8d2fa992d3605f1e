"""Build the course book: the lessons as executed, the pages around them, MkDocs, then an offline check.

    minillm book --out DIR        # from a checkout: DIR/index.html, a static site that needs no network

MkDocs with the Material theme builds the site; mkdocs-jupyter renders each lesson's executed copy
(nothing is executed by MkDocs); mkdocstrings renders the API reference from the docstrings. Search is
Material's own, from the index and the worker in the built folder (a browser runs the worker for a
served folder, e.g. ``python -m http.server``; pages opened from disk read as well, without search).
Material's ``offline`` plugin is not used: it loads a shim from a CDN. ``font: false`` keeps Google's
fonts out; :mod:`minillm.book.hooks` takes nbconvert's CDN loaders out of the lesson pages, and
:func:`external_references` checks the result: a built page or stylesheet that would load anything from
another host fails the build (the browser test of tests/book/ refuses every such request as well).
Material's maintainers have announced its end of life for May 2027, with Zensical, which reads the same
mkdocs.yml, as its successor: the configuration here is :func:`mkdocs_config`, data in one place.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

from minillm.book import hooks, pages
from minillm.book.lessons import KEPT, Lesson, gather
from minillm.errors import DISTRIBUTION, BookError, MissingExtraError

#: The modules the book extra installs, imported before any work (a missing one names the extra).
TOOLS = ("mkdocs", "material", "mkdocs_jupyter", "mkdocstrings", "mkdocstrings_handlers.python", "nbclient", "yaml")
#: A URL that leaves the site: a scheme with a host, or a protocol-relative ``//host``.
ELSEWHERE = re.compile(r"^(?:[a-z][a-z0-9+.-]*:)?//", re.IGNORECASE)
#: ``url(...)`` and ``@import "..."`` in CSS.
CSS_URL = re.compile(r"""url\(\s*['"]?([^'")\s]+)|@import\s+['"]([^'"]+)""")
BOOK_CSS = """.ran-on { border-left: .2rem solid var(--md-accent-fg-color); padding: .1rem .8rem;
  background: var(--md-code-bg-color); margin-bottom: 1rem; }
"""


@dataclass
class Book:
    """What a build made: the site's folder, the lessons in it, those this build executed, its seconds."""

    out: Path
    lessons: list[Lesson]
    executed: list[str] = field(default_factory=list)
    seconds: float = 0.0


def require_tools() -> None:
    """Import the book extra's tools before any work.

    Raises:
        MissingExtraError: one is missing; the message names the book extra (``pip install -e ".[book]"``).
    """
    for module in TOOLS:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError:
            raise MissingExtraError.for_module(module.split(".")[0], "book", "minillm book") from None


def find_checkout(start: Path) -> Path:
    """The minillm checkout at or above ``start``: the folder with ``notebooks/`` and minillm's pyproject.toml.

    Raises:
        BookError: ``start`` is in no checkout (the book is built from the lessons' sources).
    """
    for folder in (start.resolve(), *start.resolve().parents):
        project = folder / "pyproject.toml"
        if (folder / "notebooks").is_dir() and project.is_file() and f'"{DISTRIBUTION}"' in project.read_text():
            return folder
    raise BookError(
        f"no minillm checkout at or above {start}: `minillm book` builds from the lessons in a checkout's "
        "notebooks/; run it in the folder that holds notebooks/ and pyproject.toml"
    )


def serve_help(checkout: Path) -> str:
    """``minillm serve --help`` as the command prints it (100 columns): the server's flags."""
    env = {
        **os.environ,
        "COLUMNS": "100",
        "PYTHONPATH": os.pathsep.join([str(checkout), os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.run(
        [sys.executable, "-m", "minillm", "serve", "--help"],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if run.returncode != 0:
        raise BookError(f"`minillm serve --help` failed (status {run.returncode}): {run.stderr.strip()[-2000:]}")
    return run.stdout


def speed_results(checkout: Path):
    """The checkout's ``benchmarks/speed_results.py`` (the module that makes the README's speed table)."""
    spec = importlib.util.spec_from_file_location(
        "minillm_book_speed_results", checkout / "benchmarks" / "speed_results.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_sources(checkout: Path, docs: Path, lessons: list[Lesson]) -> None:
    """Every page's source into ``docs``: the index, the lessons, the README's sections, the API, speed."""
    readme = (checkout / "README.md").read_text(encoding="utf-8")
    (docs / "assets").mkdir(parents=True, exist_ok=True)
    (docs / "assets" / "book.css").write_text(BOOK_CSS)
    (docs / "index.md").write_text(pages.index_page(lessons, readme, checkout))
    for lesson in lessons:
        pages.write_lesson(lesson, docs)
    live = pages.readme_section(readme, "### Watch it live")
    (docs / "live-page.md").write_text(pages.copy_pictures(live, checkout, docs))
    (docs / "exercises.md").write_text(pages.readme_section(readme, "## Exercises: your turn"))
    (docs / "api.md").write_text(pages.api_page(serve_help(checkout)))
    speed = speed_results(checkout)
    reports = speed.tracked(checkout / "benchmarks" / "results")
    (docs / "speed.md").write_text(pages.speed_page(readme, speed.table(reports), reports))


def mkdocs_config(checkout: Path, docs: Path, out: Path, lessons: list[Lesson]) -> dict:
    """The book's mkdocs.yml, as data."""
    from minillm.book.course import title

    nav_lessons = [{title(lesson.source): f"lessons/{lesson.name}.ipynb"} for lesson in lessons]
    return {
        "site_name": "minillm: the course book",
        "docs_dir": str(docs),
        "site_dir": str(out),
        "use_directory_urls": False,  # pages are files: they open from disk and from any static server
        "theme": {"name": "material", "font": False, "features": ["navigation.sections", "search.highlight"]},
        "extra": {"generator": False},
        "extra_css": ["assets/book.css"],
        "hooks": [hooks.__file__],
        "plugins": [
            "search",
            {"mkdocs-jupyter": {"include": ["*.ipynb"], "execute": False, "include_requirejs": False, "cache": False}},
            {
                "mkdocstrings": {
                    "handlers": {
                        "python": {
                            "paths": [str(checkout)],
                            "options": {
                                "docstring_style": "google",
                                "show_source": False,
                                "show_root_heading": True,
                                "show_root_full_path": False,
                                "heading_level": 3,
                                "members_order": "source",
                                "separate_signature": True,
                                "show_signature_annotations": True,
                                "filters": ["!^_"],
                            },
                        }
                    }
                }
            },
        ],
        "markdown_extensions": [
            "admonition",
            "attr_list",
            "md_in_html",
            "tables",
            {"toc": {"permalink": True}},
            "pymdownx.highlight",
            "pymdownx.superfences",
        ],
        "nav": [{"The course": "index.md"}, {"Lessons": nav_lessons}, *({t: p} for p, t in pages.PAGES.items())],
    }


class _Loads(HTMLParser):
    """The URLs an HTML page loads by itself (not the links a reader follows)."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for name in ("src", "poster", "data"):
            if a.get(name):
                self.urls.append(a[name])
        if a.get("srcset"):
            self.urls += [part.split()[0] for part in a["srcset"].split(",") if part.strip()]
        if tag == "link" and a.get("href") and a.get("rel") not in ("canonical", "alternate"):
            self.urls.append(a["href"])
        if a.get("style"):
            self.urls += [m[0] or m[1] for m in CSS_URL.findall(a["style"])]


def external_references(site: Path) -> list[str]:
    """``file: url`` for every resource a built page or stylesheet would fetch from another host: a
    script, stylesheet, font, image, frame or CSS ``url()``/``@import`` outside the site."""
    found = []
    for path in sorted(site.rglob("*")):
        if path.suffix == ".html":
            parser = _Loads()
            parser.feed(path.read_text(encoding="utf-8"))
            urls = parser.urls + [m[0] or m[1] for m in CSS_URL.findall(path.read_text(encoding="utf-8"))]
        elif path.suffix == ".css":
            urls = [m[0] or m[1] for m in CSS_URL.findall(path.read_text(encoding="utf-8"))]
        else:
            continue
        found += [f"{path.relative_to(site)}: {url}" for url in urls if ELSEWHERE.match(url)]
    return found


def _prepare_out(out: Path) -> None:
    """Refuse to build over a folder that holds something other than an earlier book (MkDocs empties it)."""
    if out.is_dir() and any(out.iterdir()) and not (out / "search" / "search_index.json").is_file():
        raise BookError(f"{out} holds files that are not a book built by `minillm book`: choose an empty or new folder")


def build_book(
    checkout: Path,
    out: Path,
    names: list[str] | None = None,
    *,
    kept: Path | None = None,
    execute_missing: bool = True,
    rerun: bool = False,
    say: Callable[[str], None] = print,
) -> Book:
    """Build the book of ``checkout``'s lessons (all, or ``names``) into ``out``; return what was built.

    The lessons come from the executed copies in ``kept`` (default ``build/lessons`` in the checkout;
    :func:`minillm.book.lessons.gather`); a lesson without a copy of its current source is executed
    first unless ``execute_missing`` is off; ``rerun`` executes every lesson again.

    Raises:
        MissingExtraError: the book extra is not installed.
        BookError: a lesson failed (named), ``out`` holds something else, MkDocs failed, or the built
            site references another host.
    """
    require_tools()
    import yaml

    start, out = time.monotonic(), out.resolve()
    _prepare_out(out)
    kept, executed = kept or checkout / KEPT, []

    def executing(source: Path) -> None:
        executed.append(source.stem)
        say(f"executing {source.stem} (no executed copy of its current source in {kept}) ...")

    lessons = gather(
        checkout / "notebooks", kept, names, execute_missing=execute_missing, rerun=rerun, on_execute=executing
    )
    with tempfile.TemporaryDirectory(prefix="minillm-book-") as staging:
        docs = Path(staging) / "docs"
        write_sources(checkout, docs, lessons)
        config = Path(staging) / "mkdocs.yml"
        config.write_text(yaml.safe_dump(mkdocs_config(checkout, docs, out, lessons), sort_keys=False))
        env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's notice of its successor, on every build
        run = subprocess.run(
            [sys.executable, "-m", "mkdocs", "build", "--clean", "--config-file", str(config)],
            cwd=staging,
            env=env,
            capture_output=True,
            text=True,
        )
    if run.returncode != 0:
        raise BookError(f"MkDocs could not build the book (status {run.returncode}):\n{run.stderr.strip()[-3000:]}")
    leaks = external_references(out)
    if leaks:
        shutil.rmtree(out)
        raise BookError(f"the built book would load {len(leaks)} resources from other hosts: " + "; ".join(leaks[:10]))
    return Book(out, lessons, executed, time.monotonic() - start)
