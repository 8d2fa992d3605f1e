"""The live page (GET /ui) in a real headless browser: Debian's Chromium driven by Playwright.

    python -m benchmarks.ui_page    # minillm serve, classroom preset -> docs/ui-1280x720.png, ui-1920x1080.png

Playwright's own browser download cannot work offline, so Chromium comes from apt
(``apt-get install -y chromium-headless-shell``) and Playwright (``pip install playwright==1.64.1``,
the release built for Chromium 156) drives it through ``executable_path``. ``tests/serve/test_ui.py``
uses the same launch and the same three requests.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from benchmarks.server_process import free_port, ready, stop, wait_for

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
CHROMIUM_CANDIDATES = ("/usr/bin/chromium-headless-shell", "/usr/bin/chromium", "/usr/lib/chromium/chromium")
PROMPTS = (
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Write one sentence about the sea.",
)


def find_chromium() -> str:
    """The Debian Chromium binary's path.

    Raises:
        FileNotFoundError: none installed (naming the apt line that installs one).
    """
    for path in (os.environ.get("MINILLM_CHROMIUM"), *CHROMIUM_CANDIDATES, shutil.which("chromium")):
        if path and Path(path).is_file():
            return path
    raise FileNotFoundError(
        "no Chromium found (looked at $MINILLM_CHROMIUM and " + ", ".join(CHROMIUM_CANDIDATES) + "); "
        "install one with `apt-get install -y chromium-headless-shell`"
    )


def launch(playwright):
    """A headless Chromium browser (Playwright's ``Browser``) from the Debian binary."""
    return playwright.chromium.launch(executable_path=find_chromium(), args=CHROMIUM_ARGS, headless=True)


@contextmanager
def serve(log: Path, *flags: str, port: int | None = None):
    """Run ``python -m minillm serve`` on ``port`` (default: a free one) until the block ends; yield its base URL."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "minillm", "serve", MODEL, "--port", str(port), "--threads", "1", *flags]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "COLUMNS": "120"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(url, ready, proc, log, timeout=180)
        yield url
    finally:
        stop(proc)


def send_from_page(page, prompt: str, max_tokens: int, slow_motion: str = "0") -> None:
    """Type a prompt into the page's box and press Send (the page streams it through the API)."""
    page.fill("#prompt", prompt)
    page.fill("#max-tokens", str(max_tokens))
    page.select_option("#slow-motion", slow_motion)
    page.click("#send")


def three_requests(page, max_tokens: int = 24) -> None:
    """Send the three prompts at once from the page and wait until all three have finished."""
    for prompt in PROMPTS:
        send_from_page(page, prompt, max_tokens)
    page.wait_for_function("document.querySelectorAll('.req-row').length >= 3", timeout=60_000)
    page.wait_for_function(
        "[...window.minillmLive.requests.values()].filter(r => r.finished).length >= 3", timeout=180_000
    )


#: The classroom preset (README, "Watch it live"): a pool small enough that each request's blocks
#: are big squares (24 MiB: 34 blocks of 16 positions for SmolLM2-135M), and the page at ``/ui?zoom=``
#: where a 200 ms decode step is about 30 px wide.
CLASSROOM_FLAGS = ("--kv-cache-mib", "24")
CLASSROOM_PAGE = "/ui?zoom=0.15&slow=1"
SIZES = ((1280, 720), (1920, 1080))


def classroom_scene(page, slow_motion: str = "1") -> None:
    """What the README's pictures show: a slow-motion request (its held steps between its own), then
    the three prompts batched beside it; waits until the three have finished and the slow one has
    made 8 tokens, then clicks a token of the slow one for its candidates."""
    send_from_page(page, "Tell me a story about a lighthouse keeper.", 60, slow_motion=slow_motion)
    page.wait_for_function("[...window.minillmLive.requests.values()].some(r => r.tokens.length >= 1)", timeout=120_000)
    slow_id = page.evaluate("window.minillmLive.chosen")
    for prompt in PROMPTS:
        send_from_page(page, prompt, 24)
    page.wait_for_function(
        "[...window.minillmLive.requests.values()].filter(r => r.finished).length >= 3", timeout=300_000
    )
    page.wait_for_function(f"window.minillmLive.requests.get({slow_id!r}).tokens.length >= 8", timeout=300_000)
    page.click("#fit")  # every step in view
    page.locator(f'.req-row[data-request-id="{slow_id}"] .lane-label').click()
    page.locator("#d-out .tok").nth(4).click()


def main(argv: list[str] | None = None) -> int:
    """Regenerate the README's pictures of the page (the classroom preset, at 1280x720 and 1920x1080)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs"), help="the folder the screenshots go to")
    args = ap.parse_args(argv)
    from playwright.sync_api import sync_playwright

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "ui.serve.log"
    for width, height in SIZES:
        with serve(log, "-v", "quiet", *CLASSROOM_FLAGS) as url, sync_playwright() as pw:
            browser = launch(pw)
            page = browser.new_page(viewport={"width": width, "height": height})
            page.goto(url + CLASSROOM_PAGE)
            classroom_scene(page)
            path = out / f"ui-{width}x{height}.png"
            page.screenshot(path=str(path))  # the viewport: what a projector shows
            print(f"wrote {path}")
            browser.close()
    log.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
