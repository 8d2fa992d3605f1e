"""One JSON file read, its failures as the caller's error class: a missing file, invalid JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(file: Path, error: type[Exception], *, missing: str | None, fix: str) -> Any:
    """The parsed contents of ``file`` (UTF-8 JSON: any JSON value).

    Args:
        error: the exception class raised (``ConfigError``, ``AdapterError``, ...).
        missing: the message when ``file`` is not a file; None returns None instead.
        fix: what to do when the file is unreadable or not JSON, after ``"<file> is not valid JSON (why); "``.

    Raises:
        error: the file is missing (``missing``), unreadable, or not valid JSON.
    """
    if not file.is_file():
        if missing is None:
            return None
        raise error(missing)
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise error(f"{file} is not valid JSON ({exc}); {fix}") from exc
