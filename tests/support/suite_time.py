"""Where the test run's time goes: wall time per test module and per lesson, with what each starts.

Measured on every run (the README's test command included), printed at its end as the table
"time by module" and written as JSON to ``build/suite-times.json`` (untracked; ``--suite-times PATH``
or ``MINILLM_SUITE_TIMES`` to put it elsewhere):

- ``seconds``: wall time of the module's tests, setup and teardown included (``time.monotonic``
  around each test's whole protocol), so a module fixture that starts a server counts where it runs;
- ``started``: the subprocesses the test process started (``subprocess.Popen``), by kind: ``server``
  (``minillm serve``), ``cli`` (another ``python -m minillm`` or ``minillm`` command), ``kernel``
  (a lesson's Jupyter kernel), ``llama.cpp`` (the reference server), ``python`` (other Python
  children), ``other``;
- ``loads``: ``minillm.load`` calls in the test process (a lesson's loads are its kernel's, not
  counted here: the kernel is one ``kernel`` start);
- ``others``: other processes' share of the cores while the module ran (``/proc/stat``, as the
  diagnosis reads it): a module measured beside other work says so.

A measurement, not a check: nothing here fails a run.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

DEFAULT_REPORT = Path(__file__).resolve().parents[2] / "build" / "suite-times.json"


def kind_of(argv) -> str:
    """What a subprocess is, from its argv (a list of strings, or one string for ``shell=True``)."""
    words = [str(a) for a in argv] if not isinstance(argv, str | bytes | os.PathLike) else str(argv).split()
    text = " ".join(words)
    name = Path(words[0]).name if words else ""
    if "ipykernel" in text:
        return "kernel"
    if "llama_server.py" in text or "llama-server" in text:
        return "llama.cpp"
    if "minillm" in words[1:3] or name == "minillm" or ("-m" in words and "minillm" in words):
        return "server" if "serve" in words else "deployment" if "deploy" in words else "cli"
    if name.startswith("python"):
        return "python"
    return "other"


@dataclass
class ModuleTime:
    module: str
    seconds: float = 0.0
    tests: int = 0
    started: Counter = field(default_factory=Counter)
    loads: int = 0
    busy: list = field(default_factory=list)  # (seconds, others' share) per test

    @property
    def others(self) -> float:
        """Other processes' share of the cores, weighted by each test's seconds (NaN if unknown)."""
        known = [(s, share) for s, share in self.busy if share == share]
        total = sum(s for s, _ in known)
        return sum(s * share for s, share in known) / total if total else float("nan")


class SuiteTime:
    """The pytest plugin: registered by tests/conftest.py for the whole run (notebooks included)."""

    def __init__(self, report: Path | None) -> None:
        self.report = report
        self.modules: dict[str, ModuleTime] = {}
        self.current: ModuleTime | None = None
        self._wrap_popen()
        self._wrap_load()

    def _wrap_popen(self) -> None:
        original = subprocess.Popen.__init__
        plugin = self

        def init(popen, args, *rest, **kwargs):
            if plugin.current is not None:
                plugin.current.started[kind_of(args)] += 1
            return original(popen, args, *rest, **kwargs)

        subprocess.Popen.__init__ = init

    def _wrap_load(self) -> None:
        import minillm

        original = minillm.load
        plugin = self

        @functools.wraps(original)
        def load(*args, **kwargs):
            if plugin.current is not None:
                plugin.current.loads += 1
            return original(*args, **kwargs)

        minillm.load = load

    def pytest_runtest_protocol(self, item, nextitem):
        from minillm.observe.metrics import cpu_snapshot

        module = item.nodeid.split("::")[0]
        self.current = self.modules.setdefault(module, ModuleTime(module))
        self._t0, self._cpu0 = time.monotonic(), cpu_snapshot()

    def pytest_runtest_logfinish(self, nodeid, location):
        from minillm.observe.metrics import cpu_snapshot, others_cpu_share

        if self.current is None:
            return
        seconds = time.monotonic() - self._t0
        self.current.seconds += seconds
        self.current.tests += 1
        self.current.busy.append((seconds, others_cpu_share(self._cpu0, cpu_snapshot())))

    def rows(self) -> list[ModuleTime]:
        return sorted(self.modules.values(), key=lambda m: m.seconds, reverse=True)

    def pytest_terminal_summary(self, terminalreporter):
        if not self.modules:
            return
        tr = terminalreporter
        total = sum(m.seconds for m in self.modules.values())
        tr.section(f"time by module ({total / 60:.1f} min in tests; started: subprocesses by kind)")
        tr.write_line(f"{'seconds':>8} {'tests':>5} {'loads':>5} {'others':>6}  module  started")
        for m in self.rows():
            started = ", ".join(f"{k} {n}" for k, n in sorted(m.started.items()))
            tr.write_line(f"{m.seconds:8.1f} {m.tests:5d} {m.loads:5d} {m.others:6.0%}  {m.module}  {started}")

    def pytest_sessionfinish(self, session, exitstatus):
        if self.report is None:
            return
        self.report.parent.mkdir(parents=True, exist_ok=True)
        rows = [{**asdict(m), "started": dict(m.started), "others": m.others} for m in self.rows()]
        for row in rows:
            del row["busy"]
        self.report.write_text(json.dumps(rows, indent=1))


def addoption(parser) -> None:
    parser.addoption("--suite-times", type=Path, default=os.environ.get("MINILLM_SUITE_TIMES", DEFAULT_REPORT),
                     help="write each test module's wall time and what it started as JSON to this file")


def register(config) -> None:
    config.pluginmanager.register(SuiteTime(config.getoption("--suite-times")), "suite_time")
