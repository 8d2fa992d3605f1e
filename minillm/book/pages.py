"""The book's pages as MkDocs sources: the course's map, each lesson's executed copy, and the pages
made from the README (the live page, the exercises, the speed table) and the docstrings (the API).

Everything here writes Markdown or notebooks into a staging folder; MkDocs (Material, mkdocs-jupyter,
mkdocstrings) turns them into the site (``minillm/book/site.py``). The README stays the one source of
its sections: they are copied with their headings moved up to the page's level and their ``docs/``
pictures copied beside them.
"""

from __future__ import annotations

import re
import shutil
from datetime import datetime
from pathlib import Path

from minillm.book import course
from minillm.book.lessons import Lesson
from minillm.errors import BookError

#: The book's pages besides the lessons: file -> its title in the navigation.
PAGES = {
    "live-page.md": "The live page",
    "exercises.md": "Exercises: your turn",
    "api.md": "API reference",
    "speed.md": "Speed, measured",
}
#: The API page: the lifecycle, one function per phase (minillm/__init__.py), then the two settings' classes.
LIFECYCLE = (
    "load",
    "tokenize",
    "prefill",
    "sample",
    "decode_step",
    "detokenize",
    "generate",
    "stream",
    "generate_batch",
)
CLASSES = ("KVCache", "SamplingParams")
HEADING = re.compile(r"^(#{1,6}) ")


def readme_section(readme: str, heading: str) -> str:
    """The README's section whose heading line starts with ``heading`` (e.g. ``"## Exercises: your turn"``),
    up to the next heading of its level or above, its headings moved up so that it starts at ``#`` (lines
    in fenced code blocks are never headings).

    Raises:
        BookError: the README has no such heading (a section was renamed: the book names the one it needs).
    """
    level, out, fenced = len(heading.split(" ", 1)[0]), None, False
    for line in readme.splitlines():
        fenced ^= line.startswith("```")
        depth = len(HEADING.match(line).group(1)) if HEADING.match(line) and not fenced else 0
        if out is None and depth and line.startswith(heading):
            out = []
        elif out is not None and 0 < depth <= level:
            break
        if out is not None:
            out.append("#" * (depth - level + 1) + line[depth:] if depth else line)
    if out is None:
        raise BookError(f"README.md has no section '{heading}', which the book publishes")
    return "\n".join(out).rstrip() + "\n"


def copy_pictures(markdown: str, checkout: Path, docs: Path) -> str:
    """Copy the README's ``docs/`` pictures a section shows or links into ``docs/assets`` and point there."""
    for name in sorted(set(re.findall(r"\]\(docs/([\w.-]+)\)", markdown))):
        (docs / "assets").mkdir(exist_ok=True)
        shutil.copy(checkout / "docs" / name, docs / "assets" / name)
    return markdown.replace("](docs/", "](assets/")


def ran_on(record: dict) -> str:
    """The sentence on a lesson page saying which run and which machine produced its outputs."""
    m = record["machine"]
    when = datetime.fromisoformat(record["finished"])
    blas = "; ".join(
        f"{b['internal_api']} {b['version']}, kernel {b['architecture'] or 'unknown'}, {b['num_threads']} "
        f"thread{'' if b['num_threads'] == 1 else 's'}"
        for b in m["blas"]
    )
    return (
        f"**The outputs on this page** come from {record['executed_by']}, run `{record['run']}`, which "
        f"executed this lesson on {when:%Y-%m-%d at %H:%M} UTC in {record['seconds']:.0f} s, on {m['cpu']} "
        f"({m['cores']} cores) with NumPy {m['numpy']} and BLAS {blas or 'unknown (threadpoolctl found none)'}. "
        "The timings in this lesson are that machine's."
    )


