"""The HTTP layer talks to one interface (``serve/interface.py``), which the one-model Worker and the
several-model ModelRegistry both implement; nothing in minillm/serve asks which one it holds.

Checked here, without a model or a server:
  1. every member of ``ServedModels`` is on both classes, methods with a compatible signature
     (the same parameters in the same order; any extra one has a default), and the slot a registry
     routes to has what ``ServedModel`` names;
  2. no ``getattr``/``hasattr`` in minillm/serve looks at a worker or a registry (the fault hook's
     proxies in reliability.py and the flags' Namespace are the only ones left, by name);
  3. no module of minillm/serve touches another object's private attribute (``worker._remember``);
  4. the gauges are bound in one place (``app.create_app``), to the interface;
  5. the payloads of more than four fields (``Job``, ``Outcome``, ``Active``, the bench's records) are
     built by keyword only (``kw_only``: a positional construction is a TypeError).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

from minillm.serve.interface import ServedModel, ServedModels
from minillm.serve.metrics import ServerMetrics
from minillm.serve.models import ModelRegistry, ModelSlot
from minillm.serve.worker import Worker

SERVE = Path(__file__).resolve().parents[2] / "minillm" / "serve"
CLI = SERVE.parent / "cli"


def members(protocol) -> tuple[dict[str, inspect.Signature], set[str], set[str]]:
    """(methods -> signature, properties, data attributes) a Protocol declares."""
    methods, properties = {}, set()
    for name, value in vars(protocol).items():
        if isinstance(value, property):
            properties.add(name)
        elif inspect.isfunction(value) and not name.startswith("_"):
            methods[name] = inspect.signature(value)
    return methods, properties, set(protocol.__annotations__)


def compatible(declared: inspect.Signature, actual: inspect.Signature) -> str | None:
    """Why ``actual`` cannot be called as ``declared`` is, or None if it can."""
    want = [p for p in declared.parameters.values() if p.name != "self"]
    have = [p for p in actual.parameters.values() if p.name != "self"]
    for i, p in enumerate(want):
        if i >= len(have) or have[i].name != p.name or have[i].kind != p.kind:
            return f"parameter {i} should be {p}, is {have[i] if i < len(have) else 'missing'}"
    extra = [p for p in have[len(want) :] if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_KEYWORD,)]
    return f"extra parameters without a default: {extra}" if extra else None


@pytest.mark.parametrize("cls", [Worker, ModelRegistry])
def test_worker_and_registry_each_have_every_member_of_the_one_interface(cls):
    methods, properties, attributes = members(ServedModels)
    assert {"submit", "trace", "target", "served_names", "start"} <= set(methods)
    assert {"running", "waiting", "blocks_used", "alive"} <= properties and {"status", "guard"} <= attributes
    instance = cls("m", metrics=ServerMetrics()) if cls is Worker else cls([], metrics=ServerMetrics())
    for name, declared in methods.items():
        actual = getattr(cls, name, None)
        assert callable(actual), f"{cls.__name__} has no method {name}"
        assert compatible(declared, inspect.signature(actual)) is None, (cls.__name__, name)
    for name in properties:
        assert isinstance(getattr(cls, name, None), property), f"{cls.__name__}.{name} is not a property"
        assert isinstance(getattr(instance, name), int), (cls.__name__, name)  # read on an unstarted one: 0
    for name in attributes:
        assert hasattr(instance, name), f"{cls.__name__} instances have no {name}"
    assert instance.status == "starting" and instance.alive is False


@pytest.mark.parametrize("cls", [Worker, ModelSlot])
def test_what_target_returns_has_a_context_and_a_model(cls):
    _, properties, _ = members(ServedModel)
    assert properties == {"context", "model"}
    assert isinstance(vars(Worker)["context"], property) and isinstance(cls.context, property)
    assert inspect.signature(Worker.target).return_annotation == "Worker | None"
    assert inspect.signature(ModelRegistry.target).return_annotation == "ModelSlot | None"


def test_a_worker_answers_to_its_served_name_only():
    worker = Worker("/models/some-folder", metrics=ServerMetrics(), served_name="short")
    assert worker.served_names() == ["short"] and worker.model_cards() == [{"id": "short"}]
    assert worker.target("short") is worker and worker.target("/models/some-folder") is None
    assert Worker("folder", metrics=ServerMetrics()).served_names() == ["folder"]


# --- what the source may not do ------------------------------------------------------------------------
#: the getattr/hasattr calls minillm/serve keeps, by (file, function): the --test-faults proxies wrap a
#: named attribute of a request's own collaborator; flags.py reads argparse's Namespace by flag name
ALLOWED_GETATTR = {
    ("reliability.py", "_inject"),  # its FaultyParams.__getattr__
    ("reliability.py", "_wrap"),  # its Faulty.__getattr__
    ("flags.py", "worker_options"),
}


def calls(path: Path):
    """(name of the outermost function around it, or "<module>"; call node) for every call in ``path``,
    class bodies included."""

    def visit(node: ast.AST, where: str):
        for child in ast.iter_child_nodes(node):
            inner = (
                child.name
                if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) and where == "<module>"
                else where
            )
            if isinstance(child, ast.Call):
                yield inner, child
            yield from visit(child, inner)

    yield from visit(ast.parse(path.read_text()), "<module>")


def getattr_calls(folder: Path) -> set[tuple[str, str]]:
    found = set()
    for path in sorted(folder.glob("*.py")):
        for fn, call in calls(path):
            if isinstance(call.func, ast.Name) and call.func.id in ("getattr", "hasattr"):
                found.add((path.name, fn))
    return found


def test_no_getattr_on_the_worker_or_the_registry_in_minillm_serve():
    assert getattr_calls(SERVE) <= ALLOWED_GETATTR, getattr_calls(SERVE) - ALLOWED_GETATTR


def test_the_getattr_check_finds_duck_typing(tmp_path):
    (tmp_path / "app.py").write_text(
        "def make_job(worker):\n    slots = getattr(worker, 'slots', None)\n    return hasattr(worker, 'x')\n"
    )
    assert getattr_calls(tmp_path) == {("app.py", "make_job")}


def private_reads(folder: Path) -> list[str]:
    """``file:line obj._name`` for every attribute starting with one underscore read off another object."""
    found = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                owner = node.value
                mine = isinstance(owner, ast.Name) and owner.id in ("self", "cls")
                if not mine and ast.unparse(owner) != "super()":
                    found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_module_of_minillm_serve_calls_another_objects_private_methods(tmp_path):
    assert private_reads(SERVE) == []
    (tmp_path / "reliability.py").write_text("def failed(worker, a):\n    worker._count_tokens(a.request)\n")
    assert private_reads(tmp_path) == ["reliability.py:2 worker._count_tokens"]


def test_the_gauges_are_bound_once_in_create_app():
    binds = sorted(
        (path.name, fn, ast.unparse(call.func))
        for path in SERVE.glob("*.py")
        for fn, call in calls(path)
        if isinstance(call.func, ast.Attribute) and call.func.attr == "bind" and "sock" not in ast.unparse(call.func)
    )
    assert binds == [("app.py", "create_app", "served.metrics.bind")]


def big_dataclasses(folder: Path) -> dict[str, bool]:
    """``file:Class -> kw_only`` for every dataclass of more than four fields defined in ``folder``."""
    import importlib

    found = {}
    for path in sorted(folder.glob("[!_]*.py")):
        module = importlib.import_module(f"minillm.{folder.name}.{path.stem}")
        for name, value in vars(module).items():
            if dataclasses.is_dataclass(value) and value.__module__ == module.__name__:
                fields = dataclasses.fields(value)
                if len(fields) > 4:
                    found[f"{path.name}:{name}"] = all(f.kw_only for f in fields)
    return found


def test_payloads_of_more_than_four_fields_are_built_by_keyword_only():
    found = {**big_dataclasses(SERVE), **{k: v for k, v in big_dataclasses(CLI).items() if k.startswith("bench")}}
    assert {"jobs.py:Job", "jobs.py:Outcome", "jobs.py:Active", "bench.py:RequestRecord"} <= set(found)
    assert all(found.values()), [name for name, kw_only in found.items() if not kw_only]
    from minillm.serve.jobs import Outcome

    with pytest.raises(TypeError):
        Outcome("text", 1, 1, None, 0.0, None, None)  # the old positional call
