"""GET /ui in a real headless browser (Debian's Chromium, driven by Playwright; benchmarks/ui_page.py).

The page must work offline: every request it makes to anywhere but the server fails the test. The
page in front of a class (1280x720, the README's classroom preset) is checked by what its DOM holds:
each timeline cell's phase and milliseconds, colours, font sizes, where the candidates are drawn.
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

PHASES = {"queued", "prefill", "decode", "recompute", "held", "preempted", "stop"}
LIFECYCLE = ["load", "tokenize", "prefill", "decode", "detokenize", "stop", "free"]


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
        page.wait_for_function(f"!document.querySelector('#pool [data-owner=\"{slow_id}\"]')", timeout=30_000)
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


def lab(rgb: str) -> tuple[float, float, float]:
    """CIE L*a*b* (D65) of a CSS ``rgb(r, g, b)`` string."""
    r, g, b = (int(v) / 255 for v in rgb[rgb.index("(") + 1 : rgb.index(")")].split(",")[:3])
    lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in (r, g, b)]
    x = (lin[0] * 0.4124 + lin[1] * 0.3576 + lin[2] * 0.1805) / 0.95047
    y = lin[0] * 0.2126 + lin[1] * 0.7152 + lin[2] * 0.0722
    z = (lin[0] * 0.0193 + lin[1] * 0.1192 + lin[2] * 0.9505) / 1.08883
    f = [t ** (1 / 3) if t > 0.008856 else 7.787 * t + 16 / 116 for t in (x, y, z)]
    return 116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])


def delta_e(a: str, b: str) -> float:
    """CIE76 colour difference (about 2.3 is just noticeable; 25 reads as another colour)."""
    return sum((p - q) ** 2 for p, q in zip(lab(a), lab(b), strict=True)) ** 0.5


@pytest.fixture(scope="module")
def classroom(tmp_path_factory):
    """A server with the README's classroom preset (a 24 MiB pool: 34 blocks)."""
    log = tmp_path_factory.mktemp("ui") / "serve.log"
    with ui_page.serve(log, "-v", "quiet", *ui_page.CLASSROOM_FLAGS) as url:
        yield url