def write_lesson(lesson: Lesson, docs: Path) -> Path:
    """The lesson's executed copy for the book: its cells and outputs as kept, with :func:`ran_on` in a
    cell of its own (class ``ran-on``) right under the title (the first cell's ``# heading`` line)."""
    import nbformat

    nb = nbformat.read(str(lesson.copy), as_version=4)
    note = nbformat.v4.new_markdown_cell(f'<div class="ran-on" markdown>\n\n{ran_on(lesson.record)}\n\n</div>')
    at = 0
    if nb.cells and nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# "):
        heading, _, rest = nb.cells[0].source.partition("\n")
        nb.cells[0].source = heading
        nb.cells.insert(1, nbformat.v4.new_markdown_cell(rest.lstrip("\n")))
        at = 1
    nb.cells.insert(at, note)
    path = docs / "lessons" / f"{lesson.name}.ipynb"
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(path))
    return path


def index_page(lessons: list[Lesson], readme: str, checkout: Path) -> str:
    """The course's map: the lifecycle picture, the two timescales, the lessons in order (one line and
    the extras each), and the pages beyond them."""
    intro, picture = readme.split("\n## ", 1)[0].split("\n\n")[1:3]
    rows = []
    for lesson in lessons:
        name = course.title(lesson.source).split(": ", 1)[-1]
        line = course.LINES.get(lesson.name, "")
        extras = ", ".join(f"`{e}`" for e in course.extras_needed(lesson.source, checkout))
        rows.append(f"| {lesson.name[:2]} | [{name}](lessons/{lesson.name}.ipynb) | {line} | {extras} |")
    beyond = "\n".join(f"- [{title}]({page})" for page, title in PAGES.items())
    return f"""# minillm: the course book

{intro}

## The lifecycle

One request travels these phases, each a separate function you can call, time and print:

```text
{picture.strip()}
```

## Two timescales

Per **request**, in milliseconds: prefill once over the prompt, then one decode step per new token,
each reading every weight and the KV cache ([lesson 4](lessons/04_prefill_vs_decode.ipynb) onwards).
Per **model**, in seconds: startup, when a server launches or switches models: loading, warm-up and the
memory plan (lesson 14). A request's latency is TTFT and TPOT; a model's is how long until it is ready.

## The lessons

Each page shows the lesson with the outputs of the test run that executed it (plots, the trace, tables)
and says which machine ran it. To run a lesson yourself, install its extras
(`pip install torch==2.13.0 && pip install -e ".[lessons]"` installs every lesson's) and open it in Jupyter.

| # | lesson | what it shows | extras |
| --- | --- | --- | --- |
{chr(10).join(rows)}

## Beyond the lessons

{beyond}
"""


def api_page(serve_help: str) -> str:
    """The API reference: mkdocstrings renders each name from its docstring; the server's flags are
    ``minillm serve --help`` as it prints them."""
    functions = "\n\n".join(f"::: minillm.{name}" for name in LIFECYCLE)
    classes = "\n\n".join(f"::: minillm.{name}" for name in CLASSES)
    return f"""# API reference

Generated from the docstrings. The lifecycle, one function per phase (`import minillm`):

{functions}

## The KV cache and the sampler's settings

{classes}

## The server's flags

```text
$ minillm serve --help
{serve_help.rstrip()}
```
"""


def speed_page(readme: str, table: str, reports: list[dict]) -> str:
    """The README's speed table, made again from the tracked results files, with what each machine was."""
    section = readme_section(readme, "## Speed, measured")
    mark = "<!-- speed table: python -m benchmarks.speed_results -->"
    before = section.split(mark, 1)[0].rstrip()
    machines = "\n".join(
        f"- {r['machine_description']['blas']['architecture']}, {r['machine_description']['threads']} "
        f"thread(s): {r['machine_description']['cpu']}, {r['machine_description']['cores']} cores"
        for r in reports
    )
    where = "The machines that made these files (`benchmarks/results/speed-*.json`):"
    return f"{before}\n\n{table}\n\n{where}\n\n{machines}\n"
