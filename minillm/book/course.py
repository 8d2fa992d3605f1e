"""The course's map: each lesson's title, its line on the index, and the extras it needs.

A lesson's line is written here (:data:`LINES`, one per lesson, tested against ``notebooks/``); its
title is its first heading; the extras are worked out from what its code cells import (and any
``benchmarks`` module they use, and ``minillm serve`` started as a subprocess): each third-party
package is charged to the first extra of :data:`EXTRAS` that installs it (its requirements followed
through the installed packages' metadata), so the table stays true when a lesson's imports change.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from functools import cache
from pathlib import Path

#: The index's one line per lesson, in course order.
LINES = {
    "01_lifecycle": "One request through every phase (load, tokenize, prefill, sample, decode, detokenize, stop, "
    "free), each a function you call, time and print.",
    "02_tokenization_and_chat_templates": "Text to token ids and back, and how a chat template turns a conversation "
    "into the text the model reads.",
    "03_causal_mask_and_attention": "The causal mask as an array you print, and attention computed by hand against "
    "the model's own.",
    "04_prefill_vs_decode": "One forward pass, two limits: prefill is bound by compute, a decode step by memory "
    "(TTFT and TPOT).",
    "05_kv_cache": "The KV cache: what it holds, its bytes per token, and decoding with and without it.",
    "06_selection": "From logits to one token: temperature, top-k, top-p, min-p and the repetition penalty.",
    "07_stopping_and_streaming": "The seven ways a request stops, and streamed text that never splits a character "
    "or a stop string.",
    "08_diagnosing_a_slow_request": "Which phase is slow? Each phase measured against what this machine should take.",
    "09_lora_adapters": "LoRA adapters, merged into the weights or kept beside them and switched per request.",
    "10_request_as_api_call": "The request over HTTP: `minillm serve`, its health check, one worker and a queue "
    "behind OpenAI's API.",
    "11_batching_and_the_kv_cache_pool": "Batching: several requests' rows in one pass, their keys and values in a "
    "paged pool of blocks.",
    "12_what_precision_costs": "Weights held as bfloat16, int8 or GGUF blocks: the memory saved, the speed and "
    "quality paid.",
    "13_what_the_engine_room_buys": "The engine room's tuned products and attention beside the textbook's plain "
    "ones, measured.",
    "14_startup_switching_and_the_memory_plan": "The second timescale: startup, cold and warm loads, the memory plan "
    "and what switching models costs.",
    "15_speculative_decoding": "A draft guesses, the model checks several tokens in one pass, and its distribution "
    "is kept exactly.",
    "16_the_samplers_controls": "Every sampling control of OpenAI's API, and output held to a JSON schema or a regex.",
    "17_when_things_go_wrong": "Clients that vanish, more requests than fit, a request's own bug, and a restart that "
    "drains.",
    "18_from_one_server_to_a_fleet": "The same server as Ray Serve replicas: one vs two, a rolling update under load, "
    "and routing by prefix.",
}
#: Extras in the order a package is charged to them (``lessons`` installs what every lesson needs).
EXTRAS = ("notebooks", "reference", "serve", "constrained", "exercises", "deploy", "lessons")
#: What a lesson's code does with minillm that needs an extra beyond its imports: ``minillm serve`` started
#: from a cell (``[sys.executable, "-m", "minillm", "serve", ...]``), a grammar constraining the output,
#: ``minillm deploy`` started from a cell (Ray Serve).
FEATURES = {
    "serve": re.compile(r"""["']minillm["'],\s*["']serve["']|minillm serve"""),
    "constrained": re.compile(r"\bconstraint=|runtime\.constraint\b|response_format"),
    "deploy": re.compile(r"""["']minillm["'],\s*["']deploy["']|minillm deploy"""),
}


def cells(source: Path, kind: str) -> list[str]:
    """The sources of a notebook's cells of ``kind`` (``"code"`` or ``"markdown"``)."""
    nb = json.loads(source.read_text(encoding="utf-8"))
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == kind]


def title(source: Path) -> str:
    """A lesson's title: the text of its first ``# heading`` (else its file name)."""
    for text in cells(source, "markdown"):
        for line in text.splitlines():
            if line.startswith("# "):
                return line[2:].strip()
    return source.stem


def imported_modules(code: str) -> set[str]:
    """The top-level modules ``code`` imports anywhere (IPython's ``%`` and ``!`` lines dropped)."""
    code = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in code.splitlines())
    found = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@cache
def _installs(requirements: tuple[str, ...]) -> frozenset[str]:
    """Every distribution that installing ``requirements`` brings, following the installed packages'
    own requirements (markers evaluated here; another extra's requirements left out)."""
    from importlib import metadata

    from packaging.requirements import InvalidRequirement, Requirement

    seen, todo = set(), list(requirements)
    while todo:
        req = Requirement(todo.pop())
        name = _normalized(req.name)
        if name in seen or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        try:
            own = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for text in own:
            try:
                Requirement(text)
            except InvalidRequirement:
                continue
            todo.append(text)
    return frozenset(seen)


@cache
def _distributions() -> dict[str, list[str]]:
    from importlib.metadata import packages_distributions

    return packages_distributions()


def extras_needed(source: Path, checkout: Path) -> list[str]:
    """The extras (of :data:`EXTRAS`, in that order) a lesson needs beyond minillm itself: ``notebooks``
    (a kernel) always, those of :data:`FEATURES` it uses, then whichever first installs each package its code
    imports."""
    import tomllib

    project = tomllib.loads((checkout / "pyproject.toml").read_text())["project"]
    code = "\n".join(cells(source, "code"))
    modules = imported_modules(code)
    for bench in set(re.findall(r"benchmarks\.(\w+)", code)):
        modules |= imported_modules((checkout / "benchmarks" / f"{bench}.py").read_text())
    modules -= {"minillm", "benchmarks", *sys.stdlib_module_names}
    distributions = _distributions()
    base = _installs(tuple(project["dependencies"]))
    needed = {"notebooks"} | {extra for extra, pattern in FEATURES.items() if pattern.search(code)}
    for module in modules:
        for dist in {_normalized(d) for d in distributions.get(module, [module])} - base:
            extra = next((e for e in EXTRAS if dist in _installs(tuple(project["optional-dependencies"][e]))), None)
            needed.add(extra or "lessons")
    return [e for e in EXTRAS if e in needed]
