"""Keep the lessons as this test run executed them, for the course book (issue 44).

nbmake executes each lesson (``NotebookItem.runtest`` -> ``NotebookRun.execute``) and drops the
executed notebook once it has judged it. For the duration of a lesson's test this plugin hands
nbmake a ``NotebookRun`` that also remembers its result, and after the test writes it with
``minillm.book.lessons.keep`` to ``build/lessons/<lesson>.ipynb`` (``--kept-lessons DIR`` elsewhere),
passed or failed, stamped with this run's id. A lesson whose run ended without a result (nbmake's own
error) is kept as failed all the same, so an older copy is never mistaken for this run's.

The book's tests (tests/book/, marked ``book``) build the site from these copies, so one run executes
each lesson once; they are moved after every other test (the lessons included) whatever the order of
the command line's paths. ``executions`` counts how often each lesson was executed in this run.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest

from minillm.book.lessons import BY_TESTS, KEPT, keep, new_run

PLUGIN = "kept_lessons_run"  # the run's KeptLessons (the module itself is the plugin "kept_lessons")


class KeptLessons:
    """The plugin's state and hooks, registered for the whole run when this module is loaded as a plugin
    (the checkout's top conftest.py: ``pytest_plugins = ["kept_lessons"]``; elsewhere ``-p kept_lessons``)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.run = new_run()
        self.kept: dict[str, Path] = {}  # lesson -> its kept copy, in the order they ran
        self.executions: Counter = Counter()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        if not getattr(item, "nbmake", False):
            yield
            return
        from nbmake import pytest_items

        nbmake_run, results = pytest_items.NotebookRun, []

        class RecordingRun(nbmake_run):
            def execute(self):
                start = time.monotonic()
                result = super().execute()
                results.append((result, time.monotonic() - start))
                return result

        pytest_items.NotebookRun = RecordingRun
        try:
            outcome = yield
        finally:
            pytest_items.NotebookRun = nbmake_run
        self._keep(Path(item.config.rootpath) / item.filename, results, outcome.excinfo)

    def _keep(self, source: Path, results: list, excinfo) -> None:
        import nbformat

        self.executions[source.stem] += 1
        if results:
            result, seconds = results[-1]
            nb, error = result.nb, None if result.error is None else result.error.summary
        else:  # nbmake raised before it had a result: no outputs to show, and no older ones either
            nb, seconds = nbformat.read(str(source), as_version=4), 0.0
            error = f"the run ended without a result: {excinfo[1]!r}" if excinfo else "the run ended without a result"
        self.kept[source.stem] = keep(
            source, nb, error=error, executed_by=BY_TESTS, run=self.run, seconds=seconds, folder=self.folder
        )

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        items.sort(key=lambda item: item.get_closest_marker("book") is not None)  # stable: the book last


def pytest_addoption(parser) -> None:
    parser.addoption("--kept-lessons", type=Path, default=None,
                     help="keep the lessons as this run executes them in this folder (default: build/lessons)")


def pytest_configure(config) -> None:
    folder = config.getoption("--kept-lessons") or Path(config.rootpath) / KEPT
    config.pluginmanager.register(KeptLessons(folder), PLUGIN)


def plugin(config) -> KeptLessons:
    """This run's plugin (for the book's tests)."""
    return config.pluginmanager.get_plugin(PLUGIN)
