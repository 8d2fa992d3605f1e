"""What the memory plan cannot compute from a config: the runtime's own bytes and a tokenizer's,
measured once in a fresh subprocess and cached; and this process's resident set (``rss_bytes``),
read after handing freed pages back (``trim_heap``), which the tests and the server compare with the plan.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from minillm.errors import DISTRIBUTION, MemoryBudgetError

_MEASURE = r"""
import ctypes, json, sys
def rss():
    try:  # hand the heap's freed pages back first: a server trims after every load and burst (models.py)
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
import importlib, numpy, minillm
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
base, out = rss(), {}
from minillm.text.tokenizer import Tokenizer
keep = []
for path in json.loads(sys.argv[2]):
    before = rss()
    keep.append(tok := Tokenizer.from_folder(path))
    tok.decode(list(tok.encode("Hello, world!")))  # a first request's use: encode, decode, and the
    max(len(piece.encode("utf-8")) for piece in tok.backend.get_vocab(with_added_tokens=True))  # limits' scan
    out[path] = rss() - before
print(json.dumps({"runtime": base, "tokenizers": out}))
"""
#: Bumped when the measurement above changes, so a cache of the old way's numbers is not used.
_MEASURE_VERSION = 4


def _cache_file() -> Path:
    from minillm.sources.hub import cache_root

    return cache_root() / "memory_overhead.json"


def _tokenizer_key(folder: Path) -> str:
    files = sorted(folder.glob("tokenizer*.json"))
    return json.dumps([[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files])


def _minillm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return "unknown"


def measured_overhead(tokenizer_folders: list[Path], modules: tuple[str, ...] = ()) -> dict:
    """``{"runtime": bytes, "tokenizers": {folder: bytes}}``, measured in a subprocess and cached.

    ``runtime``: the resident bytes of a fresh Python process once it imported NumPy, minillm and
    ``modules`` (a server adds its HTTP stack). ``tokenizers``: how much each folder's tokenizer
    keeps resident once read and used as a server's first request uses it (an encode, a decode,
    a scan of its vocabulary). Each reading follows ``malloc_trim`` (:func:`trim_heap`), as a
    server trims after every load and every burst of steps: parsing a tokenizer's JSON makes many
    short-lived objects (for a large vocabulary, more than the tokenizer keeps), and counting them
    would plan memory no loaded model holds. Cached in ``memory_overhead.json`` in minillm's cache
    folder, keyed by Python, NumPy and minillm versions and the modules (a tokenizer by its files'
    sizes and times), so the subprocess runs only for what the cache lacks.

    Raises:
        MemoryBudgetError: the measuring subprocess failed (its error output is in the message).
    """
    import numpy

    key = json.dumps([_MEASURE_VERSION, sys.version, numpy.__version__, _minillm_version(), sorted(modules)])
    path = _cache_file()
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    entry = cache.setdefault(key, {"runtime": None, "tokenizers": {}})
    want = {_tokenizer_key(Path(f)): str(f) for f in tokenizer_folders}
    missing = [f for k, f in want.items() if k not in entry["tokenizers"]]
    if entry["runtime"] is None or missing:
        args = [sys.executable, "-c", _MEASURE, json.dumps(list(modules)), json.dumps(missing)]
        done = subprocess.run(args, capture_output=True, text=True)
        if done.returncode != 0:
            raise MemoryBudgetError(f"measuring the runtime's own memory failed:\n{done.stderr[-2000:]}")
        got = json.loads(done.stdout.strip().splitlines()[-1])
        entry["runtime"] = entry["runtime"] or got["runtime"]
        for folder, n in got["tokenizers"].items():
            entry["tokenizers"][_tokenizer_key(Path(folder))] = n
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        tmp.replace(path)
    return {"runtime": entry["runtime"], "tokenizers": {f: entry["tokenizers"][k] for k, f in want.items()}}


def trim_heap() -> None:
    """Hand the heap's freed pages back to the kernel (glibc's ``malloc_trim``, every thread's arena).

    Short-lived objects (a tokenizer's parsed JSON, the float32 rows an int8 load quantizes, a
    calibration's test arrays) otherwise stay in the process's resident set after they are freed,
    and a measured RSS would count memory nothing holds. Not glibc: nothing to do (the memory is
    reused by the next allocation instead)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def rss_bytes() -> int:
    """This process's resident set in bytes (``VmRSS`` in /proc/self/status; 0 where there is none)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
