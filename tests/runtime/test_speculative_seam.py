"""A request is state, its speculative decoder a collaborator: neither reads the other's attributes.

Checked on the source (AST): no attribute that ``Request`` keeps (``self.<name> = ...`` in
``runtime/request.py``) is read in ``runtime/speculative.py``, and no attribute the decoder keeps
(``SpeculativeDecoder``'s ``self.<name>``) is read in ``runtime/request.py``. The step between them
(``runtime/speculative_step.py``) hands the decoder the request's ids and sampler as arguments and
appends what comes back through the request.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[2] / "minillm" / "runtime"


def kept_attributes(source: str, cls: str) -> set[str]:
    """The names a class keeps on its instances: every ``self.<name> = ...`` in its methods."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {
                target.attr
                for assign in ast.walk(node)
                if isinstance(assign, (ast.Assign, ast.AnnAssign, ast.AugAssign))
                for target in (assign.targets if isinstance(assign, ast.Assign) else [assign.target])
                for target in (target.elts if isinstance(target, ast.Tuple) else [target])
                if isinstance(target, ast.Attribute) and is_self(target.value)
            }
    raise AssertionError(f"no class {cls}")


def is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def reads_of(source: str, names: set[str]) -> list[str]:
    """``line: expression`` for every read of one of ``names`` as an attribute of anything but ``self``."""
    return sorted(
        f"{node.lineno}: {ast.unparse(node)}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute)
        and node.attr in names
        and not is_self(node.value)
    )


def test_request_and_speculative_decoder_do_not_read_each_others_attributes():
    request, speculative = (RUNTIME / "request.py").read_text(), (RUNTIME / "speculative.py").read_text()
    request_state = kept_attributes(request, "Request")
    decoder_state = kept_attributes(speculative, "SpeculativeDecoder")
    assert {"seen", "new_ids", "params", "rng", "cache", "constraint", "metrics", "drafter"} <= request_state
    assert {"draft", "k", "spec"} <= decoder_state
    assert reads_of(speculative, request_state) == []
    assert reads_of(request, decoder_state) == []


def test_the_decoder_is_built_without_the_request():
    from minillm.runtime.speculative import SpeculativeDecoder

    assert list(inspect.signature(SpeculativeDecoder.__init__).parameters) == ["self", "spec", "model", "max_seq_len"]


def test_a_decoder_reading_its_request_is_found():
    """The check on the shape the decoder had: built with the request, reading its fields."""
    old = (
        "class SpeculativeDecoder:\n"
        "    def __init__(self, spec, model, request):\n"
        "        self.spec, self.request, self.k = spec, request, 1\n"
        "    def budget(self):\n"
        "        r = self.request\n"
        "        return min(self.k, r.max_new_tokens - len(r.new_ids) - 1, r.cache.free_positions - 1)\n"
    )
    request_state = kept_attributes((RUNTIME / "request.py").read_text(), "Request")
    assert reads_of(old, request_state) == ["6: r.cache", "6: r.max_new_tokens", "6: r.new_ids"]
    assert kept_attributes(old, "SpeculativeDecoder") == {"spec", "request", "k"}
    assert reads_of("x = request.drafter.k\n", {"k"}) == ["1: request.drafter.k"]
