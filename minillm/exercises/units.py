"""The units a student writes: which textbook object each one is, the lesson that teaches it, and the
stub file ``minillm exercises start`` writes for it.

A stub is the textbook's own definition with its body taken out: the same name, signature and
docstring (its contract: shapes, dtypes, what it must do), read from the textbook's source, and a
body that raises ``NotImplementedError``. The textbook is the reference solution the checks compare
with (``cases.py``); :func:`solution_source` writes it as a student file, which the tests grade 100 %.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import re
import textwrap
from dataclasses import dataclass

from minillm.runtime.units import names_of


@dataclass(frozen=True)
class Unit:
    """One exercise.

    name: the textbook's name, and the file ``<name>.py``.
    module: the textbook module that defines it (the reference solution).
    lesson: the lesson that teaches it (``notebooks/``), or the textbook file where no lesson does.
    inside: what the second stage runs: ``"model"`` (the unit replaces the textbook's in SmolLM2 through
        the seam and the greedy ids must not change), ``"closed form"`` (a distribution on a small
        vocabulary against its formula), or ``""`` (unit cases only; ``why`` says why).
    """

    name: str
    module: str
    lesson: str
    inside: str
    why: str = ""

    @property
    def file(self) -> str:
        """The student's file name: ``<name>.py``."""
        return f"{self.name}.py"

    @property
    def names(self) -> tuple[str, ...]:
        """What the file defines: the unit, and its helpers (``apply_rope.py``: ``rotate_half`` too)."""
        return names_of(self.name)

    def textbook(self, name: str | None = None):
        """The textbook's object (the unit's, or one of its helpers')."""
        return getattr(importlib.import_module(self.module), name or self.name)


_P, _S, _K = "minillm.model.primitives", "minillm.runtime.sampling", "minillm.model.paged_kv_cache"
_ADDRESSES = "address math: its cases are the whole of it"
_NO_SLIDING = "SmolLM2 has no sliding-window layers (Gemma 3 does: lesson 5 shows them)"

#: Every unit, in the order a request meets them.
UNITS: tuple[Unit, ...] = (
    Unit(name="causal_mask", module=_P, lesson="03_causal_mask_and_attention", inside="model"),
    Unit(name="sliding_window_mask", module=_P, lesson="05_kv_cache", inside="", why=_NO_SLIDING),
    Unit(name="softmax", module=_P, lesson="03_causal_mask_and_attention", inside="model"),
    Unit(name="rms_norm", module=_P, lesson="minillm/model/primitives.py", inside="model"),
    Unit(name="apply_rope", module=_P, lesson="minillm/model/primitives.py", inside="model"),
    Unit(name="attention", module=_P, lesson="03_causal_mask_and_attention", inside="model"),
    Unit(name="silu", module=_P, lesson="minillm/model/primitives.py", inside="model"),
    Unit(name="KVCache", module="minillm.model.kv_cache", lesson="05_kv_cache", inside="model"),
    Unit(name="apply_temperature", module=_S, lesson="06_selection", inside="closed form"),
    Unit(name="apply_top_k", module=_S, lesson="06_selection", inside="closed form"),
    Unit(name="apply_top_p", module=_S, lesson="06_selection", inside="closed form"),
    Unit(name="apply_min_p", module=_S, lesson="06_selection", inside="closed form"),
    Unit(name="apply_repetition_penalty", module=_S, lesson="16_the_samplers_controls", inside="closed form"),
    Unit(
        name="IncrementalDetokenizer",
        module="minillm.text.detokenize",
        lesson="07_stopping_and_streaming",
        inside="",
        why="unit cases run on SmolLM2's own tokenizer",
    ),
    Unit(name="blocks_for", module=_K, lesson="11_batching_and_the_kv_cache_pool", inside="", why=_ADDRESSES),
    Unit(name="slots", module=_K, lesson="11_batching_and_the_kv_cache_pool", inside="", why=_ADDRESSES),
    Unit(name="block_hashes", module=_K, lesson="11_batching_and_the_kv_cache_pool", inside="", why=_ADDRESSES),
    Unit(
        name="acceptance_probability",
        module="minillm.runtime.speculative",
        lesson="15_speculative_decoding",
        inside="closed form",
    ),
    Unit(name="residual", module="minillm.runtime.speculative", lesson="15_speculative_decoding", inside="closed form"),
)

BY_NAME = {u.name: u for u in UNITS}


def unit_named(name: str) -> Unit:
    """The unit called ``name``.

    Raises:
        KeyError: an unknown name; the message lists the units.
    """
    if name not in BY_NAME:
        raise KeyError(f"no unit {name!r}; the units are: {', '.join(BY_NAME)}")
    return BY_NAME[name]


# --- the stub: the textbook's definition, body taken out -------------------------------------------
def _definition(obj) -> tuple[str, ast.AST]:
    source = textwrap.dedent(inspect.getsource(obj))
    return source, ast.parse(source).body[0]


