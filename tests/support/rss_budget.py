"""The test run's memory budget, measured on every run and enforced at its end.

Three measurements, each per test (setup, call and teardown, so module fixtures count where they
load and where they are freed):

- ``pytest``: the test process's own peak RSS. Linux keeps a high-water mark (``VmHWM`` in
  /proc/self/status) that only rises; writing ``5`` to /proc/self/clear_refs resets it to the
  current RSS (proc(5)), so each test's mark is exact and its own, not a sample.
- ``child``: the peak RSS of the largest subprocess the test started and waited for (servers,
  ``python -m minillm`` runs, notebook kernels). The kernel reports it as ``ru_maxrss`` of
  ``RUSAGE_CHILDREN`` (getrusage(2)): it covers every reaped descendant (grandchildren count when
  their parent waited for them) and only rises, so a test is charged when the mark rose during it.
- ``tree``: the sum of the current RSS of the test process and all its live descendants, sampled
  every 0.2 s by a thread (psutil). This is what the machine must hold at once (a server beside
  the test process); a sample can miss a spike shorter than the interval, the two exact marks above
  cannot. Shared pages count once per process, so the sum errs high.

At the end of the run (``pytest_sessionfinish``) the largest tests and modules are printed and the
run fails (exit status 1) when a test went over budget: 3 GB (3e9 bytes) for any one process, the
test process or a subprocess (``--rss-budget-gb``), and 4.5 GB for the tree's sampled sum
(``--rss-tree-budget-gb``: the servers of test_serve.py and a notebook's kernel run beside the test
process, which keeps SmolLM2 and torch loaded; measured 4.0 GB). tests/test_rss_budget.py checks the check.

Resetting the mark hides the test process's peak from whoever started pytest: ``/usr/bin/time``
then reports the last test's peak or the largest subprocess, not the run's; read this report instead.
"""

from __future__ import annotations

import json
import os
import resource
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import pytest

DEFAULT_BUDGET_GB = 3.0
DEFAULT_TREE_BUDGET_GB = 4.5
SAMPLE_SECONDS = 0.2
GB = 1e9


def _vm_hwm() -> int:
    """This process's RSS high-water mark in bytes (/proc/self/status gives kB)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status: the RSS budget needs Linux")


def _reset_vm_hwm() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # "5": reset the peak RSS to the current RSS


def _children_maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # Linux gives kB


@dataclass
class Peak:
    nodeid: str
    pytest: int  # bytes, exact high-water mark of the test process
    child: int  # bytes, the largest reaped subprocess if it set a new mark during this test, else 0
    tree: int  # bytes, largest sampled sum over the process tree

    @property
    def module(self) -> str:
        return self.nodeid.split("::")[0]

    def worst(self) -> int:
        return max(self.pytest, self.child, self.tree)

    def over(self, budget: float, tree_budget: float) -> str | None:
        """Why this test went over budget, or None."""
        if max(self.pytest, self.child) > budget:
            which = "the test process" if self.pytest >= self.child else "a subprocess"
            return f"{which} peaked at {max(self.pytest, self.child) / GB:.2f} GB > {budget / GB:.2f} GB"
        if self.tree > tree_budget:
            return f"the process tree peaked at {self.tree / GB:.2f} GB > {tree_budget / GB:.2f} GB"
        return None


class TreeSampler(threading.Thread):
    """Samples the summed RSS of this process and its descendants; ``take()`` returns the peak since
    the last ``take()``."""

    def __init__(self) -> None:
        super().__init__(name="rss-sampler", daemon=True)
        self._me = psutil.Process()
        self._peak = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def _sum(self) -> int:
        total = self._me.memory_info().rss
        for child in self._me.children(recursive=True):
            try:
                total += child.memory_info().rss
            except psutil.Error:  # it ended between the listing and the read
                pass
        return total

    def run(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            rss = self._sum()
            with self._lock:
                self._peak = max(self._peak, rss)

    def take(self) -> int:
        rss = self._sum()  # the end of each test counts too, however short the test
        with self._lock:
            peak, self._peak = max(self._peak, rss), 0
        return peak

    def stop(self) -> None:
        self._stop.set()


class RssBudget:
    """The pytest plugin: registered by tests/conftest.py for the whole run (notebooks included)."""

    def __init__(self, budget_bytes: float, tree_budget_bytes: float, report: Path | None) -> None:
        self.budget = budget_bytes
        self.tree_budget = tree_budget_bytes
        self.report = report
        self.peaks: list[Peak] = []
        self.sampler = TreeSampler()
        self.sampler.start()
        self._children_mark = 0

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        _reset_vm_hwm()
        self.sampler.take()
        self._children_mark = _children_maxrss()  # children reaped between tests are no test's
        yield
        children = _children_maxrss()
        child = children if children > self._children_mark else 0
        self.peaks.append(Peak(item.nodeid, _vm_hwm(), child, self.sampler.take()))

    def over_budget(self) -> list[Peak]:
        return [p for p in self.peaks if p.over(self.budget, self.tree_budget)]

    def pytest_terminal_summary(self, terminalreporter):
        if not self.peaks:
            return
        tr = terminalreporter
        tr.section(f"peak RSS (budget {self.budget / GB:.2f} GB a process, {self.tree_budget / GB:.2f} GB the tree)")
        modules: dict[str, Peak] = {}
        for p in self.peaks:
            m = modules.setdefault(p.module, Peak(p.module, 0, 0, 0))
            m.pytest, m.child, m.tree = max(m.pytest, p.pytest), max(m.child, p.child), max(m.tree, p.tree)
        tr.write_line(f"{'GB: pytest':>12} {'child':>6} {'tree':>6}  (largest modules, then tests)")
        for p in sorted(modules.values(), key=Peak.worst, reverse=True)[:8]:
            tr.write_line(f"{p.pytest / GB:12.2f} {p.child / GB:6.2f} {p.tree / GB:6.2f}  {p.nodeid}")
        for p in sorted(self.peaks, key=Peak.worst, reverse=True)[:5]:
            tr.write_line(f"{p.pytest / GB:12.2f} {p.child / GB:6.2f} {p.tree / GB:6.2f}  {p.nodeid}")
        for p in self.over_budget():
            tr.write_line(f"OVER BUDGET: {p.nodeid}: {p.over(self.budget, self.tree_budget)}; load real models once "
                          "per run (tests/conftest.py), free references, run heavy references apart", red=True)

    def pytest_sessionfinish(self, session, exitstatus):
        self.sampler.stop()
        if self.report is not None:
            self.report.write_text(json.dumps([asdict(p) for p in self.peaks], indent=1))
        if self.over_budget() and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def addoption(parser) -> None:
    parser.addoption("--rss-budget-gb", type=float, default=DEFAULT_BUDGET_GB,
                     help="fail the run when a test's peak RSS (the test process or a subprocess) exceeds this")
    parser.addoption("--rss-tree-budget-gb", type=float, default=DEFAULT_TREE_BUDGET_GB,
                     help="fail the run when the summed RSS of the test process and its subprocesses exceeds this")
    parser.addoption("--rss-report", type=Path, default=os.environ.get("MINILLM_RSS_REPORT"),
                     help="write each test's peak RSS (bytes) as JSON to this file")


def register(config) -> None:
    budget = RssBudget(config.getoption("--rss-budget-gb") * GB, config.getoption("--rss-tree-budget-gb") * GB,
                       config.getoption("--rss-report"))
    config.pluginmanager.register(budget, "rss_budget")