def test_in_front_of_a_class_at_1280x720(classroom):
    from playwright.sync_api import sync_playwright

    url = classroom
    with sync_playwright() as pw:
        browser = ui_page.launch(pw)
        page = browser.new_page(viewport={"width": 1280, "height": 720})
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(url + ui_page.CLASSROOM_PAGE)
        # a slow-motion request, then three plain ones batched while it sits out its seconds
        ui_page.send_from_page(page, "Tell me a story about a lighthouse keeper.", 6, slow_motion="1")
        page.wait_for_function("[...window.minillmLive.requests.values()].some(r => r.tokens.length >= 1)")
        slow = page.evaluate("window.minillmLive.chosen")
        for prompt in ui_page.PROMPTS:
            ui_page.send_from_page(page, prompt, 16)
        page.wait_for_function(
            "[...window.minillmLive.requests.values()].filter(r => r.finished).length >= 4", timeout=300_000
        )
        rows = page.evaluate(
            """() => [...document.querySelectorAll('.req-row')].map(row => ({
                 id: row.dataset.requestId,
                 cells: [...row.querySelectorAll('.cell')].map(c => ({
                   phase: c.dataset.phase, ms: c.dataset.ms, step: c.dataset.stepId ?? null,
                   width: c.getBoundingClientRect().width }))}))"""
        )
        assert len(rows) == 4
        # 1. slow motion: prefill/decode on the steps it was fed, held only on steps it sat out
        (mine,) = [r["cells"] for r in rows if r["id"] == slow]
        fed = [c["step"] for c in mine if c["phase"] in ("prefill", "decode")]
        held = [c["step"] for c in mine if c["phase"] == "held"]
        trace = httpx.get(f"{url}/v1/traces/{slow}").json()
        decodes = [e for e in trace["events"] if e["phase"] == "decode"]
        assert [c["phase"] for c in mine if c["phase"] in ("prefill", "decode")] == ["prefill"] + ["decode"] * len(
            decodes
        )
        assert held and not set(fed) & set(held)  # no step both fed and sat out
        others = {c["step"] for r in rows if r["id"] != slow for c in r["cells"] if c["step"] is not None}
        assert set(held) <= others  # it sat out exactly while the others ran
        # 2. the DOM contract: every cell's phase and milliseconds; a queue wait drawn per request
        cells = [c for r in rows for c in r["cells"]]
        assert {c["phase"] for c in cells} <= PHASES and all(float(c["ms"]) >= 0 for c in cells)
        assert all(sum(c["phase"] == "queued" for c in r["cells"]) == 1 for r in rows)
        assert all(sum(c["phase"] == "stop" for c in r["cells"]) == 1 for r in rows)
        # width = time: every step's column is its milliseconds at the page's one scale
        steps = page.evaluate(
            """() => [...document.querySelectorAll('#steps .step')].map(s =>
                 [+s.dataset.ms, s.getBoundingClientRect().width])"""
        )
        scale = page.evaluate("window.minillmLive.scale")
        assert all(abs(w - max(2, m * scale - 1)) <= 1.5 for m, w in steps if m * scale > 4), (scale, steps)
        # 3. owners' colours are never read as a phase colour
        owner = page.evaluate(
            """() => [...document.querySelectorAll('.swatch, #pool [data-owner]:not([data-owner=""])')]
                 .map(e => getComputedStyle(e).backgroundColor)"""
        )
        phase = page.evaluate(
            """() => [...document.querySelectorAll('.legend [data-phase]')]
                 .map(e => getComputedStyle(e).backgroundColor).filter(c => c.startsWith('rgb('))"""
        )
        assert len(set(owner)) == 4 and len(phase) == 6  # four requests; held is hatched, not a colour
        assert min(delta_e(o, p) for o in owner for p in phase) >= 25
        # 4. the chosen request's lifecycle in lesson 1's words, its answer detokenized
        page.locator(f'.req-row[data-request-id="{slow}"] .lane-label').click()
        assert page.eval_on_selector_all("#phases [data-lifecycle]", "es => es.map(e => e.dataset.lifecycle)") == (
            LIFECYCLE
        )
        stop = next(e["data"] for e in trace["events"] if e["phase"] == "stop")
        assert page.text_content("#d-text") == stop["text"] and stop["text"]
        blocks = page.evaluate("document.querySelectorAll('#pool [data-block]').length")
        assert f"{blocks} KV blocks" in page.text_content("#load")
        # 5. readable from the back: no text under 14 px; the candidates above the fold
        page.locator("#d-out .tok").last.click()
        small = page.evaluate(
            """() => [...document.querySelectorAll('body *')].filter(e =>
                 [...e.childNodes].some(n => n.nodeType === 3 && n.textContent.trim()) && e.getClientRects().length
                 && parseFloat(getComputedStyle(e).fontSize) < 14).map(e => e.tagName + '.' + e.className)"""
        )
        assert small == []
        assert page.locator("#candidates .cand").count() == 5
        box = page.locator("#candidates").bounding_box()
        assert box["y"] + box["height"] <= 720
        # 6. zoomed in and scrolled to the last step, every row still says whose it is
        page.click("#zoom-in")
        page.click("#zoom-in")
        page.evaluate("document.getElementById('timeline').scrollLeft = 1e6")
        lefts = page.evaluate(
            """() => [document.getElementById('timeline').scrollLeft,
                 document.getElementById('timeline').getBoundingClientRect().left,
                 ...[...document.querySelectorAll('.req-row .lane-label')].map(l => l.getBoundingClientRect().left)]"""
        )
        assert lefts[0] > 0 and all(abs(x - lefts[1]) <= 2 for x in lefts[2:]), lefts
        assert errors == []
        browser.close()


def test_a_reload_asks_first_and_keeps_the_request(classroom):
    from playwright.sync_api import sync_playwright

    url = classroom
    with sync_playwright() as pw:
        browser = ui_page.launch(pw)
        page = browser.new_page(viewport={"width": 1280, "height": 720})
        page.goto(url + "/ui")
        ui_page.send_from_page(page, "Say yes.", 3, slow_motion="2")
        page.wait_for_function("window.minillmLive.own.size == 1")  # its stream is open: the page's request
        rid = page.evaluate("[...window.minillmLive.own.keys()][0]")
        dialogs = []

        def stay(dialog):
            dialogs.append(dialog.type)
            dialog.dismiss()  # "stay on this page"

        page.on("dialog", stay)
        page.evaluate("setTimeout(() => location.reload(), 0)")
        page.wait_for_function(f"window.minillmLive.requests.get({rid!r}).finished != null", timeout=120_000)
        assert dialogs == ["beforeunload"]
        stop_reason = httpx.get(f"{url}/v1/traces/{rid}").json()["stop_reason"]
        assert stop_reason == "max new tokens"  # its 3 tokens, not "cancelled"
        browser.close()
