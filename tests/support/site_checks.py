"""What the book's tests read a built site with: a static server for its folder, a browser page that records
every request, console error and failed load, and a link checker over its HTML files (the standard
library's HTML parser: every internal link and anchor must resolve)."""

from __future__ import annotations

import functools
import http.server
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # the test's output is the report, not the server's log
        pass


@contextmanager
def served(folder: Path):
    """Serve ``folder`` on a free loopback port (as ``python -m http.server`` would); yield its base URL."""
    handler = functools.partial(_QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@dataclass
class Visit:
    """One page opened in the browser, and what happened while it loaded."""

    page: object
    console_errors: list[str] = field(default_factory=list)
    outside: list[str] = field(default_factory=list)  # requests to anywhere but the served folder (refused)
    failed: list[str] = field(default_factory=list)  # requests that failed or answered >= 400


def visit(browser, base: str, path: str) -> Visit:
    """Open ``base + path`` in a new context of ``browser``; a request that leaves ``base`` is refused and
    recorded, and so is every console error, page error and failed load."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    seen = Visit(page)

    def route(r):
        if r.request.url.startswith(base) or r.request.url.startswith("data:"):
            r.continue_()
        else:
            seen.outside.append(r.request.url)
            r.abort()

    context.route("**/*", route)
    page.on("console", lambda m: seen.console_errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: seen.console_errors.append(str(e)))
    page.on("requestfailed", lambda r: seen.failed.append(f"{r.url}: {r.failure}"))
    page.on("response", lambda r: seen.failed.append(f"{r.url}: {r.status}") if r.status >= 400 else None)
    page.goto(base + path, wait_until="load")
    page.wait_for_load_state("networkidle")
    return seen


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for name in ("id", "name") if tag == "a" else ("id",):
            if a.get(name):
                self.ids.add(a[name])
        for name in ("href", "src"):
            if a.get(name):
                self.links.append(a[name])


def broken_links(site: Path) -> list[str]:
    """``page: link`` for every link or source in the site's HTML that names a file the site lacks or an
    anchor its page lacks (links to other hosts, ``data:``, ``mailto:`` and ``javascript:`` are not checked)."""
    pages = {}
    for path in sorted(site.rglob("*.html")):
        parser = _Links()
        parser.feed(path.read_text(encoding="utf-8"))
        pages[path.resolve()] = parser
    broken = []
    for path, parser in pages.items():
        for link in parser.links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or link.startswith(("data:", "mailto:", "javascript:")):
                continue
            where = site if parts.path.startswith("/") else path.parent  # "/x": from the site's root (404.html)
            target = (where / unquote(parts.path).lstrip("/")).resolve() if parts.path else path
            if target.is_dir():
                target = target / "index.html"
            if not target.is_file() or site.resolve() not in target.parents:
                broken.append(f"{path.relative_to(site.resolve())}: {link}")
            elif parts.fragment and target in pages and unquote(parts.fragment) not in pages[target].ids:
                broken.append(f"{path.relative_to(site.resolve())}: {link} (no such anchor)")
    return broken
