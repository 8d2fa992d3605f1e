"""GET /ui in a real headless browser (Debian's Chromium, driven by Playwright; benchmarks/ui_page.py).

The page must work offline: every request it makes to anywhere but the server fails the test.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import pytest
from servers import metrics

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ is not installed
from benchmarks import ui_page  # noqa: E402

pytestmark = pytest.mark.slow


def owned_blocks(page) -> dict[str, list[int]]:
    return page.evaluate(
        """() => { const out = {};
        for (const b of document.querySelectorAll('#pool [data-block]')) if (b.dataset.owner)
          (out[b.dataset.owner] ||= []).push(+b.dataset.block);
        return out; }"""
    )


def test_the_live_page_shows_three_batched_requests_the_pool_and_a_cancel(tmp_path):
    from playwright.sync_api import sync_playwright

    log = tmp_path / "serve.log"
    with ui_page.serve(log, "-v", "quiet") as url, sync_playwright() as pw:
        browser = ui_page.launch(pw)
        page = browser.new_page(viewport={"width": 1360, "height": 860})
        errors, outside = [], []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))

        def guard(route):
            if route.request.url.startswith(url + "/"):
                route.continue_()
            else:
                outside.append(route.request.url)
                route.abort()

        page.route("**/*", guard)
        page.goto(url + "/ui")
        ui_page.three_requests(page)
        assert page.locator(".req-row[data-request-id]").count() == 3
        assert page.locator('[data-step-id][data-batch-size="3"]').count() >= 1
        # the last token's candidates, as the page shows them, are the trace's
        rid = page.evaluate("window.minillmLive.chosen")
        page.locator("#d-out .tok").last.click()
        shown = page.evaluate(
            "[...document.querySelectorAll('#candidates .cand')].map(r => [r.dataset.piece, +r.dataset.prob])"
        )
        trace = httpx.get(f"{url}/v1/traces/{rid}").json()["events"]
        last = [e for e in trace if e["phase"] == "decode"][-1]["data"]["candidates"]
        assert [p for p, _ in shown] == [p for p, _ in last]
        assert [round(q, 6) for _, q in shown] == [round(q, 6) for _, q in last]
        assert owned_blocks(page) == {}  # all three ended: their blocks are free
        # a slow-motion request holds still between its steps: the grid then equals the scheduler's pool
        ui_page.send_from_page(page, "Tell me a long story about the moon.", 200, slow_motion="2")
        page.wait_for_function("document.querySelectorAll('#pool [data-owner]:not([data-owner=\"\"])').length > 0")
        page.wait_for_timeout(300)
        grid, m = owned_blocks(page), metrics(url)
        bytes_per_block = int(page.get_attribute("#pool", "data-bytes-per-block"))
        assert len({b for bs in grid.values() for b in bs}) * bytes_per_block == m["minillm_kv_cache_bytes_reserved"]
        (slow_id,) = grid
        page.screenshot(path=str(tmp_path / "ui.png"), full_page=True)
        # cancel: its blocks are free at the next step
        step_at_cancel = page.evaluate("window.minillmLive.lastStep")
        page.click("#cancel")
        page.wait_for_function(
            f"!document.querySelector('#pool [data-owner=\"{slow_id}\"]')", timeout=30_000
        )
        assert page.evaluate("window.minillmLive.pool.step") <= step_at_cancel + 1
        deadline = time.monotonic() + 10
        while metrics(url)["minillm_kv_cache_bytes_reserved"] != 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metrics(url)["minillm_kv_cache_bytes_reserved"] == 0
        assert httpx.get(f"{url}/v1/traces/{slow_id}").json()["stop_reason"] == "cancelled"
        assert errors == [] and outside == []
        page.close()
        browser.close()
    assert (tmp_path / "ui.png").stat().st_size > 10_000
