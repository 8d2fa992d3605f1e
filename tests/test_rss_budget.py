"""The test run's memory budget (tests/support/rss_budget.py) catches what it claims to catch.

Each case runs a small pytest session in a subprocess, with the same plugin registered the way
tests/conftest.py registers it, and a budget set low. The expected values are the sizes the probe
tests allocate, by hand: ``np.ones(n // 8)`` touches n bytes of float64, so the RSS rises by at
least n (1 MB = 1e6 bytes here, as in the plugin's GB).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

MB = 1e6
TESTS = Path(__file__).parent

CONFTEST = """
import rss_budget

def pytest_addoption(parser):
    rss_budget.addoption(parser)

def pytest_configure(config):
    rss_budget.register(config)
"""

PROBES = '''
import subprocess, sys, time
import numpy as np

HOLD = "import numpy as np, sys, time; a = np.ones({n} // 8); print('ready', flush=True); time.sleep(60)"

def test_big():
    a = np.ones(400_000_000 // 8)  # 400 MB, touched
    assert a.sum() == 50_000_000
    del a

def test_small_after_big():
    pass

def test_child():
    code = "import numpy as np; a = np.ones(400_000_000 // 8); print(a.sum())"
    subprocess.run([sys.executable, "-c", code], check=True)

def test_parent_and_live_child_together():
    a = np.ones(300_000_000 // 8)  # 300 MB here and 300 MB in a child, at the same time
    child = subprocess.Popen([sys.executable, "-c", HOLD.format(n=300_000_000)], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "ready\\n"
    time.sleep(1.0)  # five samples of the tree (every 0.2 s)
    child.kill()
    child.wait()
    assert a.sum() == 37_500_000
'''


def run_probes(
    tmp_path: Path, budget_gb: float, tree_gb: float, *select: str
) -> tuple[subprocess.CompletedProcess, dict]:
    """Run the probe tests named in ``select`` under the given budgets (GB); return the finished pytest
    process and each test's peaks (bytes) from the plugin's JSON report."""
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_probes.py").write_text(textwrap.dedent(PROBES))
    report = tmp_path / "rss.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS / "support"), os.environ.get("PYTHONPATH", "")]),
           "OPENBLAS_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:nbmake", "-q",
         "--rss-budget-gb", str(budget_gb), "--rss-tree-budget-gb", str(tree_gb), "--rss-report", str(report),
         *(f"test_probes.py::{s}" for s in select)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    peaks = {p["nodeid"].split("::")[1]: p for p in json.loads(report.read_text())}
    return proc, peaks


def test_a_test_over_budget_fails_the_run_and_is_named(tmp_path):
    proc, peaks = run_probes(tmp_path, 0.35, 5.0, "test_big", "test_small_after_big")
    assert proc.returncode == 1, proc.stdout + proc.stderr  # every test passed; the budget failed the run
    assert "2 passed" in proc.stdout
    assert "OVER BUDGET: test_probes.py::test_big: the test process peaked at" in proc.stdout
    assert "test_small_after_big:" not in proc.stdout
    assert peaks["test_big"]["pytest"] >= 400 * MB
    # the high-water mark is reset per test: the next test does not inherit the 400 MB
    assert peaks["test_small_after_big"]["pytest"] < peaks["test_big"]["pytest"] - 300 * MB


def test_under_budget_passes(tmp_path):
    proc, peaks = run_probes(tmp_path, 2.0, 2.0, "test_big", "test_small_after_big")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OVER BUDGET" not in proc.stdout and "peak RSS (budget 2.00 GB a process, 2.00 GB the tree)" in proc.stdout
    assert 400 * MB <= peaks["test_big"]["pytest"] < 2000 * MB


def test_a_subprocess_over_budget_is_charged_to_its_test(tmp_path):
    proc, peaks = run_probes(tmp_path, 0.35, 5.0, "test_small_after_big", "test_child")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "OVER BUDGET: test_probes.py::test_child: a subprocess peaked at" in proc.stdout
    assert peaks["test_child"]["child"] >= 400 * MB and peaks["test_child"]["pytest"] < 350 * MB
    assert peaks["test_small_after_big"]["child"] == 0  # no subprocess of its own


def test_a_process_tree_over_budget_fails_though_each_process_is_under(tmp_path):
    proc, peaks = run_probes(tmp_path, 0.5, 0.5, "test_parent_and_live_child_together")
    peak = peaks["test_parent_and_live_child_together"]
    assert peak["pytest"] < 500 * MB and peak["child"] < 500 * MB, peak  # each alone is within budget
    assert peak["tree"] >= 600 * MB, peak  # both at once: 300 MB + 300 MB + two interpreters
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "test_parent_and_live_child_together: the process tree peaked at" in proc.stdout


def test_the_readme_states_the_budgets_the_run_enforces():
    """The README's memory needs name the budgets this plugin enforces (its defaults)."""
    from rss_budget import DEFAULT_BUDGET_GB, DEFAULT_TREE_BUDGET_GB

    text = " ".join((TESTS.parent / "README.md").read_text(encoding="utf-8").split())
    assert (DEFAULT_BUDGET_GB, DEFAULT_TREE_BUDGET_GB) == (3.0, 4.5)
    assert "The run fails when one process passes 3 GB or the tree 4.5 GB" in text
