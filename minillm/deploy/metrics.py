"""Metrics across replicas: each replica's ``/metrics`` with its replica id as a label on every sample.

Ray Serve's own metrics (``ray_serve_*``: replicas, ongoing requests, latencies per deployment and
replica) come from Ray's metrics agent, not from this module.
"""

from __future__ import annotations

import re

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})? (?P<rest>.*)$")


def labelled(text: bytes, replica: str) -> bytes:
    """Prometheus text ``text`` with ``replica="<replica>"`` first among every sample's labels;
    comment lines (``# HELP``, ``# TYPE``) unchanged. ``replica``: Ray's replica id (no quotes)."""
    out = []
    for line in text.decode().splitlines():
        match = None if line.startswith("#") else _SAMPLE.match(line)
        if match is None:
            out.append(line)
            continue
        labels = f'replica="{replica}"' + (f",{match['labels']}" if match["labels"] else "")
        out.append(f"{match['name']}{{{labels}}} {match['rest']}")
    return ("\n".join(out) + "\n").encode()
