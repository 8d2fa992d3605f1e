"""GET /ui in a real headless browser against servers of the test's own: a restart (two servers in turn
on one port) and a preemption (a pool of 6 blocks). A module apart from test_ui.py so that its
classroom server has exited first: beside it, a second server, the browser and the test process passed
the run's 4.5 GB tree budget.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ is not installed
from benchmarks import ui_page  # noqa: E402

pytestmark = pytest.mark.slow


def test_a_restart_is_marked_and_the_steps_start_again(tmp_path):
    from playwright.sync_api import sync_playwright

    port = ui_page.free_port()
    with sync_playwright() as pw:
        browser = ui_page.launch(pw)
        page = browser.new_page(viewport={"width": 1280, "height": 720})
        with ui_page.serve(tmp_path / "first.log", "-v", "quiet", port=port) as url:
            page.goto(url + "/ui")
            ui_page.send_from_page(page, "Say yes.", 4)
            page.wait_for_function("[...window.minillmLive.requests.values()].some(r => r.finished)")
            first = page.evaluate("window.minillmLive.chosen")
            assert page.evaluate("window.minillmLive.lastStep") >= 2
        with ui_page.serve(tmp_path / "second.log", "-v", "quiet", port=port) as url:
            page.wait_for_selector('#restart[data-restarts="1"]', state="visible", timeout=120_000)
            assert page.locator(".req-row").count() == 0 and page.locator("#steps .step").count() == 0
            ui_page.send_from_page(page, "Say no.", 2)
            page.wait_for_function("[...window.minillmLive.requests.values()].some(r => r.finished)")
            ids = page.eval_on_selector_all(".req-row", "rs => rs.map(r => r.dataset.requestId)")
            assert len(ids) == 1 and ids[0] != first
            # the new server's steps from its first: each step drawn once
            steps = page.eval_on_selector_all("#steps .step", "ss => ss.map(s => +s.dataset.stepId)")
            assert steps == sorted(set(steps)) and steps[0] <= 1
        browser.close()


def test_a_preemption_is_drawn_as_a_wait_then_a_recompute(tmp_path):
    from playwright.sync_api import sync_playwright

    # 6 blocks of 16 positions: two requests of ~33 prompt tokens fit, then the older one's decode
    # needs a block and the newer one gives its blocks back, waits, and is readmitted
    with ui_page.serve(tmp_path / "serve.log", "-v", "quiet", "--kv-cache-mib", "4.3") as url, sync_playwright() as pw:
        browser = ui_page.launch(pw)
        page = browser.new_page(viewport={"width": 1280, "height": 720})
        page.goto(url + "/ui")
        for prompt in ("Count from one to fifty.", "Count from one to forty."):
            ui_page.send_from_page(page, prompt, 40)
        page.wait_for_function(
            "[...window.minillmLive.requests.values()].filter(r => r.finished).length >= 2", timeout=300_000
        )
        rows = page.evaluate(
            """() => Object.fromEntries([...document.querySelectorAll('.req-row')].map(row => [row.dataset.requestId,
                 [...row.querySelectorAll('.cell')].map(c => [c.dataset.phase, +c.dataset.ms, c.title])]))"""
        )
        assert page.evaluate("window.minillmLive.pool.blocks_total") == 6
        (older, newer) = rows.values()
        assert "preempted" not in [p for p, *_ in older]
        phases = [p for p, *_ in newer]
        assert phases.count("preempted") == 1
        at = phases.index("preempted")
        # a wait, then its tokens again: recomputed, or (its full blocks still cached) only the last one fed
        assert phases[at - 1] == "decode" and phases[at + 1] in ("recompute", "decode")
        assert newer[at][1] > 0 and newer[at][2].startswith("preempted: waited")  # it spans the older one's steps
        browser.close()
