"""MkDocs hooks (``hooks:`` in the book's mkdocs.yml) that keep the lesson pages offline and their contents
linked.

- mkdocs-jupyter renders a notebook with nbconvert's lab template, which loads MathJax and, when a page
  has a Mermaid diagram, mermaid.js from a CDN. The lessons write no TeX and draw no Mermaid diagram
  (their pictures are matplotlib images kept in the page), so both loaders are taken out of every page's
  content; ``site.external_references`` then checks the built site for any reference to another host.
- mkdocs-jupyter builds a lesson's table of contents from a Markdown conversion of the notebook, whose
  anchors leave out a heading's code (``## The same request with `generate` `` gets ``#the-same-request-with``)
  while nbconvert's headings keep it. The table's entries follow the headings one for one, so each entry
  takes its heading's anchor and text.
"""

from __future__ import annotations

import html as html_lib
import re

#: nbconvert's MathJax loader and its configuration script (``base/mathjax.html.j2``).
MATHJAX = re.compile(r"<!-- Load mathjax -->.*?<!-- End of mathjax configuration -->", re.DOTALL)
#: nbconvert's mermaid loader (``lab/mermaidjs.html.j2``): a module script importing mermaid from a CDN.
MERMAID = re.compile(r"<script type=\"module\">(?:(?!</script>).)*?mermaid(?:(?!</script>).)*</script>", re.DOTALL)
#: A heading with its anchor, as nbconvert writes it.
HEADING = re.compile(r"<h([1-6])[^>]*\bid=\"([^\"]+)\"[^>]*>(.*?)</h\1>", re.DOTALL)
TAG = re.compile(r"<[^>]+>")


def _entries(toc) -> list:
    """The table of contents' entries in document order (depth first)."""
    out = []
    for item in toc:
        out.append(item)
        out.extend(_entries(item.children))
    return out


def on_page_content(html: str, page, config, files) -> str:
    """MkDocs' event for a page's rendered content: drop the CDN loaders; point a notebook's table of
    contents at its headings (when the two count alike)."""
    html = MERMAID.sub("", MATHJAX.sub("", html))
    if page.file.src_path.endswith(".ipynb"):
        headings = [(anchor, TAG.sub("", text).replace("¶", "").strip()) for _, anchor, text in HEADING.findall(html)]
        entries = _entries(page.toc)
        if len(entries) == len(headings):
            for entry, (anchor, text) in zip(entries, headings, strict=True):
                entry.id, entry.title = anchor, html_lib.escape(html_lib.unescape(text), quote=False)
    return html
