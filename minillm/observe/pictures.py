"""Pictures in text: a mask as a grid, each request's block table, the paged pool a character a block.

Plain functions of plain data (ndarrays, lists of block ids), so a lesson can draw any mask or pool.
"""

from __future__ import annotations

import numpy as np


def mask_picture(mask: np.ndarray, visible: str = "0", hidden: str = "-") -> str:
    """Draw an additive mask ``[seq, ctx]`` as text, one row per query: ``visible`` where a query
    may look, ``hidden`` where not (the trace draws ``■`` and ``·``)."""
    return "\n".join(" ".join(visible if v == 0 else hidden for v in row) for row in mask)


def block_table_picture(tables: dict[int, list[int]], ref_count: list[int]) -> str:
    """Each running request's block table, one line each; a block held by several requests is
    marked ``*`` (a shared prefix)::

        req 0 | 0* 1* 2 3
        req 1 | 0* 1* 4
    """
    width = max((len(str(b)) for t in tables.values() for b in t), default=1)
    return "\n".join(
        f"req {r} | " + " ".join(f"{b:>{width}}" + ("*" if ref_count[b] > 1 else " ") for b in t).rstrip()
        for r, t in tables.items()
    )


def pool_picture(ref_count: list[int], cached_free: set[int], per_line: int = 64) -> str:
    """The pool, one character per block: ``#`` held by one request, ``2``-``9`` by that many
    (shared), ``c`` free but still holding a cached prefix, ``.`` free and empty."""
    chars = [
        ("#" if n == 1 else str(min(n, 9))) if n else ("c" if b in cached_free else ".")
        for b, n in enumerate(ref_count)
    ]
    return "\n".join("".join(chars[i : i + per_line]) for i in range(0, len(chars), per_line))