#: The methods a class's stub asks for (the rest of the textbook's class is bookkeeping the runtime adds).
STUB_METHODS = {
    "KVCache": ("__init__", "write", "read", "advance", "truncate"),
    "IncrementalDetokenizer": ("__init__", "add", "flush"),
}


def _seam_hooks(fn: ast.FunctionDef) -> list[str]:
    """Keyword-only parameters whose default is a textbook function (``attention``'s ``softmax=softmax``):
    how the seam hands a unit another unit. A student's file stands alone, so its stub has none."""
    args = fn.args
    return [a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if isinstance(d, ast.Name)]


def _function_stub(lines: list[str], fn: ast.FunctionDef, unit: Unit) -> list[str]:
    """A function's header and docstring from ``lines`` (without :func:`_seam_hooks`), then
    ``raise NotImplementedError``."""
    body = fn.body
    has_doc = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    start = fn.decorator_list[0].lineno if fn.decorator_list else fn.lineno
    keep_to = body[0].end_lineno if has_doc else body[0].lineno - 1  # 1-based, inclusive
    indent = " " * body[0].col_offset
    kept = lines[start - 1 : keep_to]
    for hook in _seam_hooks(fn):
        kept = [re.sub(rf",\s*\*,\s*{hook}={hook}", "", line) for line in kept]  # the header
        at = next((i for i, line in enumerate(kept) if line.strip().startswith(f"{hook}:")), None)
        if at is not None:  # its Args entry, and the lines that continue it
            depth = len(kept[at]) - len(kept[at].lstrip())
            end = at + 1
            while end < len(kept) and len(kept[end]) - len(kept[end].lstrip()) > depth and kept[end].strip():
                end += 1
            kept = kept[:at] + kept[end:]
    return kept + [f'{indent}raise NotImplementedError("{unit.name}: your turn ({unit.lesson})")']


def _stub_of(obj, unit: Unit) -> str:
    """``obj``'s definition with every body replaced by its docstring and ``raise NotImplementedError``;
    a class keeps its docstring and the methods of :data:`STUB_METHODS` only, and no base class."""
    source, tree = _definition(obj)
    lines = source.splitlines()
    if isinstance(tree, ast.FunctionDef):
        return "\n".join(_function_stub(lines, tree, unit)) + "\n"
    out = [f"class {tree.name}:"]
    doc = tree.body[0]
    if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant):
        out += lines[doc.lineno - 1 : doc.end_lineno]
    wanted = STUB_METHODS.get(tree.name, ())
    for fn in tree.body:
        if isinstance(fn, ast.FunctionDef) and fn.name in wanted:
            out += [""] + _function_stub(lines, fn, unit)
    return "\n".join(out) + "\n"


HEADER = '''"""Your turn: {name} ({lesson}).

Write the body below; keep the name and the signature (the checks and the model call it so).
Grade it:        minillm exercises check {name} --dir {dir_hint}
Run the model on it: minillm run --units {dir_hint} "The capital of France is"
The textbook's version, to compare once yours passes: {module}
"""

from __future__ import annotations

import numpy as np
'''


def stub_source(unit: Unit, dir_hint: str = "DIR") -> str:
    """The file ``start`` writes for ``unit``: a header naming the lesson and the commands, then the
    textbook's definitions of :attr:`Unit.names` with bodies that raise ``NotImplementedError``."""
    parts = [HEADER.format(name=unit.name, lesson=unit.lesson, dir_hint=dir_hint, module=unit.module)]
    parts += [_stub_of(unit.textbook(n), unit) for n in reversed(unit.names)]  # helpers first
    return "\n\n".join(parts)


def stub_digest(unit: Unit) -> str:
    """A fingerprint of the stub's definitions (independent of the folder named in the header): ``start``
    overwrites a file only while it still holds a stub, never a student's changes."""
    text = "\n".join(_stub_of(unit.textbook(n), unit) for n in unit.names)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# --- the reference solution, as a student's file ------------------------------------------------
def solution_source(unit: Unit) -> str:
    """The textbook's own definitions of ``unit`` as a student file: each object's source, after
    imports of the module-level names it uses (``as_logits``...) from the textbook module."""
    module = importlib.import_module(unit.module)
    sources, used = [], set()
    for name in reversed(unit.names):
        source, tree = _definition(unit.textbook(name))
        sources.append(source)
        used |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    defined = set(unit.names)
    imports = sorted(
        n for n in used - defined if hasattr(module, n) and not inspect.ismodule(getattr(module, n)) and n != "np"
    )
    modules = sorted(n for n in used if inspect.ismodule(getattr(module, n, None)) and n != "np")
    head = ["from __future__ import annotations", "", "import numpy as np"]
    head += [f"import {getattr(module, m).__name__} as {m}" for m in modules]
    head += [f"from {unit.module} import {n}" for n in imports]
    return "\n".join(head) + "\n\n\n" + "\n\n".join(sources)
